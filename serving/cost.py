"""Throughput model: when does speculation pay, and what acceptance does a target speed need?

cycle_ms = verify_ms + draft_steps * draft_step_ms; projected_tps = accept_len * 1000 / cycle_ms;
break-even accept_len = baseline_tps * cycle_ms / 1000. With constant conditional acceptance p and
k draft steps, E[accept_len] = (1 - p^(k+1)) / (1 - p); unbounded depth gives 1 / (1 - p).
"""

from __future__ import annotations

from dataclasses import dataclass

from serving.profile import Profile


def break_even_accept_len(profile: Profile) -> float:
    return profile.baseline_tps * profile.cycle_ms / 1000.0


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
