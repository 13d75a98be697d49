"""From timed cycles to a deployment profile: the operating points (plain speed, cycle cost per depth and
its fit), the profile text `calibrate` writes, and the figure of served tok/s against accept_len."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from common import metric_names as names
from common.errors import InternalError
from reports.plotting import pyplot
from serving.cycle_model import OperatingPoint, fit_cycle, primary


def operating_points(
    plain_tps: dict[int, float], cycle_ms: dict[int, dict[int, float]], shares: dict[int, float]
) -> tuple[OperatingPoint, ...]:
    """One point per concurrency: plain tok/s, the fit of its timed cycles (cycle_ms[k][c]). Timings so
    uneven that the fit puts the verify pass at no cost or less (a host whose speed jumped mid-measurement)
    are a failed measurement, not a profile."""
    out = []
    for c in sorted(plain_tps):
        points = {k: round(by_c[c], 4) for k, by_c in sorted(cycle_ms.items())}
        verify, step = fit_cycle(points)
        if round(verify, 4) <= 0:
            timed = ", ".join(f"k={k}: {ms:.1f} ms" for k, ms in points.items())
            raise InternalError(
                f"the timed cycles at concurrency {c} ({timed}) fit verify_ms {verify:.2f} <= 0: the host's speed "
                "moved too much while they were timed; rerun calibrate with more --rounds on a quieter host"
            )
        out.append(OperatingPoint(c, shares[c], round(plain_tps[c], 3), round(verify, 4), round(step, 4),
                                  tuple(sorted(points.items()))))  # fmt: skip
    return tuple(out)


def method_cycles(m_plain: dict, m_spec: dict, plain: dict) -> dict[int, tuple[tuple[int, float], ...]]:
    """Another method's cycles by width at each concurrency, timed beside a plain server of their own: each is
    carried onto the main plain server's clock (x its group's plain tok/s / the main one's), so break-even,
    plain_tps x cycle_ms, is the ratio timed side by side, whatever the host's speed did between the groups."""
    out = {}
    for c, main in plain.items():
        scale = m_plain[c].tps / main.tps
        out[c] = tuple((k, round(by_c[c].cycle_ms * scale, 4)) for k, by_c in sorted(m_spec.items()))
        fixed, _ = fit_cycle(dict(out[c]))
        if fixed <= 0:
            timed = ", ".join(f"width {k}: {ms:.1f} ms" for k, ms in out[c])
            raise InternalError(
                f"another method's cycles at concurrency {c} ({timed}) fit a cost of {fixed:.2f} ms <= 0 before the "
                "first draft: the host's speed moved too much while they were timed; rerun calibrate with more --rounds"
            )
    return out


def method_inversions(ops: tuple[OperatingPoint, ...]) -> list[str]:
    """Another method's width timed no dearer than a plain step: as for a chain, noise outran the difference."""
    out = []
    for op in ops:
        for name, points in op.method_cycles:
            for k, ms in points:
                if op.plain_tps * ms / 1000.0 <= 1.0:
                    out.append(f"at concurrency {op.concurrency} a {name} cycle of width {k} timed {ms:.2f} ms, no "
                               f"dearer than a plain step ({1000.0 / op.plain_tps:.2f} ms): rerun calibrate with "
                               "more --rounds or --limit")  # fmt: skip
    return out


def inversions(ops: tuple[OperatingPoint, ...], depths: list[int]) -> list[str]:
    """Cycles timed no dearer than one plain step: a cycle verifies k + 1 tokens and drafts k, so this is
    the host's noise outrunning the difference, and a break-even at or below 1 passes any drafter there."""
    out = []
    for op in ops:
        plain_ms = 1000.0 / op.plain_tps
        for k in depths:
            if op.break_even(k) <= 1.0:
                out.append(
                    f"at concurrency {op.concurrency} a depth-{k} cycle timed {op.cycle_ms(k):.2f} ms, no dearer than "
                    f"a plain step ({plain_ms:.2f} ms): break-even {op.break_even(k):.3f} is below this host's "
                    "timing resolution; rerun calibrate with more --rounds or --limit"
                )
    return out


def profile_text(
    name: str,
    description: str,
    ops: tuple[OperatingPoint, ...],
    serve_k: int,
    measured: dict[str, Any],
    eval_fields: dict[str, Any],
) -> str:
    """The profile as YAML: the headline figures are the point that carries the most traffic."""
    head = primary(ops)
    body: dict[str, Any] = {
        "name": name,
        "description": description,
        "baseline_tps": head.plain_tps,
        "verify_ms": head.verify_ms,
        "draft_step_ms": head.draft_step_ms,
        "draft_steps": serve_k,
        # the timed drafter's step size: a drafter whose steps read more is priced up (serving.cost.priced_for)
        **({"draft_step_params": measured["drafter_step_params"]} if measured.get("drafter_step_params") else {}),
        **eval_fields,
        "operating_points": [
            {
                "concurrency": op.concurrency,
                "share": op.share,
                "plain_tps": op.plain_tps,
                "verify_ms": op.verify_ms,
                "draft_step_ms": op.draft_step_ms,
                "cycle_ms_measured": dict(op.cycle_ms_measured),
                **(
                    {"method_cycle_ms_measured": {m: dict(points) for m, points in op.method_cycles}}
                    if op.method_cycles
                    else {}
                ),
            }
            for op in ops
        ],
        "measured": measured,
    }
    header = "# Written by `python -m steps.calibrate` (see measured.command); rerun it rather than edit.\n"
    return header + yaml.safe_dump(body, sort_keys=False, width=110)


def eval_fields_from(raw: dict[str, Any], source: Path, out: Path) -> dict[str, Any]:
    """What evidence is measured on, copied from another profile, its prompt paths re-rooted at `out`."""
    keep = ("min_prompts", "min_share", "class_floor", "eval_max_new_tokens", "eval_temperature")
    fields = {k: raw[k] for k in keep if k in raw}

    def rebase(path: str) -> str:
        absolute = (source.parent / path).resolve()
        return os.path.relpath(absolute, out.resolve().parent)

    if "eval_prompts" in raw:
        fields["eval_prompts"] = rebase(raw["eval_prompts"])
        fields["eval_prompts_sha256"] = raw.get("eval_prompts_sha256")
    if "workload" in raw:
        fields["workload"] = [{**c, "prompts": rebase(c["prompts"])} for c in raw["workload"]]
    return fields


def figure(ops: tuple[OperatingPoint, ...], depths: list[int], observed: dict[tuple[int, int], tuple[float, float]]):
    """Per-request tok/s the cost model gives against accept_len, a line per depth, a panel per
    concurrency; plain decoding and each depth's break-even marked; the calibration drafter's own
    (accept_len, served tok/s) as points on the lines they should fall on."""
    plt = pyplot()

    fig, axes = plt.subplots(1, len(ops), figsize=(5.2 * len(ops), 4.2), squeeze=False, sharey=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, op in zip(axes[0], ops, strict=True):
        ax.axhline(op.plain_tps, color="black", lw=1.2, label=f"plain {op.plain_tps:.1f} tok/s")
        for i, k in enumerate(depths):
            colour = colours[i % len(colours)]
            xs = [1 + k * j / 20 for j in range(21)]
            ax.plot(xs, [x * 1000 / op.cycle_ms(k) for x in xs], color=colour, label=f"k={k}: {op.cycle_ms(k):.2f} ms")
            be = op.break_even(k)
            if be <= k + 1:
                ax.axvline(be, color=colour, ls=":", lw=1)
                ax.annotate(f"{be:.2f}", (be, op.plain_tps), textcoords="offset points", xytext=(3, -12),
                            color=colour, fontsize=8)  # fmt: skip
            if (k, op.concurrency) in observed:
                a, tps = observed[(k, op.concurrency)]
                ax.plot([a], [tps], "o", color=colour, ms=6)
        ax.set_title(f"concurrency {op.concurrency} ({op.share:.0%} of traffic)")
        ax.set_xlabel("accept_len (tokens per cycle)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[0][0].set_ylabel("decode tok/s per request")
    fig.suptitle("Served speed against accept_len: lines from timed cycles, dots the calibration drafter served; "
                 "dotted: break-even", fontsize=9)  # fmt: skip
    fig.tight_layout()
    return fig


def operating_metrics(ops, depths: list[int]) -> dict[str, float]:
    """Each operating point's fitted figures under their metric names (common.metric_names)."""
    metrics = {}
    for op in ops:
        c = op.concurrency
        metrics[names.at_concurrency("plain_tps", c)] = op.plain_tps
        metrics[names.at_concurrency("verify_ms", c)] = op.verify_ms
        metrics[names.at_concurrency("draft_step_ms", c)] = op.draft_step_ms
        for k in depths:
            metrics[names.at_depth_and_concurrency("cycle_ms", k, c)] = op.cycle_ms(k)
            metrics[names.at_depth_and_concurrency("break_even", k, c)] = op.break_even(k)
        for name, points in op.method_cycles:
            for k, ms in points:
                metrics[names.at_depth_and_concurrency(f"{name}_cycle_ms", k, c)] = ms
                metrics[names.at_depth_and_concurrency(f"{name}_break_even", k, c)] = op.plain_tps * ms / 1000.0
    return metrics


def table(ops, depths) -> list[str]:
    """Each load's plain speed, each depth's cycle and break-even, and the fit, as Markdown rows."""
    head = "| concurrency | share | plain tok/s | " + " | ".join(f"k={k}: cycle ms / break-even" for k in depths)
    lines = [head + " | fit verify + k x step (ms) |", "|---" * (len(depths) + 4) + "|"]
    for op in ops:
        cells = " | ".join(f"{op.cycle_ms(k):.2f} / {op.break_even(k):.3f}" for k in depths)
        lines.append(f"| {op.concurrency} | {op.share:.0%} | {op.plain_tps:.1f} | {cells} | "
                     f"{op.verify_ms:.2f} + k x {op.draft_step_ms:.3f} |")  # fmt: skip
    return lines + method_table(ops)


def method_table(ops) -> list[str]:
    """Each other method's own cycles by width and the fit through them, as Markdown rows (none: no rows)."""
    rows = [(op, name, points) for op in ops for name, points in op.method_cycles]
    if not rows:
        return []
    lines = ["", "| method | concurrency | width: cycle ms / break-even | fit fixed + width x per draft (ms) |",
             "|---|---|---|---|"]  # fmt: skip
    for op, name, points in rows:
        fixed, per = fit_cycle(dict(points))
        cells = ", ".join(f"{k}: {ms:.2f} / {op.plain_tps * ms / 1000.0:.3f}" for k, ms in points)
        lines.append(f"| {name} | {op.concurrency} | {cells} | {fixed:.2f} + width x {per:.3f} |")
    return lines
