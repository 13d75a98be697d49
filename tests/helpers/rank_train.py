"""Train the tiny drafter on a dataset and save its weights: run as one process or under torchrun,
so the data-parallel test compares W ranks with one rank at the same global batch."""

import argparse
import os

import torch
from safetensors.torch import save_file

from drafter.data.dataset import HiddenStateDataset
from drafter.train.loop import TrainConfig, is_rank0, scratch_drafter, train
from tests.helpers.drafters import tiny_config


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ds_config", default="zero0")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    torch.set_num_threads(1)
    ds = HiddenStateDataset(args.data)
    cfg = tiny_config(vocab_size=int(ds.target_head().shape[0]), draft_vocab_size=128, aux_layer_ids=[0, 1, 2])
    model = scratch_drafter(cfg, ds, list(range(len(ds))), seed=0)
    result = train(
        model,
        ds,
        TrainConfig(
            max_steps=args.steps, batch_size=4, max_len=64, peak_lr=3e-3, ttt_length=2, val_every=args.steps,
            val_fraction=0.25, ds_config=args.ds_config, ds_overrides={"bf16.enabled": args.bf16},
        ),
        progress=False,
    )  # fmt: skip
    if is_rank0():
        state = {k: v.contiguous() for k, v in result.model.state_dict().items()}
        save_file(state, args.out, metadata={"world_size": os.environ.get("WORLD_SIZE", "1")})
        losses = [h["train_loss"] for h in result.history]
        with open(args.out + ".loss", "w") as f:
            f.write(" ".join(f"{x:.6f}" for x in losses) + f"\n{result.tokens}\n")


if __name__ == "__main__":
    main()
