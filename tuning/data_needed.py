"""How much data a drafter needs: the ladder's learning curves (accept_len(n) = a - b n^-c, warm-started and
from scratch) fitted with a bootstrap band and read off at break-even and at each `plan` row, the hours and
storage to generate that many samples on the deployment, and a check of the fit on the smaller half."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from reports.scaling import headline, rows, warnings_for
from reports.scaling import table as table_text
from serving.cost import break_even_accept_len, plan_table
from serving.scaling import estimate, fit, generation_hours, storage_gib


@dataclass
class Answer:
    """The fits and what they say: the table, the metrics, the tags that say why not, the warnings."""

    fits: dict[str, dict[float, Any]]
    metrics: dict[str, float]
    tags: dict[str, str]
    warn: list[str]
    text: str


def conclude(profile: Any, points: list[Any], sizes: list[int], seeds: int, targets: list[float],
             tokens_per_sample: float, bytes_per_token: float) -> Answer:  # fmt: skip
    """The learning curves fitted per start, read off at break-even and at each plan row's tok/s target
    (pure: no I/O); the hours and storage to generate that many samples on the profile's deployment."""
    be = break_even_accept_len(profile)
    plan = plan_table(profile, [profile.baseline_tps, *[x for x in targets if x != profile.baseline_tps]])
    ceiling = profile.draft_steps + 1.0  # k draft steps accept at most k tokens, plus the bonus one
    fits, tags, metrics = {}, {}, {}
    for start in ("warm", "scratch"):
        mine = [p for p in points if p.start == start]
        samples, values = [p.samples for p in mine], [p.val_sim_accept_len for p in mine]
        try:
            fits[start] = {row.target_tps: estimate(samples, values, row.required_accept_len, ceiling=ceiling)
                           for row in plan}  # fmt: skip
        except (RuntimeError, ValueError) as exc:
            tags[f"scale.{start}.fit"] = f"failed: {exc}"
            if start == "warm":
                tags["samples_for_break_even"] = f"not estimated: the warm fit failed ({exc})"
    all_rows = rows(
        fits, plan, ceiling, profile.draft_steps,
        lambda n: generation_hours(n, tokens_per_sample, profile.baseline_tps),
        lambda n: storage_gib(n, tokens_per_sample, round(bytes_per_token)),
    )  # fmt: skip
    warm = fits.get("warm", {}).get(profile.baseline_tps)
    if warm is not None and warm.reachable:
        metrics |= {"samples_for_break_even": warm.samples, "samples_for_break_even_low": warm.low,
                    "samples_for_break_even_high": min(warm.high, 1e15)}  # fmt: skip
    elif warm is not None and warm.samples is not None and warm.curve.a > be:
        tags["samples_for_break_even"] = f"{warm.why_not}: the warm curve approaches break-even {be:.3f} too slowly"
    elif warm is not None:
        tags["samples_for_break_even"] = (
            f"not reachable: the warm curve's ceiling {warm.curve.a:.3f} "
            f"[{warm.ceiling_low:.3f}, {warm.ceiling_high:.3f}] is below break-even {be:.3f}"
        )
    for start, by_row in fits.items():
        curve = by_row[profile.baseline_tps].curve
        metrics |= {f"curve_{start}_a": curve.a, f"curve_{start}_b": curve.b, f"curve_{start}_c": curve.c}
    metrics |= half_ladder_check(points, sizes, ceiling)
    at_largest = [p.val_sim_accept_len for p in points if p.start == "warm" and p.samples == max(sizes)]
    metrics["shortfall_vs_break_even"] = be - sum(at_largest) / len(at_largest)  # measured, largest rung
    warn = warnings_for(warm, max(sizes), ceiling) if warm is not None else []
    if warn:
        tags["scale.warning"] = "; ".join(warn)[:5000]
    top = headline("warm", warm, be, profile.name, sizes, seeds, warn)
    return Answer(fits, metrics, tags, warn, f"{top}\n\n{table_text(all_rows)}")


def half_ladder_check(points, sizes: list[int], ceiling: float) -> dict[str, float]:
    """How well the curve fitted on the smaller half of the ladder predicts the largest rung (needs 6+
    rungs): `<start>_half_fit_at_largest` against `<start>_measured_at_largest`."""
    if len(sizes) < 6:
        return {}
    small, largest = sizes[: len(sizes) // 2], max(sizes)
    out = {}
    for start in ("warm", "scratch"):
        mine = [p for p in points if p.start == start and p.samples in small]
        measured = [p.val_sim_accept_len for p in points if p.start == start and p.samples == largest]
        try:
            curve = fit([p.samples for p in mine], [p.val_sim_accept_len for p in mine], ceiling)
        except (RuntimeError, ValueError):
            continue
        out[f"{start}_half_fit_at_largest"] = float(curve(largest))
        out[f"{start}_measured_at_largest"] = sum(measured) / len(measured)
    return out
