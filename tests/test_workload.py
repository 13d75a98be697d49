"""Traffic classes: the profile's pinned prompts, the mix and its interval, the class floor."""

import json
import math

import numpy as np
import pytest

from common.errors import BadInput
from registry.ledger.policy import Evidence, decide
from serving.cost import expected_accept_len
from serving.profile import load_profile
from serving.workload import (
    ClassFigure,
    context_bucket,
    context_buckets,
    context_figures,
    mix_accept_len,
    mix_ci,
    prompt_key,
)


def synthetic_class(rng, p: float, k: int, n: int) -> list[tuple[int, int]]:
    """n prompts of 8-24 verify cycles; each cycle accepts drafts with constant conditional acceptance p."""
    out = []
    for _ in range(n):
        cycles = int(rng.integers(8, 25))
        accepted = np.minimum(rng.geometric(1 - p, size=cycles) - 1, k)
        out.append((int((accepted + 1).sum()), cycles))
    return out


def test_the_mix_interval_covers_the_true_mix_93_to_97_percent():
    """1000 synthetic deployments with a known mix value (fixed seed): the 95% interval, resampling prompts
    within each class, covers it 93-97% of the time."""
    rng = np.random.default_rng(12345)
    k, classes = 3, [(0.6, 0.75, 24), (0.25, 0.45, 24), (0.15, 0.6, 24)]  # (share, p, prompts)
    truth = sum(share * expected_accept_len(p, k) for share, p, _ in classes)
    covered = 0
    for draw in range(1000):
        parts = [(share, synthetic_class(rng, p, k, n)) for share, p, n in classes]
        lo, hi = mix_ci(parts, iters=1000, seed=draw)
        covered += lo <= truth <= hi
    assert 930 <= covered <= 970, covered


def test_the_mix_is_share_weighted_and_one_class_is_the_pooled_figure():
    a, b = [(30, 10), (20, 10)], [(12, 10), (10, 10)]
    assert mix_accept_len([(1.0, a)]) == pytest.approx(2.5)
    assert mix_accept_len([(0.5, a), (0.5, b)]) == pytest.approx(0.5 * 2.5 + 0.5 * 1.1)
    lo, hi = mix_ci([(1.0, [(20, 10)] * 5)])
    assert lo == hi == pytest.approx(2.0)


def test_prompt_identity_is_what_is_sent():
    conv = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    asked = {"messages": [{"role": "user", "content": "hi"}]}
    assert prompt_key(conv) == prompt_key(asked)  # the recorded reply is not part of the prompt
    assert prompt_key(asked) != prompt_key({"text": "hi"})


def _profile(tmp_path, body: str):
    (tmp_path / "p.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    path = tmp_path / "p.yaml"
    path.write_text("baseline_tps: 82\nverify_ms: 30\ndraft_step_ms: 0\ndraft_steps: 2\n" + body)
    return path


@pytest.mark.parametrize(
    "body, message",
    [
        ("eval_prompts: p.jsonl\n", "needs 'sha256'"),
        ("eval_prompts: p.jsonl\neval_prompts_sha256: " + "ab" * 32 + "\n", "does not match the pinned"),
        ("workload: []\n", "non-empty list"),
        ("workload:\n  - {name: a, prompts: p.jsonl, sha256: SHA, share: 0.5}\n", "shares sum to 0.5"),
        ("workload:\n  - {name: A B, prompts: p.jsonl, sha256: SHA, share: 1}\n", "class name"),
        ("workload:\n  - {name: a, prompts: p.jsonl, sha256: SHA, share: .nan}\n", "share must be"),
        ("min_prompts: .nan\n", "'min_prompts' must be a finite number"),
        ("baseline_tps: .inf\n", "'baseline_tps' must be a finite number"),
        ("draft_steps: 2.7\n", "'draft_steps' must be a whole number"),
        ("draft_steps: 1000000000\n", "more than 64"),
        ("eval_max_new_tokens: 0\n", "eval_max_new_tokens must be >= 1"),
    ],
)
def test_profile_pins_are_checked_naming_the_file(tmp_path, body, message):
    from common.prompt_files import file_digest

    path = _profile(tmp_path, "")
    sha = file_digest(tmp_path / "p.jsonl")
    text = path.read_text()
    for key in ("baseline_tps", "draft_steps"):  # a body that sets a field replaces the default line
        if body.startswith(key):
            text = "\n".join(line for line in text.splitlines() if not line.startswith(key)) + "\n"
    path.write_text(text + body.replace("SHA", sha))
    with pytest.raises(BadInput, match=message) as err:
        load_profile(str(path)).workload[0].records()
    assert str(tmp_path) in str(err.value)


def test_a_pinned_set_loads_relative_to_the_profile(tmp_path):
    from common.prompt_files import file_digest

    path = _profile(tmp_path, "")
    path.write_text(
        path.read_text() + f"eval_prompts: p.jsonl\neval_prompts_sha256: {file_digest(tmp_path / 'p.jsonl')}\n"
    )
    (cls,) = load_profile(str(path)).workload
    assert cls.name == "all" and cls.share == 1.0 and len(cls.keys()) == 2


def ev(classes, L=3.0, lo=2.8, be=2.46):
    return Evidence("2", "passed", "t", L, lo, be, classes=tuple(classes))


def cls(name, share, L, be=2.46):
    return ClassFigure(name, share, 20, L, L - 0.1, L + 0.1, L / be)


def test_no_class_that_carries_traffic_may_be_served_slower():
    """The mix beats break-even, but one class with a real share is below the floor: refused, naming it.
    The same class under min_share: promoted."""
    slow = [cls("code", 0.7, 3.4), cls("docs", 0.25, 2.2), cls("repl", 0.05, 2.9)]
    d = decide(ev(slow), "production", "t")
    assert not d.allowed
    failed = [r for r in d.reasons if not r.ok]
    assert [r.rule for r in failed] == ["class docs (25% of traffic)"]
    assert "class docs: accept_len 2.200" in failed[0].detail and "0.89x plain decoding, floor 1x" in failed[0].detail
    rare = [cls("code", 0.96, 3.4), cls("docs", 0.04, 2.2)]
    d = decide(ev(rare), "production", "t")
    assert d.allowed, d.summary()
    assert any("under min_share 0.05" in r.detail for r in d.reasons)
    assert decide(ev(slow), "staging", "t").allowed  # staging: the mix alone


def test_slow_traffic_split_into_small_classes_is_still_held_to_the_floor():
    """Three slow classes of 4% each (min_share 5%) carry 12% of the traffic together: refused, naming them,
    although each alone is under min_share. Small classes that are fast enough together, or that carry
    under min_share even together, pass."""
    slow = [cls("code", 0.88, 3.4), cls("a", 0.04, 1.2), cls("b", 0.04, 1.3), cls("c", 0.04, 1.25)]
    d = decide(ev(slow), "production", "t")
    assert not d.allowed
    (failed,) = [r for r in d.reasons if not r.ok]
    assert failed.rule == "classes under min_share together (12% of traffic)"
    assert "classes a, b, c together" in failed.detail and "floor 1x" in failed.detail
    expected = 0.12 / sum(0.04 / (L / 2.46) for L in (1.2, 1.3, 1.25))  # tokens over the time they take
    assert f"{expected:.2f}x plain decoding" in failed.detail
    fast = [cls("code", 0.88, 3.4), cls("a", 0.04, 2.6), cls("b", 0.04, 2.7), cls("c", 0.04, 2.5)]
    assert decide(ev(fast), "production", "t").allowed
    tiny = [cls("code", 0.97, 3.4), cls("a", 0.01, 1.2), cls("b", 0.02, 1.3)]
    d = decide(ev(tiny), "production", "t")
    assert d.allowed, d.summary()
    assert any("under min_share 0.05 even together" in r.detail for r in d.reasons)


def test_the_mini_world_workload_is_held_out_and_pinned():
    """Four classes, each pinned by the kimi profile's digest, none sharing text with any prompt the
    targets or drafters were trained, validated, tested or scaled on; the long class's conversations
    all lie past 512 tokens."""
    from pathlib import Path

    prompts = Path(__file__).resolve().parents[1] / "miniworld" / "prompts"
    profile = load_profile("kimi-k2.5-8xrtxpro6000")
    assert [c.name for c in profile.workload] == ["code", "docs", "repl", "long"]
    assert math.isclose(sum(c.share for c in profile.workload), 1.0)

    def users(path):
        return [json.loads(line)["messages"][0]["content"].removeprefix("Continue:\n") for line in path.open()]

    def shingles(texts, w=120):
        return {t[i : i + w] for t in texts for i in range(0, max(1, len(t) - w))}

    others = shingles([u for f in sorted(prompts.glob("k2*.jsonl")) for u in users(f)])
    for c in profile.workload:
        mine = users(c.prompts)
        assert len(c.keys()) == len(set(c.keys())) >= 16
        shared = [u for u in mine if shingles([u]) & others]
        assert not shared, f"class {c.name}: {len(shared)} prompts share text with other sets"
    from drafter.decode.evaluation import encode_prompts, target_tokenizer

    tokenizer, context = target_tokenizer(prompts.parent / "k2.5-mini")
    ids, cut = encode_prompts(tokenizer, profile.traffic_class("long").records(), context, 64, 3)
    assert cut == 0 and min(len(i) for i in ids) >= 512 and max(len(i) for i in ids) + 64 < context


def test_context_buckets_are_named_as_metrics_and_profiles_spell_them():
    assert context_buckets() == ["lt512", "512-2k", "2k-8k", "ge8k"]
    assert [context_bucket(n) for n in (1, 511, 512, 2047, 2048, 8191, 8192, 10**6)] == [
        "lt512", "lt512", "512-2k", "512-2k", "2k-8k", "2k-8k", "ge8k", "ge8k"
    ]  # fmt: skip


def test_acceptance_by_context_pools_each_buckets_prompts():
    """Long conversations that accept less are seen as such, whatever class they came from; buckets no
    prompt reaches are left out."""
    per = [(30, 10), (28, 10), (12, 10), (11, 10)]
    figs = context_figures(per, [100, 300, 900, 1500], break_even=2.0)
    assert [f.name for f in figs] == ["lt512", "512-2k"]
    assert figs[0].accept_len == pytest.approx(2.9) and figs[1].accept_len == pytest.approx(1.15)
    assert figs[1].prompts == 2 and figs[1].share == pytest.approx(0.5) and figs[1].speedup == pytest.approx(0.575)
    with pytest.raises(ValueError, match="3 context lengths for 4 prompts"):
        context_figures(per, [1, 2, 3], 2.0)


@pytest.mark.parametrize(
    "body, message",
    [
        ("context_floors: {gt9k: 1.0}\n", "unknown bucket 'gt9k'"),
        ("context_floors: {512-2k: 0}\n", "context_floors.512-2k must be a number > 0"),
        ("context_floors: [1]\n", "context_floors must map context buckets"),
    ],
)
def test_context_floors_are_checked_naming_the_file(tmp_path, body, message):
    path = _profile(tmp_path, "")
    path.write_text(path.read_text() + body)
    with pytest.raises(BadInput, match=message) as err:
        load_profile(str(path))
    assert str(tmp_path) in str(err.value)


def test_a_profile_without_context_floors_keeps_its_digest(tmp_path):
    path = _profile(tmp_path, "")
    before = load_profile(str(path))
    assert "context_floors" not in before.values()
    path.write_text(path.read_text() + "context_floors: {512-2k: 1.1}\n")
    after = load_profile(str(path))
    assert after.context_floors == (("512-2k", 1.1),) and after.digest != before.digest


def _with_contexts(contexts, floors):
    from dataclasses import replace

    return replace(ev([cls("all", 1.0, 3.2)]), contexts=contexts, context_floors=floors)


def test_a_drafter_that_fails_long_conversations_does_not_pass_on_short_ones():
    """The mix beats break-even, but the 512-2k bucket the profile floors projects below it: refused,
    naming the bucket. A floored bucket that no prompt reaches, or a record without context lengths,
    cannot show the floor holds: refused too. Staging reads the mix alone."""
    short, long_ = cls("lt512", 0.8, 3.5), cls("512-2k", 0.2, 2.0)
    floors = (("512-2k", 1.0),)
    d = decide(_with_contexts((short, long_), floors), "production", "t")
    failed = [r for r in d.reasons if not r.ok]
    assert [r.rule for r in failed] == ["context 512-2k"]
    assert "accept_len 2.000" in failed[0].detail and "0.77x at its interval's low end, floor 1x" in failed[0].detail
    assert decide(_with_contexts((short, cls("512-2k", 0.2, 2.6)), floors), "production", "t").allowed
    d = decide(_with_contexts((short,), floors), "production", "t")
    assert [r.detail for r in d.reasons if not r.ok] == [
        "context 512-2k: no pinned prompt reaches this length, so its floor 1x cannot be checked: pin at least 8 "
        "that do"
    ]
    d = decide(_with_contexts(None, floors), "production", "t")
    assert any("recorded no context lengths" in r.detail for r in d.reasons if not r.ok)
    assert decide(_with_contexts(None, ()), "production", "t").allowed  # no floor: nothing to check
    assert decide(_with_contexts((short, long_), floors), "staging", "t").allowed


def test_a_context_floor_holds_at_the_interval_low_end_on_enough_prompts():
    """Attack: one lucky long prompt, or a bucket whose point estimate clears the floor while its
    interval does not, must not carry the floor."""
    from dataclasses import replace

    short, floors = cls("lt512", 0.9, 3.5), (("512-2k", 1.0),)
    lucky = replace(cls("512-2k", 0.1, 4.0), prompts=1)
    d = decide(_with_contexts((short, lucky), floors), "production", "t")
    assert [r.detail for r in d.reasons if not r.ok] == [
        "context 512-2k: only 1 pinned prompts reach this length, so its floor 1x cannot be checked: pin at least "
        "8 that do"
    ]
    wide = replace(cls("512-2k", 0.1, 2.6), ci_low=2.3)  # 1.06x at the point, 0.93x at the low end
    d = decide(_with_contexts((short, wide), floors), "production", "t")
    assert [r.rule for r in d.reasons if not r.ok] == ["context 512-2k"]
    assert decide(_with_contexts((short, replace(wide, ci_low=2.5)), floors), "production", "t").allowed


def test_a_mix_of_classes_that_accept_nothing_is_exactly_one_whatever_the_shares_round_to(tmp_path):
    """Shares may sum to 1 within 1e-6 (0.50000049 twice): they are normalised when read, and the mix is summed as
    the excess over one token a cycle, so a drafter that accepts nothing scores exactly 1.000 with a zero-width
    interval, never a hair above a break-even of 1.0000005."""
    from serving.workload import mix_accept_len, mix_ci

    nothing = [(8, 8), (16, 16), (5, 5)]
    parts = [(0.50000049, nothing), (0.50000049, nothing)]
    assert mix_accept_len(parts) == 1.0 and mix_ci(parts) == (1.0, 1.0)
    from common.prompt_files import file_digest

    for name in ("code", "docs"):
        (tmp_path / f"{name}.jsonl").write_text("".join(f'{{"text": "{name} {i}"}}\n' for i in range(3)))
    body = "".join(f"  - {{name: {n}, prompts: {n}.jsonl, sha256: {file_digest(tmp_path / f'{n}.jsonl')}, "
                   "share: 0.50000049}\n" for n in ("code", "docs"))  # fmt: skip
    classes = load_profile(str(_profile(tmp_path, "workload:\n" + body))).workload
    assert sum(c.share for c in classes) == pytest.approx(1.0, abs=1e-15)
