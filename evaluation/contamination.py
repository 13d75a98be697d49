"""Whether a drafter was trained on the prompts it is evaluated on: its figure would then measure memory.
Said at once, and the overlapping prompts' keys kept in the signed record, so a lineage lost later is not
forgotten (promote refuses such evidence for any profile that pins them)."""

from __future__ import annotations

from typing import Any

from registry.ledger import lineage
from reports.workload import MeasuredClass
from serving.workload import prompt_key


def warn_contamination(mv: Any, classes: list[MeasuredClass]) -> list[str]:
    """Say at once when the version (or a version it descends from) was trained on these prompts; returns
    their keys, which the evidence record keeps (signed)."""
    if mv is None or not classes:
        return []
    from registry.access import store  # torch: the store reads drafter files

    trained = lineage.training_prompt_keys(store.client(), mv)
    for c in classes:
        overlap = sum(prompt_key(r) in trained for r in c.records)
        if overlap:
            print(
                f"evaluate: warning: v{mv.version} was trained on {overlap} of these prompts (class {c.name}): "
                "not evidence for any profile that pins them"
            )
    return sorted({prompt_key(r) for c in classes for r in c.records} & trained)
