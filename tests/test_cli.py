"""The shared CLI rules that need no step to show them."""

import os
from pathlib import Path

import pytest

from cli.step import _no_secrets
from common.values import none_if_empty


def test_a_storage_password_never_reaches_a_run():
    assert _no_secrets("postgresql://optuna:s3cret@db:5432/optuna") == "postgresql://optuna:***@db:5432/optuna"
    for plain in ("sqlite:////tmp/optuna.db", "models:/k2.5-mini-eagle3@imported", "http://127.0.0.1:5000"):
        assert _no_secrets(plain) == plain


def test_auto_and_none_mean_not_given():
    assert [none_if_empty(v) for v in ("", "auto", "none", "x")] == [None, None, None, "x"]


@pytest.mark.full
def test_a_step_forked_from_the_zygote_is_what_a_new_interpreter_gives(tmp_path):
    """The tests' default way of running a step (tests/helpers/step_zygote.py) against `python -m`: the same exit
    code, stdout and stderr for a refusal, a crash and a success; a step's own stray output (here a
    traceback printed by the interpreter) reaches the captured stderr, not the zygote's."""
    import subprocess
    import sys

    from tests.helpers.steps import ZYGOTE, step_env

    cases = [
        (["--tps", "82,nan"], {}),  # bad input: exit 2, one line
        (["--tps", "82"], {"DRAFTEROPS_FAILPOINT": "plan:raise", "DRAFTEROPS_LOG_DIR": str(tmp_path / "logs")}),
        (["--tps", "82,100"], {}),  # success: the table
    ]
    for args, extra in cases:
        env = step_env(tmp_path, **extra)
        fresh = subprocess.run([sys.executable, "-m", "steps.plan", *args], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=300)  # fmt: skip
        forked = ZYGOTE.run("steps.plan", args, tmp_path, env, timeout=300)
        assert forked.returncode == fresh.returncode, (args, forked.stderr, fresh.stderr)
        if "DRAFTEROPS_FAILPOINT" in extra:  # the log and run named differ; the shape does not
            assert forked.returncode == 3 and len(forked.stderr.strip().splitlines()) == 1
            assert "internal error" in forked.stderr and "Traceback" not in forked.stderr
        else:
            assert (forked.stdout, forked.stderr) == (fresh.stdout, fresh.stderr), args
    (tmp_path / "boom").mkdir()
    (tmp_path / "boom" / "__init__.py").write_text("")
    (tmp_path / "boom" / "__main__.py").write_text("import sys\nprint('out')\nraise ValueError('uncaught')\n")
    boom = ZYGOTE.run("boom", [], tmp_path, step_env(tmp_path), timeout=60)  # found in its working folder
    assert boom.returncode == 1 and boom.stdout == "out\n"
    assert boom.stderr.startswith("Traceback") and "ValueError: uncaught" in boom.stderr


def test_main_pins_the_default_store_to_the_folder_it_runs_in(tmp_path, monkeypatch):
    """`mlflow run` starts each step in the project's folder: run from elsewhere, main names the user's
    store by its absolute path (or refuses a path an SQLite URL would misread); in the project's own folder,
    or with a store the user named, nothing changes."""
    from common.errors import BadInput
    from registry.access import naming

    project = Path(__file__).resolve().parents[1]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", naming.DEFAULT_TRACKING_URI)
    monkeypatch.chdir(project)
    naming.pin_default_store(project)
    assert os.environ["MLFLOW_TRACKING_URI"] == naming.DEFAULT_TRACKING_URI
    monkeypatch.chdir(tmp_path)
    naming.pin_default_store(project)
    assert os.environ["MLFLOW_TRACKING_URI"] == f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////elsewhere/mine.db")
    naming.pin_default_store(project)
    assert os.environ["MLFLOW_TRACKING_URI"] == "sqlite:////elsewhere/mine.db"
    odd = tmp_path / "50%?"
    odd.mkdir()
    monkeypatch.chdir(odd)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", naming.DEFAULT_TRACKING_URI)
    with pytest.raises(BadInput, match="cannot hold the default store"):
        naming.pin_default_store(project)
