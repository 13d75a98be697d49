"""The suite's fixtures. What the tests share as code lives in tests/helpers/; the tiers are told apart by
the `full` marker (pyproject.toml: `pytest -q` the fast tier, `pytest -q -m full` the full one)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bench.sparse import k2_vocab_maps, write_sparse_safetensors
from tests.helpers.drafters import REFERENCE, k2_drafter_tensors, tiny_drafter
from tests.helpers.main_job import main_command, small_main_args
from tests.helpers.steps import ZYGOTE, run_module, step_env
from tests.helpers.targets import write_tiny_targets


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
    home = tmp_path_factory.mktemp("drafterops-home")
    saved = os.environ.get("DRAFTEROPS_HOME")
    os.environ["DRAFTEROPS_HOME"] = str(home)
    for name in ("DRAFTEROPS_EVIDENCE_KEY", "DRAFTEROPS_EVIDENCE_KEY_FILE"):
        os.environ.pop(name, None)
    yield home
    if saved is None:
        os.environ.pop("DRAFTEROPS_HOME", None)
    else:
        os.environ["DRAFTEROPS_HOME"] = saved


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """A flat DeepSeek-V3 target and the same weights saved Kimi-K2.5-style, with a tokenizer."""
    return write_tiny_targets(tmp_path_factory.mktemp("targets"))


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
def small_main_job(tmp_path_factory):
    """`python -m steps.main` once at the smallest settings that still train, evaluate and decide (the fast
    tier's main job; the full tier runs it under `mlflow run` at the suite's settings): (folder, result)."""
    tmp = tmp_path_factory.mktemp("small-main")
    return tmp, run_module("steps.main", small_main_args(tmp), tmp, step_env(tmp), timeout=900)
