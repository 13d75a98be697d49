"""Training a one-pass drafter on captured target states, plain PyTorch: DFlash's blocks
(drafter/train/block_objective.py) by default, or any objective a method gives (P-EAGLE's,
drafter/train/parallel_objective.py).

Used by the mini world's build for its public DFlash and P-EAGLE drafters; the same batches serve any caller.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from drafter.data.dataset import collate, iterate_batches, layers_for
from drafter.model.dflash import DFlashDrafter
from drafter.train.block_objective import GAMMA, block_acceptance, block_forward, sample_anchors
from drafter.train.loop import batch_indices


@dataclass
class BlockTrainConfig:
    steps: int = 400
    batch_size: int = 8
    max_len: int = 256
    peak_lr: float = 3e-3
    warmup_ratio: float = 0.03
    anchors: int = 16  # blocks per sample and step
    gamma: float = GAMMA
    seed: int = 0


@dataclass
class BlockTrainResult:
    seconds: float
    history: list[dict[str, float]] = field(default_factory=list)


def init_weights(model: DFlashDrafter, seed: int) -> None:
    """Normal(0, 0.02) linear weights, unit norms: reproducible from the seed alone."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif name.endswith("weight"):
                p.fill_(1.0)


def _lr(step: int, cfg: BlockTrainConfig) -> float:
    warm = max(1, int(cfg.steps * cfg.warmup_ratio))
    if step < warm:
        return cfg.peak_lr * (step + 1) / warm
    return cfg.peak_lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, cfg.steps - warm)))


StepLoss = Callable[[Any, Any, torch.Generator], torch.Tensor]  # (model, batch, generator) -> loss


def dflash_loss(cfg: BlockTrainConfig) -> StepLoss:
    """DFlash's step: `cfg.anchors` blocks a sample, redrawn every step."""
    return lambda model, batch, gen: (
        block_forward(model, batch, sample_anchors(batch, cfg.anchors, gen), cfg.gamma).loss
    )


def train_block(
    model: Any, dataset: Any, indices: list[int], cfg: BlockTrainConfig, progress: bool = True,
    step_loss: StepLoss | None = None, desc: str = "dflash",
) -> BlockTrainResult:  # fmt: skip
    """AdamW with warmup and cosine decay over `cfg.steps` batches of `indices`; `step_loss` the method's
    (DFlash's blocks by default), its anchors redrawn every step from the seed."""
    dataset = layers_for(dataset, list(model.config.aux_layer_ids))
    step_loss = step_loss or dflash_loss(cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.peak_lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    out = BlockTrainResult(0.0)
    start = time.perf_counter()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    for step in tqdm(range(cfg.steps), desc=desc, disable=not progress):
        batch = collate([dataset[i] for i in batch_indices(indices, cfg.batch_size, cfg.seed, step)], cfg.max_len)
        for group in opt.param_groups:
            group["lr"] = _lr(step, cfg)
        loss = step_loss(model, batch, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 50 == 0 or step == cfg.steps - 1:
            out.history.append({"step": step, "loss": float(loss.detach())})
    model.eval()
    out.seconds = time.perf_counter() - start
    return out


@torch.no_grad()
def block_stats(
    model: DFlashDrafter, dataset: Any, indices: list[int], k: int, anchors: int = 32, seed: int = 0
) -> tuple[float, list[float]]:
    """Teacher-forced (simulated accept_len at k drafts, conditional acceptance by position) on held-out samples."""
    dataset = layers_for(dataset, list(model.config.aux_layer_ids))
    gen = torch.Generator().manual_seed(seed)
    correct, valid = [], []
    for batch in iterate_batches(dataset, indices, 8, shuffle=False):
        res = block_forward(model, batch, sample_anchors(batch, anchors, gen))
        correct.append(res.correct)
        valid.append(res.valid)
    return block_acceptance(torch.cat(correct), torch.cat(valid), k)
