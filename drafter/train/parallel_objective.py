"""P-EAGLE's training objective: every position drafts its first token as EAGLE-3's first step does, and sampled
anchors draft deeper from parallel slots, causal by depth (SpecForge's `peagle` strategy, its COD sampling).

Drafter position t holds (token t + 1, the target's states at t), as in EAGLE-3. The slot of depth d >= 1
anchored at a stands at position a + d, holds (the mask token, fc(mask_hidden)), sees the real positions <= a and
its own anchor's slots of depth <= d, and is scored against the target at a + d + 1, exactly what the vLLM pass
at a verified position a drafts in its d-th slot. Depth d keeps max(r^d, r_min) of the scored positions, drawn
from depth d - 1's anchors, so an anchor's slots are always a chain from depth 1. Labels are the target's own
distributions over the draft vocabulary (soft cross-entropy, as EAGLE-3's loss); many anchors share one forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter.data.dataset import Batch
from drafter.model.peagle import PEagleDrafter
from drafter.train.block_objective import block_acceptance
from drafter.train.loss import pred_mask_from_loss_mask, target_draft_logits

DEPTHS, RATIO, RATIO_MIN = 4, 0.7, 0.2  # speculators' defaults (docs/user_guide/algorithms/peagle.md)
ANCHORS_AT_ONCE = 64  # held-out statistics: anchors a forward (k - 1 slot rows each, each over the draft vocabulary)


@dataclass
class Slots:
    anchor: torch.Tensor  # [B, S] anchor position of each slot (-1: padding)
    depth: torch.Tensor  # [B, S] its depth >= 1


def scored(batch: Batch) -> torch.Tensor:
    """[B, T] bool: the prediction drafter position t makes (the target's token at t + 1) is a training target."""
    pred = pred_mask_from_loss_mask(batch.loss_mask, batch.segment_ids)
    return torch.cat([pred[:, 1:], torch.zeros_like(pred[:, :1])], dim=1)


def _pad(rows: list[list[tuple[torch.Tensor, int]]]) -> Slots:
    width = max([sum(len(a) for a, _ in row) for row in rows] + [1])
    anchor = torch.full((len(rows), width), -1, dtype=torch.long)
    depth = torch.ones((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        if row:
            anchor[b, : sum(len(a) for a, _ in row)] = torch.cat([a for a, _ in row])
            depth[b, : sum(len(a) for a, _ in row)] = torch.cat([torch.full((len(a),), d) for a, d in row])
    return Slots(anchor, depth)


def sample_slots(ok: torch.Tensor, generator: torch.Generator, depths: int = DEPTHS, ratio: float = RATIO,
                 ratio_min: float = RATIO_MIN) -> Slots:  # fmt: skip
    """COD sampling per row of `ok` (scored): depth d keeps max(ratio^d, ratio_min) of the scored positions,
    among depth d - 1's anchors whose position a + d is scored."""
    t = ok.shape[1]
    rows = []
    for b in range(ok.shape[0]):
        prev = ok[b].nonzero().flatten()
        n0, row = len(prev), []
        for d in range(1, depths):
            cand = prev[(prev + d < t) & ok[b, (prev + d).clamp(max=t - 1)]]
            size = min(int(max(0, n0 - d) * max(ratio**d, ratio_min)), len(cand))
            if size <= 0:
                break
            prev = cand[torch.randperm(len(cand), generator=generator)[:size]].sort().values
            row.append((prev, d))
        rows.append(row)
    return _pad(rows)


def every_slot(length: int, batch_size: int, k: int) -> Slots:
    """Every position anchoring slots of depth 1 .. k - 1 (held-out statistics)."""
    anchors = torch.arange(length).repeat_interleave(k - 1)
    depth = torch.arange(1, k).repeat(length)
    return Slots(anchors.expand(batch_size, -1).clone(), depth.expand(batch_size, -1).clone())


@dataclass
class ParallelOutput:
    loss: torch.Tensor
    correct: torch.Tensor  # [B, T + S] the draft equals the target's token
    valid: torch.Tensor  # [B, T + S] the row is scored


def parallel_forward(model: PEagleDrafter, batch: Batch, slots: Slots, head_rows: torch.Tensor) -> ParallelOutput:
    """The real positions and every slot of a batch in one forward; the loss is the soft cross-entropy against the
    target's distributions over the draft vocabulary, averaged over scored rows."""
    bsz, t = batch.input_ids.shape
    s = slots.anchor.shape[1]
    live = slots.anchor >= 0
    a = slots.anchor.clamp(min=0)
    nxt = torch.cat([batch.input_ids[:, 1:], torch.zeros_like(batch.input_ids[:, :1])], dim=1)
    mask_id, mask_h = model.slot_inputs(1)
    ids = torch.cat([nxt, mask_id.expand(bsz, s)], dim=1)
    hidden = torch.cat([model.combine(batch.aux_hidden), mask_h[None].expand(bsz, s, -1)], dim=1)
    positions = torch.cat([torch.arange(t).expand(bsz, t), a + slots.depth], dim=1)
    seen = batch.attention_mask[:, None, :]
    real = torch.ones(t, t, dtype=torch.bool).tril()[None] & seen
    to_real = (torch.arange(t)[None, None, :] <= a[:, :, None]) & seen & live[:, :, None]
    own = (a[:, :, None] == a[:, None, :]) & (slots.depth[:, None, :] <= slots.depth[:, :, None])
    own &= live[:, :, None] & live[:, None, :]
    mask = torch.cat([torch.cat([real, real.new_zeros(bsz, t, s)], 2), torch.cat([to_real, own], 2)], 1)
    mask |= torch.eye(t + s, dtype=torch.bool)[None]  # padding rows see themselves: no empty softmax
    logits = model.logits(model.run(ids, hidden, positions, mask[:, None])).float()
    label_pos = torch.cat([torch.arange(1, t + 1).expand(bsz, t), a + slots.depth + 1], dim=1).clamp(max=t - 1)
    ok = scored(batch)
    valid = torch.cat([ok, ok.gather(1, (a + slots.depth).clamp(max=t - 1)) & live & (a + slots.depth < t)], 1)
    states = batch.last_hidden.gather(1, label_pos[..., None].expand(-1, -1, batch.last_hidden.shape[-1]))
    target = torch.softmax(target_draft_logits(states, head_rows).float(), dim=-1)
    ce = -(target * torch.log_softmax(logits, dim=-1)).sum(-1)
    loss = (ce * valid).sum() / valid.sum().clamp(min=1)
    correct = model.draft_to_target(logits.argmax(-1)) == batch.target_token.gather(1, label_pos)
    return ParallelOutput(loss, correct, valid)


def step_loss(head_rows: torch.Tensor, depths: int = DEPTHS):
    """The training step's loss for drafter/train/block_loop.train_block: slots redrawn every step."""

    def loss_of(model: PEagleDrafter, batch: Batch, generator: torch.Generator) -> torch.Tensor:
        return parallel_forward(model, batch, sample_slots(scored(batch), generator, depths), head_rows).loss

    return loss_of


@torch.no_grad()
def parallel_stats(model: PEagleDrafter, dataset, indices: list[int], k: int) -> tuple[float, list[float]]:  # noqa: ANN001
    """Teacher-forced (simulated accept_len at k drafts, conditional acceptance by depth) over every anchor of
    held-out samples: anchor a's k drafts are its own first draft and its slots of depth 1 .. k - 1."""
    from drafter.data.dataset import iterate_batches

    head_rows = dataset.target_head()[model.t2d].float()
    correct, valid = [], []
    for batch in iterate_batches(dataset, indices, 1, shuffle=False):  # memory: rows x draft vocabulary a forward
        t = batch.input_ids.shape[1]
        for first in range(0, t, ANCHORS_AT_ONCE):
            n = min(ANCHORS_AT_ONCE, t - first)
            slots = every_slot(n, 1, k)
            slots.anchor += first
            out = parallel_forward(model, batch, slots, head_rows)
            own = out.correct[0, first : first + n, None], out.valid[0, first : first + n, None]
            correct.append(torch.cat([own[0], out.correct[0, t:].reshape(n, k - 1)], 1))
            valid.append(torch.cat([own[1], out.valid[0, t:].reshape(n, k - 1)], 1))
    return block_acceptance(torch.cat(correct), torch.cat(valid), k)
