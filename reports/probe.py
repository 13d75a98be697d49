"""The probe's figure: per-layer similarity of two targets' states beside the drafter's zero-shot
acceptance on each."""

from __future__ import annotations

from typing import TYPE_CHECKING

from reports.plotting import pyplot

if TYPE_CHECKING:
    from drafter.analysis.probe import Similarity


def figure(sim: Similarity, acc_old: list[float], acc_new: list[float], title: str):
    """Per-layer cosine and CKA (bars), and the drafter's zero-shot acceptance per position on each target."""
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = [s.layer for s in sim.layers]
    xs = range(len(names))
    left.bar([x - 0.2 for x in xs], [s.cosine for s in sim.layers], width=0.4, label="mean cosine")
    left.bar([x + 0.2 for x in xs], [s.cka for s in sim.layers], width=0.4, label="linear CKA")
    left.set_xticks(list(xs), [f"layer {n}" if n != "final" else "final norm" for n in names])
    left.set_ylim(0, 1.25)  # headroom: the legend sits above the bars, covering none
    left.set_ylabel("similarity, old vs new target")
    left.legend(loc="upper center", ncol=2, fontsize=8)
    steps = range(len(acc_old))
    right.plot(steps, acc_old, "o-", label="old target")
    right.plot(steps, acc_new, "s-", label="new target")
    right.set_xticks(list(steps))
    right.set_xlabel("draft position")
    right.set_ylabel("zero-shot conditional acceptance")
    right.set_ylim(0, 1.25)
    right.legend(loc="upper center", ncol=2, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
