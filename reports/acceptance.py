"""The figures an evaluation logs: acceptance by position, accept_len against break-even, drafters side by
side, and accept_len per traffic class."""

from __future__ import annotations

from reports.plotting import pyplot


def acceptance_figure(offline: list[float] | None, online: list[float], title: str):
    """Per-position conditional acceptance, offline (teacher forced) beside online (decoding trace)."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = list(range(len(online)))
    w = 0.38
    if offline:
        ax.bar([x - w / 2 for x in xs], offline[: len(xs)], w, label="offline (teacher forced)")
    ax.bar([x + (w / 2 if offline else 0) for x in xs], online, w, label="online (decoding)")
    ax.set_xticks(xs, [f"pos {x}" for x in xs])
    ax.set_ylim(0, 1)
    ax.set_ylabel("conditional acceptance")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


def break_even_figure(accept_len: float, ci: tuple[float, float], break_even: float, k: int, title: str):
    """Measured accept_len (with its 95% interval) against the deployment's break-even and k + 1."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 3.5))
    color = "tab:green" if ci[0] > break_even else ("tab:orange" if accept_len > break_even else "tab:red")
    ax.bar(["accept_len"], [accept_len], yerr=[[accept_len - ci[0]], [ci[1] - accept_len]], color=color, capsize=8)
    ax.axhline(break_even, color="black", linestyle="--", label=f"break-even {break_even:.2f}")
    ax.axhline(k + 1, color="grey", linestyle=":", label=f"ceiling k+1 = {k + 1}")
    ax.set_ylim(0, k + 1.5)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def drafters_figure(rows: list[tuple[str, float, float, float]], break_even: float, k: int, title: str):
    """Every drafter's accept_len with its 95% interval, side by side against break-even and k + 1."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = [r[0] for r in rows]
    means = [r[1] for r in rows]
    err = [[r[1] - r[2] for r in rows], [r[3] - r[1] for r in rows]]
    colors = ["tab:green" if r[2] > break_even else ("tab:orange" if r[1] > break_even else "tab:red") for r in rows]
    ax.bar(labels, means, yerr=err, color=colors, capsize=8, label="accept_len (95% CI)")
    ax.axhline(break_even, color="black", linestyle="--", label=f"break-even {break_even:.2f}")
    ax.axhline(k + 1, color="grey", linestyle=":", label=f"ceiling k+1 = {k + 1}")
    ax.set_ylim(0, k + 1.6)
    ax.set_ylabel("accept_len (tokens per verify cycle)")
    ax.set_xlabel("drafter")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def class_bars_figure(
    rows: list[tuple[str, float, float, float, float]],
    break_even: float,
    floor: float,
    min_share: float,
    k: int,
    title: str,
):
    """accept_len per traffic class (and the mix, last) with 95% intervals against break-even; a class
    projected below the floor is red, one too small to be held to it grey, the rest green."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, colors = [], []
    for name, share, L, lo, _ in rows:
        if name == "mix":
            labels.append("traffic mix")
            colors.append("tab:green" if lo > break_even else "tab:red")
            continue
        labels.append(f"{name}\n{share:.0%} of traffic")
        held = share >= min_share
        colors.append("tab:gray" if not held else ("tab:green" if L / break_even >= floor else "tab:red"))
    means = [r[2] for r in rows]
    err = [[r[2] - r[3] for r in rows], [r[4] - r[2] for r in rows]]
    ax.bar(labels, means, yerr=err, color=colors, capsize=8)
    ax.axhline(break_even, color="black", linestyle="--", label=f"break-even {break_even:.2f}")
    if floor != 1.0:
        ax.axhline(floor * break_even, color="tab:red", linestyle=":", label=f"class floor {floor:g}x")
    return _finish_bars(fig, ax, k, title)


def context_bars_figure(
    rows: list[tuple[str, int, float, float, float]],
    break_even: float,
    floors: dict[str, float],
    k: int,
    title: str,
):
    """accept_len per context bucket (prompt plus reply tokens) with 95% intervals against break-even and
    each bucket's floor where the profile sets one: red below its floor, green otherwise."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{name} tokens\n{n} prompts" for name, n, *_ in rows]
    colors = ["tab:red" if floors.get(name, 0.0) * break_even > L else "tab:green" for name, _, L, *_ in rows]
    means = [r[2] for r in rows]
    err = [[r[2] - r[3] for r in rows], [r[4] - r[2] for r in rows]]
    ax.bar(labels, means, yerr=err, color=colors, capsize=8)
    ax.axhline(break_even, color="black", linestyle="--", label=f"break-even {break_even:.2f}")
    for i, (name, *_rest) in enumerate(rows):
        if name in floors:
            ax.hlines(floors[name] * break_even, i - 0.4, i + 0.4, color="tab:red", linestyle=":",
                      label=f"floor {floors[name]:g}x" if i == 0 else None)  # fmt: skip
    return _finish_bars(fig, ax, k, title)


def _finish_bars(fig, ax, k: int, title: str):
    """The ceiling, axes, title and legend every accept_len bar chart shares."""
    ax.axhline(k + 1, color="grey", linestyle=":", label=f"ceiling k+1 = {k + 1}")
    ax.set_ylim(0, k + 1.6)
    ax.set_ylabel("accept_len (tokens per verify cycle)")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
