"""A bake-off's evidence and its one policy: which evaluation of each version speaks for a profile, its
counts lined up prompt by prompt with every other candidate's, and when `compare --promote` may hand the
winner to `promote` at all.

A record is reused when it is signed by a trusted evaluator, its bytes are the ones its run logged, and
`evidence_verify.mismatches` finds nothing: the profile's pinned prompts, values, draft steps, decoding settings,
deployment target and precision, on the version's files as they are now. Only records of the bake-off's
engine count, so every candidate is measured the same way; of several, the newest (greedy decoding: a
re-run cannot be luckier, as `evidence_verify.deciding` reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from registry.ledger.evidence import record as evidence_record
from registry.ledger.evidence import verify as evidence_verify
from serving.paired import Counts, Difference


def reusable_record(c: Any, mv: Any, profile: Any, dep: Any, engine: str) -> evidence_record.EvidenceRecord | None:
    """The newest record of the version that stands for the profile on this engine, or None."""
    from registry.access import store

    _, folder = store.version_folder(f"models:/{mv.name}/{mv.version}")
    files = store.drafter_files(folder)
    pinned = evidence_verify.pinned_keys(profile)
    found = evidence_verify.records_for(c, mv.name, str(mv.version), dep.trust)
    ok = [
        rec
        for rec in found.records
        if rec.engine == engine
        and not evidence_verify.mismatches(
            rec, profile, dep.digest, files, pinned, (mv.name, str(mv.version)), dep.precision
        )
    ]
    return max(ok, key=lambda rec: rec.created) if ok else None


def classes_of(rec: evidence_record.EvidenceRecord, profile: Any) -> list[tuple[str, float, Counts]]:
    """The record's (class, share, counts) in the profile's class order and each class's pinned prompt order,
    looked up by prompt identity: two candidates' lists line up prompt by prompt."""
    pinned = evidence_verify.pinned_keys(profile)
    by_class = {c.name: dict(zip(c.prompt_keys, c.per_prompt, strict=True)) for c in rec.classes}
    return [(c.name, c.share, [by_class[c.name][key] for key in pinned[c.name]]) for c in profile.workload]


@dataclass(frozen=True)
class PromotionCheck:
    """Whether the bake-off lets `promote` judge the winner, and why (the rule itself is promote's)."""

    allowed: bool
    reason: str


def may_promote(winner: str, incumbent: str | None, versus: Difference | None) -> PromotionCheck:
    """The winner goes to `promote` only when it beats the incumbent by a paired interval above zero (no
    incumbent: nothing to beat, the promotion rule alone decides)."""
    if incumbent is None:
        return PromotionCheck(True, f"{winner} ranks first and nothing holds production")
    if winner == incumbent:
        return PromotionCheck(False, f"the incumbent {incumbent} ranks first: nothing to promote")
    if versus is None or not versus.a_better:
        interval = f" (paired difference {fmt_difference(versus)})" if versus is not None else ""
        return PromotionCheck(False, f"{winner} does not beat the incumbent {incumbent} by a paired interval above "
                                     f"zero{interval}")  # fmt: skip
    return PromotionCheck(True, f"{winner} beats the incumbent {incumbent} by {fmt_difference(versus)}")


def fmt_difference(d: Difference) -> str:
    return f"{d.estimate:+.3f} [{d.low:+.3f}, {d.high:+.3f}]"
