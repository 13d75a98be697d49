"""Packing: several conversations in one row of a micro-batch, so real lengths waste no compute.

Padding every sample of a batch to its longest (what SpecForge's collator does) spends attention,
MLP and logits on pad tokens; on a long-tailed length mix that is most of the work. Here the batch's
samples are placed first-fit-decreasing into rows as long as its longest sample: each sample keeps
its own positions (0, 1, ...), attends only within itself (segment ids), and a TTT step never
reads across a boundary. The loss is normalised over the same real loss positions, so a packed batch
gives the same loss and gradients as the padded one (tests/test_packing.py).
"""

from __future__ import annotations

from drafter.data.dataset import Batch, Sample, cut_lengths, fill_rows


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
    lengths = cut_lengths(samples, max_len)
    width = max(lengths)
    return fill_rows(samples, lengths, first_fit_decreasing(lengths, width), width, packed=True)
