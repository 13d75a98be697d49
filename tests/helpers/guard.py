"""A live `mlflow server` with the guard's webhook installed and the guard service running: what the
guard's full-tier test and its latency benchmark (bench/guard_latency.py) start from."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers.servers import free_port, mlflow_server
from tests.helpers.steps import step_env

SECRET = "a-shared-secret-for-tests-0123456789"
# the server delivers webhooks to loopback over http only when told to (docs: the guard)
WEBHOOK_ENV = {"MLFLOW_WEBHOOK_ALLOWED_SCHEMES": "http,https", "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS": "true",
               "MLFLOW_WEBHOOK_CACHE_TTL": "1"}  # fmt: skip


@dataclass
class Guarded:
    folder: Path
    url: str  # the tracking server
    port: int  # the guard's
    env: dict[str, str]  # a step's environment against the server
    service: subprocess.Popen

    def start_service(self) -> subprocess.Popen:
        """The guard service (again, after a test stopped it)."""
        self.service = subprocess.Popen(
            [sys.executable, "-m", "steps.guard", "--port", str(self.port)],
            cwd=self.folder, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        return self.service

    def stop_service(self) -> None:
        self.service.terminate()
        self.service.wait(timeout=30)


@contextlib.contextmanager
def guarded_server(folder: Path) -> Iterator[Guarded]:
    with pytest.MonkeyPatch.context() as env_of_server:  # the server process reads them
        for key, value in WEBHOOK_ENV.items():
            env_of_server.setenv(key, value)
        backend, artifacts = f"sqlite:///{folder}/server.db", str(folder / "art")
        with mlflow_server(folder, backend, "--default-artifact-root", artifacts) as url:
            env = step_env(folder, MLFLOW_TRACKING_URI=url, DRAFTEROPS_WEBHOOK_SECRET=SECRET)
            port = free_port()
            installed = subprocess.run(
                [sys.executable, "-m", "steps.guard", "--install", "--port", str(port)],
                cwd=folder, env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert installed.returncode == 0, installed.stderr
            guarded = Guarded(folder, url, port, env, None)  # type: ignore[arg-type]
            from registry.ledger import signing

            signing.load_key()  # the guard runs where the promoter's key (or the team's trust file) is
            guarded.start_service()
            try:
                yield guarded
            finally:
                guarded.stop_service()


def wait_for(predicate: Callable[[], bool], seconds: float = 30.0) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return False
