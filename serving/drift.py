"""Whether production's live acceptance has dropped: a sequential test on an engine's counters.

Each interval's counter differences give, per draft position i, trials n_i (the drafts that reached
position i: every draft at i = 0, those accepted at i - 1 after) and successes a_i (accepted at i); the
interval's accept_len is 1 + sum_i a_i / drafts, as the engines count it.

- **Baseline.** Production's own live acceptance right after promotion, not the pinned workload's: the
  live traffic mix is another mix. It pools intervals until every position has seen enough trials that
  its estimate sits well inside the tolerance (`required_trials`: its standard error at most a quarter of
  the drop to detect), and is then fixed (the watch signs it into the audit trail).
- **Drop.** A drop of `tolerance` (relative; 2% as vLLM's own acceptance test) at every position, or at
  one: a Bernoulli CUSUM per position and one pooled over the positions (the sum of their log-likelihood
  ratios), each S <- max(0, S + LLR of the interval's counts under p(1 - tolerance) against p). Checked
  after every interval, as often as anyone looks: a CUSUM is built for continuous looks.
- **False alarms.** A CUSUM with threshold h has an average run length to a false alarm of at least
  e^h observations (Lorden 1971). With `monitors` CUSUMs watching at once and a stated false-alarm rate
  of one per `false_alarm_intervals` intervals, h = ln(false_alarm_intervals x monitors); each interval
  holds many draft observations, so the interval count is a floor.
- **Economics.** Break-even depends on load: the calibrated operating points give it per concurrency, and
  the live accept_len is held against it at the load the engine reports (between two calibrated loads, by
  straight lines; outside them, no verdict).

Delays and false alarms are measured by `python -m bench.watch_detection` on replayed served counters.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from serving.cycle_model import OperatingPoint


@dataclass(frozen=True)
class Counts:
    """One interval's speculative counts: verify cycles that carried drafts, and accepted draft tokens at
    each position (without per-position counts: `accepted` only, pooled)."""

    drafts: float
    per_pos: tuple[float, ...] = ()
    accepted: float | None = None
    depth: int = 0  # draft tokens per cycle: with `accepted` only, each draft token is one trial

    @property
    def accepted_total(self) -> float:
        return float(sum(self.per_pos)) if self.per_pos else float(self.accepted or 0.0)

    @property
    def accept_len(self) -> float | None:
        return None if self.drafts <= 0 else 1.0 + self.accepted_total / self.drafts

    def trials(self) -> list[tuple[float, float]]:
        """(trials, successes) per position: position 0's trials are the drafts, then each position's
        trials are the previous position's successes. Without per-position counts, one pooled pair: every
        draft token a trial (an engine that reports only totals)."""
        if not self.per_pos:
            return [(self.drafts * self.depth, self.accepted_total)] if self.depth and self.accepted is not None else []
        out, reached = [], self.drafts
        for a in self.per_pos:
            out.append((reached, a))
            reached = a
        return out


def required_trials(p: float, tolerance: float) -> int:
    """Trials at which a Bernoulli estimate's standard error is a quarter of the drop p * tolerance."""
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.ceil(16 * (1 - p) / (p * tolerance**2))


@dataclass(frozen=True)
class Baseline:
    """Production's live conditional acceptance per position, pooled over its first intervals."""

    acceptance: tuple[float, ...]
    trials: tuple[float, ...]
    drafts: float
    accept_len: float
    intervals: int

    def to_dict(self) -> dict[str, object]:
        return {"acceptance": list(self.acceptance), "trials": list(self.trials), "drafts": self.drafts,
                "accept_len": self.accept_len, "intervals": self.intervals}  # fmt: skip

    @classmethod
    def from_dict(cls, raw: dict) -> Baseline:
        return cls(tuple(float(x) for x in raw["acceptance"]), tuple(float(x) for x in raw["trials"]),
                   float(raw["drafts"]), float(raw["accept_len"]), int(raw["intervals"]))  # fmt: skip


@dataclass
class BaselineWindow:
    """Intervals pooled until every position's estimate is tight enough for `tolerance`."""

    tolerance: float
    min_intervals: int = 5
    drafts: float = 0.0
    successes: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)
    intervals: int = 0

    def add(self, counts: Counts) -> Baseline | None:
        """Pool one interval; the baseline once it is ready, else None."""
        pairs = counts.trials()
        if counts.drafts <= 0 or not pairs:
            return None
        if not self.tried:
            self.tried, self.successes = [0.0] * len(pairs), [0.0] * len(pairs)
        if len(pairs) != len(self.tried):
            raise ValueError(f"the draft depth changed: {len(self.tried)} positions, then {len(pairs)}")
        for i, (n, a) in enumerate(pairs):
            self.tried[i] += n
            self.successes[i] += a
        self.drafts += counts.drafts
        self.intervals += 1
        p = [a / n if n else 0.0 for a, n in zip(self.successes, self.tried, strict=True)]
        enough = all(n >= required_trials(q, self.tolerance) for q, n in zip(p, self.tried, strict=True) if q > 0)
        if self.intervals < self.min_intervals or not enough or not any(p):
            return None
        return Baseline(tuple(p), tuple(self.tried), self.drafts, 1 + sum(self.successes) / self.drafts,
                        self.intervals)  # fmt: skip

    def progress(self) -> str:
        if not self.tried:
            return "no drafts yet"
        p = [a / n if n else 0.0 for a, n in zip(self.successes, self.tried, strict=True)]
        need = [required_trials(q, self.tolerance) for q in p]
        short = [f"position {i}: {n:.0f}/{r}" for i, (n, r) in enumerate(zip(self.tried, need, strict=True)) if n < r]
        return f"{self.intervals} intervals; " + (
            "; ".join(short) if short else f"{self.min_intervals} intervals needed"
        )


def threshold(false_alarm_intervals: float, monitors: int) -> float:
    """The CUSUM threshold h for at most one false alarm per `false_alarm_intervals` intervals among
    `monitors` CUSUMs (Lorden's bound ARL0 >= e^h, Bonferroni over the monitors)."""
    return math.log(false_alarm_intervals * monitors)


def llr(n: float, a: float, p0: float, p1: float) -> float:
    """Log-likelihood ratio of `a` successes in `n` Bernoulli trials under p1 against p0."""
    p0, p1 = min(max(p0, 1e-9), 1 - 1e-9), min(max(p1, 1e-9), 1 - 1e-9)
    return a * math.log(p1 / p0) + (n - a) * math.log((1 - p1) / (1 - p0))


@dataclass(frozen=True)
class Alarm:
    monitor: str  # "pooled" or "position i"
    statistic: float
    threshold: float


@dataclass
class DropMonitor:
    """CUSUMs for a relative drop of `tolerance` from `baseline`: one per position and one pooled."""

    baseline: Baseline
    tolerance: float
    false_alarm_intervals: float
    statistics: list[float] = field(default_factory=list)  # per position, then pooled
    intervals: int = 0
    cycles: float = 0.0  # verify cycles watched

    def __post_init__(self) -> None:
        self.statistics = [0.0] * (len(self.baseline.acceptance) + 1)

    @property
    def h(self) -> float:
        return threshold(self.false_alarm_intervals, len(self.statistics))

    def names(self) -> list[str]:
        return [f"position {i}" for i in range(len(self.baseline.acceptance))] + ["pooled"]

    def update(self, counts: Counts) -> list[Alarm]:
        """The interval's evidence added; the monitors now past the threshold (each then starts again)."""
        pairs = counts.trials()
        if len(pairs) != len(self.baseline.acceptance):
            raise ValueError(f"the draft depth changed: {len(self.baseline.acceptance)} positions, now {len(pairs)}")
        self.intervals += 1
        self.cycles += counts.drafts
        step = [llr(n, a, p, p * (1 - self.tolerance)) for (n, a), p in zip(pairs, self.baseline.acceptance,
                                                                          strict=True)]  # fmt: skip
        step.append(sum(step))
        alarms = []
        for i, s in enumerate(step):
            self.statistics[i] = max(0.0, self.statistics[i] + s)
            if self.statistics[i] >= self.h:
                alarms.append(Alarm(self.names()[i], self.statistics[i], self.h))
                self.statistics[i] = 0.0
        return alarms


def break_even_at(points: Sequence[OperatingPoint], k: int, concurrency: float) -> float | None:
    """The break-even accept_len at `concurrency` requests in flight: a calibrated point's own, straight
    lines between two, None outside the calibrated loads (no verdict there)."""
    pts = sorted(points, key=lambda p: p.concurrency)
    if not pts or concurrency < pts[0].concurrency or concurrency > pts[-1].concurrency:
        return None
    for lo, hi in zip(pts, pts[1:], strict=False):
        if lo.concurrency <= concurrency <= hi.concurrency:
            t = (concurrency - lo.concurrency) / max(hi.concurrency - lo.concurrency, 1e-12)
            return lo.break_even(k) + t * (hi.break_even(k) - lo.break_even(k))
    return pts[0].break_even(k)


def serve_without_above(points: Sequence[OperatingPoint], k: int, accept_len: float) -> int | None:
    """The most requests in flight up to which `accept_len` beats break-even at every calibrated load, when a
    heavier calibrated load comes where it does not (None: it wins at every load, or already at the lightest
    loses)."""
    pts = sorted(points, key=lambda p: p.concurrency)
    last = None
    for p in pts:
        if accept_len <= p.break_even(k):
            return last
        last = p.concurrency
    return None


def pooled_accept_len(window: Sequence[Counts]) -> tuple[float | None, float]:
    """The accept_len pooled over intervals, and its standard error across them (ratio estimator)."""
    drafts = sum(c.drafts for c in window)
    if drafts <= 0:
        return None, math.inf
    mean = 1 + sum(c.accepted_total for c in window) / drafts
    if len(window) < 2:
        return mean, math.inf
    n = len(window)
    bar = drafts / n
    resid = [(c.accepted_total + c.drafts) - mean * c.drafts for c in window]
    var = sum(r * r for r in resid) / (n - 1) / (n * bar * bar)
    return mean, math.sqrt(var)
