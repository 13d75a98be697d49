"""The whole evaluation as evidence: what was measured, on what, under which conditions. The record is
signed and logged by registry/ledger/evidence/record.py; this module only fills it in."""

from __future__ import annotations

from typing import Any

from drafter.analysis.fingerprint import target_digest
from evaluation.measure import Evaluation
from evaluation.request import Request
from registry.ledger.deployment import trust_for
from registry.ledger.evidence import verify as ev_verify
from registry.ledger.evidence.record import ClassCounts, EvidenceRecord
from reports.workload import by_class
from serving.workload import prompt_key


def evidence_record(request: Request, ev: Evaluation) -> EvidenceRecord:
    """The record of this evaluation, class by class, prompt by prompt."""
    from registry.access import store  # torch: the store reads drafter files

    measured, mv, profile = ev.measured, ev.mv, request.profile
    histograms = [list(h) for h in measured.histograms or []]
    counts = [
        ClassCounts(c.name, c.share, c.sha256, [prompt_key(r) for r in c.records], per, list(lengths), list(hs))
        for (c, per), (_, lengths), (_, hs) in zip(
            by_class(request.classes, measured.per_prompt), by_class(request.classes, ev.contexts or []),
            by_class(request.classes, histograms), strict=True
        )
    ]  # fmt: skip
    return EvidenceRecord(
        model=mv.name if mv is not None else "",
        version=str(mv.version) if mv is not None else "",
        drafter_files=store.drafter_files(ev.folder),
        weights_sha256=store.weights_sha256(store.file_hashes(ev.folder)),
        profile=profile.name,
        profile_digest=profile.digest,
        profile_values=profile.values(),
        draft_steps=request.k,
        target=str(request.asked.target),
        target_digest=target_digest(request.asked.target),
        target_precision="unknown" if measured.endpoint else request.precision,  # a user's server does not say
        temperature=request.temperature,
        max_new_tokens=request.max_new,
        engine=measured.engine,
        engine_version=measured.engine_version,
        classes=counts,
        scope=request.scope,
        dataset_digest=ev.dataset_digest,
        sim_accept_len=ev.metrics.get("sim_accept_len"),
        aux_layers=measured.aux or None,
        acc_pos=[float(a) for a in measured.acc_pos],
        endpoint=measured.endpoint,
        drafter_attested=measured.attested,
        acknowledged=unusable_runs(mv, profile),
        trained_on=ev.trained_on,
    )


def unusable_runs(mv: Any, profile: Any) -> list[str]:
    """The version's runs whose record is unusable now: this evaluation, newer than each, replaces them."""
    if mv is None:
        return []
    from registry.access import store  # torch

    found = ev_verify.records_for(store.client(), mv.name, str(mv.version), trust_for(profile))
    return [run for run, _, _ in found.unusable]
