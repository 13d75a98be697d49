"""The data-scaling ladder: train at several data sizes drawn from one captured dataset (several seeds
each), warm-started and from scratch, with the same settings and the same token budget per sample
(steps grow with the data), and score each on the validation set at the deployment's draft depth."""

from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass, replace
from typing import Any

from drafter.train.loop import TrainConfig, scratch_drafter, train


@dataclass(frozen=True)
class Point:
    start: str  # "warm" or "scratch"
    samples: int
    seed: int
    steps: int
    val_sim_accept_len: float


def subset(n_total: int, size: int, seed: int) -> list[int]:
    """`size` samples of the dataset, drawn by `seed` (nested: a larger draw holds the smaller one)."""
    order = list(range(n_total))
    random.Random(seed).shuffle(order)
    return sorted(order[:size])


def steps_for(size: int, epochs: float, batch_size: int) -> int:
    """The same token budget per sample at every size: `epochs` passes over the subset."""
    return max(1, math.ceil(epochs * size / batch_size))


def run_point(
    start: str, base: Any, drafter_config: Any, dataset: Any, val_dataset: Any, settings: TrainConfig,
    size: int, seed: int, epochs: float, progress: bool = False,
) -> Point:  # fmt: skip
    indices = subset(len(dataset), size, seed)
    batch = min(settings.batch_size, size)
    cfg = replace(settings, max_steps=steps_for(size, epochs, batch), batch_size=batch, seed=seed)
    cfg = replace(cfg, val_every=cfg.max_steps)  # validate once, at the end
    if start == "warm":
        model = copy.deepcopy(base)
        model.has_embedding = True
    else:
        model = scratch_drafter(drafter_config, dataset, indices, seed)
    view = _Subset(dataset, indices)
    result = train(model, view, cfg, progress=progress, val_dataset=val_dataset)
    return Point(start, size, seed, cfg.max_steps, result.val.sim_accept_len)


class _Subset:
    """A dataset restricted to some samples (train() reads len, items, head and the layer facts)."""

    def __init__(self, dataset: Any, indices: list[int]) -> None:
        self.dataset, self.indices = dataset, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.indices[i]]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataset, name)
