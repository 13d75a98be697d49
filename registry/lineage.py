"""What a version was trained on, as far as the registry knows: the prompts of its fine-tuning datasets
and of every version it descends from.

`make_data` records the identity of each prompt a dataset was captured from (serving.workload.prompt_key,
covered by the dataset's digest); `finetune` logs them with the run that registers a version
(`lineage/training_prompts.json`). An evaluation on prompts the candidate (or an ancestor) was trained on
measures memory, not acceptance: such a candidate is refused on that evaluation set. A drafter imported
from outside carries no such record: the registry cannot know its training data.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

LINEAGE_FILE = "lineage/training_prompts.json"


def log_training_prompts(dataset: Any) -> None:
    """Into the active run (the one that registers the version): the dataset's prompt identities."""
    import mlflow

    keys = list(dataset.index.get("meta", {}).get("prompt_keys", []))
    mlflow.log_dict({"dataset_digest": dataset.digest, "prompt_keys": keys}, LINEAGE_FILE)


def training_prompt_keys(c: Any, mv: Any, depth: int = 32) -> set[str]:
    """Prompt identities the version and its ancestors were fine-tuned on (empty when none is known).
    The run is the version's own (`run_id`, set by MLflow when the version was created, not a tag)."""
    from mlflow.exceptions import MlflowException

    from common.errors import BadInput
    from registry import store

    keys: set[str] = set()
    seen: set[tuple[str, str]] = set()
    while mv is not None and depth > 0 and (mv.name, str(mv.version)) not in seen:
        seen.add((mv.name, str(mv.version)))
        depth -= 1
        for run_id in {getattr(mv, "run_id", None), _source_run(mv)} - {None, ""}:
            keys |= _keys_of_run(c, run_id)
        parent = mv.tags.get("parent", "")
        try:
            mv = store.get_version(parent, c) if parent.startswith("models:/") else None
        except (MlflowException, BadInput):  # a parent deleted since: the chain ends there
            mv = None
    return keys


def _source_run(mv: Any) -> str | None:
    source = mv.tags.get("source", "")
    return source.removeprefix("run:") if source.startswith("run:") else None


def _keys_of_run(c: Any, run_id: str) -> set[str]:
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = c.download_artifacts(run_id, LINEAGE_FILE, tmp)
            return set(json.loads(Path(path).read_text()).get("prompt_keys", []))
        except (MlflowException, OSError, ValueError, AttributeError):
            return set()


def overlap(trained: set[str], pinned: dict[str, list[str]]) -> dict[str, int]:
    """Per class: how many of its pinned prompts the lineage was trained on."""
    return {name: n for name, keys in pinned.items() if (n := sum(k in trained for k in keys))}
