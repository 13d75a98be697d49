"""Evaluation records made by hand, as anyone with store access (or an evaluator's key) can make them: a run
with the genuine tags and params and a record written offline. Every identity in it (profile digest, pinned
prompts, drafter files, target digest) is computable by anyone; only the signature needs a key."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

PerPrompt = Callable[[str, list[str]], list[tuple[int, int]]]  # (class, its prompt keys) -> (tokens, cycles) each


def forge_record(c, name: str, version: str, profile_path: Path, per_prompt: PerPrompt | None = None,
                 sign: bool = True, key=None, engine_version: str = "forged") -> str:  # fmt: skip
    """A run holding an evaluation record of models:/name/version on the profile's pinned prompts (per class),
    signed with `key` (None: this process's signing key) unless `sign` is False; its run id."""
    from drafter.analysis.fingerprint import target_digest
    from drafter.model.target import target_precision
    from registry.access import store
    from registry.ledger import signing
    from registry.ledger.evidence.record import DIGEST_PARAM, EVIDENCE_FILE, TAG, ClassCounts, EvidenceRecord
    from registry.ledger.evidence.verify import pinned_keys
    from serving.profile import load_profile

    profile = load_profile(str(profile_path))
    folder = Path(c.get_model_version_download_uri(name, version).removeprefix("file://"))
    per_prompt = per_prompt or (lambda _cls, keys: [(3, 1)] * len(keys))
    pinned = pinned_keys(profile)
    classes = [ClassCounts(w.name, w.share, w.sha256, pinned[w.name], per_prompt(w.name, pinned[w.name]))
               for w in profile.workload]  # fmt: skip
    rec = EvidenceRecord(
        name, version, store.drafter_files(folder), store.weights_sha256(store.file_hashes(folder)), profile.name,
        profile.digest, profile.values(), profile.draft_steps, str(profile.target), target_digest(profile.target),
        profile.eval_temperature, profile.eval_max_new_tokens, "in-process", engine_version, classes,
        target_precision=target_precision(str(profile.target)),
    )  # fmt: skip
    payload = signing.sign(rec.payload(), key) if sign else rec.payload()
    text = json.dumps(payload)
    run = c.create_run(c.get_experiment_by_name("Default").experiment_id, tags=rec.run_tags())
    c.log_param(run.info.run_id, TAG, f"{name}/{version}")  # the param evidence is found by, as evaluate logs it
    c.log_text(run.info.run_id, text, EVIDENCE_FILE)
    c.log_param(run.info.run_id, DIGEST_PARAM, hashlib.sha256(text.encode()).hexdigest())
    c.set_terminated(run.info.run_id, "FINISHED")
    return run.info.run_id


def plant_lineage(c, folder: Path, prompt_keys: list[str]) -> str:
    """A run as `finetune` logs one for the weights in `folder`: trained on `prompt_keys` (lineage records are not
    signed: anyone can claim a drafter was trained on something, which only ever holds it back)."""
    from drafter.analysis.fingerprint import tensor_digest
    from registry.ledger.lineage import LINEAGE_FILE, SHA_PARAM, WEIGHTS_PARAM

    text = json.dumps({"dataset_digest": "planted", "prompt_keys": prompt_keys, "weights_digest": tensor_digest(folder),
                       "init_digest": ""})  # fmt: skip
    run = c.create_run(c.get_experiment_by_name("Default").experiment_id)
    c.log_text(run.info.run_id, text, LINEAGE_FILE)
    c.log_param(run.info.run_id, WEIGHTS_PARAM, tensor_digest(folder))
    c.log_param(run.info.run_id, SHA_PARAM, hashlib.sha256(text.encode()).hexdigest())
    c.set_terminated(run.info.run_id)
    return run.info.run_id
