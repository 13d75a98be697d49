"""A deployment's measured cost model: per operating point (requests in flight), the plain decode speed
and what one speculative cycle costs at each draft depth, fitted as `verify + k x draft_step`.

Break-even is then a function of (k, concurrency): plain_tps(c) x cycle_ms(k, c) / 1000, with the
measured cycle where depth k was timed and the fit elsewhere. For a drafter's acceptance by position,
the depth that maximises projected tok/s at an operating point is the one to serve it at.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from common.errors import BadInput

METHOD_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")  # drafter/methods NAME (eagle3, dflash, peagle)
CHAIN_METHOD = "eagle3"  # drafter/methods DEFAULT.NAME: its cycles are the operating point's own cycle_ms_measured
FIT_TOLERANCE = 0.01  # relative: a stated fit further than this from its own points contradicts them


@dataclass(frozen=True)
class OperatingPoint:
    """One load the deployment serves at: `concurrency` requests in flight, `share` of its traffic."""

    concurrency: int
    share: float
    plain_tps: float  # decode tok/s one request sees without speculation
    verify_ms: float
    draft_step_ms: float
    cycle_ms_measured: tuple[tuple[int, float], ...] = ()  # (k, ms): the timed cycles the fit came from
    # the drafter's cycle shape (drafter/methods): "chain" runs a pass per draft, "block" one pass for all; set on
    # a view for one drafter, never in the identity (the profile as written prices a chain)
    draft_shape: str = "chain"
    # other draft methods' own cycles, timed by width with a drafter of that method: (method NAME, ((k, ms), ...))
    method_cycles: tuple[tuple[str, tuple[tuple[int, float], ...]], ...] = ()
    draft_method: str = ""  # the method a view prices (drafter/methods NAME): its own cycles where timed

    def method_points(self) -> tuple[tuple[int, float], ...]:
        """The timed cycles of the method this view prices, by width (none: not timed here)."""
        return dict(self.method_cycles).get(self.draft_method, ())

    def cycle_ms(self, k: int) -> float:
        """A cycle at k drafts. A method timed by width: its own cycle (timed at k, else the fit of its widths). A
        chain's: timed where k was timed, fitted elsewhere. An untimed block's: the chain fit's verify plus one
        pass, at any k (a chain's timed points hold k passes, so none is a block's)."""
        own = self.method_points()
        if own:
            return timed_or_fitted(own, k)
        if self.draft_shape == "block":
            return self.verify_ms + self.draft_step_ms
        return dict(self.cycle_ms_measured).get(k, self.verify_ms + k * self.draft_step_ms)

    def break_even(self, k: int) -> float:
        return self.plain_tps * self.cycle_ms(k) / 1000.0

    def residuals(self) -> dict[int, float]:
        """Measured minus fitted cycle ms, per timed depth."""
        return {k: ms - (self.verify_ms + k * self.draft_step_ms) for k, ms in self.cycle_ms_measured}

    def identity(self) -> dict[str, object]:
        out: dict[str, object] = {
            "concurrency": self.concurrency,
            "share": self.share,
            "plain_tps": self.plain_tps,
            "verify_ms": self.verify_ms,
            "draft_step_ms": self.draft_step_ms,
            "cycle_ms_measured": [list(p) for p in self.cycle_ms_measured],
        }
        if self.method_cycles:  # left out when none: a profile without them keeps its digest
            out["method_cycle_ms_measured"] = {m: [list(p) for p in points] for m, points in self.method_cycles}
        return out

    def label(self) -> str:
        return f"concurrency {self.concurrency} ({self.share:.0%} of traffic)"


def timed_or_fitted(points: tuple[tuple[int, float], ...], k: int) -> float:
    """The cycle timed at k, else the least-squares line through the timed ones (one timing: the whole cycle)."""
    timed = dict(points)
    if k in timed:
        return timed[k]
    fixed, per_draft = fit_cycle(timed)
    return fixed + k * per_draft


def fit_cycle(points: dict[int, float]) -> tuple[float, float]:
    """Least squares `cycle_ms = verify + k x draft_step` (one depth: the whole cycle is verify_ms)."""
    if not points:
        raise ValueError("no cycle timings to fit")
    ks = sorted(points)
    if len(ks) == 1:
        return points[ks[0]], 0.0
    n = len(ks)
    mk = sum(ks) / n
    my = sum(points[k] for k in ks) / n
    sxx = sum((k - mk) ** 2 for k in ks)
    step = sum((k - mk) * (points[k] - my) for k in ks) / sxx
    step = max(step, 0.0)  # a draft step cannot cost negative time; noise can make the slope dip below 0
    return my - step * mk, step


def parse_operating_points(raw: object, path: Path) -> tuple[OperatingPoint, ...]:
    """The profile's `operating_points` list, every field checked, and each fit against its own points."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise BadInput(f"{path}: operating_points must be a non-empty list")
    out, seen = [], set()
    for i, item in enumerate(raw):
        where = f"{path}: operating_points[{i}]"
        if not isinstance(item, dict):
            raise BadInput(f"{where} must be a mapping")
        unknown = sorted(set(item) - {"concurrency", "share", "plain_tps", "verify_ms", "draft_step_ms",
                                      "cycle_ms_measured", "method_cycle_ms_measured", "description"})  # fmt: skip
        if unknown:
            raise BadInput(f"{where}: unknown field(s) {', '.join(unknown)}")
        c = _whole(item.get("concurrency"), f"{where}.concurrency")
        if c in seen:
            raise BadInput(f"{where}: concurrency {c} appears twice")
        seen.add(c)
        share = _finite(item.get("share", 1.0 if len(raw) == 1 else None), f"{where}.share")
        plain = _finite(item.get("plain_tps"), f"{where}.plain_tps")
        verify = _finite(item.get("verify_ms"), f"{where}.verify_ms")
        step = _finite(item.get("draft_step_ms"), f"{where}.draft_step_ms")
        if not 0 <= share <= 1 or plain <= 0 or verify <= 0 or step < 0:
            raise BadInput(f"{where}: needs share in [0, 1], plain_tps > 0, verify_ms > 0, draft_step_ms >= 0")
        points = _points(item.get("cycle_ms_measured", {}), f"{where}.cycle_ms_measured")
        methods = _method_cycles(item.get("method_cycle_ms_measured", {}), f"{where}.method_cycle_ms_measured")
        op = OperatingPoint(c, share, plain, verify, step, tuple(sorted(points.items())), method_cycles=methods)
        if points:
            fv, fs = fit_cycle(points)
            if not (_close(fv, verify) and _close(fs, step, absolute=1e-3)):
                raise BadInput(
                    f"{where}: verify_ms {verify:g} and draft_step_ms {step:g} are not the fit of its own "
                    f"cycle_ms_measured (which gives {fv:.4f} and {fs:.4f}): the figures contradict the measurement"
                )
        out.append(op)
    if abs(sum(op.share for op in out) - 1) > 1e-6:
        raise BadInput(f"{path}: operating_points shares sum to {sum(op.share for op in out):g}, not 1")
    return tuple(sorted(out, key=lambda op: op.concurrency))


def primary(points: tuple[OperatingPoint, ...]) -> OperatingPoint:
    """The point that carries the most traffic (the lowest concurrency on a tie): the profile's headline."""
    return max(points, key=lambda op: (op.share, -op.concurrency))


def _method_cycles(raw: object, where: str) -> tuple[tuple[str, tuple[tuple[int, float], ...]], ...]:
    """{method NAME: {width: cycle ms}}: each method's own timed cycles."""
    if not isinstance(raw, dict):
        raise BadInput(f"{where} must map a draft method's name to its cycle ms by width")
    out = []
    for name, points in raw.items():
        if not isinstance(name, str) or not METHOD_NAME.fullmatch(name):
            raise BadInput(f"{where}: {name!r} is not a draft method's name")
        if name == CHAIN_METHOD:
            raise BadInput(f"{where}: {name}'s cycles are the point's own cycle_ms_measured, not another method's")
        timed = _points(points, f"{where}.{name}")
        if not timed:
            raise BadInput(f"{where}.{name} times no width")
        fixed, _ = fit_cycle(timed)
        if fixed <= 0:  # extrapolated to a narrower width, the line would price a cycle at or below nothing
            raise BadInput(f"{where}.{name}: the line through its widths costs {fixed:.3f} ms before the first "
                           "draft (<= 0): timings too uneven to price any other width")  # fmt: skip
        out.append((name, tuple(sorted(timed.items()))))
    return tuple(sorted(out))


def _points(raw: object, where: str) -> dict[int, float]:
    if not isinstance(raw, dict):
        raise BadInput(f"{where} must map draft depth to cycle ms")
    out = {}
    for k, ms in raw.items():
        depth = _whole(k, f"{where} depth")
        value = _finite(ms, f"{where}[{k}]")
        if value <= 0:
            raise BadInput(f"{where}[{k}] must be > 0 ms")
        out[depth] = value
    return out


def _whole(value: object, where: str) -> int:
    try:
        number = float(value) if isinstance(value, str) else value
    except ValueError:
        number = None
    if isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(number):
        raise BadInput(f"{where} must be a whole number >= 1, got {value!r}")
    if number != int(number) or not 1 <= number <= 4096:
        raise BadInput(f"{where} must be a whole number in [1, 4096], got {value!r}")
    return int(number)


def _finite(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadInput(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _close(a: float, b: float, absolute: float = 1e-6) -> bool:
    return abs(a - b) <= max(absolute, FIT_TOLERANCE * abs(b))


# ------------------------------------------------------------------------------------------ depth
def accept_len_at_depth(acc_pos: list[float], k: int) -> float:
    """E[tokens per cycle] at depth k from conditional acceptance by position; positions past the
    measured ones continue at the last measured rate (an extrapolation, said where it is reported)."""
    if not acc_pos:
        raise ValueError("no acceptance by position")
    total, reach = 1.0, 1.0
    for i in range(k):
        reach *= acc_pos[i] if i < len(acc_pos) else acc_pos[-1]
        total += reach
    return total


@dataclass(frozen=True)
class DepthChoice:
    concurrency: int
    k: int
    projected_tps: float
    plain_tps: float
    extrapolated: bool  # the chosen depth is past the measured positions

    @property
    def speedup(self) -> float:
        return self.projected_tps / self.plain_tps

    @property
    def beats_plain(self) -> bool:
        return self.projected_tps > self.plain_tps

    def sentence(self) -> str:
        past = " (acceptance past the measured positions extrapolated)" if self.extrapolated else ""
        if not self.beats_plain:
            return (
                f"at concurrency {self.concurrency} no depth beats plain decoding (best k={self.k}: "
                f"{self.speedup:.2f}x){past}"
            )
        return f"at concurrency {self.concurrency} serve at k={self.k}: {self.speedup:.2f}x plain decoding{past}"


def recommend_depth(acc_pos: list[float], op: OperatingPoint, depths: list[int]) -> DepthChoice:
    """The depth that maximises projected tok/s at this operating point (the smaller k on a tie). A depth whose cycle
    is priced no dearer than a plain step (break-even <= 1: a timing lost in noise) is never offered: on it any
    drafter, one that accepts nothing too, would look like a gain."""
    best = None
    for k in sorted([d for d in depths if op.break_even(d) > 1] or depths):
        tps = accept_len_at_depth(acc_pos, k) * 1000.0 / op.cycle_ms(k)
        if best is None or tps > best[1] * (1 + 1e-9):
            best = (k, tps)
    k, tps = best
    return DepthChoice(op.concurrency, k, tps, op.plain_tps, k > len(acc_pos))
