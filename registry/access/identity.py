"""A drafter's identity by content: the values of its tensors (drafter.analysis.fingerprint.tensor_digest, whatever
file, metadata or lossless precision they were saved in) and its config.json in one canonical spelling. Two
drafters with the same weights and other aux layer ids are two drafters; a tag says nothing about either.
`compare` matches a folder to a registered version by this, never by the version's `sha256` tag (which any
client can edit)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from registry.access import naming


def content_identity(folder: Path) -> str:
    """sha256 over the weights' canonical digest and the canonical config.json digest."""
    from drafter.analysis.fingerprint import tensor_digest
    from registry.access.store import drafter_files

    config = drafter_files(folder)["config.json"]
    return hashlib.sha256(f"{tensor_digest(folder)}\n{config}".encode()).hexdigest()


def version_identity(c: Any, mv: Any) -> str:
    from registry.access import store

    folder = store.local_folder(c, mv) or store.download_version(f"models:/{mv.name}/{mv.version}").folder
    return content_identity(folder)


def find_by_content(c: Any, names: list[str], identity: str) -> Any:
    """The first complete version, of the registered models named, whose files have this identity (None: none)."""
    from mlflow.exceptions import MlflowException

    for name in dict.fromkeys(names):
        try:
            versions = c.search_model_versions(f"name={naming.quote_filter_value(name)}")
        except MlflowException:
            continue
        for mv in sorted(versions, key=lambda v: int(v.version)):
            if mv.tags.get(naming.TAG_COMPLETE) == "true" and version_identity(c, mv) == identity:
                return mv
    return None
