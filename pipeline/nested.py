"""Entry points run as nested `mlflow run`s of this project, each a child run of the caller's: a step that
finished with the same inputs and an expected exit code is reused, so a rerun after a kill continues."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

from common.errors import INTERNAL_ERROR, BadInput, DrafterOpsError
from common.paths import ROOT


class StepFailed(DrafterOpsError):
    """A step exited with a code the pipeline did not expect: the pipeline passes on bad input (2) and treats
    anything else (a crash, a kill) as an internal error (3)."""

    def __init__(self, entry: str, code: int, run_id: str) -> None:
        super().__init__(f"step {entry} failed with exit code {code} (run {run_id}); see its output above")
        self.exit_code = code if code == 2 else INTERNAL_ERROR


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Pipeline:
    """Runs entry points as nested `mlflow run`s, reusing finished ones with the same inputs."""

    def __init__(self, client: Any, experiment_id: str) -> None:
        self.client = client
        self.experiment_id = experiment_id
        self.log: list[str] = []

    def key(self, entry: str, params: dict[str, str]) -> str:
        blob = json.dumps({"entry": entry, "params": params}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def finished(self, key: str, ok_codes: tuple[int, ...]):
        """The latest run of this step with these inputs that ended with an expected exit code. The
        cache key is set only after the process exited with one; a crashed (3), refused-input (2) or
        killed step has none, or a code not in ok_codes, and runs again."""
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`drafterops.cache_key` = '{key}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if not runs or runs[0].info.status == "RUNNING":
            return None
        code = runs[0].data.tags.get("drafterops.exit_code")
        return runs[0] if code is not None and int(code) in ok_codes else None

    def exit_code(self, submitted: Any) -> int:
        """The code the step recorded on its run; a step that recorded none crashed before it could, or
        was killed (the launcher's own code says only 'failed')."""
        recorded = self.client.get_run(submitted.run_id).data.tags.get("drafterops.exit_code")
        if recorded is not None:
            return int(recorded)
        return 0 if submitted.get_status() == "FINISHED" else INTERNAL_ERROR

    def step(self, entry: str, params: dict[str, Any], ok_codes: tuple[int, ...] = (0,)) -> tuple[str, int]:
        """(child run id, exit code). A previous finished run with the same inputs is reused."""
        return self.steps([(entry, params, ok_codes)], at_once=1)[0]

    def steps(self, calls: list[tuple[str, dict[str, Any], tuple[int, ...]]], at_once: int = 2
              ) -> list[tuple[str, int]]:  # fmt: skip
        """Independent steps, `at_once` at a time, each (entry, params, ok_codes): (child run id, exit code) in the
        given order, a finished run with the same inputs reused. Run together, each child gets one torch thread:
        on the mini world's small tensors one thread decodes as fast as two (measured: docs/measurements), so
        two children take half the time of one after the other. A step that fails stops the rest from starting
        and raises once the running ones end."""
        import mlflow

        together = at_once > 1 and len(calls) > 1
        threads = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"} if together else {}
        results: list[tuple[str, int] | None] = [None] * len(calls)
        pending, running, failed = list(enumerate(calls)), [], None
        try:
            while pending or running:
                while pending and len(running) < at_once and failed is None:
                    i, (entry, params, ok_codes) = pending.pop(0)
                    params = {k: str(v) for k, v in params.items()}
                    key = self.key(entry, params)
                    done = self.finished(key, ok_codes)
                    if done is not None:
                        code = int(done.data.tags["drafterops.exit_code"])
                        self.log.append(f"{entry}: reused run {done.info.run_id[:8]} (exit {code})")
                        print(f"main: {entry} already done with these inputs (run {done.info.run_id[:8]}), reused")
                        results[i] = (done.info.run_id, code)
                        continue
                    print(f"main: {entry} ...", flush=True)
                    # the launcher (a child `mlflow run`) logs "ERROR ... Run failed" for any nonzero exit, an
                    # expected refusal included; main reads the step's own code and speaks for it instead
                    with _env(MLFLOW_LOGGING_LEVEL="CRITICAL", **threads):
                        submitted = mlflow.projects.run(str(ROOT), entry_point=entry, parameters=params,
                                                        env_manager="local", experiment_id=self.experiment_id,
                                                        synchronous=False)  # fmt: skip
                    running.append((i, entry, key, ok_codes, submitted, time.perf_counter()))
                if failed is not None:
                    pending = []
                ended = [r for r in running if r[4].get_status() not in ("RUNNING", "SCHEDULED")] if running else []
                if running and not ended:
                    time.sleep(0.2)
                    continue
                for i, entry, key, ok_codes, submitted, t0 in ended:
                    running.remove((i, entry, key, ok_codes, submitted, t0))
                    submitted.wait()
                    code, run_id = self.exit_code(submitted), submitted.run_id
                    self.log.append(f"{entry}: run {run_id[:8]}, exit {code}, {time.perf_counter() - t0:.0f} s")
                    if code not in ok_codes:  # the worst one is said: a crash (3) over bad input (2)
                        step_failed = StepFailed(entry, code, run_id)
                        failed = step_failed if failed is None or step_failed.exit_code > failed.exit_code else failed
                        continue
                    if code == 1:  # a gate's "no" is an expected outcome here: not a red "Failed" in the run list
                        self.client.set_tag(run_id, "drafterops.outcome", "refused")
                        self.client.set_terminated(run_id, "FINISHED")
                    self.client.set_tag(run_id, "drafterops.cache_key", key)
                    results[i] = (run_id, code)
        except BaseException:  # a step's launcher raised, or main was interrupted: no child outlives it
            for *_, submitted, _ in running:
                submitted.cancel()
            raise
        if failed is not None:
            raise failed
        return [r for r in results if r is not None]


def version_from_run(c: Any, name: str, run_id: str) -> str:
    """The version a finetune run registered (its source tag names the run)."""
    from registry.access import naming

    for mv in c.search_model_versions(f"name={naming.quote_filter_value(name)}"):
        if mv.tags.get("source") == f"run:{run_id}":
            return str(mv.version)
    raise BadInput(f"finetune run {run_id} registered no version of {name}")


def best_params(c: Any, run_id: str) -> str:
    """A study's best settings (its `best.*` params) as the JSON `fixed_params` another run trains with."""
    best = {k.removeprefix("best."): v for k, v in c.get_run(run_id).data.params.items() if k.startswith("best.")}
    return json.dumps({k: _typed(v) for k, v in sorted(best.items())})


def _typed(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            continue
    return value


def aliases_by_version(c: Any, name: str) -> dict[str, list[str]]:
    """{version: [alias, ...]} of a registered model now."""
    out: dict[str, list[str]] = {}
    for alias, version in dict(getattr(c.get_registered_model(name), "aliases", {}) or {}).items():
        out.setdefault(str(version), []).append(alias)
    return out
