"""Random hidden-state datasets of a chosen size, for memory and throughput measurements."""

from __future__ import annotations

from pathlib import Path

import torch

from drafter.data.dataset import DatasetWriter, Sample

READER = """
import resource, sys, time
from drafter.data.dataset import HiddenStateDataset, iterate_batches
ds = HiddenStateDataset(sys.argv[1])
t = time.perf_counter()
n = sum(b.num_tokens for b in iterate_batches(ds, list(range(len(ds))), 8, seed=0))
print(n, time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""  # a full reader pass in a fresh process: tokens, seconds, peak RSS (KiB)


def write_random_dataset(
    folder: Path, samples: int, t: int = 256, h: int = 256, vocab: int = 100, shard_tokens: int = 8192
) -> int:
    """Write `samples` random samples of `t` tokens; returns the bytes on disk."""
    g = torch.Generator().manual_seed(0)
    meta = {"target": "synthetic", "layer_ids": [0, 1, 2], "hidden_size": h, "vocab_size": vocab}
    w = DatasetWriter(Path(folder), meta, shard_tokens=shard_tokens)
    for _ in range(samples):
        w.add(
            Sample(
                torch.randint(0, vocab, (t,), generator=g),
                torch.ones(t, dtype=torch.bool),
                torch.randn(t, 3 * h, generator=g),
                torch.randn(t, h, generator=g),
                torch.randint(0, vocab, (t,), generator=g),
            )
        )
    w.write_head(torch.randn(vocab, h), torch.randn(vocab, h))
    w.finish()
    return sum(p.stat().st_size for p in Path(folder).iterdir())
