"""A throwaway PostgreSQL server from Debian's packages, for tests that share an Optuna study."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from tests.conftest import free_port


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


@contextmanager
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
