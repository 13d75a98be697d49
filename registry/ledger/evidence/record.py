"""The evidence record: what an evaluation measured, on what, signed by its evaluator; and how `evaluate`
logs it (the signed file, its digest in a param nobody can change, tags for the UI)."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from registry.ledger import signing
from serving.acceptance import Histograms, RequestHistogram, mix_per_request
from serving.workload import mix_accept_len, mix_ci

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
    histograms: list[list[int]] = field(default_factory=list)  # per prompt h(0..k) ([]: not recorded)


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

    def histograms(self) -> Histograms | None:
        """Every prompt's verify-step histogram with its class (None: a class was recorded without them)."""
        if any(len(c.histograms) != len(c.per_prompt) for c in self.classes):
            return None
        requests = tuple(RequestHistogram(tuple(h), c.name) for c in self.classes for h in c.histograms)
        return Histograms(self.draft_steps, requests)

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
            **({"accept_len_per_request": mix_per_request(self.parts())} if self.classes else {}),
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


def log_record(rec: EvidenceRecord) -> None:
    """Into the active MLflow run: the whole signed record as an artifact, its conditions as tags."""
    import mlflow

    text = rec.to_json() + "\n"
    mlflow.log_text(text, EVIDENCE_FILE)
    mlflow.log_param(DIGEST_PARAM, hashlib.sha256(text.encode()).hexdigest())  # an overwrite is then seen
    mlflow.log_param(TAG, f"{rec.model}/{rec.version}")  # what finds it: a param can be neither changed nor removed
    mlflow.set_tags(rec.run_tags())
