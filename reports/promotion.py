"""A promotion in words: the run's first sentence, what was decided and by how much."""

from __future__ import annotations


def verdict(version: str, stage: str, decision, ev) -> str:
    """The run's first sentence: what was decided and by how much, before the table of rules."""
    be = ev.break_even
    if decision.allowed:
        by = (
            f": accept_len_ci_low {ev.ci_low:.3f} clears break-even {be:.3f} by {ev.ci_low - be:.3f}"
            if (ev.ci_low is not None and be is not None and stage == "production")
            else ""
        )
        return f"**Promoted v{version} to {stage}**{by}."
    failed = "; ".join(r.detail for r in decision.reasons if not r.ok)
    return f"**Refused v{version} for {stage}**: {failed}."
