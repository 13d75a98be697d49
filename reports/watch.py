"""The production watch's picture: live acceptance interval by interval against its signed baseline, the
drop the test is looking for, and break-even at the load the engine reported; where the watch warned or
demoted, and where it could not read (a restart, a gap, another model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from reports.plotting import pyplot


@dataclass
class WatchHistory:
    """What the figure draws, interval by interval (None where an interval gave no reading)."""

    accept_len: list[float | None] = field(default_factory=list)
    break_even: list[float | None] = field(default_factory=list)
    acc_pos: list[tuple[float, ...]] = field(default_factory=list)
    events: list[tuple[int, str]] = field(default_factory=list)  # (interval, warn / demote / finding)

    def add(self, accept_len: float | None, break_even: float | None, acc_pos: tuple[float, ...]) -> int:
        self.accept_len.append(accept_len)
        self.break_even.append(break_even)
        self.acc_pos.append(acc_pos)
        return len(self.accept_len)


def watch_figure(h: WatchHistory, baseline: list[float] | None, baseline_len: float | None, tolerance: float,
                 title: str):  # fmt: skip
    """Two panels: accept_len per interval (baseline, the drop to detect, break-even at load, actions), and
    conditional acceptance per position against the baseline's."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    xs = list(range(1, len(h.accept_len) + 1))
    # markers: an interval read between two gaps (a server restarting) is a lone point a line alone never draws
    top.plot(xs, [float("nan") if v is None else v for v in h.accept_len], color="C0", lw=1.2, marker=".",
             label="live accept_len")  # fmt: skip
    if baseline_len is not None:
        top.axhline(baseline_len, color="C2", lw=1, label=f"baseline {baseline_len:.3f}")
        drop = 1 + (baseline_len - 1) * (1 - tolerance)
        top.axhline(drop, color="C2", lw=1, ls=":", label=f"drop of {tolerance:.0%} ({drop:.3f})")
    top.plot(xs, [float("nan") if v is None else v for v in h.break_even], color="C3", lw=1, ls="--",
             label="break-even at the live load")  # fmt: skip
    colours = {"warn": "C1", "demote": "C3"}
    for i, what in h.events:
        colour = colours.get(what, "0.6")
        top.axvline(i, color=colour, lw=1.5 if what in colours else 0.8, ls="-" if what in colours else ":")
        top.annotate(what, (i, top.get_ylim()[1]), rotation=90, va="top", ha="right", fontsize=7, color=colour)
    top.set_ylabel("accept_len (tokens per verify cycle)")
    top.legend(loc="lower left", fontsize=8)
    top.set_title(title, fontsize=10)
    positions = max((len(p) for p in h.acc_pos), default=0)
    for i in range(positions):
        values = [p[i] if len(p) > i else float("nan") for p in h.acc_pos]
        bottom.plot(xs, values, color=f"C{i}", lw=1, marker=".", label=f"position {i}")
        if baseline and i < len(baseline):
            bottom.axhline(baseline[i], color=f"C{i}", lw=0.8, ls=":")
    bottom.set_xlabel("interval")
    bottom.set_ylabel("conditional acceptance")
    if positions:
        bottom.legend(loc="lower left", fontsize=8, ncols=min(positions, 4))
    fig.tight_layout()
    return fig
