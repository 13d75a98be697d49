"""The bake-off's statistics on synthetic per-prompt counts: paired intervals are narrower than unpaired
ones when drafters share the prompts' difficulty, a zero difference ties, known differences are found
and ranked, and the difference is the mix figure's difference."""

from __future__ import annotations

import numpy as np
import pytest

from serving.paired import difference, rank
from serving.workload import mix_accept_len


def prompts(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(cycles, difficulty) per prompt: accept_len varies widely from prompt to prompt (1.4 to 2.8)."""
    rng = np.random.default_rng(seed)
    return rng.integers(15, 40, n), rng.uniform(1.4, 2.8, n)


def drafter(cycles: np.ndarray, level: np.ndarray, effect: float, noise: float, seed: int) -> list[tuple[int, int]]:
    """Counts of a drafter whose accept_len on each prompt is the prompt's level plus its effect and some noise
    of its own (k = 3: at most 4 tokens a cycle)."""
    rng = np.random.default_rng(seed)
    per = np.clip(level + effect + rng.normal(0, noise, len(level)), 1, 4)
    return [(int(round(c * a)), int(c)) for c, a in zip(cycles, per, strict=True)]


def two_classes(effect_a: float, effect_b: float, noise: float = 0.05, seed: int = 0):
    """Two classes (70% / 30%) of 24 and 16 prompts, both drafters decoding the same prompts."""
    out = {"A": [], "B": []}
    for name, share, n, s in (("code", 0.7, 24, seed), ("docs", 0.3, 16, seed + 1)):
        cycles, level = prompts(n, s)
        out["A"].append((name, share, drafter(cycles, level, effect_a, noise, 100 + s)))
        out["B"].append((name, share, drafter(cycles, level, effect_b, noise, 200 + s)))
    return out


def parts(classes):
    return [(share, a, b) for (_, share, a), (_, _, b) in zip(classes["A"], classes["B"], strict=True)]


def test_paired_is_much_narrower_than_unpaired_when_the_prompts_drive_acceptance():
    """A is 0.1 better on every prompt; prompts differ by 1.4: only the paired interval sees it."""
    classes = two_classes(0.1, 0.0)
    d = difference("A", "B", parts(classes))
    assert d.a_better and not d.tied
    assert d.unpaired_low < 0 < d.unpaired_high  # read as two separate runs, the gain is invisible
    assert d.width < 0.3 * d.unpaired_width and d.narrower > 0.7
    assert d.low < 0.1 < d.high  # the true gain lies in the interval
    mix = {k: mix_accept_len([(s, per) for _, s, per in v]) for k, v in classes.items()}
    assert d.estimate == pytest.approx(mix["A"] - mix["B"])  # the difference of the mix figures


def test_without_shared_difficulty_pairing_buys_little():
    """Two drafters whose per-prompt figures are unrelated: the paired interval is about as wide."""
    cycles, level = prompts(30, 3)
    rng = np.random.default_rng(9)
    a = drafter(cycles, level, 0.0, 0.02, 1)
    b = drafter(cycles, rng.permutation(level), 0.0, 0.02, 2)  # each prompt's difficulty shuffled for B
    d = difference("A", "B", [(1.0, a, b)])
    assert 0.6 < d.width / d.unpaired_width < 1.5


def test_a_zero_difference_ties():
    classes = two_classes(0.0, 0.0)
    same = difference("A", "A'", [(share, a, a) for share, a, _ in parts(classes)])
    assert same.estimate == 0 and same.low == 0 and same.high == 0 and same.tied and not same.a_better
    ranking = rank({"A": classes["A"], "A'": classes["A"]})
    assert ranking.group == {"A": 1, "A'": 1} and ranking.tied_with("A") == ["A'"]


def test_known_differences_are_found_and_ranked():
    """Three drafters 0.15 apart on every prompt, given in the wrong order: ranked, three groups; a fourth
    within noise of the best ties with it."""
    base = two_classes(0.0, 0.15)
    top = two_classes(0.3, 0.3, seed=0)["A"]
    near = two_classes(0.3, 0.31, seed=0)["B"]
    ranking = rank({"low": base["A"], "mid": base["B"], "top": top, "near": near})
    assert ranking.order[-2:] == ["mid", "low"] and set(ranking.order[:2]) == {"top", "near"}
    assert ranking.group["top"] == ranking.group["near"] == 1
    assert ranking.group["mid"] == 2 and ranking.group["low"] == 3
    gain = ranking.between("top", "mid")
    assert gain.a_better and gain.low < 0.15 < gain.high
    assert ranking.between("mid", "top").estimate == pytest.approx(-gain.estimate)
    assert ranking.between("mid", "top").high == pytest.approx(-gain.low)


def test_different_prompt_counts_are_refused():
    with pytest.raises(ValueError, match="needs the same prompts"):
        difference("A", "B", [(1.0, [(3, 2), (4, 2)], [(3, 2)])])


def test_a_bake_off_holds_each_drafter_to_its_own_break_even_when_steps_are_priced_apart():
    """A drafter whose draft steps read more is held to its own (higher) break-even and ranked by projected speed-up
    (accept_len over its own break-even), not by accept_len: the table says which break-even each row is held to,
    the verdict judges the winner by its own, the pairs are speed-up differences, and the figure draws each."""
    from reports import bakeoff as report
    from serving.workload import class_figures

    counts = two_classes(0.3, 0.0)
    mix = {label: class_figures(parts, 1.0)[1].accept_len for label, parts in counts.items()}
    be = {"A": mix["A"] + 0.2, "B": mix["B"] - 0.4}  # A ranks first, but its dearer steps cost more than it gains
    figures = {label: class_figures(parts, be[label]) for label, parts in counts.items()}
    ranking = rank(counts, break_even=be)
    assert ranking.by == "speed-up" and ranking.order == ["B", "A"]  # A accepts more, B pays: speed-up decides
    gain = ranking.between("B", "A")
    assert gain.a_better and gain.estimate == pytest.approx(mix["B"] / be["B"] - mix["A"] / be["A"], abs=1e-9)
    rows = {row["drafter"]: row for row in report.rows(ranking, figures, be, 1.0, 0.05, None, {"A": "a", "B": "b"})}
    assert (rows["A"]["beats_break_even"], rows["B"]["beats_break_even"]) == ("no", "yes")
    assert rows["A"]["break_even"] == pytest.approx(be["A"])
    table = report.markdown(ranking, figures, be, 1.0, 0.05, None, {"A": "a", "B": "b"})
    assert "break-even (its own draft steps')" in table and f"no ({be['A']:.2f})" in table
    said = report.verdict(ranking, figures, be, "host-vllm", None)
    assert said.startswith("**B ranks first by projected speed-up") and f"above its break-even {be['B']:.2f}" in said
    assert "| pair | difference (speed-up) |" in report.pairs_markdown(ranking)
    by_accept = rank(counts)  # one break-even for all (or none given): accept_len orders them, in its own units
    assert by_accept.by == "accept_len" and by_accept.order == ["A", "B"]
    assert rank(counts, break_even={"A": 2.0, "B": 2.0}).by == "accept_len"
    shared = report.markdown(ranking, figures, 1.5, 1.0, 0.05, None, {"A": "a", "B": "b"})
    assert "break-even 1.50 |" in shared
    fig = report.figure(ranking, figures, be, 1.0, 3, "priced apart")
    lines = [c for c in fig.axes[0].collections if c.get_label().startswith("break-even (each")]
    assert len(lines) == 1 and len(lines[0].get_segments()) == 2


def test_a_bake_off_names_both_means_and_says_when_they_rank_two_drafters_apart():
    """docs/metrics.md's worked flip as a bake-off: the ranking follows the pooled mean, the table shows the
    per-request mean beside it, and one sentence says the two means disagree."""
    from reports import bakeoff as report
    from serving.acceptance import mix_per_request
    from serving.workload import class_figures

    counts = {"A": [("all", 1.0, [(30, 10), (30, 10)])], "B": [("all", 1.0, [(42, 21), (42, 10)])]}
    figures = {label: class_figures(parts, 1.2) for label, parts in counts.items()}
    per_request = {label: mix_per_request([(s, per) for _, s, per in parts]) for label, parts in counts.items()}
    assert per_request == pytest.approx({"A": 3.0, "B": 3.1})
    ranking = rank(counts)
    assert ranking.order == ["A", "B"]
    said = report.flips(ranking.order, {k: f[1].accept_len for k, f in figures.items()}, per_request)
    assert said == ["A leads on the pooled accept_len (3.000 against 2.710) and B on the per-request mean (3.100 "
                    "against 3.000): decode speed follows the pooled one, so A ranks first."]  # fmt: skip
    table = report.markdown(ranking, figures, 1.2, 1.0, 0.05, None, {"A": "a", "B": "b"}, per_request=per_request)
    assert "| per-request mean |" in table and "| 3.100 |" in table
    rows = report.rows(ranking, figures, 1.2, 1.0, 0.05, None, {"A": "a", "B": "b"}, per_request=per_request)
    assert [r["accept_len_per_request"] for r in rows] == pytest.approx([3.0, 3.1])
    assert report.flips(["A", "B"], {"A": 3.0, "B": 2.0}, {"A": 3.0, "B": 2.5}) == []


def test_the_main_jobs_description_opens_with_the_bake_offs_answer():
    """With a bake-off, its verdict over every candidate is the first sentence; the run's own drafters follow
    (their best is not called the best of all when another candidate beat it)."""
    from reports.main_job import summary

    results = {"fine-tuned": ("2", {"accept_len": 1.621, "accept_len_ci_low": 1.6, "accept_len_ci_high": 1.64,
                                    "break_even_accept_len": 2.46})}  # fmt: skip
    verdict = "**ls-mini ranks first on host-vllm's traffic mix**: accept_len 1.701 [1.69, 1.71], below its break-even."
    text = summary("k2.5-mini-eagle3", results, "host-vllm", "refused", 60.0, verdict=verdict)
    body = text.split("\n\n", 1)[1]
    assert body.startswith(verdict) and "Of the drafters this run imported and trained: **No drafter beats" in body
    assert (
        summary("k2.5-mini-eagle3", results, "host-vllm", "refused", 60.0)
        .split("\n\n")[1]
        .startswith("**No drafter beats break-even (2.46) on host-vllm.** The best, fine-tuned v2")
    )


def test_a_summary_too_long_for_a_tag_is_cut_at_a_line_and_says_where_the_rest_is():
    from reports.main_job import DESCRIPTION_LIMIT, description

    text = "\n".join(f"| row {i} | {'x' * 60} |" for i in range(200))
    cut = description(text)
    assert len(cut) <= DESCRIPTION_LIMIT and cut.endswith("the whole summary is the run's summary.md)")
    assert text.startswith(cut.split("\n\n(cut here")[0]) and cut.split("\n\n(cut here")[0].endswith("|")
    assert description("short") == "short"
