"""The suite's fixtures. What the tests share as code lives in tests/helpers/; the tiers are told apart by
the `full` marker (pyproject.toml: `pytest -q` the fast tier, `pytest -q -m full` the full one).

The fast tier runs on two pytest-xdist workers, each test process single-threaded (two cores, two
workers); what several workers read (the evidence key, the small main job) is made once in the folder
they share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # a worker of two on two cores: one thread, its children too
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from bench.sparse import k2_vocab_maps, write_sparse_safetensors
from tests.helpers.drafters import REFERENCE, k2_drafter_tensors, tiny_drafter
from tests.helpers.main_job import SmallMainJob, main_command
from tests.helpers.steps import ZYGOTE, step_env
from tests.helpers.targets import write_tiny_targets


@pytest.hookimpl(optionalhook=True)  # xdist's hook: without xdist (-p no:xdist) there is nothing to answer
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """Two workers for the fast tier (`-n auto` in pyproject.toml): most of its time is process start-up,
    SQLite and small tensors, one thread each. Every other selection runs in one process: the full tier's
    vLLM servers and main jobs slow down beside anything else (docs/testing.md)."""
    cores = os.cpu_count() or 1
    return 2 if config.getoption("markexpr") == "not full" and cores >= 2 else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The small main job's readers first: the worker that takes them runs the job (about 3 minutes)
    while the other works through the rest, instead of the job starting last and running alone."""
    items.sort(key=lambda item: "small_main_job" not in getattr(item, "fixturenames", ()))


def shared_folder(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder every xdist worker of this session sees (the workers' common temporary root), or this
    session's own where there are no workers."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    folder.mkdir(exist_ok=True)
    return folder


@pytest.fixture
def drafter_factory():
    return tiny_drafter


@pytest.fixture
def k2_sparse_drafter(tmp_path: Path) -> Path:
    """A folder with the real K2 drafter's config and a sparse model.safetensors of its exact shapes."""
    folder = tmp_path / "kimi-k2-eagle3"
    folder.mkdir()
    (folder / "config.json").write_text((REFERENCE / "kimi-k2-eagle3.config.json").read_text())
    write_sparse_safetensors(folder / "model.safetensors", k2_drafter_tensors(), data=k2_vocab_maps())
    return folder


@pytest.fixture(scope="session", autouse=True)
def evidence_key_home(tmp_path_factory):
    """The suite's own drafterops home: the evidence key every step of the session signs with (created on
    first use, as on a user's machine), never the user's ~/.drafterops."""
    home = shared_folder(tmp_path_factory, "drafterops-home")  # one key for every worker's evidence
    saved = os.environ.get("DRAFTEROPS_HOME")
    os.environ["DRAFTEROPS_HOME"] = str(home)
    for name in ("DRAFTEROPS_EVIDENCE_KEY", "DRAFTEROPS_EVIDENCE_KEY_FILE"):
        os.environ.pop(name, None)
    from registry.ledger.signing import generate, local_key_path, write_private

    write_private(local_key_path(), generate())  # made before any step: no step's stderr says it made it
    yield home
    if saved is None:
        os.environ.pop("DRAFTEROPS_HOME", None)
    else:
        os.environ["DRAFTEROPS_HOME"] = saved


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """A flat DeepSeek-V3 target and the same weights saved Kimi-K2.5-style, with a tokenizer."""
    return write_tiny_targets(tmp_path_factory.mktemp("targets"))


@pytest.fixture(scope="session")
def trained_tiny(tiny_targets, tmp_path_factory) -> Path:
    """Tiny drafters trained on the tiny target (tests/helpers/trained.py): built once a session by the first
    worker that needs them, in a folder keyed by the target's digest; the others wait and read them."""
    from filelock import FileLock

    from drafter.analysis.fingerprint import target_digest

    _, wrapped = tiny_targets
    folder = shared_folder(tmp_path_factory, f"trained-tiny-{target_digest(wrapped)[:12]}")
    with FileLock(f"{folder}.lock"):
        if not (folder / "done").exists():
            cmd = [sys.executable, "-m", "tests.helpers.trained", "--target", str(wrapped), "--out", str(folder)]
            res = subprocess.run(cmd, cwd=folder, env=step_env(folder), capture_output=True, text=True, timeout=900)
            assert res.returncode == 0, res.stderr[-3000:]
            (folder / "done").write_text("")
    return folder


@pytest.fixture(scope="session", autouse=True)
def _step_zygote():
    yield
    ZYGOTE.stop()


@pytest.fixture(scope="session")
def main_job(tmp_path_factory):
    """The main job, run once for the tests that read its store (the end-to-end test, the UI test)."""
    tmp = tmp_path_factory.mktemp("main")
    cmd, env = main_command(tmp)
    first = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=1500)
    return tmp, cmd, env, first


@pytest.fixture(scope="session")
def small_main_job(tmp_path_factory, evidence_key_home):
    """`python -m steps.main` at the smallest settings that still train, evaluate and decide (the fast
    tier's main job; the full tier runs it under `mlflow run` at the suite's settings): (folder, result).
    Run once by the first worker that needs it (its readers are scheduled first); another waits for it
    and reads the same store."""
    from filelock import FileLock

    folder = shared_folder(tmp_path_factory, "small-main")
    with FileLock(f"{folder}.lock"):
        if not (folder / "result.json").exists():
            SmallMainJob(folder).run()
    return SmallMainJob(folder).result()
