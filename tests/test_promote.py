import json
from pathlib import Path

import mlflow
import pytest

from registry.policy import Evidence, decide
from tests.conftest import run_step
from tests.test_data import PROMPTS, write_prompts

ROOT = Path(__file__).resolve().parents[1]


def ev(version="2", gate="passed", target="t", L=3.0, lo=2.8, be=2.46):
    return Evidence(version, gate, target, L, lo, be)


@pytest.mark.parametrize(
    "candidate, incumbent, allowed, failing",
    [
        (ev(), None, True, []),
        (ev(gate="failed"), None, False, ["shape_gate"]),
        (ev(gate=None), None, False, ["shape_gate"]),
        (ev(target="other"), None, False, ["shape_gate"]),
        (Evidence("2", "passed", "t"), None, False, ["evaluated"]),
        (ev(lo=2.46), None, False, ["ci_low beats break-even"]),  # a tie with break-even is not beating it
        (ev(L=2.5, lo=2.3), None, False, ["ci_low beats break-even"]),
        (ev(L=3.0), ev(version="1", L=3.0), True, []),  # a tie with production is "not worse"
        (ev(L=2.9), ev(version="1", L=3.0), False, ["not worse than production"]),
        (ev(L=2.9), Evidence("1", "passed", "t"), True, []),  # incumbent never evaluated here
        (ev(version="1"), ev(version="1"), True, []),
    ],
)
def test_production_rules(candidate, incumbent, allowed, failing):
    d = decide(candidate, "production", "t", incumbent)
    assert d.allowed is allowed
    assert [r.rule for r in d.reasons if not r.ok] == failing


def test_margin_and_staging_rules():
    assert decide(ev(L=2.9), "production", "t", ev(version="1", L=3.0), margin=0.2).allowed
    assert decide(ev(L=2.5, lo=2.0), "staging", "t").allowed  # staging needs the mean above break-even only
    assert not decide(ev(L=2.46, lo=2.0), "staging", "t").allowed
    assert not decide(ev(gate="failed"), "staging", "t").allowed
    with pytest.raises(ValueError):
        decide(ev(), "archived", "t")


@pytest.fixture(scope="module")
def evaluated(tiny_targets, tmp_path_factory):
    """Two registered tiny drafters, gated and really evaluated on the seed profile and on a slow one."""
    from drafter.checkpoint import save_drafter
    from tests.conftest import tiny_drafter

    tmp = tmp_path_factory.mktemp("promote")
    _, wrapped = tiny_targets
    vocab = json.loads((wrapped / "config.json").read_text())["text_config"]["vocab_size"]
    (tmp / "slow.yaml").write_text(
        "name: slow-target\nbaseline_tps: 10\nverify_ms: 30\ndraft_step_ms: 0\ndraft_steps: 2\n"
    )
    prompts = write_prompts(tmp / "p.jsonl", PROMPTS[:2])
    for seed in (1, 2):
        save_drafter(
            tiny_drafter(seed=seed, vocab_size=vocab, draft_vocab_size=128, aux_layer_ids=[0, 1, 2]),
            tmp / f"d{seed}",
            include_embedding=False,
        )
        assert (
            run_step("import_drafter", ["--source", str(tmp / f"d{seed}"), "--target", str(wrapped)], tmp).returncode
            == 0
        )
        uri = f"models:/k25-tiny-eagle3/{seed}"
        assert run_step("shape_gate", ["--model", uri, "--target", str(wrapped)], tmp).returncode == 0
        for profile in ("kimi-k2.5-8xrtxpro6000", str(tmp / "slow.yaml")):
            res = run_step(
                "evaluate",
                [
                    "--model",
                    uri,
                    "--target",
                    str(wrapped),
                    "--prompts",
                    str(prompts),
                    "--profile",
                    profile,
                    "--max_new_tokens",
                    "8",
                    "--no-progress",
                ],
                tmp,
            )
            assert res.returncode == 0, res.stderr[-2000:]
    return tmp


def test_refused_below_break_even_and_promoted_above(evaluated):
    tmp = evaluated
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    refused = run_step("promote", ["--model", "models:/k25-tiny-eagle3/1"], tmp)
    assert refused.returncode == 1, refused.stderr
    assert "| ci_low beats break-even | NO |" in refused.stdout
    assert "production" not in c.get_registered_model("k25-tiny-eagle3").aliases
    assert c.get_model_version("k25-tiny-eagle3", "1").tags["promotion"].startswith("refused to production")
    ok = run_step("promote", ["--model", "models:/k25-tiny-eagle3/1", "--profile", str(tmp / "slow.yaml")], tmp)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    mv = c.get_model_version_by_alias("k25-tiny-eagle3", "production")
    assert str(mv.version) == "1" and mv.current_stage == "Production"
    never = run_step("promote", ["--model", "models:/k25-tiny-eagle3/1", "--profile", "nope"], tmp)
    assert never.returncode == 2 and "unknown profile" in never.stderr


def test_two_promotions_racing_end_consistent(evaluated):
    tmp = evaluated
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    procs = [
        run_step(
            "promote",
            ["--model", f"models:/k25-tiny-eagle3/{v}", "--profile", str(tmp / "slow.yaml"), "--margin", "10"],
            tmp,
            wait=False,
        )
        for v in (1, 2)
    ]
    codes = [p.wait(timeout=300) for p in procs]
    assert codes == [0, 0], [p.stderr.read() for p in procs]
    prod = c.get_model_version_by_alias("k25-tiny-eagle3", "production")
    stages = {str(v.version): v.current_stage for v in c.search_model_versions("name='k25-tiny-eagle3'")}
    assert stages[str(prod.version)] == "Production"
    assert list(stages.values()).count("Production") == 1
    audit = c.search_runs(
        [c.get_experiment_by_name("drafterops-audit").experiment_id],
        filter_string="tags.decision LIKE 'promote:production%'",
    )
    assert {r.data.tags["version"] for r in audit} >= {"1", "2"}


def test_production_alias_on_a_deleted_version_is_handled(evaluated):
    tmp = evaluated
    c = mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")
    c.set_registered_model_alias("k25-tiny-eagle3", "staging", "2")
    c.delete_model_version("k25-tiny-eagle3", "2")
    res = run_step(
        "promote",
        ["--model", "models:/k25-tiny-eagle3/1", "--profile", str(tmp / "slow.yaml"), "--stage", "staging"],
        tmp,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert str(c.get_model_version_by_alias("k25-tiny-eagle3", "staging").version) == "1"
