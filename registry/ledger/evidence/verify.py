"""Which runs are evidence, and which records count.

Every record of the version counts, from every experiment, whatever its run's state (deleted and FAILED
runs included: MLflow keeps them until garbage collection), measured on exactly the prompts the profile
pins. The least favourable one decides. A record is withdrawn only by a newer one of the same engine on the
same pinned prompts (greedy decoding, so a re-run cannot draw a lucky sample); a record that fails its
signature or its bounds stands as a refusal until such a newer record exists. A run that was never evidence
(no digest logged by `evaluate`, unsigned, signed by a key no trust list names) is ignored and reported.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from registry.access.runs import all_experiment_ids, artifact_bytes, runs_with_param
from registry.ledger import signing
from registry.ledger.evidence.record import (
    DIGEST_PARAM,
    ENGINES_BOUND_TO_WEIGHTS,
    EVIDENCE_FILE,
    TAG,
    WORKLOAD,
    EvidenceRecord,
)
from registry.ledger.trust import EVALUATOR, load_trust
from serving.profile import Profile


class Unusable(Exception):
    """A run that is not evidence at all: no digest logged by `evaluate`, unsigned, or signed by a key no
    trust list names for it. Anyone with store access can make one, so it is ignored (and reported)."""


class Blocking(Unusable):
    """A record `evaluate` logged that can no longer be read as it was (overwritten, deleted), or one a
    trusted evaluator signed with impossible counts: it stands in the way of the version's promotion until
    a newer evaluation acknowledges it, so withdrawing an unfavourable record withdraws nothing."""


def read_record(text: str, run_id: str, trust: Any = None) -> EvidenceRecord:
    """Verify first (signed by a trusted evaluator), then parse, then check the counts are possible;
    Unusable says why not."""
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Unusable("not JSON") from None
    if not isinstance(raw, dict):
        raise Unusable("not a record")
    why = signing.verify(raw, EVALUATOR, trust or load_trust())
    if why:
        raise Unusable(why)
    try:
        rec = EvidenceRecord.from_payload(raw, run_id)
    except (KeyError, TypeError, ValueError):
        raise Blocking("signed, but not a record of this format") from None
    impossible = sanity(rec)
    if impossible:
        raise Blocking("impossible counts: " + impossible[0])
    return rec


def sanity(rec: EvidenceRecord) -> list[str]:
    """What no real decoding can produce: more tokens than k + 1 per cycle or fewer than one, more than
    the output holds (max_new_tokens, plus the k a last cycle may overshoot by), counts without prompts."""
    k, why = rec.draft_steps, []
    for c in rec.classes:
        if len(c.per_prompt) != len(c.prompt_keys):
            why.append(f"class {c.name}: {len(c.per_prompt)} counts for {len(c.prompt_keys)} prompts")
        for i, (tokens, cycles) in enumerate(c.per_prompt):
            if cycles < 0 or tokens < cycles or tokens > (k + 1) * cycles:
                why.append(f"class {c.name} prompt {i}: {tokens} tokens in {cycles} cycles at {k} draft steps")
            elif tokens > rec.max_new_tokens + k or cycles > rec.max_new_tokens:
                why.append(
                    f"class {c.name} prompt {i}: {tokens} tokens in {cycles} cycles at max_new_tokens "
                    f"{rec.max_new_tokens}"
                )
    if rec.acc_pos and (len(rec.acc_pos) != k or not all(0 <= a <= 1 for a in rec.acc_pos)):
        why.append(f"acceptance by position {rec.acc_pos} at {k} draft steps")
    for c in rec.classes:
        if c.contexts and (len(c.contexts) != len(c.per_prompt) or any(n < 1 for n in c.contexts)):
            why.append(f"class {c.name}: context lengths do not match its {len(c.per_prompt)} prompts")
    if not rec.classes or abs(sum(c.share for c in rec.classes) - 1) > 1e-6:
        why.append("class shares do not sum to 1")
    return why + histogram_mismatches(rec)


def histogram_mismatches(rec: EvidenceRecord) -> list[str]:
    """Where a record carries verify-step histograms, its figures must be theirs: each prompt's (tokens, cycles)
    and the pooled acceptance by position are recomputed from them (serving/acceptance.py)."""
    k, why = rec.draft_steps, []
    for c in rec.classes:
        if not c.histograms:
            continue
        if len(c.histograms) != len(c.per_prompt):
            why.append(f"class {c.name}: {len(c.histograms)} histograms for {len(c.per_prompt)} prompts")
            continue
        for i, (h, counts) in enumerate(zip(c.histograms, c.per_prompt, strict=True)):
            ok = len(h) == k + 1 and all(isinstance(n, int) and n >= 0 for n in h)
            own = (sum((j + 1) * n for j, n in enumerate(h)), sum(h)) if ok else None
            if own != tuple(counts):
                why.append(f"class {c.name} prompt {i}: histogram {h} does not give its counts {tuple(counts)}")
    whole = rec.histograms() if not why else None
    if whole is not None and rec.acc_pos and whole.verify_steps:
        own = whole.conditional
        if any(abs(a - b) > 1e-6 for a, b in zip(own, rec.acc_pos, strict=False)) or len(own) != len(rec.acc_pos):
            why.append(f"acceptance by position {rec.acc_pos} is not the histograms' own {[round(a, 6) for a in own]}")
    return why


def pinned_keys(profile: Profile) -> dict[str, list[str]]:
    """The prompt identities the profile pins, per class (each file checked against its digest)."""
    return {c.name: c.keys() for c in profile.workload}


def mismatches(
    rec: EvidenceRecord,
    profile: Profile,
    target_digest: str,
    drafter_files: dict[str, str],
    pinned: dict[str, list[str]] | None = None,
    version: tuple[str, str] | None = None,
    precision: str = "",
) -> list[str]:
    """Why a record cannot stand as evidence for this profile, target and drafter (empty: it can)."""
    why = []
    pinned = pinned_keys(profile) if pinned is None else pinned
    if version is not None and (rec.model, rec.version) != version:
        why.append(f"a record of models:/{rec.model}/{rec.version}, not of this version")
    if not profile.workload:
        why.append(f"profile {profile.name} pins no evaluation prompts (eval_prompts or workload)")
    elif rec.scope != WORKLOAD:
        why.append(f"measured on {rec.scope.replace(':', ' ', 1)} only, not on the profile's whole workload")
    else:
        why += _prompt_mismatches(rec, profile, pinned)
    if rec.profile_digest != profile.digest:
        why.append(f"measured under other profile values than {profile.name}'s")
    if rec.draft_steps != profile.draft_steps:
        why.append(f"{rec.draft_steps} draft steps, the profile uses {profile.draft_steps}")
    if rec.max_new_tokens != profile.eval_max_new_tokens or rec.temperature != profile.eval_temperature:
        why.append(
            f"decoded {rec.max_new_tokens} new tokens at temperature {rec.temperature:g}; the profile pins "
            f"{profile.eval_max_new_tokens} at {profile.eval_temperature:g}"
        )
    if rec.target_digest != target_digest:
        why.append(f"measured on another target ({rec.target})")
    elif precision and (rec.target_precision or "float32") != precision:
        why.append(f"measured with the target at {rec.target_precision or 'float32'}; it is served at {precision}")
    distinct = len({key for c in rec.classes for key in c.prompt_keys})
    if distinct < rec.num_prompts:
        why.append(f"{rec.num_prompts} prompts counted, {distinct} distinct: a copy of a prompt is not another prompt")
    if distinct < profile.min_prompts:
        why.append(f"{distinct} prompts, the profile needs {profile.min_prompts}")
    names = set(rec.drafter_files) | set(drafter_files)
    changed = sorted(n for n in names if rec.drafter_files.get(n) != drafter_files.get(n))
    if changed:
        why.append(f"{', '.join(changed)} changed after evaluation run {rec.run_id or '(this record)'}")
    if rec.engine not in ENGINES_BOUND_TO_WEIGHTS:
        why.append(f"engine {rec.engine!r} cannot prove which drafter it ran")
    elif rec.endpoint or not rec.drafter_attested:
        why.append(
            f"measured on a server the project did not launch ({rec.endpoint or 'unknown'}), "
            "which does not say which drafter it runs"
        )
    if rec.aux_layers and not rec.aux_layers.get("matches_training", True):
        why.append("the engine fed the drafter other target layers than it was trained on")
    if rec.aux_layers and any((rec.aux_layers.get("norm_flags_read") or {}).values()):
        why.append("the engine read a norm flag as true: it served another network than the drafter")
    return why


def _prompt_mismatches(rec: EvidenceRecord, profile: Profile, pinned: dict[str, list[str]]) -> list[str]:
    names = [c.name for c in rec.classes]
    expected = [c.name for c in profile.workload]
    if names != expected:
        return [f"measured on classes {names}, the profile pins {expected}"]
    why = []
    for measured, pin in zip(rec.classes, profile.workload, strict=True):
        if measured.prompt_keys != pinned[pin.name]:
            why.append(
                f"class {pin.name} measured on other prompts than the pinned {pin.prompts.name} "
                f"(sha256 {pin.sha256[:16]}...)"
            )
    return why


@dataclass
class Found:
    """What the store holds for one version: readable records, records that stand in the way, and runs
    that claim to be evidence and are not (ignored, said as findings)."""

    records: list[EvidenceRecord]
    unusable: list[tuple[str, str, str]]  # (run id, the engine its run's params name, why): Blocking records
    planted: list[tuple[str, str]] = field(default_factory=list)  # (run id, why): not evidence, ignored

    def findings(self) -> list[str]:
        return [f"evaluation run {run} is not evidence ({why}): ignored" for run, why in self.planted]


def records_for(c: Any, model: str, version: str, trust: Any = None) -> Found:
    """Every evaluation of this version, from every experiment, active or deleted, whatever its state,
    oldest first. Runs are found by their `drafterops.evidence` *param*, which MLflow lets nobody change
    or delete (a tag could be removed to hide an unfavourable record), page by page (none left out). A
    record whose bytes no longer match the sha256 its run logged as a param was overwritten: unusable."""
    experiments = all_experiment_ids(c)
    found = Found([], [])
    for run in runs_with_param(c, experiments, TAG, f"{model}/{version}"):
        engine = run.data.params.get("engine", "")  # a param: what the run said it measured with, unchangeable
        try:
            found.records.append(_logged_record(c, run, trust))
        except Blocking as exc:
            found.unusable.append((run.info.run_id, engine, str(exc)))
        except Unusable as exc:
            found.planted.append((run.info.run_id, str(exc)))
    return found


def _logged_record(c: Any, run: Any, trust: Any) -> EvidenceRecord:
    """The run's record, when its bytes are those the run logged; Unusable says why not."""
    raw = artifact_bytes(c, run, EVIDENCE_FILE)
    logged = run.data.params.get(DIGEST_PARAM)
    if not logged:
        raise Unusable("its run logged no evidence digest (not written by evaluate)")
    if raw is None:
        raise Blocking("its evidence.json is missing (deleted after the run logged it)")
    if logged != hashlib.sha256(raw).hexdigest():
        raise Blocking("its evidence.json was overwritten after the run logged it")
    return read_record(raw.decode("utf-8", "replace"), run.info.run_id, trust)


def deciding(matching: list[EvidenceRecord], greedy: bool) -> list[EvidenceRecord]:
    """The records that still stand: with greedy decoding the newest per engine withdraws the older ones
    (a re-run on the same pinned prompts cannot be luckier); with sampling, every one stands."""
    if not greedy:
        return matching
    newest: dict[str, EvidenceRecord] = {}
    for rec in sorted(matching, key=lambda r: r.created):
        newest[rec.engine] = rec
    return list(newest.values())
