"""Which positions each TTT step computes and scores, worked out on the host before a step runs.

The forward computes only what the loss reads (drafter/model/eagle3.py): step j's logits where step j is
scored, its attention and MLP where step j or a later step is. How many positions that is decides
tensor shapes, so on a GPU working it out from device tensors would stop the host at every step and
every row until the GPU caught up. The masks come from the data loader on the host: the plan is made
there, from them, and its few index tensors travel to the device with the batch, without a wait.

A step's positions are `Rows`: an int M when they are the prefix 0..M-1 of every row (a plain slice),
else a [B, M] tensor of positions per row (the row's own positions in order, then padding positions
whose results nothing reads).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter.train.loss import shifted

Rows = torch.Tensor | int  # [B, M] positions per row, or M for the prefix 0..M-1 of every row


def compact(mask: torch.Tensor) -> Rows:
    """The positions each row computes: M when every row's True positions lie in 0..M-1, else [B, M]
    positions per row, the row's True positions in order, then (to pad rows to the longest, M)
    positions that are False, whose results nothing reads. M >= 1."""
    b, t = mask.shape
    m = max(int(mask.sum(1).max()), 1)
    ends = torch.where(mask.any(1), t - mask.flip(1).long().argmax(1), 0)  # last True position + 1
    if int(ends.max()) <= m:
        return m
    key = (~mask).long() * t + torch.arange(t, device=mask.device)[None]
    return torch.argsort(key, dim=1)[:, :m]


def count(rows: Rows) -> int:
    return rows if isinstance(rows, int) else rows.shape[1]


@dataclass(frozen=True)
class StepPlan:
    """One TTT unroll over a batch: per step, the positions it computes (`needed`) and the positions
    whose logits it scores (`scored`; None: every position, when nothing was masked)."""

    needed: tuple[Rows, ...]
    scored: tuple[Rows | None, ...]

    def to(self, device: torch.device | str) -> StepPlan:
        """On `device`, the index tensors copied from pinned memory without waiting for the GPU."""
        move = lambda r: r if r is None or isinstance(r, int) else _send(r, device)  # noqa: E731
        return StepPlan(tuple(move(r) for r in self.needed), tuple(move(r) for r in self.scored))


@dataclass(frozen=True)
class PackedPlan:
    """Packed rows run one at a time, each cut to its content (drafter/model/eagle3.py `_each_row`): each row's
    length and its own plan."""

    lengths: tuple[int, ...]
    rows: tuple[StepPlan, ...]

    def to(self, device: torch.device | str) -> PackedPlan:
        return PackedPlan(self.lengths, tuple(p.to(device) for p in self.rows))


Plan = StepPlan | PackedPlan


def plan_steps(
    pred_mask: torch.Tensor | None,
    steps: int,
    shape: tuple[int, int],
    attention_mask: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
) -> Plan:
    """The plan for a batch of `shape` [B, T] from its host masks. Step j at position t is scored against
    the prediction at t+j+1 of the same sample; a step runs where it or a later step is scored."""
    b, t = shape
    if segment_ids is not None and b > 1:
        lengths = attention_mask.sum(1).tolist() if attention_mask is not None else [t] * b
        cut = lambda x, r, n: None if x is None else x[r : r + 1, :n]  # noqa: E731
        rows = []
        for r, n in enumerate(lengths):
            n = max(int(n), 1)
            rows.append(plan_steps(cut(pred_mask, r, n), steps, (1, n), None, cut(segment_ids, r, n)))
        return PackedPlan(tuple(max(int(n), 1) for n in lengths), tuple(rows))
    if pred_mask is None:
        return StepPlan((t,) * steps, (None,) * steps)
    scored = [shifted(pred_mask.bool(), j + 1, segment_ids) for j in range(steps)]
    needed, acc = [], torch.zeros(b, t, dtype=torch.bool, device=pred_mask.device)
    for s in reversed(scored):
        acc = acc | s
        needed.append(acc)
    return StepPlan(tuple(compact(n) for n in needed[::-1]), tuple(compact(s) for s in scored))


def _send(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)
