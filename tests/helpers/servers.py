"""Live servers on loopback for the full tier: free ports, a real `mlflow server`, a throwaway PostgreSQL
from Debian's packages (for tests that share an Optuna study)."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(folder: Path, backend_uri: str, *extra: str) -> Iterator[str]:
    """A real `mlflow server` on loopback, up (port accepting) before the body runs; yields its URL."""
    for _attempt in range(5):  # another test's server may take the free port first: then start on another one
        port = free_port()
        cmd = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port),
               "--backend-store-uri", backend_uri, "--workers", "1", *extra]  # fmt: skip
        server = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if _listens_itself(server, port):
            break
        server.terminate()
        server.wait(timeout=30)
    else:
        raise RuntimeError("no free port held by our own mlflow server after 5 tries")
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


def _listens_itself(server: subprocess.Popen, port: int, wait_s: float = 60.0) -> bool:
    """Whether `server` (or a process it started: gunicorn's workers) is what listens on `port`: a port that
    accepts is not proof, since another test's server may have taken it between free_port and the bind."""
    import psutil

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and server.poll() is None:
        try:
            ours = {server.pid, *(c.pid for c in psutil.Process(server.pid).children(recursive=True))}
            listening = {c.pid for c in psutil.net_connections("tcp")
                         if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN}  # fmt: skip
        except psutil.Error:
            listening, ours = set(), set()
        if listening & ours:
            return True
        time.sleep(0.5)
    return False


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """Yields a SQLAlchemy URL; initdb/pg_ctl run as the postgres user when we are root."""
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    if not initdb or not pg_ctl:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
    root = os.geteuid() == 0
    data = tempfile.mkdtemp(prefix="drafterops-pg-", dir="/tmp")
    as_user = ["runuser", "-u", "postgres", "--"] if root else []
    if root:
        shutil.chown(data, "postgres", "postgres")
    port = free_port()
    subprocess.run([*as_user, initdb, "-D", data, "-A", "trust", "-U", "postgres"], check=True, capture_output=True)
    subprocess.run(
        [
            *as_user,
            pg_ctl,
            "-D",
            data,
            "-w",
            "-l",
            f"{data}/log",
            "-o",
            f"-p {port} -k {data} -c listen_addresses=127.0.0.1",
            "start",
        ],
        check=True,
        capture_output=True,
    )
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"  # the URL the README documents
    finally:
        subprocess.run([*as_user, pg_ctl, "-D", data, "-m", "fast", "stop"], capture_output=True)
        shutil.rmtree(data, ignore_errors=True)
