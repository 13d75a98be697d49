"""DFlash's training objective: blocks anchored where the loss mask holds, labelled with the target's own tokens,
cross-entropy decaying with the position in the block (z-lab's recipe, gamma = 7).

A block anchored at position a is [token a, mask x (B - 1)] at positions a .. a + B - 1. It sees the context
states of positions < a (what the target has verified when token a is the bonus token) and its own block, never
another block. Block position j >= 1 is labelled with the target's greedy token at a + j given the true prefix
(`target_token[a + j - 1]`), which is what greedy verification accepts. Many blocks share one forward per batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from drafter.data.dataset import Batch
from drafter.model.dflash import DFlashDrafter

GAMMA = 7.0


def sample_anchors(batch: Batch, per_row: int, generator: torch.Generator) -> torch.Tensor:
    """[B, per_row] anchor positions (-1: none): a >= 1 with a reply token at a + 1, drawn without replacement."""
    b = batch.input_ids.shape[0]
    out = torch.full((b, per_row), -1, dtype=torch.long)
    for row in range(b):
        n = int(batch.attention_mask[row].sum())
        ok = [a for a in range(1, n - 1) if bool(batch.loss_mask[row, a + 1])]
        if not ok:
            continue
        pick = torch.randperm(len(ok), generator=generator)[:per_row]
        out[row, : len(pick)] = torch.tensor(ok)[pick].sort().values
    return out


def position_weights(block: int, gamma: float = GAMMA) -> torch.Tensor:
    """Weight of block positions 1 .. B - 1: exp(-(j - 1) / gamma); early positions gate every later one."""
    return torch.tensor([math.exp(-(j - 1) / gamma) for j in range(1, block)])


@dataclass
class BlockOutput:
    loss: torch.Tensor
    correct: torch.Tensor  # [blocks, B - 1] bool: the draft equals the label
    valid: torch.Tensor  # [blocks, B - 1] bool: the label is a reply token inside the sample


def block_forward(model: DFlashDrafter, batch: Batch, anchors: torch.Tensor, gamma: float = GAMMA) -> BlockOutput:
    """Every anchored block of a batch in one forward; the loss is the decayed cross-entropy over valid labels."""
    bsz, t = batch.input_ids.shape
    blk = model.block_size
    a = anchors.clamp(min=0)  # [B, A]
    offsets = torch.arange(blk)
    positions = (a[..., None] + offsets).reshape(bsz, -1)  # [B, A*blk]
    first = batch.input_ids.gather(1, a)  # the bonus token of each block
    tokens = torch.full((bsz, a.shape[1], blk), model.config.mask_token_id, dtype=torch.long)
    tokens[..., 0] = first
    tokens = tokens.reshape(bsz, -1)
    label_pos = (a[..., None] + offsets[1:]).clamp(max=t - 1)  # [B, A, blk-1]
    labels = batch.target_token.gather(1, (label_pos - 1).reshape(bsz, -1)).reshape(label_pos.shape)
    inside = (a[..., None] + offsets[1:]) < batch.attention_mask.sum(1)[:, None, None]
    valid = inside & batch.loss_mask.gather(1, label_pos.reshape(bsz, -1)).reshape(label_pos.shape)
    valid &= (anchors >= 0)[..., None]
    # attention: a block sees context positions < its anchor (real ones) and the whole of its own block
    q_block = torch.arange(a.shape[1]).repeat_interleave(blk)  # [Q] block index of each query
    ctx_ok = (torch.arange(t)[None, None, :] < a.repeat_interleave(blk, dim=1)[..., None]) & batch.attention_mask[
        :, None, :
    ]
    own = (q_block[:, None] == q_block[None, :])[None].expand(bsz, -1, -1)
    mask = torch.cat([ctx_ok, own], dim=-1)[:, None]  # [B, 1, Q, T + Q]
    ctx_k, ctx_v = model.context_kv(batch.aux_hidden, torch.arange(t)[None])
    hidden = model.block_hidden(tokens, positions, ctx_k, ctx_v, mask)
    logits = model.logits(hidden).float().reshape(bsz, a.shape[1], blk, -1)[:, :, 1:]  # [B, A, blk-1, V]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view(labels.shape)
    w = position_weights(blk, gamma)[None, None] * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-9)
    correct = logits.argmax(-1) == labels
    return BlockOutput(loss, correct.reshape(-1, blk - 1), valid.reshape(-1, blk - 1))


def block_acceptance(correct: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[float, list[float]]:
    """(simulated accept_len at k drafts, conditional acceptance at each position) from teacher-forced blocks,
    counted over blocks whose k labels are all valid: a draft counts only when every draft before it does."""
    full = valid[:, :k].all(1)
    run = correct[full, :k].int().cumprod(1)
    if run.shape[0] == 0:
        return 1.0, [0.0] * k
    reached = torch.cat([torch.ones(run.shape[0], 1, dtype=torch.int), run[:, :-1]], 1)
    cond = [float(run[:, j].sum() / reached[:, j].sum().clamp(min=1)) for j in range(k)]
    return 1.0 + float(run.sum(1).float().mean()), cond
