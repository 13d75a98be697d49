"""Evaluation evidence: each evaluation kept whole, signed, and bound to what it was measured on.

An evaluate run carries `evidence.json`: the per-class, per-prompt cycle counts that accept_len and its
interval are computed from, the prompts' identities, the digest of every file the engine loaded, the
profile's values, the target, the engine. It is signed (registry.signing) by the evaluating process, so
a person with registry access can read evidence but cannot write it. A decision verifies the signature
before reading anything else, checks the counts are physically possible, and recomputes every figure:
tags are pointers for the UI, never evidence.

Which records count: every record of the version, from every experiment, whatever its run's state
(deleted and FAILED runs included: MLflow keeps them until garbage collection), measured on exactly the
prompts the profile pins. The least favourable one decides. A record is withdrawn only by a newer one of
the same engine on the same pinned prompts (greedy decoding, so a re-run cannot draw a lucky sample);
a record that fails its signature or its bounds stands as a refusal until such a newer record exists.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from registry import signing
from registry.policy import Evidence
from registry.runs import all_experiment_ids, artifact_bytes, runs_with_param
from registry.trust import EVALUATOR, load_trust
from serving.cost import break_even_accept_len
from serving.profile import Profile
from serving.workload import class_figures, context_figures, mix_accept_len, mix_ci

EVIDENCE_FILE = "evidence.json"
TAG = "drafterops.evidence"  # on the evaluate run: "<model>/<version>"
ENGINES_BOUND_TO_WEIGHTS = ("in-process", "vllm", "sglang")  # engines the project launched itself
FORMAT = 3  # 3: Ed25519-signed, with the unusable records it acknowledged
DIGEST_PARAM = "drafterops.evidence_sha256"  # the record's sha256, in a param nobody can change
WORKLOAD = "workload"  # scope of an evaluation on every class the profile pins


@dataclass
class ClassCounts:
    """One traffic class as measured: its prompts' identities and (tokens, cycles) per prompt."""

    name: str
    share: float
    prompts_sha256: str  # of the file the prompts were read from
    prompt_keys: list[str]
    per_prompt: list[tuple[int, int]]
    contexts: list[int] = field(default_factory=list)  # tokens of prompt plus reply, per prompt ([]: not recorded)


@dataclass
class EvidenceRecord:
    model: str
    version: str
    drafter_files: dict[str, str]  # every file the engine loads -> sha256 (config.json canonicalised)
    weights_sha256: str
    profile: str
    profile_digest: str
    profile_values: dict[str, Any]
    draft_steps: int
    target: str
    target_digest: str
    temperature: float
    max_new_tokens: int
    engine: str
    engine_version: str
    classes: list[ClassCounts]
    scope: str = WORKLOAD  # "workload", "class:<name>" or "prompts:<file>"
    dataset_digest: str = ""
    sim_accept_len: float | None = None
    aux_layers: dict[str, Any] | None = None  # what the engine was handed and which layers it feeds
    endpoint: str = ""  # a server the user runs (not launched by the project)
    drafter_attested: bool = True  # the project launched the engine with the version's own files
    acc_pos: list[float] = field(default_factory=list)  # conditional acceptance by draft position, pooled
    # runs of this version whose record was unusable when this one was made: what this evaluation replaces
    acknowledged: list[str] = field(default_factory=list)
    trained_on: list[str] = field(default_factory=list)  # measured prompts its lineage was trained on, then
    target_precision: str = ""  # what the target ran at ("": a record from before it was recorded: float32)
    created: float = field(default_factory=time.time)
    format: int = FORMAT
    run_id: str = ""  # where it was read from; not part of the signed record

    @property
    def per_prompt(self) -> list[tuple[int, int]]:
        return [p for c in self.classes for p in c.per_prompt]

    @property
    def contexts(self) -> list[int] | None:
        """Each prompt's context length (prompt plus reply), in per_prompt's order; None when a class
        was measured without them (a record from before they were recorded)."""
        if any(len(c.contexts) != len(c.per_prompt) for c in self.classes):
            return None
        return [n for c in self.classes for n in c.contexts]

    @property
    def num_prompts(self) -> int:
        return sum(len(c.per_prompt) for c in self.classes)

    def parts(self) -> list[tuple[float, list[tuple[int, int]]]]:
        return [(c.share, c.per_prompt) for c in self.classes]

    @property
    def accept_len(self) -> float:
        """The mix: share-weighted over classes (one class: the pooled figure)."""
        return mix_accept_len(self.parts())

    def ci(self) -> tuple[float, float]:
        return mix_ci(self.parts())

    def payload(self) -> dict[str, Any]:
        """The record, plus the figures derived from it for a reader (a decision recomputes them)."""
        body = asdict(self)
        body.pop("run_id")
        lo, hi = self.ci()
        body["figures"] = {
            "accept_len": self.accept_len,
            "accept_len_ci_low": lo,
            "accept_len_ci_high": hi,
            "break_even_accept_len": self.profile_values["baseline_tps"]
            * (self.profile_values["verify_ms"] + self.draft_steps * self.profile_values["draft_step_ms"])
            / 1000,
        }
        return body

    def to_json(self) -> str:
        return json.dumps(signing.sign(self.payload()), indent=1, sort_keys=True, allow_nan=False)

    @property
    def key_id(self) -> str:
        return signing.load_key().id

    @classmethod
    def from_payload(cls, raw: dict[str, Any], run_id: str) -> EvidenceRecord:
        raw = {k: v for k, v in raw.items() if k in cls.__dataclass_fields__}
        raw["classes"] = [
            ClassCounts(**{**c, "per_prompt": [(int(t), int(n)) for t, n in c["per_prompt"]]}) for c in raw["classes"]
        ]
        raw["run_id"] = run_id
        return cls(**raw)

    def run_tags(self) -> dict[str, str]:
        """What the run list shows (the record itself is the artifact)."""
        return {
            TAG: f"{self.model}/{self.version}",
            "evidence.profile": self.profile,
            "evidence.profile_digest": self.profile_digest[:16],
            "evidence.scope": self.scope,
            "evidence.draft_steps": str(self.draft_steps),
            "evidence.target": self.target,
            "evidence.target_digest": self.target_digest[:16],
            "evidence.classes": ",".join(c.name for c in self.classes),
            "evidence.num_prompts": str(self.num_prompts),
            "evidence.engine": self.engine,
            "evidence.engine_version": self.engine_version,
            **({"evidence.endpoint": self.endpoint} if self.endpoint else {}),
            "evidence.temperature": f"{self.temperature:g}",
            "evidence.key_id": self.key_id,
        }


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


def log_record(rec: EvidenceRecord) -> None:
    """Into the active MLflow run: the whole signed record as an artifact, its conditions as tags."""
    import mlflow

    text = rec.to_json() + "\n"
    mlflow.log_text(text, EVIDENCE_FILE)
    mlflow.log_param(DIGEST_PARAM, hashlib.sha256(text.encode()).hexdigest())  # an overwrite is then seen
    mlflow.log_param(TAG, f"{rec.model}/{rec.version}")  # what finds it: a param can be neither changed nor removed
    mlflow.set_tags(rec.run_tags())


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


def recompute(c: Any, mv: Any, profile: Profile, dep: Any = None, holder: bool = False,
              decide_on: str | None = None) -> Evidence:  # fmt: skip
    """Everything the promotion rule depends on for one version, recomputed now: the shape gate from
    the version's headers against the profile's deployment target, the digest of every file the engine
    loads, the target's identity, and the least favourable standing record on the profile's pinned
    prompts. Tags are never read. Runs that are not evidence are ignored and said as findings.

    `holder`: the version holds the alias, and its figure is what a candidate must not fall short of: a lost
    record of it is a finding, never a block (a block would freeze production on it). `decide_on`: only that
    run's record decides (recertify's fresh measurement); every other run is at most a finding."""
    from drafter.analysis.compat import check_compat, drafter_facts, target_facts, verdict
    from registry import store
    from registry.deployment import deployment
    from registry.lineage import lineage, overlap

    dep = dep or deployment(profile)
    _, folder = store.version_folder(f"models:/{mv.name}/{mv.version}")
    gate = verdict(check_compat(drafter_facts(folder), target_facts(dep.target))) if dep.target else None
    files = store.drafter_files(folder)
    found = records_for(c, mv.name, str(mv.version), dep.trust)
    pinned = pinned_keys(profile)
    known = lineage(c, mv, folder=folder)
    remembered = {key for rec in found.records for key in rec.trained_on}  # signed when evaluated
    findings = found.findings()
    if decide_on is not None or holder:
        findings += [f"evaluation run {run} is not usable evidence ({why}): not counted" for run, _, why in
                     found.unusable]  # fmt: skip
        records = [r for r in found.records if decide_on is None or r.run_id == decide_on]
        found = Found(records, [], found.planted)
    contaminated = overlap(known.keys | remembered, pinned)
    matching, refused = [], []
    for rec in found.records:
        why = mismatches(rec, profile, dep.digest, files, pinned, (mv.name, str(mv.version)), dep.precision)
        (refused if why else matching).append((rec, why))
    standing = deciding([r for r, _ in matching], profile.eval_temperature == 0)
    # an unusable run stands in the way until an evaluation on the pinned prompts with the same engine, made
    # after it was found unusable, acknowledges it (greedy and sampled alike): an overwrite after the fact
    # blocks again, and one engine's evaluation never lifts another's lost record
    acknowledged = {(rec.engine, run) for rec, _ in matching for run in rec.acknowledged}
    blocking = [
        (run, why) for run, engine, why in found.unusable
        if not any(r == run and engine in ("", e) for e, r in acknowledged)
    ]  # fmt: skip
    # records match the profile as written; the break-even is the one this drafter's draft steps cost
    priced, pricing = priced_profile(profile, folder)
    points = priced.serving_points()
    ops = tuple((p.concurrency, _share(profile, p), break_even_accept_len(p)) for p in points if p.concurrency)
    basis = "; ".join(part for part in (dep.basis, pricing) if part)
    base = Evidence(str(mv.version), gate, dep.target or None, classes=(), min_share=profile.min_share,
                    class_floor=profile.class_floor, contaminated=contaminated, operating_points=ops,
                    basis=basis, lineage_problems=tuple(known.problems),
                    context_floors=profile.context_floors, findings=tuple(findings))  # fmt: skip
    if dep.refusal:
        return _with(base, note=dep.refusal)
    if blocking:
        run, why = blocking[-1]
        note = (
            f"evaluation run {run} is not usable evidence ({why}); it stands in the way until a newer "
            f"evaluation on {profile.name}'s pinned prompts"
        )
        return _with(base, note=note, unusable=True)
    if not standing:
        if not found.records:
            note = f"never evaluated (no evaluation record of v{mv.version})"
        else:
            same_name = [rw for rw in refused if rw[0].profile == profile.name]
            rec, why = (same_name or refused)[-1]
            note = (
                f"none of {len(found.records)} evaluation(s) counts for {profile.name}: latest run {rec.run_id}: "
                + "; ".join(why)
            )
        return _with(base, note=note)
    rec = min(standing, key=lambda r: r.ci()[0])
    lo, _ = rec.ci()
    be = break_even_accept_len(priced.binding())  # every class must clear the hardest operating point
    classes, _ = class_figures([(c.name, c.share, c.per_prompt) for c in rec.classes], be)
    note = (
        f"{rec.num_prompts} pinned prompts in {len(rec.classes)} class(es), {rec.draft_steps} draft steps, "
        f"engine {rec.engine}"
    )
    if len(standing) > 1:
        note += f"; the least favourable of {len(standing)} standing evaluations"
    contexts = rec.contexts
    by_context = tuple(context_figures(rec.per_prompt, contexts, be)) if contexts is not None else None
    return _with(base, accept_len=rec.accept_len, ci_low=lo, break_even=be, run_id=rec.run_id, note=note,
                 classes=tuple(classes), acc_pos=tuple(rec.acc_pos), contexts=by_context)  # fmt: skip


def priced_profile(profile: Profile, folder: Any) -> tuple[Profile, str]:
    """The profile priced for this drafter's draft step (serving.cost.priced_for), read from its config."""
    from drafter.analysis.step_cost import folder_step_cost
    from serving.cost import priced_for

    return priced_for(profile, folder_step_cost(folder).per_step)


def _share(profile: Profile, view: Profile) -> float:
    return next(op.share for op in profile.operating_points if op.concurrency == view.concurrency)


def _with(base: Evidence, **changes: Any) -> Evidence:
    from dataclasses import replace

    return replace(base, **changes)
