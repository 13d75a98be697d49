"""What a version was trained on, as far as the registry knows: the prompts of its fine-tuning datasets
and of everything it descends from, found by the weights' values, not by names or tags.

`make_data` records the identity of each prompt a dataset was captured from (serving.workload.prompt_key,
covered by the dataset's digest); `finetune` logs them with the run that registers a version
(`lineage/training_prompts.json`), with the content digest of the weights it produced and of the init it
started from (drafter.analysis.fingerprint.tensor_digest), the produced digest also as a param nobody can change,
and the file's sha256 beside it. A version's lineage is then every such run whose produced weights have
the version's digest, and, through each run's init digest, everything before it: a fine-tune from a
registry URI, a folder or a hub id, and weights re-saved or re-imported under another name, all lead back
to the same runs. The digest hashes values at one precision (a lossless re-save in float32 is the same
weights), and each run also keeps a sketch of its weights (drafter.analysis.sketch), so a near-copy (a little noise,
a lossy re-save: within 1% of the weights' norm) inherits the lineage of the weights it is near. An
evaluation on prompts the candidate (or an ancestor) was trained on measures memory,
not acceptance: such a candidate is refused on that evaluation set. A drafter imported from outside
carries no such record: the registry cannot know its training data.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LINEAGE_FILE = "lineage/training_prompts.json"
WEIGHTS_PARAM = "drafterops.weights"  # the content digest of the weights the run produced
SHAPES_PARAM = "drafterops.weights_shapes"  # their tensors' names and shapes: where near-copies are looked for
SHA_PARAM = "drafterops.lineage_sha256"  # the lineage file's sha256 as logged


def log_training_prompts(dataset: Any, weights_digest: str = "", init_digest: str = "", sketch: Any = None) -> None:
    """Into the active run (the one that registers the version): the dataset's prompt identities, the content
    digests of the weights produced and of the init they started from, and the weights' sketch
    (drafter.analysis.sketch: how near-copies of them are recognised)."""
    import mlflow

    keys = list(dataset.index.get("meta", {}).get("prompt_keys", []))
    record = {"dataset_digest": dataset.digest, "prompt_keys": keys, "weights_digest": weights_digest,
              "init_digest": init_digest, "sketch": sketch.to_json() if sketch is not None else None}  # fmt: skip
    text = json.dumps(record, indent=1)
    mlflow.log_text(text, LINEAGE_FILE)
    params = {SHA_PARAM: hashlib.sha256(text.encode()).hexdigest()}
    if weights_digest:
        params[WEIGHTS_PARAM] = weights_digest
    if sketch is not None:
        params[SHAPES_PARAM] = sketch.shapes
    mlflow.log_params(params)


@dataclass
class Lineage:
    keys: set[str] = field(default_factory=set)  # prompt identities it and its ancestors were trained on
    problems: list[str] = field(default_factory=list)  # lineage records that cannot be read as logged
    near: dict[str, float] = field(default_factory=dict)  # weights digest of a near-copy's source -> distance


def training_prompt_keys(c: Any, mv: Any, depth: int = 32, folder: Path | None = None) -> set[str]:
    """Prompt identities the version and its ancestors were fine-tuned on (empty when none is known)."""
    return lineage(c, mv, depth, folder).keys


def lineage(c: Any, mv: Any, depth: int = 256, folder: Path | None = None) -> Lineage:
    """The version's lineage: by its own runs and `parent` chain, and by the content of its weights."""
    from mlflow.exceptions import MlflowException

    from common.errors import BadInput
    from registry.access import store

    out = Lineage()
    seen: set[tuple[str, str]] = set()
    first, steps = mv, depth
    while mv is not None and steps > 0 and (mv.name, str(mv.version)) not in seen:
        seen.add((mv.name, str(mv.version)))
        steps -= 1
        for run_id in {getattr(mv, "run_id", None), _source_run(mv)} - {None, ""}:
            out.keys |= _keys_of_run(c, run_id)
        parent = mv.tags.get("parent", "")
        try:
            mv = store.get_version(parent, c) if parent.startswith("models:/") else None
        except (MlflowException, BadInput):  # a parent deleted since: the chain ends there
            mv = None
    if first is not None:
        try:
            folder = (
                folder
                or store.local_folder(c, first)
                or store.version_folder(f"models:/{first.name}/{first.version}")[1]
            )
        except (MlflowException, BadInput):
            return out
        _by_content(c, folder, depth, out)
    return out


def _by_content(c: Any, folder: Path, depth: int, out: Lineage) -> None:
    """Every run that produced these weights (by value at a canonical precision, or within drafter.analysis.sketch.NEAR
    of them), then every run that produced their init, and so on."""
    from common.errors import BadInput
    from drafter.analysis.fingerprint import legacy_tensor_digest, tensor_digest
    from drafter.analysis.sketch import weights_sketch
    from registry.access.runs import all_experiment_ids, runs_with_param

    try:
        frontier = [tensor_digest(folder), legacy_tensor_digest(folder)]
        sketch = weights_sketch(folder)
    except BadInput:
        return
    experiments = all_experiment_ids(c)
    for _run, record in _near_copies(c, experiments, sketch, out):
        out.keys |= set(record.get("prompt_keys", []))
        if record.get("init_digest"):
            frontier.append(str(record["init_digest"]))
    done: set[str] = set()
    while frontier:  # breadth first: a made-up chain of inits cannot push a real ancestor past the limit
        digest = frontier.pop(0)
        if digest in done:
            continue
        if len(done) >= depth:
            out.problems.append(f"the lineage goes past {depth} weights digests: not followed to its end")
            return
        done.add(digest)
        for run in runs_with_param(c, experiments, WEIGHTS_PARAM, digest):
            record = _lineage_record(c, run)
            if record is None:
                out.problems.append(f"the lineage record of run {run.info.run_id} is missing or was overwritten")
                continue
            out.keys |= set(record.get("prompt_keys", []))
            if record.get("init_digest"):
                frontier.append(str(record["init_digest"]))


def _near_copies(c: Any, experiments: list[str], sketch: Any, out: Lineage) -> list[tuple[Any, dict]]:
    """The lineage runs whose weights have these tensors' names and shapes and lie within NEAR of them."""
    from drafter.analysis.sketch import NEAR, Sketch, relative_distance
    from registry.access.runs import runs_with_param

    near = []
    for run in runs_with_param(c, experiments, SHAPES_PARAM, sketch.shapes):
        record = _lineage_record(c, run)
        theirs = Sketch.from_json((record or {}).get("sketch"))
        if record is None or theirs is None:
            continue  # a record that cannot be read is reported where it is found by its digest
        distance = relative_distance(theirs, sketch)
        if distance <= NEAR:
            near.append((run, record))
            if record.get("weights_digest") not in out.near:
                out.near[str(record.get("weights_digest"))] = distance
    return near


def _lineage_record(c: Any, run: Any) -> dict | None:
    """The run's lineage record when its bytes are those it logged (None: missing or overwritten)."""
    from registry.access.runs import artifact_bytes

    raw = artifact_bytes(c, run, LINEAGE_FILE)
    if raw is None or hashlib.sha256(raw).hexdigest() != run.data.params.get(SHA_PARAM):
        return None
    return _as_record(raw)


def _as_record(raw: bytes | None) -> dict | None:
    try:
        record = json.loads(raw) if raw is not None else None
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _source_run(mv: Any) -> str | None:
    source = mv.tags.get("source", "")
    return source.removeprefix("run:") if source.startswith("run:") else None


def _keys_of_run(c: Any, run_id: str) -> set[str]:
    from registry.access.runs import artifact_bytes

    record = _as_record(artifact_bytes(c, run_id, LINEAGE_FILE)) or {}
    keys = record.get("prompt_keys", [])
    return set(keys) if isinstance(keys, list) else set()


def overlap(trained: set[str], pinned: dict[str, list[str]]) -> dict[str, int]:
    """Per class: how many of its pinned prompts the lineage was trained on."""
    return {name: n for name, keys in pinned.items() if (n := sum(k in trained for k in keys))}
