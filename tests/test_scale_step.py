"""The data-scaling planner end to end on the mini world at a reduced size: a ladder of 3 rungs drawn
from the K2.5 pool, warm and scratch, one nested run per point, the curve, the table, and the samples
for break-even (or why not)."""

import mlflow

from common.paths import MINIWORLD
from tests.helpers.steps import run_step
from tests.helpers.stores import project_runs


def test_scale_runs_a_reduced_mini_world_ladder_end_to_end(tmp_path):
    drafter = MINIWORLD / "aq-mini-eagle3"
    for name, prompts, limit in (("pool", "k2.5-pool", "12"), ("val", "k2.5-val", "8")):
        made = run_step(
            "make_data",
            ["--target", str(MINIWORLD / "k2.5-mini"), "--prompts", str(MINIWORLD / "prompts" / f"{prompts}.jsonl"),
             "--out", str(tmp_path / name), "--drafter", str(drafter), "--limit", limit, "--max_len", "256"],
            tmp_path,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr[-2000:]
    res = run_step(
        "scale",
        ["--init", str(drafter), "--data", str(tmp_path / "pool"), "--val_data", str(tmp_path / "val"),
         "--sizes", "4,8,12", "--seeds", "0", "--epochs", "2", "--no-progress"],
        tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| warm | 82" in res.stdout and "not reachable with 2 draft steps" in res.stdout
    assert res.stdout.index("start: ") < res.stdout.index("| start |")  # the answer before the table
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (parent,) = project_runs(c, filter_string="tags.`drafterops.step` = 'scale'")
    children = project_runs(c, filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 6 and {r.data.params["start"] for r in children} == {"warm", "scratch"}
    assert {"learning_curve.png", "scale.md", "ladder.json"} <= {a.path for a in c.list_artifacts(parent.info.run_id)}
    has_estimate = "samples_for_break_even" in parent.data.metrics
    assert has_estimate or parent.data.tags["samples_for_break_even"].startswith("not ")
    if has_estimate:
        m = parent.data.metrics
        assert m["samples_for_break_even_low"] <= m["samples_for_break_even"] <= m["samples_for_break_even_high"]


def test_scale_refuses_fewer_than_three_rungs(tmp_path):
    res = run_step(
        "scale",
        ["--init", str(MINIWORLD / "aq-mini-eagle3"), "--data", str(tmp_path / "none"), "--val_data",
         str(tmp_path / "none"), "--sizes", "4,8"],
        tmp_path,
    )  # fmt: skip
    assert res.returncode == 2 and "at least 3 rungs" in res.stderr
