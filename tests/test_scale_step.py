"""The data-scaling planner end to end at a reduced size: a ladder of 3 rungs, warm and scratch, one
nested run per point, the curve, the table, and samples for break-even (or why not)."""

import mlflow

from tests.conftest import run_step, save_tiny_drafter
from tests.test_data import PROMPTS, write_prompts


def test_scale_runs_a_reduced_ladder_end_to_end(tiny_targets, tmp_path):
    flat, wrapped = tiny_targets
    drafter = save_tiny_drafter(tmp_path / "d", flat)
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS * 3)
    made = run_step(
        "make_data",
        ["--target", str(wrapped), "--prompts", str(prompts), "--out", str(tmp_path / "ds"), "--drafter", str(drafter)],
        tmp_path,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    res = run_step(
        "scale",
        ["--init", str(drafter), "--arch", str(drafter), "--data", str(tmp_path / "ds"), "--val_data",
         str(tmp_path / "ds"), "--sizes", "2,4,6", "--seeds", "0", "--epochs", "2", "--no-progress"],
        tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "| warm | 82 | 2.46 |" in res.stdout
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (parent,) = c.search_runs(["0"], filter_string="tags.`drafterops.step` = 'scale'")
    children = c.search_runs(["0"], filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 6 and {r.data.params["start"] for r in children} == {"warm", "scratch"}
    assert {"learning_curve.png", "scale.md", "ladder.json"} <= {a.path for a in c.list_artifacts(parent.info.run_id)}
    has_estimate = "samples_for_break_even" in parent.data.metrics
    assert has_estimate or parent.data.tags["samples_for_break_even"].startswith("not ")
    if has_estimate:
        m = parent.data.metrics
        assert m["samples_for_break_even_low"] <= m["samples_for_break_even"] <= m["samples_for_break_even_high"]
