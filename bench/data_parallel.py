"""Data-parallel scaling on this machine: one rank using every core against two ranks (torchrun,
gloo) with one core each, the same global batch and steps; tokens/s counts every rank's tokens.

    python -m bench.data_parallel
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._common import write_results
from bench.synthetic import write_random_dataset

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = dict(
    hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
    vocab_size=8000, draft_vocab_size=2000, aux_layer_ids=[0, 1, 2],
)  # fmt: skip
TRAIN = dict(max_steps=12, batch_size=8, max_len=256, ttt_length=3, val_every=1000, val_fraction=0.05)

SCRIPT = """
import json, sys
from drafter.model.config import DrafterConfig
from drafter.data.dataset import HiddenStateDataset
from drafter.train.loop import TrainConfig, is_rank0, scratch_drafter, train
spec = json.loads(sys.argv[2])
ds = HiddenStateDataset(sys.argv[1])
model = scratch_drafter(DrafterConfig(**spec["drafter"]), ds, list(range(len(ds))))
res = train(model, ds, TrainConfig(**spec["train"]), progress=False)
if is_rank0():
    print(json.dumps({"tokens": res.tokens, "seconds": res.seconds}))
"""


def run(folder: Path, ranks: int, threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = str(threads)
    spec = json.dumps({"drafter": DRAFTER, "train": TRAIN})
    script = folder.parent / "dp_train.py"
    script.write_text(SCRIPT)
    launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks)] if ranks > 1 else []
    cmd = [sys.executable, *launcher, str(script), str(folder), spec]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp_:
        folder = Path(tmp_) / "ds"
        write_random_dataset(folder, 64, t=256, h=DRAFTER["hidden_size"], vocab=DRAFTER["vocab_size"])
        one = run(folder, 1, cores)
        two = run(folder, 2, max(1, cores // 2))
    tps1, tps2 = one["tokens"] / one["seconds"], two["tokens"] / two["seconds"]
    rows = [
        {"ranks": 1, "threads per rank": cores, "tokens/s (all ranks)": f"{tps1:.0f}", "vs 1 rank": "1.00x"},
        {"ranks": 2, "threads per rank": max(1, cores // 2), "tokens/s (all ranks)": f"{tps2:.0f}",
         "vs 1 rank": f"{tps2 / tps1:.2f}x"},
    ]  # fmt: skip
    notes = (
        f"{cores}-core CPU, gloo; drafter hidden {DRAFTER['hidden_size']}, global batch {TRAIN['batch_size']} x "
        f"{TRAIN['max_len']}, TTT 3, {TRAIN['max_steps']} steps, ZeRO-0 fp32. The two ranks split each global "
        "batch; the cores are the same in both rows, so the ratio is the cost (or gain) of splitting them into ranks."
    )
    print(write_results("data_parallel", rows, notes))


if __name__ == "__main__":
    main()
