"""The main job end to end: `mlflow run . --env-manager local` on the mini world, in a temporary folder."""

import os
import subprocess
import sys
from pathlib import Path

import mlflow

ROOT = Path(__file__).resolve().parents[1]
# a smaller study and fewer decoded tokens than the default, to keep the suite fast; same code paths
PARAMS = {"n_trials": "2", "max_steps": "60", "limit": "6", "max_new_tokens": "32"}


def test_main_pipeline_registers_three_drafters_and_gates_production(tmp_path):
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db",
        "DRAFTEROPS_CACHE": str(tmp_path / "cache"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    cmd = [
        str(Path(sys.executable).with_name("mlflow")),
        "run",
        str(ROOT),
        "--env-manager",
        "local",
        "-P",
        f"workdir={tmp_path / 'work'}",
        *[x for k, v in PARAMS.items() for x in ("-P", f"{k}={v}")],
    ]
    first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "| imported |" in first.stdout and "| fine-tuned |" in first.stdout and "| scratch |" in first.stdout
    c = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    name = "k2.5-mini-eagle3"
    versions = {str(v.version): v for v in c.search_model_versions(f"name='{name}'")}
    assert len(versions) == 3
    imported = c.get_model_version_by_alias(name, "imported")
    candidate = c.get_model_version_by_alias(name, "candidate")
    scratch = next(v for v in versions.values() if v.version not in (imported.version, candidate.version))
    assert imported.tags["source"].startswith("file://") and imported.tags["card.license"] == "mit"
    assert candidate.tags["parent"] == f"models:/{name}/{imported.version}"
    assert "parent" not in scratch.tags and scratch.tags["dataset_digest"] == candidate.tags["dataset_digest"]
    profile = "kimi-k2.5-8xrtxpro6000"
    for v in (imported, candidate, scratch):
        tags = c.get_model_version(name, v.version).tags
        assert tags["shape_gate"] == "passed"
        assert f"eval.{profile}.accept_len" in tags and "promotion" in c.get_model_version(name, candidate.version).tags
    rm = c.get_registered_model(name)
    if "production" in rm.aliases:
        prod = c.get_model_version_by_alias(name, "production").tags
        assert float(prod[f"eval.{profile}.accept_len_ci_low"]) > float(prod[f"eval.{profile}.break_even"])
    else:
        tags = c.get_model_version(name, candidate.version).tags
        assert tags["promotion"].startswith("refused")
    # the story at a glance: each version page says how it did and what was decided; main's
    # description is its summary, with all drafters against break-even in one figure
    for v in (imported, candidate, scratch):
        assert f"## Evaluation on `{profile}`" in c.get_model_version(name, v.version).description
    assert "## Promotion to production" in c.get_model_version(name, candidate.version).description
    (main_run,) = c.search_runs(["0"], filter_string="tags.`drafterops.step` = 'main'")
    assert "| fine-tuned |" in main_run.data.tags["mlflow.note.content"]
    assert "drafters_vs_break_even.png" in [a.path for a in c.list_artifacts(main_run.info.run_id)]
    refusals = c.search_runs(["0"], filter_string="tags.`drafterops.outcome` = 'refused'")
    assert all(r.info.status == "FINISHED" for r in refusals)
    # a rerun continues from the finished steps instead of redoing them
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already done with these inputs") >= 10
    assert len(c.search_model_versions(f"name='{name}'")) == 3
