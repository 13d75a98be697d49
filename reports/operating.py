"""What a drafter's measured acceptance means at each operating point of a deployment: break-even and
projected speed-up there, the draft depth to serve it at, and (with a serving engine's run) how far
the speed-up the profile predicts is from the one the engine served."""

from __future__ import annotations

from common import metric_names as names
from serving.cost import break_even_accept_len, fit_conditional_acceptance
from serving.cycle_model import DepthChoice, OperatingPoint, accept_len_at_depth, recommend_depth
from serving.profile import Profile


def positions_or_fit(acc_pos: list[float] | None, accept_len: float, k: int) -> list[float]:
    """Conditional acceptance by position that gives the headline accept_len at depth k: the measured
    shape scaled to it (positions pooled over prompts need not reproduce a share-weighted mix), or, with
    none kept, the constant rate that gives it."""
    if not acc_pos or not any(acc_pos):
        return [fit_conditional_acceptance(accept_len, k)] * k
    lo, hi = 0.0, 1.0 / max(acc_pos)
    for _ in range(60):
        mid = (lo + hi) / 2
        if accept_len_at_depth([a * mid for a in acc_pos], k) < accept_len:
            lo = mid
        else:
            hi = mid
    return [a * (lo + hi) / 2 for a in acc_pos]


def candidate_depths(profile: Profile, k: int) -> list[int]:
    """Depths to choose among: those the calibration timed; a hand-written profile's cycle model at 1..k. A block
    drafter's only the width measured: a narrower block is another set of drafts (its masks attend each other), so
    the acceptance by position of one width says nothing of another's, and none is extrapolated."""
    if profile.draft_shape == "block":
        return [k]
    timed = sorted({d for op in profile.operating_points for d, _ in op.cycle_ms_measured})
    return timed or list(range(1, k + 1))


def points_of(profile: Profile) -> list[OperatingPoint]:
    """The operating points (a hand-written profile: its one figure, as a point at unknown concurrency 0)."""
    if profile.operating_points:
        return list(profile.operating_points)
    return [OperatingPoint(0, 1.0, profile.baseline_tps, profile.verify_ms, profile.draft_step_ms,
                           draft_shape=profile.draft_shape)]  # fmt: skip


def depth_choices(profile: Profile, acc_pos: list[float], k: int) -> list[DepthChoice]:
    depths = candidate_depths(profile, k)
    return [recommend_depth(acc_pos, op, depths) for op in points_of(profile)]


def operating_metrics(profile: Profile, accept_len: float, acc_pos: list[float] | None, k: int) -> dict[str, float]:
    """Per operating point: break-even at depth k, the projected speed-up, and the recommended depth."""
    out: dict[str, float] = {}
    positions = positions_or_fit(acc_pos, accept_len, k)
    for view in profile.serving_points() if profile.operating_points else []:
        c = view.concurrency
        out[names.at_concurrency("break_even_accept_len", c)] = break_even_accept_len(view)
        out[names.at_concurrency("projected_speedup", c)] = accept_len / break_even_accept_len(view)
    for choice in depth_choices(profile, positions, k):
        at = (lambda f, c=choice.concurrency: names.at_concurrency(f, c)) if profile.operating_points else str
        out[at("recommended_draft_steps")] = choice.k
        out[at("recommended_speedup")] = choice.speedup
    return out


def served_vs_predicted(
    profile: Profile, k: int, engine_accept_len: float, served: dict[int, float], delivered_share: float = 1.0
) -> dict:
    """For each concurrency the engine served at and the profile has a point for: the speed-up the
    profile predicts from the tokens each engine cycle delivered (accept_len x delivered_share: the
    counters also count what a reply's last cycle accepted past its end), and the served one's relative
    error against it."""
    out = {}
    for op in profile.operating_points:
        if op.concurrency not in served:
            continue
        predicted = engine_accept_len * delivered_share * 1000.0 / op.cycle_ms(k) / op.plain_tps
        out[names.at_concurrency("predicted_served_speedup", op.concurrency)] = predicted
        out[names.at_concurrency("served_vs_predicted", op.concurrency)] = served[op.concurrency] / predicted - 1
    return out


def depth_sentences(profile: Profile, accept_len: float, acc_pos: list[float] | None, k: int) -> list[str]:
    positions = positions_or_fit(acc_pos, accept_len, k)
    lines = []
    for choice in depth_choices(profile, positions, k):
        text = choice.sentence()
        lines.append(text if profile.operating_points else text.replace("at concurrency 0 ", "on this profile "))
    return lines
