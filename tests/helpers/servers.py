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
    port = free_port()
    cmd = [
        str(Path(sys.executable).with_name("mlflow")),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend-store-uri",
        backend_uri,
        "--workers",
        "1",
        *extra,
    ]
    server = subprocess.Popen(cmd, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(120):
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)


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
