"""How much data to break even? A saturating learning curve of accept_len against training samples,

    accept_len(n) = a - b * n^(-c)      (a: the ceiling, b > 0, c > 0),

fitted by least squares, with a bootstrap band (points resampled with replacement and refitted), read
off at a target: the samples it needs, or "not reachable" when the ceiling lies below it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Curve:
    a: float
    b: float
    c: float

    def __call__(self, n: float | np.ndarray) -> float | np.ndarray:
        return self.a - self.b * np.power(n, -self.c)

    def samples_for(self, target: float) -> float | None:
        """Samples at which the curve reaches `target`; None when its ceiling is below it."""
        if target >= self.a:
            return None
        return float((self.b / (self.a - target)) ** (1.0 / self.c))


def fit(n: list[float] | np.ndarray, y: list[float] | np.ndarray, ceiling: float | None = None) -> Curve:
    """Least squares; `ceiling` bounds a (with k draft steps accept_len never exceeds k + 1)."""
    from scipy.optimize import curve_fit

    n, y = np.asarray(n, dtype=float), np.asarray(y, dtype=float)
    if len(set(n.tolist())) < 3:
        raise ValueError("a saturating curve needs points at 3 or more sizes")
    span = max(float(y.max() - y.min()), 1e-3)
    top = float(y.max()) + 100 * span if ceiling is None else max(float(ceiling), float(y.max()) + 1e-6)
    p0 = (min(float(y.max()) + span, top - 1e-9), span * float(n.min()) ** 0.5, 0.5)
    bounds = ([float(y.min()), 1e-9, 1e-3], [top, np.inf, 3.0])
    (a, b, c), _ = curve_fit(lambda x, a, b, c: a - b * np.power(x, -c), n, y, p0=p0, bounds=bounds, maxfev=20000)
    return Curve(float(a), float(b), float(c))


@dataclass(frozen=True)
class Estimate:
    """The fitted curve and what it says about a target, with a bootstrap band."""

    curve: Curve
    target: float
    samples: float | None  # point estimate; None: not reachable by the fitted curve
    low: float | None  # 5th percentile of the bootstrap (None when not reachable)
    high: float | None  # 95th percentile (inf when some resamples never reach it)
    reachable_share: float  # share of bootstrap refits whose ceiling is above the target
    ceiling_low: float
    ceiling_high: float

    @property
    def reachable(self) -> bool:
        return self.samples is not None and self.samples <= PRACTICAL_LIMIT and self.reachable_share >= 0.5

    @property
    def why_not(self) -> str:
        """Why the target is out of reach: the curve's ceiling, or a sample count no one could collect."""
        if self.samples is not None and self.samples > PRACTICAL_LIMIT:
            return f"not reachable in practice (over {PRACTICAL_LIMIT:.0e} samples; curve ceiling {self.curve.a:.2f})"
        return f"not reachable (curve ceiling {self.curve.a:.2f})"


# A curve that creeps up to the target only asymptotically "reaches" it at absurd sample counts (1e36
# conversations); past this the answer is no.
PRACTICAL_LIMIT = 1e12


def estimate(
    n: list[float] | np.ndarray,
    y: list[float] | np.ndarray,
    target: float,
    reps: int = 300,
    seed: int = 0,
    ceiling: float | None = None,
) -> Estimate:
    n, y = np.asarray(n, dtype=float), np.asarray(y, dtype=float)
    curve = fit(n, y, ceiling)
    rng = np.random.default_rng(seed)
    needs, ceilings = [], []
    for _ in range(reps):
        pick = rng.integers(0, len(n), len(n))
        if len(set(n[pick].tolist())) < 3:
            continue
        try:
            refit = fit(n[pick], y[pick], ceiling)
        except (RuntimeError, ValueError):  # a resample the optimiser cannot fit
            continue
        ceilings.append(refit.a)
        needed = refit.samples_for(target)
        needs.append(math.inf if needed is None else needed)
    needs_arr = np.asarray(needs) if needs else np.asarray([math.inf])
    share = float(np.isfinite(needs_arr).mean())
    point = curve.samples_for(target)
    low = float(np.percentile(needs_arr, 5)) if point is not None else None
    high = float(np.percentile(needs_arr, 95)) if point is not None else None
    lo_a, hi_a = np.percentile(ceilings, [5, 95]).tolist() if ceilings else [curve.a, curve.a]
    return Estimate(curve, target, point, low, high, share, float(lo_a), float(hi_a))


def generation_hours(samples: float, tokens_per_sample: float, baseline_tps: float) -> float:
    """Hours to generate `samples` conversations with the target at its plain decoding speed."""
    return samples * tokens_per_sample / baseline_tps / 3600.0


def storage_gib(samples: float, tokens_per_sample: float, bytes_per_token: int) -> float:
    return samples * tokens_per_sample * bytes_per_token / 2**30
