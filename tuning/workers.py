"""Which process runs what: a worker's identity (host, pid and the pid's start time, so a reused pid is
no impostor) is recorded with each trial and each step run, and a rerun on the same host recognises at
once the trials and runs whose process is gone (kill -9, OOM killer, a closed laptop) instead of
waiting for heartbeats to go stale, or, for MLflow runs, forever. Another host's workers are left to
the heartbeats: from here their processes cannot be seen."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any

WORKER_ATTR = "worker"  # trial user attr and run tag `drafterops.worker`: "host:pid:start"
RUN_TAG = "drafterops.worker"


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); '' if unknown."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - a one-line read
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # fields after the command name; 22nd overall


def this_worker() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{_start_time(os.getpid())}"


def is_gone(worker: str | None) -> bool:
    """True only when the worker ran on this host and its process no longer exists (or its pid now
    belongs to a younger process); False when alive or when that cannot be known from here."""
    if not worker or worker.count(":") < 2:
        return False
    host, pid_text, start = worker.rsplit(":", 2)
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return bool(start) and _start_time(pid) not in ("", start)
    return bool(start) and _start_time(pid) not in ("", start)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Optuna's notices that the retry API is experimental, kept off the terminal."""
    import warnings

    from optuna.exceptions import ExperimentalWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        yield


def retry_callback() -> Any:
    """Optuna's callback that re-queues a trial whose worker died (at most twice)."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    with _quiet():
        return RetryHeartbeatStaleTrialCallback(max_retry=2)


def retry_history(trial: Any) -> list[int]:
    """The trials this one retries, oldest first."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    with _quiet():
        return RetryHeartbeatStaleTrialCallback.retry_history(trial)


def retried_number(trial: Any) -> int | None:
    """The trial this one retries (None: a first attempt), as Optuna records it."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    with _quiet():
        return RetryHeartbeatStaleTrialCallback.retried_trial_number(trial)


def fail_gone_trials(study: Any) -> list[int]:
    """Trials RUNNING for a worker that is gone are failed and handed to the study's retry callback
    (re-queued with their settings and checkpoint identity), as a stale heartbeat would be, but now."""
    from optuna.trial import TrialState

    failed = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not is_gone(t.user_attrs.get(WORKER_ATTR)):
            continue
        try:
            study.tell(t.number, state=TrialState.FAIL)
        except ValueError:  # finished meanwhile (another worker got there first)
            continue
        frozen = next(x for x in study.get_trials(deepcopy=False) if x.number == t.number)
        retry_callback()(study, frozen)
        failed.append(t.number)
    return failed


def end_gone_runs(c: Any, experiment_id: str) -> list[str]:
    """RUNNING runs of the experiment whose worker is gone end KILLED, with the reason as a tag."""
    gone = []
    for run in c.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'"):
        worker = run.data.tags.get(RUN_TAG)
        if is_gone(worker):
            c.set_tag(run.info.run_id, "failed_because", f"worker lost: process {worker} is gone")
            c.set_terminated(run.info.run_id, "KILLED")
            gone.append(run.info.run_id)
    return gone
