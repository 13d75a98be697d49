"""A step as a user runs it: forked from the step zygote (the default: its own process, imports paid
once), a new interpreter (DRAFTEROPS_TEST_FRESH_INTERPRETERS=1), or in this process (`here`: tests
about what a step decides rather than its command line)."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# DRAFTEROPS_TEST_FRESH_INTERPRETERS=1: every step a new `python -m` (the zygote's results, checked against)
FRESH_INTERPRETERS = os.environ.get("DRAFTEROPS_TEST_FRESH_INTERPRETERS") == "1"


def step_env(cwd: Path, **extra: str) -> dict[str, str]:
    """The environment of a step run from `cwd`: its own tracking store and download cache, and no
    process-group settings left in this process by in-process training (each step picks its own port)."""
    return {
        **{k: v for k, v in os.environ.items() if k not in DIST_ENV},
        "PYTHONPATH": str(ROOT),
        "MLFLOW_TRACKING_URI": f"sqlite:///{cwd}/mlflow.db",
        "DRAFTEROPS_CACHE": str(cwd / "cache"),
        **extra,
    }


def run_step(name: str, args: list[str], cwd: Path, wait: bool = True, here: bool = False, **env: str):
    """`python -m steps.<name> args...` in a subprocess (finished CompletedProcess, or a Popen); with
    `here`, the same entry point in this process (tests about what a step decides, not about its CLI), with
    `env` over the step's environment."""
    if here:
        return run_step_here(name, args, cwd, **env)
    cmd = [sys.executable, "-m", f"steps.{name}", *args]
    if not wait:
        return subprocess.Popen(
            cmd, cwd=cwd, env=step_env(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return run_module(f"steps.{name}", args, cwd, step_env(cwd))


def run_modules_together(module: str, argvs: list[list[str]], cwd: Path, env: dict[str, str], timeout: float = 900):
    """`python -m module args...` once per argument list, all at once, as processes of their own (forked from the
    step zygote, or new interpreters under DRAFTEROPS_TEST_FRESH_INTERPRETERS=1); each to its end."""
    if not FRESH_INTERPRETERS:
        return ZYGOTE.together(module, argvs, cwd, env, timeout)
    procs = [subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for args in argvs]  # fmt: skip
    done = []
    for args, proc in zip(argvs, procs, strict=True):
        stdout, stderr = proc.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess([sys.executable, "-m", module, *args], proc.returncode, stdout, stderr))
    return done


def run_module(module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float = 900):
    """`python -m module args...` to its end, as its own process: forked from the step zygote (imports
    paid once), or a new interpreter under DRAFTEROPS_TEST_FRESH_INTERPRETERS=1."""
    if FRESH_INTERPRETERS:
        cmd = [sys.executable, "-m", module, *args]
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return ZYGOTE.run(module, args, cwd, env, timeout)


class StepZygote:
    """The client of tests/helpers/step_zygote.py: a step as its own forked process, its imports paid once."""

    def __init__(self) -> None:
        self.proc = None

    def start(self) -> None:
        script = Path(__file__).with_name("step_zygote.py")
        env = {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, str(script)], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        ready = self.proc.stdout.readline()
        assert ready.strip() == '{"ready": true}', f"the step zygote did not start: {ready!r}"

    def run(self, module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float):
        return self.together(module, [args], cwd, env, timeout, batch=False)[0]

    def together(self, module: str, argvs: list[list[str]], cwd: Path, env: dict[str, str], timeout: float,
                 batch: bool = True) -> list[subprocess.CompletedProcess]:  # fmt: skip
        """One forked process per argument list, all started at once (batch), each run to its end."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        with tempfile.TemporaryDirectory() as folder:
            requests = [{"module": module, "args": [str(a) for a in args], "env": env, "cwd": str(cwd),
                         "stdout": f"{folder}/{i}.out", "stderr": f"{folder}/{i}.err", "timeout": timeout}
                        for i, args in enumerate(argvs)]  # fmt: skip
            self.proc.stdin.write(json.dumps({"together": requests} if batch else requests[0]) + "\n")
            self.proc.stdin.flush()
            answer = json.loads(self.proc.stdout.readline())
            answers = answer["answers"] if batch else [answer]
            outputs = [(Path(r["stdout"]).read_text(errors="replace"), Path(r["stderr"]).read_text(errors="replace"))
                       for r in requests]  # fmt: skip
        done = []
        for args, one, (stdout, stderr) in zip(argvs, answers, outputs, strict=True):
            cmd = ["python", "-m", module, *args]
            if one.get("timeout"):
                raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
            done.append(subprocess.CompletedProcess(cmd, one["code"], stdout, stderr))
        return done

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


ZYGOTE = StepZygote()


def fresh_process_state() -> None:
    """What a new process would not remember: the runs and arguments of the last step, the stores made
    ready, files hashed, keys announced. An in-process step must not see another's."""
    from cli import step as _cli
    from registry.access import store
    from registry.ledger import signing

    for module in (_cli, store, signing):
        module.forget_process_state()
    _forget_mlflow_uris()


def _forget_mlflow_uris() -> None:
    """A URI set with mlflow.set_tracking_uri outlives the environment it came with and wins over
    MLFLOW_TRACKING_URI: a step run here after one would write to that other store (a full-tier flake: one
    test's set_tracking_uri sent a later test's registrations elsewhere). MLflow has no public reset."""
    from mlflow.tracking._model_registry import utils as registry_uris
    from mlflow.tracking._tracking_service import utils as tracking_uris

    tracking_uris._tracking_uri = None
    registry_uris._registry_uri = None


def run_step_here(name: str, args: list[str], cwd: Path, **extra: str):
    """`steps.<name>.main(args)` in this process, as a subprocess would run it: the step's environment
    and working folder, stdout and stderr captured, its exit code; no imports paid again (about 5 s a
    step). Nothing of it is left behind: environment, folder, active runs, remembered state."""
    import mlflow

    assert mlflow.active_run() is None, "a step run here would nest under the test's own run"
    module = importlib.import_module(f"steps.{name}")
    saved_env, saved_cwd, env = dict(os.environ), Path.cwd(), step_env(cwd, **extra)
    out, err, code = io.StringIO(), io.StringIO(), 0
    fresh_process_state()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            module.main(list(args))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        while mlflow.active_run() is not None:
            mlflow.end_run("KILLED")
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        fresh_process_state()
    return subprocess.CompletedProcess(["steps." + name, *args], code, out.getvalue(), err.getvalue())
