"""The convention every entry point follows: argparse with the MLproject's parameter names, one-line
errors on stderr, DESIGN.md's exit codes (0 ok, 1 a gate said no, 2 bad input), and the MLflow run
the step belongs to (the one `mlflow run` started, or a new one)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator

from drafter.errors import DrafterOpsError
from registry.naming import DEFAULT_TRACKING_URI


def parser(name: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"python -m steps.{name}", description=description)


def none_if_empty(value: str | None) -> str | None:
    """MLproject parameters cannot be absent; an empty string means 'not given'."""
    return value if value not in (None, "", "none", "None") else None


def configure_mlflow() -> None:
    """The embedded default store unless the user points MLFLOW_TRACKING_URI elsewhere."""
    os.environ.setdefault("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI)
    for name in ("mlflow", "alembic", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", module="mlflow")


@contextlib.contextmanager
def step_run(name: str, tags: dict[str, str] | None = None) -> Iterator[object]:
    """The MLflow run of this step: joins `mlflow run`'s run (MLFLOW_RUN_ID), nests under an active
    run, or starts a fresh one. Marks it FAILED when the step raises bad input."""
    import mlflow

    configure_mlflow()
    nested = mlflow.active_run() is not None
    run = mlflow.start_run(run_name=name, nested=nested, tags={"drafterops.step": name, **(tags or {})})
    try:
        yield run
    except DrafterOpsError as exc:
        mlflow.end_run(status="FINISHED" if exc.exit_code == 1 else "FAILED")
        raise
    except BaseException:
        mlflow.end_run(status="FAILED")
        raise
    else:
        mlflow.end_run()


def run_step(
    name: str,
    build: Callable[[], argparse.ArgumentParser],
    body: Callable[[argparse.Namespace], int | None],
    argv: list[str] | None = None,
) -> None:
    """Parse, run, and exit with the contract's code; errors are one line on stderr, no traceback."""
    args = build().parse_args(argv)
    try:
        code = body(args) or 0
    except DrafterOpsError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)


def log_params(params: dict[str, object]) -> None:
    """Log params the run does not have yet (`mlflow run` has logged the entry point's own already,
    and MLflow refuses to change a param)."""
    import mlflow

    run = mlflow.active_run()
    have = mlflow.get_run(run.info.run_id).data.params if run else {}
    fresh = {k: ("" if v is None else str(v)) for k, v in params.items() if k not in have}
    if fresh:
        mlflow.log_params(fresh)
