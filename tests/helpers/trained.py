"""Tiny drafters trained on the tiny target's own greedy continuations: they accept enough (accept_len about
1.3 on the pinned prompts) to clear a break-even just above 1, which the promotion rule requires of every
profile. Built once a session by `python -m tests.helpers.trained` (make_data with --regenerate, then the
project's own DeepSpeed training loop) in a process of its own, so no process group is left in a test worker.
Trained on prompts of random corpus words, never on the prompts the tests pin."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

SEEDS = (1, 2, 3)
STEPS = 200


def drafter_folder(root: Path, seed: int) -> Path:
    """Where the drafter trained with `seed` lies under the session's folder (tests/conftest.py: trained_tiny)."""
    return root / f"d{seed}"


def training_prompts(path: Path, n: int = 120, seed: int = 7) -> Path:
    """`n` prompts of 4-12 words drawn from the tiny tokenizer's corpus (none is a prompt the tests pin)."""
    from tests.helpers.targets import CORPUS

    words = " ".join(CORPUS).split()
    rng = random.Random(seed)
    records = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(4, 12)))} for _ in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def build(target: Path, out: Path, seeds: tuple[int, ...] = SEEDS, steps: int = STEPS) -> None:
    """Capture the target's greedy continuations, then train one tiny drafter per seed into out/d<seed>."""
    import torch

    from drafter.data.dataset import HiddenStateDataset
    from drafter.formats.checkpoint import save_drafter
    from drafter.train.loop import TrainConfig, ensure_distributed, scratch_drafter, train
    from tests.helpers.drafters import tiny_config

    data = out / "data"
    capture = [sys.executable, "-m", "steps.make_data", "--target", str(target), "--prompts",
               str(training_prompts(out / "train.jsonl")), "--out", str(data), "--layers", "0,1,2", "--regenerate",
               "--max_new_tokens", "16", "--no-progress"]  # fmt: skip
    subprocess.run(capture, check=True, capture_output=True, text=True)
    torch.set_num_threads(1)
    ensure_distributed()
    ds = HiddenStateDataset(data)
    for seed in seeds:
        cfg = tiny_config(vocab_size=int(ds.target_head().shape[0]), draft_vocab_size=128, aux_layer_ids=[0, 1, 2])
        model = scratch_drafter(cfg, ds, list(range(len(ds))), seed=seed)
        tcfg = TrainConfig(max_steps=steps, batch_size=8, max_len=64, peak_lr=3e-3, ttt_length=3, val_every=steps,
                           val_fraction=0.1, seed=seed)  # fmt: skip
        result = train(model, ds, tcfg, progress=False)
        save_drafter(result.model, drafter_folder(out, seed), include_embedding=False)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    build(args.target, args.out)


if __name__ == "__main__":
    main()
