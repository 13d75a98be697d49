"""What the data-scaling fit says, in words a reader can trust: numbers rounded to two significant
figures (a fit on a short ladder knows no more), a warning when the answer lies far beyond the ladder
or the fit sits on its ceiling, rows that are not reachable collapsed into one, and a figure that draws
the extrapolation dashed with the 90% band shaded."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from reports.plotting import pyplot

FAR_BEYOND = 10.0  # an answer more than this many times the largest rung is an extrapolation to flag
ON_CEILING = 1e-3  # a fitted ceiling this close to its bound was stopped by the bound, not the data


def sig(x: float, digits: int = 2) -> str:
    """'39,542,884' -> '40,000,000'; '14989.32' -> '15,000'; '0.0123' -> '0.012'."""
    if x is None or not math.isfinite(x):
        return "inf" if x == math.inf else "?"
    if x == 0:
        return "0"
    rounded = float(f"{x:.{digits}g}")
    if abs(rounded) >= 10 ** (digits - 1):
        return f"{rounded:,.0f}"
    return f"{rounded:.{digits}g}"


@dataclass(frozen=True)
class Row:
    start: str
    tps: float
    needed: float  # accept_len needed
    cell: str  # samples [band], or why not
    hours: str
    gib: str

    @property
    def reachable(self) -> bool:
        return self.hours != "-"


def rows(fits: dict[str, dict[float, Any]], plan: list[Any], ceiling: float, k: int,
         hours: Any, gib: Any) -> list[Row]:  # fmt: skip
    """One row per (start, plan row); `hours(samples)` and `gib(samples)` give the cost of a reachable one."""
    out = []
    for start, by_row in fits.items():
        for p in plan:
            est = by_row[p.target_tps]
            if p.required_accept_len >= ceiling:
                out.append(Row(start, p.target_tps, p.required_accept_len,
                               f"not reachable with {k} draft steps (max {ceiling:g})", "-", "-"))  # fmt: skip
            elif est.reachable:
                high = sig(est.high) if est.high < 1e12 else "beyond 1e12"
                out.append(Row(start, p.target_tps, p.required_accept_len,
                               f"{sig(est.samples)} [{sig(est.low)}, {high}]", sig(hours(est.samples)),
                               sig(gib(est.samples))))  # fmt: skip
            else:
                out.append(Row(start, p.target_tps, p.required_accept_len, est.why_not, "-", "-"))
    return out


def table(all_rows: list[Row]) -> str:
    """The markdown table; consecutive rows of one start that are out of reach for the same reason
    become one row naming the tok/s range, so no start contradicts itself row by row."""
    lines = ["| start | target tok/s | accept_len needed | samples [90% band] | generation (h) | storage (GiB) |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    i = 0
    while i < len(all_rows):
        r, j = all_rows[i], i + 1
        while (not r.reachable and j < len(all_rows) and all_rows[j].start == r.start
               and not all_rows[j].reachable and all_rows[j].cell == r.cell):  # fmt: skip
            j += 1
        group = all_rows[i:j]
        tps = f"{group[0].tps:g}" if len(group) == 1 else f"{group[0].tps:g}-{group[-1].tps:g}"
        need = f"{group[0].needed:.2f}" if len(group) == 1 else f"{group[0].needed:.2f}-{group[-1].needed:.2f}"
        lines.append(f"| {r.start} | {tps} | {need} | {r.cell} | {r.hours} | {r.gib} |")
        i = j
    return "\n".join(lines)


def warnings_for(est: Any, largest: int, ceiling: float) -> list[str]:
    """Why a reader should not take the break-even answer at face value."""
    out = []
    if est.samples is not None and est.samples > FAR_BEYOND * largest:
        out.append(
            f"the answer lies {est.samples / largest:,.0f}x beyond the largest rung ({largest:,}): an "
            "extrapolation; add rungs nearer it before trusting it"
        )
    if abs(est.curve.a - ceiling) < ON_CEILING:
        out.append(f"the fit sits on its ceiling ({ceiling:g}, the most {ceiling - 1:g} draft steps allow): the "
                   "ladder does not show where accept_len saturates")  # fmt: skip
    return out


def headline(start: str, est: Any, be: float, profile: str, sizes: list[int], seeds: int,
             warnings: list[str]) -> str:  # fmt: skip
    """The run's first sentence: the answer (or why there is none), the ladder it rests on, its warnings."""
    ladder = f"ladder {min(sizes):,}-{max(sizes):,} ({len(sizes)} rungs x {seeds} seed{'s' if seeds != 1 else ''})"
    if est is None:
        head = f"**No {start} estimate**: the fit failed"
    elif est.reachable:
        width = f"{est.high / est.low:,.0f}x wide" if est.low and est.high < 1e12 else "open above"
        head = (
            f"**{start.capitalize()} start: about {sig(est.samples)} samples "
            f"[{sig(est.low)}, {sig(est.high) if est.high < 1e12 else 'beyond 1e12'}] to reach break-even "
            f"{be:.2f} on `{profile}`** (90% band, {width})"
        )
    else:
        head = f"**{start.capitalize()} start: break-even {be:.2f} on `{profile}` {est.why_not}**"
    text = f"{head}; {ladder}."
    for w in warnings:
        text += f"\n\n**Warning**: {w}."
    return text


def figure(points: list[Any], fits: dict[str, dict[float, Any]], tps: float, be: float, profile: str, k: int):
    """Measured points, each fit solid over the ladder and dashed beyond it, the 90% band of the
    samples for break-even shaded, and break-even itself."""
    plt = pyplot()
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = {"warm": "tab:blue", "scratch": "tab:orange"}
    low_n, top = min(p.samples for p in points), max(p.samples for p in points)
    right = top * 30  # far enough to see where an unreachable curve levels off
    for start in fits:
        est = fits[start][tps]
        if est.reachable:
            right = max(right, min(est.high if est.high < 1e12 else est.samples * 10, 1e12) * 1.5)
    for start, color in colors.items():
        mine = [p for p in points if p.start == start]
        ax.scatter([p.samples for p in mine], [p.val_sim_accept_len for p in mine], color=color, zorder=3,
                   label=f"{start} runs")  # fmt: skip
        if start not in fits:
            continue
        est = fits[start][tps]
        inside = np.geomspace(low_n, top, 100)
        beyond = np.geomspace(top, right, 100)
        ax.plot(inside, est.curve(inside), color=color, label=f"{start} fit (ceiling {est.curve.a:.2f})")
        ax.plot(beyond, est.curve(beyond), color=color, linestyle="--", label=f"{start} fit, extrapolated")
        if est.reachable:
            high = min(est.high, right)
            ax.axvspan(est.low, high, color=color, alpha=0.15, label=f"{start}: 90% band for break-even")
            ax.plot([est.samples], [be], "o", color=color, markeredgecolor="black", zorder=4)
    ax.axvline(top, color="grey", linewidth=0.8, linestyle=":", label=f"largest rung ({top:,})")
    ax.axhline(be, color="black", linestyle="--", linewidth=1, label=f"break-even {be:.2f} ({profile})")
    ax.set_xscale("log")
    ax.set_xlim(low_n / 1.5, right)
    ax.set_xlabel("training samples (conversations)")
    ax.set_ylabel(f"val sim_accept_len at {k} draft steps")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
