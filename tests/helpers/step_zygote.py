"""A step as a real process, without paying its imports again: a zygote that imports the heavy third-party
libraries once (torch, mlflow, transformers, ...; about 10 s, none of this project's modules) and forks a
child per step. The child is its own process: the step's arguments, environment and working folder; its
stdout and stderr are the files the caller reads (at the descriptor level, so a library's stray warning or
a traceback lands there as it would on a terminal); its exit code is the process's. It runs
`steps.<name>` as `__main__`, as `python -m` does, and shuts down as the interpreter would (non-daemon
threads joined, atexit handlers run, streams flushed). Only interpreter start-up and those imports are
skipped, about 6 s a step here. The processes tests signal or kill, and the main job, still start a
fresh interpreter.

Protocol: one JSON request a line on stdin, {"module", "args", "env", "cwd", "stdout", "stderr",
"timeout"}; one JSON answer a line on stdout, {"code"} or {"timeout": true}. A request {"together": [...]}
forks one child per request in it at once and answers {"answers": [...]} when all have ended (processes that
race each other, as two users' would).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import signal
import sys
import threading
import time
import traceback

PRELOAD = ("torch", "numpy", "yaml", "safetensors.torch", "tokenizers", "transformers", "pandas", "optuna",
           "mlflow", "mlflow.tracking", "mlflow.projects")  # fmt: skip


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter does with a SystemExit: an int is the code, None is 0, anything else is
    printed to stderr and is 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _child(request: dict, control: int) -> None:
    """Become the step's process; never returns."""
    code = 70
    try:
        os.close(control)  # a step's process holds no descriptor of the zygote's
        os.setsid()  # its own process group: a timeout stops it and everything it started
        opened = [(0, os.open(os.devnull, os.O_RDONLY))]
        opened += [(fd, os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
                   for fd, path in ((1, request["stdout"]), (2, request["stderr"]))]  # fmt: skip
        for fd, source in opened:  # stdin, stdout, stderr and nothing else open, as in a new process
            os.dup2(source, fd)
            os.close(source)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]  # `python -m` puts the working folder first
        sys.argv = [request["module"], *request["args"]]
        code = 0
        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:
            traceback.print_exc()
            code = 1
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter does at exit
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"code": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"timeout": True}
        time.sleep(0.02)


def serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    control_out = os.fdopen(os.dup(1), "w")
    print(json.dumps({"ready": True}), file=control_out, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        batch = request.get("together", [request])
        pids = []
        for one in batch:
            pid = os.fork()
            if pid == 0:
                _child(one, control_out.fileno())
            pids.append(pid)
        answers = [_wait(pid, float(one["timeout"])) for pid, one in zip(pids, batch, strict=True)]
        print(json.dumps({"answers": answers} if "together" in request else answers[0]), file=control_out, flush=True)


if __name__ == "__main__":
    serve()
