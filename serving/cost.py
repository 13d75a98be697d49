"""Throughput model: when does speculation pay, and what acceptance does a target speed need?

cycle_ms = verify_ms + passes * draft_step_ms, where a chain method (EAGLE-3) runs one drafter pass per draft
(passes = draft_steps) and a block method (DFlash) one pass for the whole block (passes = 1, drafter/methods);
projected_tps = accept_len * 1000 / cycle_ms;
break-even accept_len = baseline_tps * cycle_ms / 1000. With constant conditional acceptance p and
k draft steps, E[accept_len] = (1 - p^(k+1)) / (1 - p); unbounded depth gives 1 / (1 - p).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from serving.profile import Profile


def break_even_accept_len(profile: Profile) -> float:
    return profile.baseline_tps * profile.cycle_ms / 1000.0


def method_cycle_ms(profile: Profile, k: int, passes: int) -> float:
    """One cycle at k drafts whose drafter runs `passes` times. A chain's (passes == k) is the profile's own, timed
    where k was timed; any other (a block's: one pass, as Profile.shaped prices it) is the fit's verify plus its
    passes, never a chain's timed point (those hold k passes). On a profile whose whole cycle sits in verify_ms
    (draft_step_ms 0), drafting is free to every method alike, which favours none."""
    if passes == k:
        return profile.with_draft_steps(k).cycle_ms
    return profile.verify_ms + passes * profile.draft_step_ms


def method_break_even(profile: Profile, k: int, passes: int) -> float:
    """The accept_len a drafter of this cycle shape needs at k drafts to match plain decoding."""
    return profile.baseline_tps * method_cycle_ms(profile, k, passes) / 1000.0


def priced_for(profile: Profile, step_params: int) -> tuple[Profile, str]:
    """The profile with its draft steps priced for a drafter whose step reads `step_params` parameters
    (drafter.analysis.step_cost), and the sentence that says so. A step bound by reading its weights costs in
    proportion to them, so where the profile records what its timed drafter's step read and this one reads
    more, draft_step_ms (at every operating point, and the timed cycles' draft part) grows by the ratio.
    Never priced down: a cheaper step is credited only by timing it (calibrate with that drafter)."""
    if any(op.method_points() for op in profile.operating_points):  # timed with another drafter of its method
        return profile, (
            f"not priced by drafter size: its {profile.draft_method} cycles in profile {profile.name} "
            "are those calibrate timed with another drafter of its method (time the one you serve)"
        )
    timed = profile.draft_step_params
    steps_cost = profile.draft_step_ms > 0 or any(op.draft_step_ms > 0 for op in profile.operating_points)
    if not steps_cost:
        return profile, ""  # the whole cycle sits in verify_ms: nothing to scale
    if not timed:
        return profile, (f"draft steps not priced by drafter size (profile {profile.name} does not record "
                         "what its timed drafter's step reads)")  # fmt: skip
    ratio = step_params / timed
    if ratio <= 1.0:
        return profile, ""

    def extra(step_ms: float, k: int) -> float:
        return k * step_ms * (ratio - 1.0)

    ops = tuple(
        replace(op, draft_step_ms=op.draft_step_ms * ratio,
                cycle_ms_measured=tuple((k, ms + extra(op.draft_step_ms, k)) for k, ms in op.cycle_ms_measured))
        for op in profile.operating_points
    )  # fmt: skip
    # a profile's own timed cycles are its primary point's (or, on a view, its point's): timed with its step
    points = tuple((k, ms + extra(profile.draft_step_ms, k)) for k, ms in profile.cycle_points)
    priced = replace(profile, draft_step_ms=profile.draft_step_ms * ratio, operating_points=ops, cycle_points=points)
    note = (f"draft steps priced at {ratio:.2f}x: a step reads {step_params / 1e6:.3g} M parameters against "
            f"{timed / 1e6:.3g} M of the drafter {profile.name}'s cycles were timed with")  # fmt: skip
    return priced, note


def projected_tps(accept_len: float, profile: Profile) -> float:
    return accept_len * 1000.0 / profile.cycle_ms


def expected_accept_len(p: float, k: int | None) -> float:
    """E[tokens per cycle] with constant conditional acceptance p; k=None for unbounded depth."""
    if not 0 <= p <= 1:
        raise ValueError(f"p must be in [0, 1], got {p}")
    if k is None:
        return float("inf") if p == 1 else 1.0 / (1.0 - p)
    return float(k + 1) if p == 1 else (1.0 - p ** (k + 1)) / (1.0 - p)


def required_acceptance(accept_len: float, k: int | None) -> float | None:
    """The p that gives this accept_len; None when k steps can never reach it (accept_len > k+1)."""
    if accept_len <= 1.0:
        return 0.0
    if k is None:
        return 1.0 - 1.0 / accept_len
    if accept_len > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if expected_accept_len(mid, k) < accept_len:
            lo = mid
        else:
            hi = mid
    return hi


def fit_conditional_acceptance(accept_len: float, k: int) -> float:
    """cond_acc: the constant p whose k-step expectation equals a measured accept_len."""
    return required_acceptance(min(max(accept_len, 1.0), k + 1.0), k) or 0.0


@dataclass(frozen=True)
class PlanRow:
    target_tps: float
    required_accept_len: float
    acc_unbounded: float
    acc_k_steps: float | None  # None: unreachable with k steps


def plan_table(profile: Profile, target_tps: list[float]) -> list[PlanRow]:
    """Required accept_len and conditional acceptance for each target speed (break-even first)."""
    rows = []
    for tps in target_tps:
        need = tps * profile.cycle_ms / 1000.0
        rows.append(PlanRow(tps, need, required_acceptance(need, None), required_acceptance(need, profile.draft_steps)))
    return rows
