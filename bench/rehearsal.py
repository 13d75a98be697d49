"""A real-width rehearsal: the K2 drafter's shapes against a Kimi-style target as wide as the real one,
through the pipeline's own steps, each in a fresh process: peak RSS and time per step.

- Drafter: AQ-MedAI's K2 drafter config (configs/reference/kimi-k2-eagle3.config.json; 1.19 B
  parameters, bf16, no embedding, as released) with random values. Its aux layer ids are remapped to
  the rehearsal target's three layers [0, 1, 2]: the shapes do not depend on them.
- Target: Kimi-K2's width (hidden 7168, vocabulary 163840, MLA with q_lora 1536, kv_lora 512, 64
  heads of 128 + 64 rope dims) but three layers: a tiny dense first layer and two tiny-MoE layers
  (4 experts of 64), saved as Kimi-K2.5 ships (wrapper config, `language_model.` weights), with the mini
  world's tokenizer. 2.7 B parameters, 5.4 GB in bf16.
- Steps: import_drafter, shape_gate, make_data on 4 short prompts, evaluate (in-process, 2 prompts of
  8 new tokens, 3 draft steps; the target and the drafter at the target's own precision, bf16), and
  finetune's memory plan for the real drafter (it refuses on a host
  that cannot hold it, before reading any data).

    python -m bench.rehearsal [--work /tmp/rehearsal]   # about 6 GB RAM at peak, 16 GB of disk
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench._common import write_results

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "miniworld"
REFERENCE = ROOT / "configs" / "reference" / "kimi-k2-eagle3.config.json"
K2_WIDTH = dict(
    hidden_size=7168, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=256, moe_intermediate_size=64,
    max_position_embeddings=4096,
)  # fmt: skip

BUILD_TARGET = """
import sys, torch
from transformers import AutoTokenizer, DeepseekV3ForCausalLM
from miniworld.models import deepseek_config, save_k25_style
import json
width = json.loads(sys.argv[2])
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
model = DeepseekV3ForCausalLM(deepseek_config(163840, layers=3, **width))
save_k25_style(model, sys.argv[1], AutoTokenizer.from_pretrained(sys.argv[3]))
"""


def write_drafter(folder: Path) -> None:
    """The K2 drafter's tensors (configs/reference) with random bf16 values, written tensor by tensor."""
    from safetensors.torch import save_file

    cfg = json.loads(REFERENCE.read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 1, 2]
    cfg["bos_token_id"], cfg["eos_token_id"] = 1, 2  # the rehearsal target speaks the mini world's tokenizer
    h, i, vd, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["draft_vocab_size"], cfg["vocab_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).bfloat16()  # noqa: E731
    tensors = {
        "fc.weight": rand(h, 3 * h),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(q, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(q, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, q),
        "midlayer.mlp.gate_proj.weight": rand(i, h),
        "midlayer.mlp.up_proj.weight": rand(i, h),
        "midlayer.mlp.down_proj.weight": rand(h, i),
        "midlayer.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        "midlayer.hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        "norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "lm_head.weight": rand(vd, h),
        "d2t": torch.zeros(vd, dtype=torch.long),
        "t2d": torch.arange(v) < vd,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def timed_process(cmd: list[str], env: dict[str, str], expect: tuple[int, ...] = (0,)) -> tuple[float, float, int, str]:
    """(seconds, peak RSS GiB, exit code, last stderr line) of one step in a fresh process (wait4's
    rusage: that child's own peak)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        err.seek(0)
        out.seek(0)
        text, said = err.read(), out.read()
    lines = [ln for ln in text.splitlines() if ln.strip() and "WARNING" not in ln] or said.strip().splitlines() or [""]
    last = lines[-1][:300]
    if code not in expect:
        raise SystemExit(f"{' '.join(cmd[2:4])}: exit {code}\n{text[-3000:]}")
    return seconds, usage.ru_maxrss / 1024**2, code, last


def available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024**2
    return float("inf")


def target_params() -> int:
    """The rehearsal target's parameters: embedding and lm_head (vocabulary x hidden) dominate."""
    h, v = K2_WIDTH["hidden_size"], 163840
    return 2 * v * h + 3 * 110_000_000  # + three MLA layers with tiny MLPs (about 0.1 B each)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="/tmp/drafterops-rehearsal")
    work = Path(ap.parse_args().work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{work}/mlflow.db",
           "DRAFTEROPS_CACHE": str(work / "cache")}  # fmt: skip
    target, drafter, data = work / "k2.5-width-target", work / "k2-drafter", work / "data"
    prompts = work / "prompts.jsonl"
    lines = (MINI / "prompts" / "k2.5-val.jsonl").read_text().splitlines()[:4]
    prompts.write_text("\n".join(lines) + "\n")
    rows = []

    def step(
        name: str, cmd: list[str], expect: tuple[int, ...] = (0,), note: str = "", needs: float = 0, what: str = ""
    ) -> None:
        """Run a step, or say why not: `needs` (GiB, from the shapes) beyond what this host has free."""
        free = available_gib()
        if needs > 0.9 * free:
            reason = f"not run: needs about {needs:.1f} GiB ({what}), this host has {free:.1f} GiB available"
            rows.append({"step": name, "peak RSS": "-", "time": "-", "exit": "-", "note": reason})
            print(rows[-1], flush=True)
            return
        seconds, rss, code, last = timed_process(cmd, env, expect)
        row = {"step": name, "peak RSS": f"{rss:.2f} GiB", "time": f"{seconds:.0f} s", "exit": code}
        rows.append({**row, "note": note or last})
        print(rows[-1], flush=True)

    build = [sys.executable, "-c", BUILD_TARGET, str(target), json.dumps(K2_WIDTH), str(MINI / "k2.5-mini")]
    step("build the target (random, bf16)", build, note="3 layers at K2's width, 2.7 B parameters")
    write = [sys.executable, "-c", f"from pathlib import Path; from bench.rehearsal import write_drafter; "
             f"write_drafter(Path({str(drafter)!r}))"]  # fmt: skip
    step("write the K2 drafter (random, bf16)", write, note="1.19 B parameters, no embedding")
    m = [sys.executable, "-m"]
    uri = "models:/k2.5-width-target-eagle3@imported"
    step(
        "import_drafter",
        [*m, "steps.import_drafter", "--source", str(drafter), "--target", str(target),
         "--trained_for", "moonshotai/Kimi-K2-Instruct"],
    )  # fmt: skip
    step("shape_gate", [*m, "steps.shape_gate", "--model", uri, "--target", str(target)], expect=(0, 1))
    target_bf16 = target_params() * 2 / 1024**3  # a target loads at its own precision: bf16 here
    drafter_bf16 = (1.19e9 + 163840 * 7168) * 2 / 1024**3  # its weights and the target's embedding, bf16
    step(
        "make_data (4 prompts, 64 tokens)",
        [*m, "steps.make_data", "--target", str(target), "--prompts", str(prompts), "--out", str(data),
         "--drafter", uri, "--max_len", "64", "--no-progress"],
        needs=target_bf16 * 1.1, what="the target in bf16",
    )  # fmt: skip
    step(
        "evaluate (2 prompts x 8 tokens, k=3)",
        [*m, "steps.evaluate", "--model", uri, "--target", str(target), "--prompts", str(prompts), "--limit", "2",
         "--max_new_tokens", "8", "--draft_steps", "3", "--no-progress"],
        needs=(target_bf16 + drafter_bf16) * 1.1, what="the target and the drafter with its embedding, bf16",
    )  # fmt: skip
    step(
        "finetune: memory plan (ZeRO-0 fp32, 1 x 512, TTT up to 4)",
        [*m, "steps.finetune", "--init", uri, "--data", str(data), "--n_trials", "1", "--max_steps", "2",
         "--batch_size", "1", "--no-progress"],
        expect=(0, 2),
    )  # fmt: skip
    notes = (
        "Each step in its own process started from this small one (a child's peak RSS starts at its parent's: "
        "fork copies the high-water mark). The drafter's aux ids and bos/eos are the rehearsal target's; its "
        f"shapes are the K2 drafter's. python -m bench.rehearsal; torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 1024**3:.0f} GiB RAM."
    )
    print(write_results("rehearsal", rows, notes))


if __name__ == "__main__":
    main()
