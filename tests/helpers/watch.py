"""What the watch's tests share: a tiny drafter promoted to production on a deployment calibrated at two
loads, exported for vLLM (the served name the watch expects), copies of that store to act on, the watch
run as a user runs it against an engine metrics endpoint of the tests' own, and the audit lines it wrote."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlflow

from tests.helpers.engine_metrics import EngineMetrics, Script
from tests.helpers.promotion import evaluate, register_gated, write_profiles
from tests.helpers.steps import run_module, run_step, step_env

NAME = "k25-tiny-eagle3"
POINTS = """operating_points:
- concurrency: 1
  share: 0.5
  plain_tps: 34
  verify_ms: 30
  draft_step_ms: 0
- concurrency: 8
  share: 0.5
  plain_tps: 26
  verify_ms: 40
  draft_step_ms: 0
"""


def promote_for_watch(tmp: Path, wrapped: Path, trained: Path) -> tuple[Path, str]:
    """v1 of the tiny drafter holds production (promoted on the lenient profile); `watch.yaml` is that
    deployment calibrated at two loads; returns the folder and the name its export serves under."""
    write_profiles(tmp, wrapped)
    register_gated(tmp, wrapped, trained, (1,))
    evaluate(tmp, f"models:/{NAME}/1", wrapped, tmp / "lenient.yaml")
    res = run_step("promote", ["--model", f"models:/{NAME}/1", "--profile", str(tmp / "lenient.yaml")], tmp)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (tmp / "watch.yaml").write_text((tmp / "lenient.yaml").read_text().replace("name: lenient", "name: watched")
                                    + POINTS)  # fmt: skip
    res = run_step("export", ["--model", f"models:/{NAME}@production", "--engine", "vllm", "--out",
                              str(tmp / "export"), "--target", str(wrapped)], tmp)  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    served = [a for a in (tmp / "export" / "serve.sh").read_text().split() if a.startswith("drafterops-")]
    assert len(served) == 1, (tmp / "export" / "serve.sh").read_text()
    return tmp, served[0]


def copy_store(promoted: tuple[Path, str], tmp_path: Path, policy: str = "") -> Path:
    """A copy of the promoted store to act on, and the watch profile with `policy` added."""
    src, _ = promoted
    shutil.copy(src / "mlflow.db", tmp_path / "mlflow.db")
    for name in ("many.jsonl", "lenient.yaml"):
        shutil.copy(src / name, tmp_path / name)
    (tmp_path / "watch.yaml").write_text((src / "watch.yaml").read_text() + policy)
    return tmp_path


def run_watch(tmp: Path, url: str, intervals: int, *extra: str, **env: str):
    args = ["--model", NAME, "--endpoints", url, "--profile", str(tmp / "watch.yaml"), "--interval", "0.02",
            "--max_intervals", str(intervals), "--recertify", "no", *extra]  # fmt: skip
    return run_module("steps.watch", args, tmp, step_env(tmp, **env))  # forked from the step zygote


def client(tmp: Path) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(f"sqlite:///{tmp}/mlflow.db")


def audit_lines(tmp: Path, experiment: str = "drafterops-audit") -> list:
    c = client(tmp)
    exp = c.get_experiment_by_name(experiment).experiment_id
    return c.search_runs([exp], filter_string="tags.decision LIKE 'watch:%'", order_by=["attributes.start_time"])


def metrics_endpoint(promoted: tuple[Path, str], **script) -> EngineMetrics:
    _, served = promoted
    script.setdefault("acceptance", (0.8, 0.6))
    return EngineMetrics(Script(served=("target", served), **script))


def watch_against(promoted: tuple[Path, str], tmp: Path, intervals: int, *extra: str, env: dict | None = None,
                  **script):  # fmt: skip
    """The watch run against an endpoint of the tests' own serving `script`, the endpoint closed after."""
    engine = metrics_endpoint(promoted, **script)
    try:
        return run_watch(tmp, engine.url, intervals, *extra, **(env or {}))
    finally:
        engine.close()
