import subprocess
import sys
from pathlib import Path

import pytest

from common.errors import BadInput
from serving.cost import (
    break_even_accept_len,
    expected_accept_len,
    fit_conditional_acceptance,
    plan_table,
    priced_for,
    projected_tps,
    required_acceptance,
)
from serving.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]


def test_seed_profile_break_even():
    p = load_profile("kimi-k2.5-8xrtxpro6000")
    assert p.cycle_ms == 30.0 and p.draft_steps == 2
    assert break_even_accept_len(p) == pytest.approx(2.46)
    # the seed's own drafter: accept_len 2.0 at 30 ms is 67 tok/s, below the 82 baseline
    assert projected_tps(2.0, p) == pytest.approx(66.67, abs=0.01)


def test_plan_reproduces_the_seed_table():
    rows = plan_table(load_profile("kimi-k2.5-8xrtxpro6000"), [82, 100, 150, 200])
    assert [round(r.required_accept_len, 2) for r in rows] == [2.46, 3.0, 4.5, 6.0]
    assert [round(100 * r.acc_unbounded) for r in rows] == [59, 67, 78, 83]
    # with 2 draft steps at most 3 tokens per cycle: 150 and 200 tok/s are out of reach
    assert rows[0].acc_k_steps == pytest.approx(0.81, abs=0.01)
    assert rows[2].acc_k_steps is None and rows[3].acc_k_steps is None


def test_bounded_formula_inverts():
    for k in (1, 2, 3, 5):
        for p in (0.1, 0.5, 0.64, 0.9):
            L = expected_accept_len(p, k)
            assert required_acceptance(L, k) == pytest.approx(p, abs=1e-9)
            assert fit_conditional_acceptance(L, k) == pytest.approx(p, abs=1e-9)
    assert expected_accept_len(1.0, 3) == 4.0
    assert required_acceptance(4.01, 3) is None


def test_profile_errors_name_the_field(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("baseline_tps: 82\nverify_ms: 30\ndraft_steps: 2\n")
    with pytest.raises(BadInput, match="missing field 'draft_step_ms'"):
        load_profile(str(bad))
    bad.write_text("baseline_tps: fast\nverify_ms: 30\ndraft_step_ms: 0\ndraft_steps: 2\n")
    with pytest.raises(BadInput, match="'baseline_tps' must be a finite number"):
        load_profile(str(bad))
    with pytest.raises(BadInput, match="unknown profile 'nope'"):
        load_profile("nope")


def _plan(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "steps.plan", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={
            "PYTHONPATH": str(ROOT),
            "PATH": "/usr/bin:/bin",
            "MLFLOW_TRACKING_URI": f"sqlite:///{cwd}/mlflow.db",
        },
    )


def test_plan_cli_prints_logs_and_exits_with_contract_codes(tmp_path):
    ok = _plan(cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "| 82 | 2.46 | 59% | 81% |" in ok.stdout
    assert "| 150 | 4.50 | 78% | unreachable with 2 steps |" in ok.stdout
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and runs[0].data.metrics["break_even_accept_len"] == pytest.approx(2.46)
    artifacts = {a.path for a in client.list_artifacts(runs[0].info.run_id)}
    assert {"plan_table.json", "plan.md"} <= artifacts

    bad = _plan("--profile", "nope", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("plan: unknown profile 'nope'")
    assert "Traceback" not in bad.stderr
    assert _plan("--tps", "fast", cwd=tmp_path).returncode == 2
    assert _plan("--draft_steps", "0", cwd=tmp_path).returncode == 2
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) == 1


def test_a_drafter_whose_steps_read_more_is_priced_up_and_never_down(tmp_path):
    """host-vllm's cycles as if timed on a GPU with aq-mini-eagle3 (344576 parameters a step): a drafter whose step
    reads twice that costs twice the draft part of every cycle, at every operating point; a cheaper one keeps
    the calibrated price (only timing it may credit it), and a profile whose cycle is all verify has nothing
    to scale."""
    text = (ROOT / "configs/profiles/host-vllm.yaml").read_text() + "draft_step_params: 344576\n"
    (tmp_path / "gpu.yaml").write_text(text.replace("name: host-vllm", "name: gpu"))
    p = load_profile(str(tmp_path / "gpu.yaml"))
    assert p.draft_step_params == 344576 and "draft_step_params" in p.values()
    assert p.digest != load_profile("host-vllm").digest  # recorded, the step's size is a value decisions depend on
    same, note = priced_for(p, 344576)
    assert same is p and note == ""
    cheaper, note = priced_for(p, 100_000)
    assert cheaper is p and note == ""
    dear, note = priced_for(p, 2 * 344576)
    assert "priced at 2.00x" in note and "0.345 M" in note
    for op, priced in zip(p.operating_points, dear.operating_points, strict=True):
        assert priced.draft_step_ms == pytest.approx(2 * op.draft_step_ms)
        for (k, ms), (_, more) in zip(op.cycle_ms_measured, priced.cycle_ms_measured, strict=True):
            assert more == pytest.approx(ms + k * op.draft_step_ms)
    for view, priced in zip(p.serving_points(), dear.serving_points(), strict=True):
        grows = view.baseline_tps * view.draft_steps * view.draft_step_ms / 1000
        assert break_even_accept_len(priced) == pytest.approx(break_even_accept_len(view) + grows)
    assert break_even_accept_len(dear.binding()) > break_even_accept_len(p.binding())
    seed = load_profile("kimi-k2.5-8xrtxpro6000")  # the 30 ms cycle sits in verify_ms
    assert priced_for(seed, 10**9) == (seed, "")


def test_a_profile_that_does_not_record_its_drafters_step_says_it_cannot_price(tmp_path):
    """host.yaml was timed on a CPU, whose draft step is bound by its operations, not by what it reads."""
    text = (ROOT / "configs/profiles/host.yaml").read_text()
    p = load_profile("host")
    assert p.draft_step_params == 0 and "draft_step_params" not in p.values()
    same, note = priced_for(p, 10**6)
    assert same is p and "not priced by drafter size" in note
    for bad in ("0", "1.5", "-3", "true"):
        (tmp_path / "q.yaml").write_text(text + f"draft_step_params: {bad}\n")
        with pytest.raises(BadInput, match="draft_step_params"):
            load_profile(str(tmp_path / "q.yaml"))
