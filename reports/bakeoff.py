"""A bake-off in words, a table and a figure: the ranking by traffic-mix accept_len (by projected speed-up where the
candidates' cycles cost apart) with tie groups, each
drafter against the incumbent and break-even, each traffic class against its floor, and every pair's
paired interval beside its unpaired one."""

from __future__ import annotations

from serving.paired import Ranking
from serving.workload import ClassFigure

Figures = dict[str, tuple[list[ClassFigure], ClassFigure]]  # label -> (each class, the mix)
BreakEven = float | dict[str, float]  # one for every drafter, or each its own (draft steps priced by size)


def be_of(break_even: BreakEven, label: str) -> float:
    return break_even[label] if isinstance(break_even, dict) else break_even


def one_break_even(break_even: BreakEven) -> float | None:
    """The break-even every drafter shares, or None when their draft steps are priced apart."""
    if not isinstance(break_even, dict):
        return break_even
    values = set(break_even.values())
    return values.pop() if len(values) == 1 else None


def rank_label(ranking: Ranking, label: str) -> str:
    """'1', or '1=' when the drafter shares its tie group."""
    return f"{ranking.group[label]}{'=' if ranking.tied_with(label) else ''}"


def rows(ranking: Ranking, figures: Figures, break_even: BreakEven, floor: float, min_share: float,
         incumbent: str | None, evidence: dict[str, str], flags: dict[str, str] | None = None,
         per_request: dict[str, float] | None = None) -> list[dict[str, object]]:  # fmt: skip
    """One row per drafter, best first: the mix (pooled, and the per-request mean beside it where given), the
    difference to the incumbent, each class's figure and projected speed-up against the class floor (classes
    under min_share of traffic are not held to it), and why a flagged drafter can never be the winner."""
    out = []
    for label in ranking.order:
        classes, mix = figures[label]
        be = be_of(break_even, label)
        row: dict[str, object] = {
            "rank": rank_label(ranking, label),
            "drafter": label,
            "flag": (flags or {}).get(label, ""),
            "accept_len": mix.accept_len,
            **({"accept_len_per_request": per_request[label]} if per_request and label in per_request else {}),
            "ci_low": mix.ci_low,
            "ci_high": mix.ci_high,
            "projected_speedup": mix.speedup,
            "break_even": be,
            "beats_break_even": "yes" if mix.ci_low > be else ("mean only" if mix.accept_len > be else "no"),
        }
        if incumbent is not None and label != incumbent:
            d = ranking.between(label, incumbent)
            row |= {"vs_incumbent": d.estimate, "vs_incumbent_low": d.low,
                    "vs_incumbent_high": d.high}  # fmt: skip
        for c in classes:
            held = c.share >= min_share
            row[f"{c.name}_accept_len"] = c.accept_len
            row[f"{c.name}_speedup"] = c.speedup
            row[f"{c.name}_floor"] = ("ok" if c.speedup >= floor else "below") if held else "not held (share)"
        row["evidence"] = evidence[label]
        out.append(row)
    return out


def markdown(ranking: Ranking, figures: Figures, break_even: BreakEven, floor: float, min_share: float,
             incumbent: str | None, evidence: dict[str, str], flags: dict[str, str] | None = None,
             per_request: dict[str, float] | None = None) -> str:  # fmt: skip
    """The ranking table (the pooled mix, with the per-request mean beside it where given), then the per-class
    table (figure [95% CI] and speed-up against the floor)."""
    names = [c.name for c in figures[ranking.order[0]][0]]
    inc = incumbent is not None
    shared = one_break_even(break_even)
    both = bool(per_request)
    lines = [
        "| rank | drafter | traffic-mix accept_len [95% CI] | "
        + ("per-request mean | " if both else "")
        + "speed-up | "
        + (f"break-even {shared:.2f}" if shared is not None else "break-even (its own draft steps')")
        + " |"
        + (" vs incumbent [paired 95% CI] |" if inc else "")
        + " evidence |",
        "|---|---|---|---|---|" + ("---|" if both else "") + ("---|" if inc else "") + "---|",
    ]
    for row in rows(ranking, figures, break_even, floor, min_share, incumbent, evidence, flags, per_request):
        label = row["drafter"]
        own = "" if shared is not None else f" ({row['break_even']:.2f})"
        flag = f" **flagged: {row['flag']}**" if row["flag"] else ""
        cells = [str(row["rank"]), f"{label}" + (" (incumbent)" if label == incumbent else "") + flag,
                 f"{row['accept_len']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}]",
                 *([f"{row.get('accept_len_per_request', float('nan')):.3f}"] if both else []),
                 f"{row['projected_speedup']:.2f}x", str(row["beats_break_even"]) + own]  # fmt: skip
        if inc:
            cells.append(
                f"{row['vs_incumbent']:+.3f} [{row['vs_incumbent_low']:+.3f}, {row['vs_incumbent_high']:+.3f}]"
                if "vs_incumbent" in row
                else "-"
            )
        cells.append(str(row["evidence"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Per traffic class (accept_len [95% CI], projected speed-up; class floor {floor:g}x for classes "
              f"with at least {min_share:.0%} of traffic):", "",
              "| drafter | " + " | ".join(f"{n} ({share:.0%})" for n, share in
                                        ((c.name, c.share) for c in figures[ranking.order[0]][0])) + " |",
              "|---" * (len(names) + 1) + "|"]  # fmt: skip
    for label in ranking.order:
        cells = []
        for c in figures[label][0]:
            below = c.share >= min_share and c.speedup < floor
            cells.append(f"{c.accept_len:.2f} [{c.ci_low:.2f}, {c.ci_high:.2f}] {c.speedup:.2f}x"
                         + (" **below floor**" if below else ""))  # fmt: skip
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def flips(order: list[str], pooled: dict[str, float], per_request: dict[str, float]) -> list[str]:
    """A sentence for each pair (the first against every other, and each against the next) that the two means
    order oppositely; the ranking follows the pooled one (serving/acceptance.ranking_flip)."""
    from serving.acceptance import ranking_flip

    pairs = dict.fromkeys([(order[0], x) for x in order[1:]] + list(zip(order, order[1:], strict=False)))
    said = (ranking_flip(a, (pooled[a], per_request[a]), b, (pooled[b], per_request[b])) for a, b in pairs)
    return [s + "." for s in said if s]


def pairs_markdown(ranking: Ranking) -> str:
    """Every pair, the better-ranked first: the paired difference and interval, the unpaired interval of the
    same difference, and how much narrower pairing made it."""
    lines = [f"| pair | difference ({ranking.by}) | paired 95% CI | unpaired 95% CI | paired narrower by | verdict |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for (a, b), d in ranking.pairs.items():
        said = f"{a} better" if d.a_better else "tied"
        lines.append(f"| {a} - {b} | {d.estimate:+.3f} | [{d.low:+.3f}, {d.high:+.3f}] | "
                     f"[{d.unpaired_low:+.3f}, {d.unpaired_high:+.3f}] | {d.narrower:.0%} | {said} |")  # fmt: skip
    return "\n".join(lines)


def verdict(ranking: Ranking, figures: Figures, break_even: BreakEven, profile: str, incumbent: str | None,
            flags: dict[str, str] | None = None) -> str:  # fmt: skip
    """The first sentence of the run's description: who ranks first, against break-even and the incumbent; a
    flagged drafter (trained on the pinned prompts, say) is said as such and never named the winner."""
    flags = flags or {}
    above = []
    for label in ranking.order:
        if label not in flags:
            break
        above.append(f"**{label} is flagged ({flags[label]}): its figure cannot make it the winner.**")
    else:
        return " ".join(above) + " Every candidate is flagged: no winner."
    return " ".join([*above, _winner(ranking, figures, break_even, profile, incumbent, label)])


def _winner(ranking: Ranking, figures: Figures, break_even: BreakEven, profile: str, incumbent: str | None,
            top: str) -> str:  # fmt: skip
    mix = figures[top][1]
    tied = ranking.tied_with(top)
    be = be_of(break_even, top)
    first = "ranks first" if top == ranking.order[0] else "is the first unflagged"
    by = " by projected speed-up" if ranking.by == "speed-up" else ""  # the candidates' cycles cost apart
    head = f"**{top} {first}{by} on {profile}'s traffic mix**: accept_len {mix.accept_len:.3f} [{mix.ci_low:.3f}, " \
           f"{mix.ci_high:.3f}]"  # fmt: skip
    if mix.ci_low > be:
        head += f", above its break-even {be:.2f} with the whole interval"
    elif mix.accept_len > be:
        head += f", above its break-even {be:.2f} on the mean only"
    else:
        head += f", below its break-even {be:.2f}"
        if not any(figures[x][1].accept_len > be_of(break_even, x) for x in ranking.order):
            head += ": no candidate makes speculative decoding pay"
    head += "." + (f" Tied with {', '.join(tied)} (paired intervals include zero)." if tied else "")
    if incumbent is not None and incumbent != top:
        d = ranking.between(top, incumbent)
        how = "beats" if d.a_better else ("is not told apart from" if d.tied else "falls short of")
        head += (f" It {how} the incumbent {incumbent}: {d.estimate:+.3f} [{d.low:+.3f}, {d.high:+.3f}] "
                 f"(paired, {ranking.by}).")  # fmt: skip
    elif incumbent == top:
        head += " It is the incumbent."
    return head


def figure(ranking: Ranking, figures: Figures, break_even: BreakEven, floor: float, k: int, title: str):
    """Left: each drafter's traffic-mix accept_len with its 95% interval against break-even; right: each traffic
    class, drafters side by side, against break-even and the class floor."""
    import numpy as np

    from reports.plotting import pyplot

    plt = pyplot()
    order = ranking.order
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 1.6]})
    mixes = [figures[label][1] for label in order]
    bes = [be_of(break_even, label) for label in order]
    colors = ["tab:green" if m.ci_low > be else ("tab:orange" if m.accept_len > be else "tab:red")
              for m, be in zip(mixes, bes, strict=True)]  # fmt: skip
    left.bar(
        [f"{x} (rank {rank_label(ranking, x)})" for x in order],
        [m.accept_len for m in mixes],
        color=colors,
        yerr=[[m.accept_len - m.ci_low for m in mixes], [m.ci_high - m.accept_len for m in mixes]],
        capsize=6,
    )
    shared = one_break_even(break_even)
    if shared is not None:
        left.axhline(shared, color="black", linestyle="--", label=f"break-even {shared:.2f}")
    else:  # each drafter's own, its draft steps priced by what they read
        left.hlines(bes, np.arange(len(order)) - 0.45, np.arange(len(order)) + 0.45, color="black",
                    linestyle="--", label="break-even (each its own draft steps')")  # fmt: skip
    left.set_title("traffic mix (95% CI)")
    left.tick_params(axis="x", labelrotation=20, labelsize=8)
    names = [c.name for c in figures[order[0]][0]]
    xs, width = np.arange(len(names)), 0.8 / len(order)
    for i, label in enumerate(order):
        cs = figures[label][0]
        right.bar(
            xs + (i - (len(order) - 1) / 2) * width,
            [c.accept_len for c in cs],
            width,
            label=label,
            yerr=[[c.accept_len - c.ci_low for c in cs], [c.ci_high - c.accept_len for c in cs]],
            capsize=3,
        )
    low = min(bes)  # priced apart, the cheapest step's: a class below it is below every drafter's
    said = "break-even" if shared is not None else "lowest break-even"
    right.axhline(low, color="black", linestyle="--",
                  label=f"{said} = class floor 1x" if floor == 1.0 else f"{said} {low:.2f}")  # fmt: skip
    if floor != 1.0:
        right.axhline(floor * low, color="tab:red", linestyle=":", label=f"class floor {floor:g}x")
    right.set_xticks(xs, [f"{c.name}\n{c.share:.0%}" for c in figures[order[0]][0]])
    right.set_title("per traffic class (95% CI)")
    for ax in (left, right):
        ax.axhline(k + 1, color="grey", linestyle=":")
        ax.set_ylim(0, k + 1.6)
        ax.set_ylabel("accept_len (tokens per verify cycle)")
    left.legend(loc="upper right", fontsize=8)
    right.legend(loc="upper right", fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
