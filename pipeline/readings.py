"""One endpoint's readings turned into interval counts, each reading checked before it counts.

A reading counts only when it serves production's drafter, carries every counter the watch needs at the
served depth, and its counts (since the server started, and since the last reading) are ones speculation
can produce (engines/exposition.implausible). Anything else is a finding and leaves the endpoint without a
base: the next good reading starts one, so an exporter glitch costs one or two intervals and is never read
as a drop, and a glitched value never becomes the base the next interval is measured from.

An interval counts only once the reading after it confirms it: every counter of that next reading at least
where the interval ended. A glitch that is possible but false (a counter raised once, by any amount) is
followed by counters that went back, and both intervals around it are left out; the price is that the watch
acts one interval later.

Pure: no store, no network. The watch (pipeline/watching.py) fetches and says the findings; the bench
(bench/watch_detection.py) replays glitched streams through the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engines import exposition
from engines.endpoint import Reading
from serving import drift

SETTLE_INTERVALS = 3  # an engine version must hold this many readings before recertify runs for it


@dataclass
class Watched:
    """One endpoint: its last good reading (the base of the next interval), the engine version it settled on
    and one it may be moving to, and the findings it has had (each said once)."""

    url: str
    last: exposition.Scrape | None = None
    pending: tuple[drift.Counts, float] | None = None  # the last interval, counted once the next reading confirms it
    version: str = ""
    moving_to: str = ""  # a version read but not yet held for SETTLE_INTERVALS readings
    moving_for: int = 0
    said: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Taken:
    """What one reading gave: an interval's counts and load, or nothing; and a finding (key, line) to say."""

    counts: drift.Counts | None = None
    running: float = 0.0
    finding: tuple[str, str] | None = None


def take(w: Watched, reading: Reading, expected: str, k: int) -> Taken:
    """This reading's interval counts for endpoint `w` (serving `expected` at depth `k`)."""
    now = reading.scrape
    if expected not in reading.served:
        return _left_out(w, "other", f"{w.url} serves {', '.join(reading.served) or 'no named model'}, not "
                         f"{expected}: its counts are not production's")  # fmt: skip
    missing = now.missing(k)
    if missing:
        return _left_out(w, "missing", f"{w.url} reports no {', '.join(missing)}: its counts are left out")
    why = exposition.implausible(now, k)
    if why:
        return _left_out(w, f"implausible:{why}", f"{w.url} reports {why} ({_figures(now)}): the reading is left "
                         "out and counting starts again from the next")  # fmt: skip
    before, w.last = w.last, now
    if before is None:
        return Taken()  # the first good reading after a gap is the base of the next interval
    counts = exposition.interval_counts(before, now, k)
    if counts is None:  # a restart, or the reading before was a glitch upwards: neither interval counts
        w.pending = None
        return Taken(finding=("reset", f"{w.url}: counters went back (the server restarted, or the reading "
                                       "before was a glitch); the intervals around it are left out and counting "
                                       "starts again"))  # fmt: skip
    why = exposition.implausible(exposition.difference(before, now), k) or exposition.implausible_interval(counts, k)
    if why:
        return _left_out(w, f"implausible:{why}", f"{w.url}: the interval's counts show {why}: left out, and "
                         "counting starts again from the next reading")  # fmt: skip
    confirmed, w.pending = w.pending, (counts, float(now.running or 0.0))
    return Taken() if confirmed is None else Taken(*confirmed)


def _left_out(w: Watched, key: str, line: str) -> Taken:
    """A reading that does not count: no base kept, no interval waiting on it, and the finding to say."""
    w.last = w.pending = None
    return Taken(finding=(key, line))


def settled_version(w: Watched, version: str) -> str | None:
    """The engine version this reading says; returned once, when a new one has held for SETTLE_INTERVALS
    readings (a rolling upgrade behind one URL flaps between two and never settles)."""
    if not version or version == w.version:
        w.moving_to, w.moving_for = "", 0
        return None
    if not w.version:
        w.version = version
        return None
    w.moving_for = w.moving_for + 1 if version == w.moving_to else 1
    w.moving_to = version
    if w.moving_for < SETTLE_INTERVALS:
        return None
    w.version, w.moving_to, w.moving_for = version, "", 0
    return version


def _figures(s: exposition.Scrape) -> str:
    parts = [f"drafts {s.drafts:g}" if s.drafts is not None else "", f"draft tokens {s.draft_tokens:g}"
             if s.draft_tokens is not None else "", f"accepted {s.accepted:g}" if s.accepted is not None else "",
             "by position " + ", ".join(f"{v:g}" for v in s.per_pos) if s.per_pos else ""]  # fmt: skip
    return "; ".join(p for p in parts if p) or "no counts"
