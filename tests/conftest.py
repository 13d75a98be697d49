"""Shared fixtures: tiny drafters written by the tests themselves (no downloads)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

from bench.sparse import k2_vocab_maps, write_sparse_safetensors
from drafter.config import DrafterConfig
from drafter.model import Eagle3Drafter
from drafter.vocab import build_vocab_maps

REFERENCE = Path(__file__).resolve().parents[1] / "configs" / "reference"


def tiny_config(**overrides) -> DrafterConfig:
    values = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=96,
        draft_vocab_size=48,
        aux_layer_ids=[0, 2, 3],
        rope_theta=10000.0,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(overrides)
    return DrafterConfig(**values)


def tiny_drafter(seed: int = 0, **overrides) -> Eagle3Drafter:
    cfg = tiny_config(**overrides)
    model = Eagle3Drafter(cfg)
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.5)
    counts = torch.rand(cfg.vocab_size, generator=gen)
    d2t, t2d = build_vocab_maps(counts, cfg.draft_vocab_size)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    model.has_embedding = True
    return model


def save_tiny_drafter(folder: Path, target: Path, seed: int = 2) -> Path:
    """A tiny drafter for the tiny target (its vocabulary, aux layers 0-2), saved without embedding."""
    import json

    from drafter.checkpoint import save_drafter

    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    drafter = tiny_drafter(seed=seed, vocab_size=vocab, draft_vocab_size=128, aux_layer_ids=[0, 1, 2])
    save_drafter(drafter, folder, include_embedding=False)
    return folder


@pytest.fixture
def drafter_factory():
    return tiny_drafter


def k2_drafter_tensors() -> dict[str, tuple[str, list[int]]]:
    """The real AQ-MedAI Kimi-K2 drafter's tensors (configs/reference), without embed_tokens."""
    m = "midlayer."
    return {
        "fc.weight": ("BF16", [7168, 21504]),
        f"{m}input_layernorm.weight": ("BF16", [7168]),
        f"{m}hidden_norm.weight": ("BF16", [7168]),
        f"{m}post_attention_layernorm.weight": ("BF16", [7168]),
        f"{m}self_attn.q_proj.weight": ("BF16", [8192, 14336]),
        f"{m}self_attn.k_proj.weight": ("BF16", [8192, 14336]),
        f"{m}self_attn.v_proj.weight": ("BF16", [8192, 14336]),
        f"{m}self_attn.o_proj.weight": ("BF16", [7168, 8192]),
        f"{m}mlp.gate_proj.weight": ("BF16", [18432, 7168]),
        f"{m}mlp.up_proj.weight": ("BF16", [18432, 7168]),
        f"{m}mlp.down_proj.weight": ("BF16", [7168, 18432]),
        "norm.weight": ("BF16", [7168]),
        "lm_head.weight": ("BF16", [32000, 7168]),
        "d2t": ("I64", [32000]),
        "t2d": ("BOOL", [163840]),
    }


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
    import os

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


# ------------------------------------------------------------------ tiny targets (no downloads)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
    "Hidden states flow from the target to the drafter through three auxiliary layers.",
] * 4


@pytest.fixture(scope="session")
def tiny_targets(tmp_path_factory):
    """A flat DeepSeek-V3 target and the same weights saved Kimi-K2.5-style, with a tokenizer."""
    from transformers import DeepseekV3ForCausalLM

    from miniworld.models import deepseek_config, save_k25_style, train_tokenizer

    root = tmp_path_factory.mktemp("targets")
    tok = train_tokenizer(CORPUS, vocab_size=300)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(deepseek_config(len(tok), hidden_size=32, layers=4)).eval()
    with torch.no_grad():  # a random LM predicts near-uniformly; a sharper head gives drafters something to learn
        model.lm_head.weight.mul_(40.0)
    model = model.to(torch.bfloat16)  # stored as real targets are (the drafter shares its bf16 embedding)
    flat = root / "k2-tiny"
    model.save_pretrained(flat)
    tok.save_pretrained(flat)
    wrapped = save_k25_style(model, root / "k25-tiny", tok)
    return flat, wrapped


# ------------------------------------------------------------------ entry points as a user runs them
ROOT = Path(__file__).resolve().parents[1]


DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def step_env(cwd: Path, **extra: str) -> dict[str, str]:
    """The environment of a step run from `cwd`: its own tracking store and download cache, and no
    process-group settings left in this process by in-process training (each step picks its own port)."""
    import os

    return {
        **{k: v for k, v in os.environ.items() if k not in DIST_ENV},
        "PYTHONPATH": str(ROOT),
        "MLFLOW_TRACKING_URI": f"sqlite:///{cwd}/mlflow.db",
        "DRAFTEROPS_CACHE": str(cwd / "cache"),
        **extra,
    }


def run_step(name: str, args: list[str], cwd: Path, wait: bool = True, here: bool = False):
    """`python -m steps.<name> args...` in a subprocess (finished CompletedProcess, or a Popen); with
    `here`, the same entry point in this process (tests about what a step decides, not about its CLI)."""
    import subprocess
    import sys

    if here:
        return run_step_here(name, args, cwd)
    cmd = [sys.executable, "-m", f"steps.{name}", *args]
    if not wait:
        return subprocess.Popen(
            cmd, cwd=cwd, env=step_env(cwd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return run_module(f"steps.{name}", args, cwd, step_env(cwd))


def run_module(module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float = 900):
    """`python -m module args...` to its end, as its own process: forked from the step zygote (imports
    paid once), or a new interpreter under DRAFTEROPS_TEST_FRESH_INTERPRETERS=1."""
    import subprocess
    import sys

    if FRESH_INTERPRETERS:
        cmd = [sys.executable, "-m", module, *args]
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return ZYGOTE.run(module, args, cwd, env, timeout)


# DRAFTEROPS_TEST_FRESH_INTERPRETERS=1: every step a new `python -m` (the zygote's results, checked against)
FRESH_INTERPRETERS = os.environ.get("DRAFTEROPS_TEST_FRESH_INTERPRETERS") == "1"


class StepZygote:
    """The client of tests/step_zygote.py: a step as its own forked process, its imports paid once."""

    def __init__(self) -> None:
        self.proc = None

    def start(self) -> None:
        import subprocess
        import sys

        script = Path(__file__).with_name("step_zygote.py")
        env = {**{k: v for k, v in os.environ.items() if k not in DIST_ENV}, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [sys.executable, str(script)], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        ready = self.proc.stdout.readline()
        assert ready.strip() == '{"ready": true}', f"the step zygote did not start: {ready!r}"

    def run(self, module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float):
        import json
        import subprocess
        import tempfile

        if self.proc is None or self.proc.poll() is not None:
            self.start()
        with tempfile.TemporaryDirectory() as folder:
            out, err = Path(folder) / "stdout", Path(folder) / "stderr"
            request = {"module": module, "args": [str(a) for a in args], "env": env, "cwd": str(cwd),
                       "stdout": str(out), "stderr": str(err), "timeout": timeout}  # fmt: skip
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            answer = json.loads(self.proc.stdout.readline())
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
        cmd = ["python", "-m", module, *args]
        if answer.get("timeout"):
            raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
        return subprocess.CompletedProcess(cmd, answer["code"], stdout, stderr)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


ZYGOTE = StepZygote()


@pytest.fixture(scope="session", autouse=True)
def _step_zygote():
    yield
    ZYGOTE.stop()


def fresh_process_state() -> None:
    """What a new process would not remember: the runs and arguments of the last step, the stores made
    ready, files hashed, keys announced. An in-process step must not see another's."""
    from registry import signing, store
    from steps import _cli

    for remembered in (_cli._STEP_RUNS, _cli._ASKED, store._READY, store._HASHED, signing._ANNOUNCED):
        remembered.clear()


def run_step_here(name: str, args: list[str], cwd: Path):
    """`steps.<name>.main(args)` in this process, as a subprocess would run it: the step's environment
    and working folder, stdout and stderr captured, its exit code; no imports paid again (about 5 s a
    step). Nothing of it is left behind: environment, folder, active runs, remembered state."""
    import importlib
    import io
    import os
    import subprocess

    import mlflow

    assert mlflow.active_run() is None, "a step run here would nest under the test's own run"
    module = importlib.import_module(f"steps.{name}")
    saved_env, saved_cwd, env = dict(os.environ), Path.cwd(), step_env(cwd)
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


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def mlflow_server(folder: Path, backend_uri: str, *extra: str):
    """A real `mlflow server` on loopback, up (port accepting) before the body runs; yields its URL."""
    import socket
    import subprocess
    import sys
    import time

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


MAIN_PARAMS = {"n_trials": "2", "max_steps": "60", "limit": "6", "max_new_tokens": "32", "calibrate": "no"}


def main_command(tmp: Path) -> tuple[list[str], dict[str, str]]:
    """`mlflow run . --env-manager local` on the mini world into `tmp`: a smaller study and fewer
    decoded tokens than the default, to keep the suite fast; the same code paths."""
    import os
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{tmp}/mlflow.db",
        "DRAFTEROPS_CACHE": str(tmp / "cache"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }
    cmd = [str(Path(sys.executable).with_name("mlflow")), "run", str(root), "--env-manager", "local",
           "--experiment-name", "drafterops"]  # fmt: skip
    cmd += ["-P", f"workdir={tmp / 'work'}", *[x for k, v in MAIN_PARAMS.items() for x in ("-P", f"{k}={v}")]]
    return cmd, env


@pytest.fixture(scope="session")
def main_job(tmp_path_factory):
    """The main job, run once for the tests that read its store (the end-to-end test, the UI test)."""
    import subprocess

    tmp = tmp_path_factory.mktemp("main")
    cmd, env = main_command(tmp)
    first = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=1500)
    return tmp, cmd, env, first


def project_runs(c, filter_string: str = "", **kwargs) -> list:
    """The runs the steps logged to the project's experiment (`drafterops`); none when it does not exist."""
    exp = c.get_experiment_by_name("drafterops")
    return c.search_runs([exp.experiment_id], filter_string=filter_string, **kwargs) if exp else []


def all_runs(c) -> list:
    """Every run in every experiment of a store (to check that nothing was written)."""
    return c.search_runs([e.experiment_id for e in c.search_experiments()])
