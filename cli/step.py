"""The convention every entry point follows: argparse with the MLproject's parameter names, one-line
errors on stderr, docs/design.md's exit codes (0 ok, 1 a gate said no, 2 bad input, 3 an internal error
whose traceback goes to a log file and the run's artifacts, never onto the user's terminal), and the
MLflow run the step belongs to (the one `mlflow run` started, or a new one)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from common import failpoints
from common.errors import INTERNAL_ERROR, BadInput, DrafterOpsError
from registry.access.naming import use_default_store


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line and exit 2 (not a usage block)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"{self.prog.split('.')[-1]}: bad argument: {message}", file=sys.stderr)
        sys.exit(2)


def parser(name: str, description: str) -> argparse.ArgumentParser:
    return _Parser(prog=f"python -m steps.{name}", description=description)


def log_dir() -> Path:
    return Path(os.environ.get("DRAFTEROPS_LOG_DIR", Path.home() / ".cache" / "drafterops" / "logs"))


def write_traceback(name: str, text: str) -> Path | None:
    """Keep an internal error's traceback where a user (or a bug report) can find it."""
    try:
        folder = log_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}.log"
        path.write_text(text)
        return path
    except OSError:
        return None


def configure_mlflow() -> None:
    """The embedded default store unless the user points MLFLOW_TRACKING_URI elsewhere."""
    use_default_store()
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # not for a few small files
    for name in ("mlflow", "alembic", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="mlflow")
    # Optuna's notices that a feature we rely on (heartbeats, retries) is experimental: not for the user's terminal
    warnings.filterwarnings("ignore", message=r"(?s).*experimental.*The interface can change in the future")


_STEP_RUNS: list[str] = []  # runs this process opened as steps: the exit code is recorded on the first
_ASKED: dict[str, str] = {}  # the step's arguments as given: a param shows what was asked


def forget_process_state() -> None:
    """Forget the step runs this process opened and the arguments it was asked, as a new process would."""
    _STEP_RUNS.clear()
    _ASKED.clear()


@contextlib.contextmanager
def step_run(name: str, tags: dict[str, str] | None = None, run_name: str | None = None) -> Iterator[object]:
    """The MLflow run of this step: joins `mlflow run`'s run (MLFLOW_RUN_ID), nests under an active
    run, or starts a fresh one. Marks it FAILED when the step raises bad input."""
    import mlflow

    from registry.access.store import client

    configure_mlflow()
    c = client()  # a fresh local store is created once, under its lock, before any run touches it
    nested = mlflow.active_run() is not None
    experiment_id = mlflow.active_run().info.experiment_id if nested else None  # beside its parent
    if not nested and not os.environ.get("MLFLOW_RUN_ID"):
        experiment_id = project_experiment(c)
    elif os.environ.get("MLFLOW_RUN_ID") and not nested:  # `mlflow run` made the run and its experiment
        with contextlib.suppress(Exception):
            mark_model_training(c, c.get_run(os.environ["MLFLOW_RUN_ID"]).info.experiment_id)
    from tuning.workers import RUN_TAG, end_gone_runs, this_worker

    run = mlflow.start_run(
        experiment_id=experiment_id,
        run_name=name,
        nested=nested,
        tags={"drafterops.step": name, RUN_TAG: this_worker(), **(tags or {})},
    )
    _STEP_RUNS.append(run.info.run_id)
    if not nested:  # a run whose process was killed on this host is not left RUNNING forever
        with contextlib.suppress(Exception):
            end_gone_runs(c, run.info.experiment_id)
    if run_name:  # named for what it is (a run `mlflow run` created has a random name)
        mlflow.set_tag("mlflow.runName", run_name)
    try:
        failpoints.hit(name)
        yield run
    except DrafterOpsError as exc:
        _mark(exc.exit_code, None if exc.exit_code < INTERNAL_ERROR else traceback.format_exc())
        mlflow.end_run(status="FINISHED" if exc.exit_code == 1 else "FAILED")
        raise
    except Exception:
        _mark(INTERNAL_ERROR, traceback.format_exc())
        mlflow.end_run(status="FAILED")
        raise
    except BaseException:  # Ctrl-C, SystemExit: the run did not finish
        mlflow.end_run(status="KILLED")
        raise
    else:
        mlflow.end_run()


@contextlib.contextmanager
def open_run(name: str, run_name: str, params: Mapping[str, object], asked: Mapping[str, object]) -> Iterator[object]:
    """The run a library service logs into (common/runs.OpenRun): this step's run, its params shown as asked."""
    remember_asked(asked)
    with step_run(name, run_name=run_name) as run:
        log_params(dict(params))
        yield run


def project_experiment(c: object) -> str:
    """The experiment a step logs to: the user's (MLFLOW_EXPERIMENT_ID or _NAME), else `drafterops`,
    created as a model-training experiment so that MLflow 3 opens it in its runs view."""
    from mlflow.exceptions import MlflowException

    from registry.access.naming import EXPERIMENT_KIND, PROJECT_EXPERIMENT

    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT_EXPERIMENT
    exp = c.get_experiment_by_name(name)
    if exp is None:
        try:
            return c.create_experiment(name, tags={"mlflow.experimentKind": EXPERIMENT_KIND})
        except MlflowException:  # created meanwhile by a concurrent step
            exp = c.get_experiment_by_name(name)
    if exp.lifecycle_stage == "deleted":
        raise BadInput(f"experiment {name!r} is deleted; restore it (`mlflow experiments restore`) or name another")
    return exp.experiment_id


def mark_model_training(c: object, experiment_id: str) -> None:
    """An experiment `mlflow run --experiment-name` created has no kind: say it is model training."""
    from registry.access.naming import EXPERIMENT_KIND

    if experiment_id != "0" and "mlflow.experimentKind" not in c.get_experiment(experiment_id).tags:
        c.set_experiment_tag(experiment_id, "mlflow.experimentKind", EXPERIMENT_KIND)


def run_link(c: object, run_id: str) -> str:
    """The run's page in the MLflow UI's runs view (a UI started on this store, on its default port)."""
    exp = c.get_run(run_id).info.experiment_id
    return f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{run_id}?workflowType=machine_learning"


def _mark(code: int, trace: str | None) -> None:
    """The exit code on the run, and an internal error's traceback as its artifact."""
    import mlflow

    with contextlib.suppress(Exception):  # recording a failure must not hide it
        mlflow.set_tag("drafterops.exit_code", str(code))
        if trace:
            mlflow.log_text(trace, "error/traceback.txt")


def run_step(
    name: str,
    build: Callable[[], argparse.ArgumentParser],
    body: Callable[[argparse.Namespace], int | None],
    argv: list[str] | None = None,
) -> None:
    """Parse, run, and exit with the contract's code; errors are one line on stderr, no traceback."""
    args = build().parse_args(argv)
    line_by_line()
    remember_asked(vars(args))
    configure_mlflow()
    try:
        code = body(args) or 0
        _record_exit_code(code)
    except DrafterOpsError as exc:
        _record_exit_code(exc.exit_code)
        first = str(exc).splitlines()[0] if str(exc) else exc.__class__.__name__
        if exc.exit_code >= INTERNAL_ERROR:
            log = write_traceback(name, traceback.format_exc())
            first += f" (traceback: {log})" if log else ""
        print(f"{name}: {first}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # unforeseen: one line here, the whole story in the log
        _record_exit_code(INTERNAL_ERROR)
        log = write_traceback(name, traceback.format_exc())
        what = str(exc).splitlines()[0][:300] if str(exc) else ""
        where = f"; traceback in {log}" if log else ""
        print(f"{name}: internal error: {exc.__class__.__name__}: {what}{where}", file=sys.stderr)
        sys.exit(INTERNAL_ERROR)
    sys.exit(code)


def line_by_line() -> None:
    """Each printed line reaches a pipe or log file as it is printed: under a service manager or `| tee`, a
    block-buffered stdout held a long-running step's lines (the watch's baseline, its warnings) for hours."""
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(line_buffering=True)


def remember_asked(asked: Mapping[str, object]) -> None:
    """The arguments as given, for the params of the step run that follows."""
    _ASKED.clear()
    _ASKED.update({k: v for k, v in asked.items() if isinstance(v, str)})


def _record_exit_code(code: int) -> None:
    """The step's exit code on its run, which `main` trusts over the launcher's (`mlflow run` exits 1
    for any failure, so a crash would look like a gate's refusal)."""
    run_id = _STEP_RUNS[0] if _STEP_RUNS else os.environ.get("MLFLOW_RUN_ID")  # `mlflow run` made the run
    if not run_id:
        return
    from registry.access.store import client

    with contextlib.suppress(Exception):
        client().set_tag(run_id, "drafterops.exit_code", str(code))


def _no_secrets(value: str) -> str:
    """A URL's password never lands in a run (postgresql://user:secret@db/optuna -> user:***@)."""
    return re.sub(r"(//[^/@:\s]+):[^/@\s]+@", r"\1:***@", value)


def _same(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def log_params(effective: dict[str, object]) -> None:
    """Each parameter as asked (`mlflow run` logs the entry point's own before the step starts, and
    MLflow refuses to change a param) and, where the step worked it out (`auto`, a relative path, a
    default), its effective value as `resolved.<name>`, so Compare lines up what actually ran."""
    import mlflow

    run = mlflow.active_run()
    have = mlflow.get_run(run.info.run_id).data.params if run else {}
    fresh: dict[str, str] = {}
    for key, value in effective.items():
        value = _no_secrets("none" if value in (None, "") else str(value))
        asked = have.get(key, _no_secrets(_ASKED.get(key, value)))
        if key not in have:
            fresh[key] = asked if asked not in ("", None) else "none"
        if not _same(fresh.get(key, asked), value) and f"resolved.{key}" not in have:
            fresh[f"resolved.{key}"] = value
    if fresh:
        mlflow.log_params(fresh)
