"""Evaluation evidence: each evaluation kept whole, bound to the conditions it was measured under.

An evaluate run carries `evidence.json` (the record below, with the per-prompt cycle counts that
accept_len and its interval are computed from) and run tags that the MLflow UI lists. Nothing is
overwritten: every evaluation stays a record; the version's `eval.<profile>.*` tags only point at the
latest one for the UI. A decision reads the records, never the tags, and recomputes what it depends
on: accept_len and its interval from the per-prompt counts, break-even from the profile it loads, the
target's identity from the target, the weights' identity from the version's files.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from drafter.cost import Profile, break_even_accept_len
from drafter.evaluation import bootstrap_ci, pooled_accept_len
from registry.policy import Evidence

EVIDENCE_FILE = "evidence.json"
TAG = "drafterops.evidence"  # on the evaluate run: "<model>/<version>"
ENGINES_BOUND_TO_WEIGHTS = ("in-process", "vllm", "sglang")  # engines the project launched itself


@dataclass
class EvidenceRecord:
    model: str
    version: str
    weights_sha256: str
    profile: str
    profile_digest: str
    profile_values: dict[str, Any]
    draft_steps: int
    target: str
    target_digest: str
    prompts: str
    prompts_digest: str
    num_prompts: int
    temperature: float
    max_new_tokens: int
    engine: str
    engine_version: str
    per_prompt: list[tuple[int, int]]  # (sum of accepted + 1 over its verify cycles, verify cycles) per prompt
    dataset_digest: str = ""
    sim_accept_len: float | None = None
    aux_layers: dict[str, Any] | None = None  # what the engine was handed and which layers it feeds
    endpoint: str = ""  # a server the user runs (not launched by the project)
    drafter_attested: bool = True  # the project launched the engine with the version's own files
    run_id: str = ""

    @property
    def accept_len(self) -> float:
        return pooled_accept_len(self.per_prompt)

    def ci(self) -> tuple[float, float]:
        return bootstrap_ci(self.per_prompt)

    def to_json(self) -> str:
        """The record, plus the figures derived from it for a reader (a decision recomputes them)."""
        lo, hi = self.ci()
        figures = {"accept_len": self.accept_len, "accept_len_ci_low": lo, "accept_len_ci_high": hi}
        figures["break_even_accept_len"] = break_even_accept_len(Profile(**self.profile_values))
        return json.dumps({**asdict(self), "figures": figures}, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, run_id: str) -> EvidenceRecord:
        raw = json.loads(text)
        raw["per_prompt"] = [(int(t), int(c)) for t, c in raw["per_prompt"]]
        raw["run_id"] = run_id
        return cls(**{k: v for k, v in raw.items() if k in cls.__dataclass_fields__})

    def run_tags(self) -> dict[str, str]:
        """What the run list shows (the record itself is the artifact)."""
        return {
            TAG: f"{self.model}/{self.version}",
            "evidence.profile": self.profile,
            "evidence.profile_digest": self.profile_digest[:16],
            "evidence.draft_steps": str(self.draft_steps),
            "evidence.target": self.target,
            "evidence.target_digest": self.target_digest[:16],
            "evidence.prompts_digest": self.prompts_digest[:16],
            "evidence.num_prompts": str(self.num_prompts),
            "evidence.engine": self.engine,
            "evidence.engine_version": self.engine_version,
            **({"evidence.endpoint": self.endpoint} if self.endpoint else {}),
            "evidence.temperature": f"{self.temperature:g}",
        }


def mismatches(rec: EvidenceRecord, profile: Profile, target_digest: str, weights_sha256: str) -> list[str]:
    """Why a record cannot stand as evidence for this profile, target and weights (empty: it can)."""
    why = []
    if rec.profile_digest != profile.digest:
        why.append(f"measured under other profile values than {profile.name}'s")
    if rec.draft_steps != profile.draft_steps:
        why.append(f"{rec.draft_steps} draft steps, the profile uses {profile.draft_steps}")
    if rec.target_digest != target_digest:
        why.append(f"measured on another target ({rec.target})")
    if rec.num_prompts < profile.min_prompts:
        why.append(f"{rec.num_prompts} prompts, the profile needs {profile.min_prompts}")
    if rec.weights_sha256 != weights_sha256:
        why.append("measured on other weights than the version holds")
    if rec.engine not in ENGINES_BOUND_TO_WEIGHTS:
        why.append(f"engine {rec.engine!r} cannot prove which drafter it ran")
    elif rec.endpoint or not rec.drafter_attested:
        why.append(
            f"measured on a server the project did not launch ({rec.endpoint or 'unknown'}), "
            "which does not say which drafter it runs"
        )
    if rec.aux_layers and not rec.aux_layers.get("matches_training", True):
        why.append("the engine fed the drafter other target layers than it was trained on")
    return why


def log_record(rec: EvidenceRecord) -> None:
    """Into the active MLflow run: the whole record as an artifact, its conditions as tags."""
    import mlflow

    mlflow.log_text(rec.to_json() + "\n", EVIDENCE_FILE)
    mlflow.set_tags(rec.run_tags())


def records_for(c: Any, model: str, version: str) -> list[EvidenceRecord]:
    """Every finished evaluation of this version, from every experiment, oldest first."""
    from mlflow.exceptions import MlflowException

    from registry.naming import quote_filter_value

    experiments = [e.experiment_id for e in c.search_experiments()]
    runs = c.search_runs(
        experiments,
        filter_string=f"tags.`{TAG}` = {quote_filter_value(f'{model}/{version}')} and attributes.status = 'FINISHED'",
        order_by=["attributes.start_time ASC"],
        max_results=1000,
    )
    out = []
    for run in runs:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = c.download_artifacts(run.info.run_id, EVIDENCE_FILE, tmp)
                out.append(EvidenceRecord.from_json(Path(path).read_text(), run.info.run_id))
            except (MlflowException, OSError, ValueError, KeyError, TypeError):
                continue  # a run that claims to be evidence but holds no readable record is none
    return out


def recompute(c: Any, mv: Any, profile: Profile, model_target: str) -> Evidence:
    """Everything the promotion rule depends on for one version, recomputed now: the shape gate from
    the version's headers against the registered target, the weights' sha256 from its files, the
    target's identity, and the least favourable evaluation record whose conditions match (so that no
    lucky run can be picked out of several). Tags are never read."""
    from drafter.compat import check_compat, drafter_facts, target_facts, verdict
    from drafter.fingerprint import target_digest
    from registry import store

    _, folder = store.version_folder(f"models:/{mv.name}/{mv.version}")
    gate = verdict(check_compat(drafter_facts(folder), target_facts(model_target)))
    sha = store.weights_sha256(store.file_hashes(folder))
    tdigest = target_digest(model_target)
    records = records_for(c, mv.name, str(mv.version))
    matching, refused = [], []
    for rec in records:
        why = mismatches(rec, profile, tdigest, sha)
        (refused if why else matching).append((rec, why))
    if not matching:
        if not records:
            note = f"never evaluated (no evaluation record of v{mv.version})"
        else:
            same_name = [rw for rw in refused if rw[0].profile == profile.name]
            rec, why = (same_name or refused)[-1]
            note = (
                f"none of {len(records)} evaluation(s) matches {profile.name}: latest run {rec.run_id}: "
                + "; ".join(why)
            )
        return Evidence(str(mv.version), gate, model_target, note=note)
    with_ci = [(rec, rec.ci()) for rec, _ in matching]
    rec, (lo, _) = min(with_ci, key=lambda rc: rc[1][0])
    note = f"{rec.num_prompts} prompts, {rec.draft_steps} draft steps, engine {rec.engine}"
    if len(matching) > 1:
        note += f"; the least favourable of {len(matching)} matching evaluations"
    return Evidence(
        str(mv.version), gate, model_target, rec.accept_len, lo, break_even_accept_len(profile), rec.run_id, note
    )
