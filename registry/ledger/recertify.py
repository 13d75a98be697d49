"""Re-certification: production's evidence was measured under one engine version, target and workload;
when any of them moves, the holder is measured again and held to what it showed before.

The comparison is paired per prompt (the prompts both records measured, by identity), as vLLM's own
acceptance-length guard compares a release against the last (+-2% on MT-Bench). Within the tolerance the
holder keeps production; beyond it the promotion rule decides again on the new evidence: kept with a
warning when it still clears the rule, demoted when it does not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from serving.workload import pooled

KEEP, WARN, DEMOTE = "keep", "warn", "demote"


@dataclass(frozen=True)
class Comparison:
    before: float  # accept_len over the paired prompts, as recorded
    after: float  # the same prompts, measured again now
    paired: int  # prompts both records measured
    changed_prompts: int  # prompts whose own accept_len moved by more than the tolerance
    tolerance: float

    @property
    def change(self) -> float:
        """Relative change of accept_len on the paired prompts (-0.05: 5% fewer tokens a cycle)."""
        return self.after / self.before - 1 if self.before else 0.0

    @property
    def within(self) -> bool:
        return self.paired > 0 and abs(self.change) <= self.tolerance

    def sentence(self) -> str:
        if not self.paired:
            return "no prompt in common with the recorded evidence: nothing to pair"
        return (
            f"accept_len {self.before:.3f} -> {self.after:.3f} ({self.change:+.1%}) on {self.paired} paired prompts "
            f"({self.changed_prompts} moved by more than {self.tolerance:.0%} on their own); tolerance "
            f"+-{self.tolerance:.0%}"
        )


def compare(old: Any, new: Any, tolerance: float) -> Comparison:
    """The two records (registry.ledger.evidence.record.EvidenceRecord) paired on the prompts both measured."""
    recorded = {key: counts for c in old.classes for key, counts in zip(c.prompt_keys, c.per_prompt, strict=True)}
    pairs = [(recorded[key], counts) for c in new.classes for key, counts in zip(c.prompt_keys, c.per_prompt,
             strict=True) if key in recorded]  # fmt: skip
    if not pairs:
        return Comparison(0.0, 0.0, 0, 0, tolerance)
    before, after = pooled([b for b, _ in pairs]), pooled([a for _, a in pairs])
    moved = sum(
        1 for (bt, bc), (at, ac) in pairs if bc and ac and abs((at / ac) / (bt / bc) - 1) > tolerance
    )  # fmt: skip
    return Comparison(before, after, len(pairs), moved, tolerance)


@dataclass
class Verdict:
    action: str  # keep, warn or demote
    lines: list[str] = field(default_factory=list)


def verdict(comparison: Comparison | None, decision: Any) -> Verdict:
    """Keep within the tolerance; beyond it (or unpaired), the promotion rule on the new evidence decides."""
    if comparison is not None and comparison.within and decision.allowed:
        return Verdict(KEEP, [f"within tolerance: {comparison.sentence()}"])
    said = [comparison.sentence()] if comparison is not None else ["no recorded evidence to compare against"]
    if decision.allowed:
        return Verdict(WARN, [*said, "beyond tolerance, but the promotion rule still holds on the new evidence: kept"])
    measured = [r for r in decision.reasons if not r.ok and r.rule not in NOT_MEASURED]
    if not measured:  # a record or lineage nobody can read is a finding, never a reason to clear production
        return Verdict(WARN, [*said, f"kept: the rule cannot be applied on what was measured ({decision.summary()})"])
    return Verdict(DEMOTE, [*said, f"the promotion rule no longer holds: {decision.summary()}"])


# rules that fail on what the store holds (a blocking record, a lineage claim), not on what was measured:
# anyone with store access can make them fail, so they never demote
NOT_MEASURED = ("evaluated", "not trained on its evaluation")
