"""The main job's summary: the headline against break-even, each drafter's table row, per traffic class and per
context length, what this machine's calibrated vLLM predicts for each, where each drafter stands now, and the
drafters-vs-break-even figure. `results` is {label: (version, the evaluate run's metrics)}."""

from __future__ import annotations

from typing import Any

from common import metric_names as names

Results = dict[str, tuple[str, dict[str, float]]]


def summary(name: str, results: Results, profile: str, decision: str, seconds: float,
            served: list[str] | None = None, where: str = "", verdict: str = "") -> str:  # fmt: skip
    """The run's description. With a bake-off (`verdict`: compare's first sentence over every candidate), its
    answer comes first: which drafter a team should serve, or that none pays; this run's own drafters follow."""
    be_all = next(iter(results.values()))[1].get("break_even_accept_len", float("nan"))
    winners = [f"{label} v{v}" for label, (v, m) in results.items() if m.get("accept_len_ci_low", 0) > be_all]
    label, (version, top) = max(results.items(), key=lambda item: item[1][1].get("accept_len", 0.0))
    headline = (
        f"**{', '.join(winners)} beat{'s' if len(winners) == 1 else ''} break-even ({be_all:.2f})** "
        "with the whole 95% interval above it."
        if winners
        else f"**No drafter beats break-even ({be_all:.2f}) on {profile}.** The best, {label} v{version}, "
        f"reaches {top.get('accept_len', 0):.3f} [{top.get('accept_len_ci_low', 0):.3f}, "
        f"{top.get('accept_len_ci_high', 0):.3f}]: speculative decoding with it would be slower than plain decoding."
    )
    if verdict:
        headline = f"{verdict}\n\nOf the drafters this run imported and trained: {headline}"
    lines = [
        f"## drafterops main: {name} on {profile}",
        "",
        headline,
        "",
        *([where, ""] if where else []),
        "| drafter | version | accept_len [95% CI] | sim_accept_len | projected tok/s | break-even | beats it |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, (version, m) in results.items():
        be = m.get("break_even_accept_len", float("nan"))
        L, lo, hi = m.get("accept_len", float("nan")), m.get("accept_len_ci_low", 0), m.get("accept_len_ci_high", 0)
        verdict = "yes" if lo > be else ("mean only" if be < L else "no")
        lines.append(
            f"| {label} | v{version} | {L:.3f} [{lo:.3f}, {hi:.3f}] | {m.get('sim_accept_len', 0):.3f} | "
            f"{m.get('projected_tps', 0):.1f} | {be:.2f} | {verdict} |"
        )
    lines += class_lines(results)
    lines += class_lines(results, names.CONTEXT)
    lines += served or []
    lines += ["", f"promotion: {decision}", f"wall time: {seconds / 60:.1f} min"]
    return "\n".join(lines)


DESCRIPTION_LIMIT = 8000  # MLflow's longest tag value (mlflow.utils.validation.MAX_TAG_VAL_LENGTH)


def description(text: str) -> str:
    """The summary as the run's description: whole when it fits a tag, else cut at a line and said so (it is
    whole in summary.md), never cut silently by MLflow with a warning on the terminal."""
    if len(text) <= DESCRIPTION_LIMIT:
        return text
    tail = "\n\n(cut here to fit the run's description: the whole summary is the run's summary.md)"
    return text[: text.rfind("\n", 0, DESCRIPTION_LIMIT - len(tail))] + tail


def class_lines(results: Results, prefix: str = names.CLASS) -> list[str]:
    """Each drafter per traffic class and for the mix (prefix "class_"), or per context length ("ctx_"):
    accept_len [95% CI] and projected speed-up."""
    from serving.workload import context_buckets

    metrics = next(iter(results.values()))[1]
    groups = names.groups(metrics, prefix, "accept_len")
    if not groups:
        return []
    mix = prefix == names.CLASS
    if not mix:  # context buckets, shortest first, named as lengths
        groups = [n for n in context_buckets() if n in groups]
    heads = groups if mix else [f"{n} tokens" for n in groups]
    lines = ["", "| drafter | " + " | ".join(heads) + (" | traffic mix |" if mix else " |"),
             "|---" * (len(groups) + 1 + mix) + "|"]  # fmt: skip

    def cell(m: dict[str, float], n: str) -> str:
        at = lambda figure: m[names.per_group(prefix, n, figure)]  # noqa: E731
        return f"{at('accept_len'):.2f} [{at('accept_len_ci_low'):.2f}, {at('accept_len_ci_high'):.2f}] " \
               f"{at('projected_speedup'):.2f}x"  # fmt: skip

    for label, (version, m) in results.items():
        cells = [cell(m, n) if names.per_group(prefix, n, "accept_len") in m else "-" for n in groups]
        if mix:
            cells.append(f"{m['accept_len']:.2f} [{m['accept_len_ci_low']:.2f}, {m['accept_len_ci_high']:.2f}] "
                         f"{m['projected_speedup']:.2f}x")  # fmt: skip
        lines.append(f"| {label} v{version} | " + " | ".join(cells) + " |")
    return lines


def where_now(by_version: dict[str, list[str]], drafters: dict[str, str]) -> str:
    """'fine-tuned v2 is `candidate`, ...': where each drafter of this run stands in the registry now."""

    def where(v: str) -> str:
        return " and ".join(sorted(f"`{a}`" for a in by_version[v])) if v in by_version else "on no alias"

    parts = [f"{label} v{v} is {where(v)}" for label, v in drafters.items()]
    return "Where each drafter is now: " + "; ".join(parts) + "."


def calibrated_lines(profile: Any, results: Results, k: int) -> list[str]:
    """What a calibrated deployment profile predicts for each drafter's accept_len at each load."""
    ops = profile.operating_points
    lines = ["", f"On this machine's vLLM ({profile.basis()}), at k={k}:", "",
             "| drafter | " + " | ".join(f"break-even c{op.concurrency} / predicted speed-up" for op in ops) + " |",
             "|---" * (len(ops) + 1) + "|"]  # fmt: skip
    for label, (version, m) in results.items():
        cells = [f"{op.break_even(k):.3f} / {m['accept_len'] / op.break_even(k):.2f}x" for op in ops]
        lines.append(f"| {label} v{version} | " + " | ".join(cells) + " |")
    return lines


def comparison_figure(results: Results, profile: str):
    from reports.acceptance import drafters_figure

    rows = [
        (f"{label} v{version}", m["accept_len"], m["accept_len_ci_low"], m["accept_len_ci_high"])
        for label, (version, m) in results.items()
    ]
    any_m = next(iter(results.values()))[1]
    k = len([key for key in any_m if key.startswith("acc_pos_")])  # one per draft step
    return drafters_figure(rows, any_m["break_even_accept_len"], k, f"drafters on {profile}")
