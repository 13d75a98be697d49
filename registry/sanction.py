"""Where `promote` put each serving alias, in records nobody else can write.

When `promote` moves a serving alias it writes a sanction: the registered model's identity (its name and
the creation time the server stamped, which no API call changes; a renamed model or a new one under the
old name is another model), the alias, the version and that version's own creation time, the evaluation
run and the decision. It is signed with the evidence key (registry.signing) and kept as `sanction.json`
in the decision's audit run. The sanctioned holder of an alias is the newest valid sanction (by the time signed
into it) for this very model whose version still exists; audit runs made by hand, with the right tags
or not, sanction nothing, and a copy of an old sanction in a new run is no newer than the original.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from registry import naming, signing

SANCTION_FILE = "sanction.json"


def version_files(c: Any, mv: Any) -> dict[str, str]:
    """sha256 of every file an engine loads from the version, as the registry holds them now."""
    from registry import store

    folder = store.local_folder(c, mv) or store.download_version(f"models:/{mv.name}/{mv.version}").folder
    return store.drafter_files(folder)


def model_identity(rm: Any) -> dict[str, Any]:
    return {"name": rm.name, "created": int(rm.creation_timestamp or 0)}


def payload(c: Any, rm: Any, mv: Any, alias: str, evidence_run: str, reason: str, terms: str = "") -> dict[str, Any]:
    """The signed sanction for moving `alias` of `rm` to `mv`: what was decided, on which files."""
    return signing.sign(
        {
            "kind": "sanction",
            "model": model_identity(rm),
            "alias": alias,
            "version": str(mv.version),
            "version_created": int(mv.creation_timestamp or 0),
            "files": version_files(c, mv),
            "terms": terms,  # the profile (name and digest) and margin the decision was taken under
            "evidence_run": evidence_run,
            "reason": reason,
            "at": time.time(),  # the order of sanctions is theirs, not their runs' (a copy made later is no newer)
        }
    )


@dataclass(frozen=True)
class Holder:
    """The sanctioned holder of an alias (version None: no valid sanction for a version that exists)."""

    version: str | None
    run_id: str | None = None
    deleted: tuple[str, ...] = ()  # newer sanctioned versions that no longer exist
    ignored: int = 0  # audit runs that claimed a move but carry no valid sanction for this model
    changed: tuple[str, ...] = ()  # newer sanctioned versions whose files changed since their sanction


def holder(c: Any, name: str, alias: str) -> Holder:
    """The newest valid sanction of `alias` for the registered model now called `name`."""
    from mlflow.entities import ViewType
    from mlflow.exceptions import MlflowException

    exp = c.get_experiment_by_name(naming.AUDIT_EXPERIMENT)
    if exp is None:
        return Holder(None)
    rm = c.get_registered_model(name)
    identity = model_identity(rm)
    q = naming.quote_filter_value
    runs = c.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.model = {q(name)} and tags.decision = {q(f'alias:{alias}')}",
        run_view_type=ViewType.ALL,
        order_by=["attributes.start_time DESC"],
        max_results=500,
    )
    valid, ignored = [], 0
    for run in runs:
        record = read(c, run.info.run_id)
        if _sanctions(record, identity, alias):
            valid.append((float(record.get("at", 0.0)), run.info.run_id, record))
        else:
            ignored += 1
    deleted, changed = [], []
    for _, run_id, record in sorted(valid, key=lambda v: v[0], reverse=True):
        version = str(record.get("version"))
        try:
            mv = c.get_model_version(name, version)
        except MlflowException:
            if version not in deleted:
                deleted.append(version)
            continue
        if version in deleted or version in changed:
            continue  # another copy of a sanction already judged
        if int(mv.creation_timestamp or 0) != record.get("version_created"):
            deleted.append(version)  # the number was reused by another version
            continue
        if record.get("files") != version_files(c, mv):
            changed.append(version)  # what would be served is not what was decided on
            continue
        return Holder(version, run_id, tuple(deleted), ignored, tuple(changed))
    return Holder(None, None, tuple(deleted), ignored, tuple(changed))


def _sanctions(record: dict[str, Any] | None, identity: dict[str, Any], alias: str) -> bool:
    """A signed sanction of this alias for this very model (not a copy from another model or alias)."""
    return (
        record is not None
        and signing.verify(record) is None
        and record.get("kind") == "sanction"
        and record.get("model") == identity
        and record.get("alias") == alias
    )


def read(c: Any, run_id: str) -> dict[str, Any] | None:
    """The sanction an audit run holds, unverified (None: none readable); `holder` verifies it."""
    from mlflow.exceptions import MlflowException

    with tempfile.TemporaryDirectory() as tmp:
        try:
            raw = json.loads(Path(c.download_artifacts(run_id, SANCTION_FILE, tmp)).read_text())
        except (MlflowException, OSError, ValueError):
            return None
    return raw if isinstance(raw, dict) else None
