"""Packing: several conversations in one row of a micro-batch, so real lengths waste no compute.

Padding every sample of a batch to its longest (what SpecForge's collator does) spends attention,
MLP and logits on pad tokens; on a long-tailed length mix that is most of the work. Here the batch's
samples are placed first-fit-decreasing into rows as long as its longest sample: each sample keeps
its own positions (0, 1, ...), attends only within itself (segment ids), and a TTT step never
reads across a boundary. The loss is normalised over the same real loss positions, so a packed batch
gives the same loss and gradients as the padded one (tests/test_packing.py).
"""

from __future__ import annotations

import torch

from drafter.data import Batch, Sample


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of sample indices whose lengths sum to at most `capacity` (every length <= capacity),
    longest samples placed first; fewest rows in practice, at most the number of samples."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        slot = next((r for r, room in enumerate(free) if room >= n), None)
        if slot is None:
            rows.append([i])
            free.append(capacity - n)
        else:
            rows[slot].append(i)
            free[slot] -= n
    return [sorted(r) for r in rows]


def collate_packed(samples: list[Sample], max_len: int | None = None) -> Batch:
    """Samples (each cut to max_len) packed into rows as long as the longest one; pad positions
    carry segment id -1 and attention_mask False."""
    lengths = [min(len(s), max_len) if max_len else len(s) for s in samples]
    width = max(lengths)
    rows = first_fit_decreasing(lengths, width)
    r = len(rows)
    aux_w, h = samples[0].aux_hidden.shape[-1], samples[0].last_hidden.shape[-1]
    out = Batch(
        input_ids=torch.zeros(r, width, dtype=torch.long),
        attention_mask=torch.zeros(r, width, dtype=torch.bool),
        loss_mask=torch.zeros(r, width, dtype=torch.bool),
        aux_hidden=torch.zeros(r, width, aux_w),
        last_hidden=torch.zeros(r, width, h),
        target_token=torch.zeros(r, width, dtype=torch.long),
        position_ids=torch.zeros(r, width, dtype=torch.long),
        segment_ids=torch.full((r, width), -1, dtype=torch.long),
    )
    for row, members in enumerate(rows):
        start = 0
        for i in members:
            s, n = samples[i], lengths[i]
            at = slice(start, start + n)
            out.input_ids[row, at] = s.input_ids[:n]
            out.attention_mask[row, at] = True
            out.loss_mask[row, at] = s.loss_mask[:n]
            out.aux_hidden[row, at] = s.aux_hidden[:n].float()
            out.last_hidden[row, at] = s.last_hidden[:n].float()
            out.target_token[row, at] = s.target_token[:n]
            out.position_ids[row, at] = torch.arange(n)
            out.segment_ids[row, at] = i
            start += n
    return out
