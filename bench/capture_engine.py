"""Capture where the target is served (`make_data --engine vllm`) against capture in this process, side by
side in one run, each through the real entry point in its own process:

1. equality on 8 k2.5-val prompts (token ids, loss masks, worst per-token cosine of each field, next-token
   agreement; drafter/data/equality.py) at float32 and at the target's own bf16, and a float32 capture whose
   layer ids are handed to vLLM untranslated (one off, TorchSpec #87's fault);
2. capture throughput on k2.5-train (80 conversations, max_len 256 as the main job), the two alternating
   for two rounds: tokens per second of capture alone (the runs' `capture_tokens_per_s`) and the command's
   wall time (model load or server start included);
3. `make_data --regenerate` on k2.5-train (in-process, greedy): how many replies the target writes otherwise
   than the shipped ones;
4. the imported drafter fine-tuned on each train capture (in-process, vLLM, regenerated; the same fixed
   settings and seed) and validated on the same in-process capture of all 40 k2.5-val conversations:
   val_sim_accept_len.

    python -m bench.capture_engine [--equality]    (needs `python -m engines.environment vllm` once)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._common import write_results
from drafter.data.dataset import HiddenStateDataset
from drafter.data.equality import compare

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "miniworld" / "k2.5-mini"
PROMPTS = ROOT / "miniworld" / "prompts"
LAYERS = "1,3,4"
FIXED = {"peak_lr": 3e-4, "ttt_length": 3, "warmup_ratio": 0.1}

OFF_BY_ONE = """
import sys
import engines.capture
engines.capture.served_layer_ids = lambda ids, n: [*ids, n]  # handed untranslated: vLLM feeds the layer below
from steps import make_data
make_data.main(sys.argv[1:])
"""


def step(store: Path, module_or_code: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{store}/mlflow.db",
        "DRAFTEROPS_LOG_DIR": str(store / "logs"),
    }
    head = ["-c", module_or_code] if "\n" in module_or_code else ["-m", module_or_code]
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, *head, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"bench.capture_engine: {' '.join(args[:6])} failed:\n{res.stderr[-3000:]}")
    return res, time.perf_counter() - t0


def make_data(store: Path, out: Path, split: str, *extra: str, limit: int = 0, code: str = "steps.make_data"):
    args = ["--target", str(TARGET), "--prompts", str(PROMPTS / f"k2.5-{split}.jsonl"), "--layers", LAYERS,
            "--max_len", "256", "--limit", str(limit), "--out", str(out), "--no-progress", *extra]  # fmt: skip
    return step(store, code, *args)


def last_metric(store: Path, name: str) -> float:
    from mlflow import MlflowClient

    c = MlflowClient(f"sqlite:///{store}/mlflow.db")
    runs = c.search_runs([e.experiment_id for e in c.search_experiments()], order_by=["attributes.start_time DESC"])
    return next(r.data.metrics[name] for r in runs if name in r.data.metrics)


def main() -> None:
    store = Path(tempfile.mkdtemp(prefix="bench-capture-"))
    engine = ["--engine", "vllm"]
    rows = []
    for dtype in ("float32", "bfloat16"):
        make_data(store, store / f"val-engine-{dtype}", "val", *engine, "--dtype", dtype, limit=8)
        make_data(store, store / f"val-inproc-{dtype}", "val", "--dtype", dtype, limit=8)
        eq = compare(
            HiddenStateDataset(store / f"val-engine-{dtype}"), HiddenStateDataset(store / f"val-inproc-{dtype}")
        )
        rows.append({"capture": f"vLLM vs in-process, {dtype}", **eq.row()})
    truth = HiddenStateDataset(store / "val-inproc-float32")
    for side in ("engine", "inproc"):  # each bf16 capture against the float32 states: how far bf16 rounding goes
        eq = compare(HiddenStateDataset(store / f"val-{side}-bfloat16"), truth)
        rows.append(
            {"capture": f"{'vLLM' if side == 'engine' else 'in-process'} bfloat16 vs in-process float32", **eq.row()}
        )
    make_data(store, store / "val-off", "val", *engine, "--dtype", "float32", limit=8, code=OFF_BY_ONE)
    eq = compare(HiddenStateDataset(store / "val-off"), truth)
    rows.append({"capture": "vLLM, ids handed untranslated (one off), float32", **eq.row()})
    equality_notes = "8 k2.5-val conversations, k2.5-mini, aux layers [1, 3, 4]."
    print(write_results("capture_equality", rows, equality_notes), flush=True)
    if "--equality" in sys.argv[1:]:
        return

    speed: dict[str, list[tuple[float, float]]] = {"in-process": [], "vLLM": []}
    for r in range(2):
        for side, extra in (("in-process", ()), ("vLLM", engine)):
            out = store / f"train-{side}-{r}"
            _, wall = make_data(store, out, "train", *extra)
            speed[side].append((last_metric(store, "capture_tokens_per_s"), wall))
    tokens = HiddenStateDataset(store / "train-in-process-0").index["num_tokens"]
    best = {side: (max(t for t, _ in v), min(w for _, w in v)) for side, v in speed.items()}
    speed_rows = [
        {
            "capture": side,
            "tokens": tokens,
            "capture tok/s (best of 2)": f"{tps:.0f}",
            "command wall s (best of 2)": f"{wall:.1f}",
            "tok/s vs in-process": f"{tps / best['in-process'][0]:.2f}x",
            "wall vs in-process": f"{wall / best['in-process'][1]:.2f}x",
        }
        for side, (tps, wall) in best.items()
    ]

    make_data(store, store / "train-regenerated", "train", "--regenerate", "--max_new_tokens", "128")
    regen = HiddenStateDataset(store / "train-regenerated").index["meta"]["regenerated"]
    make_data(store, store / "val-all", "val")
    vals = {}
    for side, data in (("in-process", "train-in-process-0"), ("vLLM", "train-vLLM-0"),
                       ("in-process, replies regenerated", "train-regenerated")):  # fmt: skip
        step(store, "steps.finetune", "--init", str(ROOT / "miniworld" / "aq-mini-eagle3"),
             "--data", str(store / data), "--val_data", str(store / "val-all"),
             "--n_trials", "1", "--fixed_params", json.dumps(FIXED), "--max_steps", "150", "--seed", "0",
             "--alias", "none", "--name", "bench-capture", "--no-progress")  # fmt: skip
        vals[side] = last_metric(store, "val_sim_accept_len")
    for row in speed_rows:
        row["fine-tuned on it: val_sim_accept_len"] = f"{vals[row['capture']]:.3f}"
    blank = dict.fromkeys(speed_rows[0], "")
    regenerated_tokens = HiddenStateDataset(store / "train-regenerated").index["num_tokens"]
    regenerated_val = f"{vals['in-process, replies regenerated']:.3f}"
    speed_rows.append({**blank, "capture": "in-process, replies regenerated", "tokens": regenerated_tokens,
                       "fine-tuned on it: val_sim_accept_len": regenerated_val})  # fmt: skip
    notes = (
        f"k2.5-train, 80 conversations, max_len 256, at the target's own bf16; two alternating rounds per side. "
        f"vLLM's wall time includes its server's start. --regenerate (greedy, at most 128 new tokens): the target "
        f"wrote {regen['turns']} replies, {regen['changed']} of them differ from the shipped ones. Fine-tuning: the "
        f"imported aq-mini-eagle3, {json.dumps(FIXED)}, 150 steps, seed 0, validated on the same in-process "
        "capture of the 40 k2.5-val conversations."
    )
    print(write_results("capture_engine", speed_rows, notes))


if __name__ == "__main__":
    main()
