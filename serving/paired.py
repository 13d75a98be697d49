"""Drafters compared on the same prompts: the difference of their traffic-mix accept_len with a paired
interval, the same difference's unpaired interval, and a ranking in which drafters that cannot be told
apart are tied.

Every candidate in a bake-off decodes the profile's pinned prompts, so prompt i of drafter A and prompt
i of drafter B share whatever makes that prompt easy or hard. The difference

    D = sum_c share_c * (pooled_A,c - pooled_B,c),   pooled = sum tokens / sum cycles over the class

is the mix figure of `serving.workload.mix_accept_len` taken for A minus the same for B. Its interval
resamples prompts within each class, the **same indices for both drafters** (paired): what is common to a
prompt cancels, and only how differently the two drafters fare on it varies. The unpaired interval
resamples each drafter's prompts independently, as two separate evaluate runs would be read; the ratio of
the widths says what pairing bought. Both use `mix_ci`'s method (the bootstrap's spread, corrected for
small classes by sqrt(n / (n - 1)), times Student's t with smallest class - 1 degrees of freedom), so a
difference's interval and a drafter's own interval are the same kind of figure.

Ranking: by the mix, highest first. A drafter joins the tie group of the group's leader (the first drafter
of the group) when their paired interval includes zero; otherwise it starts the next group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Counts = list[tuple[int, int]]  # (tokens, cycles) per prompt, in the pinned order
ITERS = 2000


@dataclass(frozen=True)
class Difference:
    """A minus B in traffic-mix accept_len, with its paired and unpaired 95% intervals."""

    a: str
    b: str
    estimate: float
    low: float
    high: float
    unpaired_low: float
    unpaired_high: float
    prompts: int  # prompts both decoded

    @property
    def width(self) -> float:
        return self.high - self.low

    @property
    def unpaired_width(self) -> float:
        return self.unpaired_high - self.unpaired_low

    @property
    def narrower(self) -> float:
        """How much narrower the paired interval is than the unpaired one (0.6: 60% narrower)."""
        return 1 - self.width / self.unpaired_width if self.unpaired_width > 0 else 0.0

    @property
    def tied(self) -> bool:
        """The paired interval includes zero: the data cannot say which is better."""
        return self.low <= 0 <= self.high

    @property
    def a_better(self) -> bool:
        """A beats B with the whole paired interval above zero."""
        return self.low > 0


def _pooled(arr: np.ndarray) -> np.ndarray:
    """Pooled accept_len of (..., n, 2) counts over the prompt axis (a prompt of no cycles adds nothing)."""
    return arr[..., 0].sum(-1) / np.maximum(arr[..., 1].sum(-1), 1)


def difference(
    a: str,
    b: str,
    parts: list[tuple[float, Counts, Counts]],
    iters: int = ITERS,
    seed: int = 0,
    level: float = 0.95,
    scale: tuple[float, float] = (1.0, 1.0),
) -> Difference:
    """A minus B over classes given as (share, A's counts, B's counts), each class's prompts in the same
    order for both; each side's accept_len times its `scale` (1 / its break-even: the difference of projected
    speed-ups). Deterministic for a seed."""
    from scipy.stats import t as student

    paired_rng, a_rng, b_rng = (np.random.default_rng([seed, i]) for i in range(3))
    paired, unpaired = np.zeros(iters), np.zeros(iters)
    center, smallest, prompts = 0.0, None, 0
    for share, ca, cb in parts:
        if len(ca) != len(cb):
            raise ValueError(f"{len(ca)} prompts for {a}, {len(cb)} for {b}: pairing needs the same prompts")
        xa = np.asarray(ca, dtype=np.float64).reshape(-1, 2)
        xb = np.asarray(cb, dtype=np.float64).reshape(-1, 2)
        n = len(xa)
        prompts += n
        if n == 0:
            continue
        sa, sb = scale
        va, vb = sa * float(_pooled(xa)), sb * float(_pooled(xb))
        center += share * (va - vb)
        paired += share * (va - vb)
        unpaired += share * (va - vb)
        if n == 1:
            continue
        widen = math.sqrt(n / (n - 1))
        pick = paired_rng.integers(0, n, size=(iters, n))
        paired += share * widen * ((sa * _pooled(xa[pick]) - va) - (sb * _pooled(xb[pick]) - vb))
        pick_a, pick_b = a_rng.integers(0, n, size=(iters, n)), b_rng.integers(0, n, size=(iters, n))
        unpaired += share * widen * ((sa * _pooled(xa[pick_a]) - va) - (sb * _pooled(xb[pick_b]) - vb))
        smallest = n if smallest is None else min(smallest, n)
    if smallest is None:
        return Difference(a, b, center, center, center, center, center, prompts)
    t = float(student.ppf(0.5 + level / 2, smallest - 1))
    half, half_unpaired = t * float(paired.std(ddof=1)), t * float(unpaired.std(ddof=1))
    return Difference(a, b, center, center - half, center + half, center - half_unpaired, center + half_unpaired,
                      prompts)  # fmt: skip


@dataclass(frozen=True)
class Ranking:
    """Drafters by traffic-mix accept_len (highest first), or by projected speed-up when their break-evens differ
    (`by`), their tie groups (1 = the best group), and the paired difference of every pair in that measure, the
    better-ranked drafter first."""

    order: list[str]
    accept_len: dict[str, float]
    group: dict[str, int]
    pairs: dict[tuple[str, str], Difference]
    by: str = "accept_len"  # or "speed-up": accept_len over each drafter's own break-even

    def between(self, a: str, b: str) -> Difference:
        """A minus B, whichever way round it was computed."""
        if (a, b) in self.pairs:
            return self.pairs[(a, b)]
        d = self.pairs[(b, a)]
        return Difference(a, b, -d.estimate, -d.high, -d.low, -d.unpaired_high, -d.unpaired_low, d.prompts)

    def tied_with(self, label: str) -> list[str]:
        return [x for x in self.order if x != label and self.group[x] == self.group[label]]


def rank(drafters: dict[str, list[tuple[str, float, Counts]]], iters: int = ITERS, seed: int = 0,
         break_even: dict[str, float] | None = None) -> Ranking:  # fmt: skip
    """Each drafter's classes as (name, share, counts), in the same class and prompt order for all. With
    `break_even` per drafter and not all the same (methods whose cycles cost apart), ranked by projected speed-up
    (accept_len / break-even): accept_len alone does not compare drafters whose cycles cost differently."""
    from serving.workload import mix_accept_len

    mix = {label: mix_accept_len([(share, per) for _, share, per in classes]) for label, classes in drafters.items()}
    apart = break_even is not None and len({round(break_even[x], 9) for x in drafters}) > 1
    scale = {x: 1.0 / break_even[x] if apart else 1.0 for x in drafters}  # type: ignore[index]
    order = sorted(drafters, key=lambda label: -mix[label] * scale[label])  # stable: a tie keeps the given order
    pairs = {}
    for i, a in enumerate(order):
        for b in order[i + 1 :]:
            parts = [(share, pa, pb) for (_, share, pa), (_, _, pb) in zip(drafters[a], drafters[b], strict=True)]
            pairs[(a, b)] = difference(a, b, parts, iters, seed, scale=(scale[a], scale[b]))
    group, leader = {}, None
    for label in order:
        if leader is None or not pairs[(leader, label)].tied:
            leader = label
            group[label] = len(set(group.values())) + 1
        else:
            group[label] = group[leader]
    return Ranking(order, mix, group, pairs, "speed-up" if apart else "accept_len")
