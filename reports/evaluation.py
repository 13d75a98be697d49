"""An evaluation in words: the summary on the terminal, and the section the version page shows for its latest
evaluation on a profile (the verdict against break-even, then each class)."""

from __future__ import annotations

from common import metric_names as names
from reports.workload import class_markdown


def summary(name: str, profile: str, m: dict[str, float]) -> str:
    """The figures as evaluate prints them: acceptance, the engine's and the served figures, the host's."""
    lines = [f"evaluate {name} on {profile}:"]
    if "accept_len" in m:
        lines.append(
            f"  accept_len {m['accept_len']:.3f} [{m['accept_len_ci_low']:.3f}, {m['accept_len_ci_high']:.3f}]"
            f"  break-even {m['break_even_accept_len']:.2f}  projected {m['projected_tps']:.1f} tok/s "
            f"({m['projected_speedup']:.2f}x)"
        )
    for prefix in ("", names.engine("")):  # the other mean, named beside the pooled one that decides (docs/metrics.md)
        if f"{prefix}accept_len_per_request" in m:
            who, mean = prefix.rstrip("_") or "in-process", m[f"{prefix}accept_len_per_request"]
            lines.append(f"  {who}: per-request mean {mean:.3f} (never decides), acceptance rate "
                         f"{m[f'{prefix}acceptance_rate']:.3f}")  # fmt: skip
    if "engine_accept_len" in m:
        lines.append(
            f"  engine: accept_len {m['engine_accept_len']:.3f}"
            + (f" (in-process {m['inprocess_accept_len']:.3f})" if "inprocess_accept_len" in m else "")
            + "  acceptance by position "
            + " ".join(f"{m[names.engine(f'acc_pos_{i}')]:.3f}" for i in range(8) if names.engine(f"acc_pos_{i}") in m)
        )
        if "served_tps_baseline" in m:
            lines.append(
                f"  served: {m['served_tps_baseline']:.1f} -> {m['served_tps_spec']:.1f} tok/s at batch 1 "
                f"({m['served_speedup']:.2f}x)"
                + "".join(
                    f"; {base:.1f} -> {m[names.at_concurrency('served_tps_spec', c)]:.1f} tok/s at concurrency {c}"
                    for c, base in names.by_concurrency(m, "served_tps_baseline").items()
                )
            )
    if "host_tps_baseline" in m:
        lines.append(
            f"  host: {m['host_tps_baseline']:.1f} -> {m['host_tps_spec']:.1f} tok/s "
            f"({m['host_speedup']:.2f}x)  cond_acc {m['cond_acc']:.3f}"
            + (
                f"  (host profile projects {m['host_tps_projected']:.1f} tok/s, "
                f"speed-up {100 * m['host_projection_error']:+.1f}%)"
                if "host_tps_projected" in m
                else ""
            )
        )
    if "sim_accept_len" in m:
        lines.append(f"  sim_accept_len (offline) {m['sim_accept_len']:.3f}")
    return "\n".join(lines)


def evaluation_section(
    profile: str, m: dict[str, float], k: int, prompts: int, run: str, engine: str = "in-process", figures=None
) -> str:
    """What the version page says about its latest evaluation on a profile (`run`: the run as a link): the
    verdict, then each class."""
    be, L, lo, hi = m["break_even_accept_len"], m["accept_len"], m["accept_len_ci_low"], m["accept_len_ci_high"]
    verdict = "beats break-even" if lo > be else ("above break-even on the mean only" if be < L else "below break-even")
    what = "the traffic mix" if figures is not None and len(figures[0]) > 1 else "the pinned prompts"
    text = (
        f"## Evaluation on `{profile}`: {what} {verdict}\n\n"
        "| accept_len [95% CI] | break-even | projected tok/s | sim_accept_len | draft steps | prompts | engine | run |"
        "\n|---|---|---|---|---|---|---|---|\n"
        f"| **{L:.3f}** [{lo:.3f}, {hi:.3f}] | {be:.2f} | {m['projected_tps']:.1f} ({m['projected_speedup']:.2f}x) | "
        f"{m.get('sim_accept_len', float('nan')):.3f} | {k} | {prompts} | {engine} | {run} |\n"
    )
    if figures is not None and len(figures[0]) > 1:
        text += "\n" + class_markdown(*figures)
    return text
