"""A fine-tuning run of a one-pass draft method (DFlash, P-EAGLE) on DeepSpeed's engine: the method's own step
loss, validation at the deployment's draft depth by the method's held-out statistics, and checkpoints that resume
a trial whose worker died. The contract is drafter/train/loop.train's (`on_step`, `on_validate`, `TrainResult`),
so a finetune trial (tuning/trial.py) runs either through the same study.

The TTT settings of the search space (ttt_length, step_decay, noise_std) mean nothing to a one-pass method and are
ignored; the learning rate, its warm-up and weight decay are DeepSpeed's, as for EAGLE-3.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from common.errors import BadInput
from drafter.data.dataset import collate, split_indices
from drafter.train.loop import (
    TrainConfig,
    TrainingDiverged,
    TrainingStopped,
    TrainResult,
    batch_indices,
    ensure_distributed,
    full_state_dict,
    is_rank0,
    load_ds_config,
    rank_share,
)

StepLoss = Callable[[Any, Any, torch.Generator], torch.Tensor]  # (model, batch, generator) -> loss
HeldOut = Callable[[Any, Any, list[int], int], tuple[float, list[float]]]  # (model, dataset, indices, k)


@dataclass
class Validation:
    """What on_validate reads, as EAGLE-3's StepStats gives it."""

    sim_accept_len: float
    conditional_acceptance: list[float]


def train_one_pass(
    model: Any, dataset: Any, cfg: TrainConfig, step_loss: StepLoss, held_out: HeldOut,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    on_validate: Callable[[int, Validation], bool] | None = None, progress: bool = True, val_dataset: Any = None,
) -> TrainResult:  # fmt: skip
    """Train `model` (the method's network over the dataset's layers) for cfg.max_steps on DeepSpeed's engine;
    every cfg.val_every steps and at the end, validate at cfg.val_draft_steps and checkpoint."""
    import deepspeed
    import torch.distributed as dist

    if cfg.max_steps < 1 or cfg.batch_size < 1:
        raise BadInput("max_steps and batch_size must be >= 1")
    if val_dataset is None:
        train_idx, val_idx = split_indices(len(dataset), cfg.val_fraction, cfg.seed)
        val_dataset = dataset
    else:
        train_idx, val_idx = list(range(len(dataset))), list(range(len(val_dataset)))
    if not train_idx:
        raise BadInput("dataset has no training samples")
    ensure_distributed()
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(cfg.seed)
    model.train()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=load_ds_config(cfg.ds_config, cfg, cfg.max_steps),
    )  # fmt: skip
    ckpt = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    start = 0
    if ckpt is not None and (ckpt / "latest").is_file():
        _, client = engine.load_checkpoint(str(ckpt))
        start = int((client or {}).get("step", 0))
    history: list[dict[str, float]] = []
    val, tokens, t0 = None, 0, time.perf_counter()
    bar = tqdm(range(start, cfg.max_steps), initial=start, total=cfg.max_steps, desc="train", unit="step",
               disable=not (progress and is_rank0()))  # fmt: skip
    for step in bar:
        mine = rank_share(batch_indices(train_idx, cfg.batch_size, cfg.seed, step), rank, world)
        batch = collate([dataset[i] for i in mine], cfg.max_len)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # a resumed step draws the same anchors
        loss = step_loss(engine.module, batch, gen)
        shown = float(loss.detach())
        if not math.isfinite(shown):
            raise TrainingDiverged(step + 1, shown)
        engine.backward(loss)
        engine.step()
        tokens += batch.num_tokens
        lr = scheduler.get_last_lr()[0] if scheduler is not None else cfg.peak_lr
        history.append({"train_loss": shown, "lr": float(lr)})
        if on_step is not None and is_rank0():
            on_step(step + 1, history[-1])
        bar.set_postfix(loss=f"{history[-1]['train_loss']:.3f}")
        done = step + 1
        if done % max(1, cfg.val_every) == 0 or done == cfg.max_steps:
            engine.module.eval()
            val = Validation(*held_out(engine.module, val_dataset, val_idx, cfg.val_draft_steps))
            engine.module.train()
            if ckpt is not None:
                engine.save_checkpoint(str(ckpt), tag=f"step{done}", client_state={"step": done})
            if on_validate is not None and on_validate(done, val) and done < cfg.max_steps:
                raise TrainingStopped(done)
    bar.close()
    state = full_state_dict(engine)
    trained = engine.module
    trained.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    return TrainResult(trained.float().eval(), val, cfg.max_steps - start, tokens, time.perf_counter() - t0, history)
