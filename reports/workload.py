"""An evaluation's prompts by traffic class, and what each class measured: the figures, the metrics,
the table and the figure that the evaluate run and the version page show. Prompts are decoded in class
order; `by_class` cuts any per-prompt list back into its classes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from common import metric_names as names
from serving.cost import break_even_accept_len

T = TypeVar("T")


def by_class(classes: list[MeasuredClass], items: Sequence[T]) -> list[tuple[MeasuredClass, list[T]]]:
    """Each class with its slice of a per-prompt list (decoded in class order)."""
    out, start = [], 0
    for c in classes:
        out.append((c, list(items[start : start + len(c.records)])))
        start += len(c.records)
    return out


def class_rows(classes, mix, profile) -> list[dict[str, object]]:
    """One row per traffic class and one for the mix: the figure, the floor, the verdict."""
    rows = []
    for c in [*classes, mix]:
        held = c.name == "mix" or c.share >= profile.min_share
        floor = 1.0 if c.name == "mix" else profile.class_floor
        ok = c.ci_low > break_even_accept_len(profile) if c.name == "mix" else (c.speedup >= floor or not held)
        rows.append(
            {
                "class": c.name,
                "share": round(c.share, 4),
                "prompts": c.prompts,
                "accept_len": round(c.accept_len, 4),
                "ci_low": round(c.ci_low, 4),
                "ci_high": round(c.ci_high, 4),
                "projected_speedup": round(c.speedup, 4),
                "floor": "ci_low > break-even" if c.name == "mix" else (f"{floor:g}x" if held else "none (share)"),
                "verdict": "ok" if ok else "below",
            }
        )
    return rows


def class_table(classes, mix, profile):
    import pandas as pd

    return pd.DataFrame(class_rows(classes, mix, profile))


def class_markdown(classes, mix) -> str:
    lines = ["| class | share | prompts | accept_len [95% CI] | projected speed-up |", "|---|---|---|---|---|"]
    for c in [*classes, mix]:
        label = "**mix**" if c.name == "mix" else c.name
        lines.append(
            f"| {label} | {c.share:.0%} | {c.prompts} | {c.accept_len:.3f} [{c.ci_low:.3f}, {c.ci_high:.3f}] | "
            f"{c.speedup:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def classes_figure(classes, mix, profile, title: str):
    from reports.acceptance import class_bars_figure

    return class_bars_figure(
        [(c.name, c.share, c.accept_len, c.ci_low, c.ci_high) for c in [*classes, mix]],
        break_even_accept_len(profile),
        profile.class_floor,
        profile.min_share,
        profile.draft_steps,
        title,
    )


@dataclass
class MeasuredClass:
    """A class of prompts as this evaluation decodes them."""

    name: str
    share: float
    path: Path
    sha256: str
    records: list[dict[str, Any]]


def workload_figures(classes: list[MeasuredClass], per_prompt, profile):
    """Per-class figures and the mix's, from the decoded prompts in class order."""
    from serving.workload import class_figures

    parts = [(c.name, c.share, per) for c, per in by_class(classes, per_prompt)]
    return class_figures(parts, break_even_accept_len(profile))


def figure_metrics(classes, mix, profile) -> dict[str, float]:
    """The headline is the mix (share-weighted; one class: the pooled figure); each class gets its own."""
    out = {
        "accept_len": mix.accept_len,
        "accept_len_ci_low": mix.ci_low,
        "accept_len_ci_high": mix.ci_high,
        "projected_tps": mix.speedup * profile.baseline_tps,
        "projected_speedup": mix.speedup,
        "projected_speedup_ci_low": mix.ci_low / break_even_accept_len(profile),
        "projected_speedup_ci_high": mix.ci_high / break_even_accept_len(profile),
    }
    if len(classes) > 1:
        for c in classes:
            out.update(
                {
                    names.per_class(c.name, "accept_len"): c.accept_len,
                    names.per_class(c.name, "accept_len_ci_low"): c.ci_low,
                    names.per_class(c.name, "accept_len_ci_high"): c.ci_high,
                    names.per_class(c.name, "projected_speedup"): c.speedup,
                    names.per_class(c.name, "projected_tps"): c.speedup * profile.baseline_tps,
                }
            )
    return out


def class_positions(classes: list[MeasuredClass], accepted: list[list[int]], k: int) -> dict[str, float]:
    from serving.workload import acceptance_by_position

    out = {}
    for c, part in by_class(classes, accepted):
        out.update({names.per_class(c.name, f"acc_pos_{i}"): a for i, a in enumerate(acceptance_by_position(part, k))})
    return out


def context_metrics(buckets, profile) -> dict[str, float]:
    """accept_len per context bucket (prompt plus reply tokens), with its interval and prompt count."""
    out: dict[str, float] = {}
    for c in buckets:
        out.update({
            names.per_context(c.name, "accept_len"): c.accept_len,
            names.per_context(c.name, "accept_len_ci_low"): c.ci_low,
            names.per_context(c.name, "accept_len_ci_high"): c.ci_high,
            names.per_context(c.name, "prompts"): float(c.prompts),
            names.per_context(c.name, "projected_speedup"): c.speedup,
        })  # fmt: skip
    return out


def contexts_figure(buckets, profile, title: str):
    from reports.acceptance import context_bars_figure

    return context_bars_figure(
        [(c.name, c.prompts, c.accept_len, c.ci_low, c.ci_high) for c in buckets],
        break_even_accept_len(profile),
        dict(profile.context_floors),
        profile.draft_steps,
        title,
    )
