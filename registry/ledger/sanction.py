"""Where `promote` put each serving alias, in a chain of signed records nobody else can write or re-point.

When `promote` (or `recertify`) moves a serving alias it writes a sanction: the registered model's
identity (its name and the creation time the server stamped, which no API call changes), the alias, the
version (None: the alias was cleared on purpose) and that version's creation time and files, the
evaluation run, the decision, and the digest of the sanction it follows (`previous`), so the sanctions of
one model and alias form a chain. It is signed with the promoter's Ed25519 key (registry.ledger.signing, a key
the trust file lists under trusted_promoters) and kept as `sanction.json` in the decision's audit run,
found by a param (`drafterops.sanction`, which nobody can change) and checked against the sha256 logged
beside it; the signed record is also kept as a param of that run (`drafterops.sanction_record`), which
nobody can change, so an overwritten or deleted file loses no link (a clearing stays a clearing). The holder
of an alias is read from the chain's head: never from tags, never from a search window, so junk runs,
edited tags and copies of old sanctions move nothing.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from registry.ledger import signing

SANCTION_FILE = "sanction.json"
PARAM = "drafterops.sanction"  # "<model>@<alias>" on the audit run: what finds it (a param nobody can change)
DIGEST_PARAM = "drafterops.sanction_sha256"  # the file's sha256 as written: an overwrite is then seen
RECORD_PARAM = "drafterops.sanction_record"  # the signed record itself, where it fits a param: nobody can change it


def version_files(c: Any, mv: Any) -> dict[str, str]:
    """sha256 of every file an engine loads from the version, as the registry holds them now."""
    from registry.access import store

    folder = store.local_folder(c, mv) or store.download_version(f"models:/{mv.name}/{mv.version}").folder
    return store.drafter_files(folder)


def model_identity(rm: Any) -> dict[str, Any]:
    return {"name": rm.name, "created": int(rm.creation_timestamp or 0)}


def payload(c: Any, rm: Any, mv: Any | None, alias: str, evidence_run: str, reason: str, terms: str = "",
            previous: str = "", figure: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """The signed sanction for moving `alias` of `rm` to `mv` (None: clearing it), after `previous`; `figure`
    is what the version was promoted on (its accept_len and the profile's digest), which a later candidate
    must not fall short of even when the version's evaluation runs can no longer be read."""
    return signing.sign(
        {
            "kind": "sanction",
            "model": model_identity(rm),
            "alias": alias,
            "version": None if mv is None else str(mv.version),
            "version_created": None if mv is None else int(mv.creation_timestamp or 0),
            "files": {} if mv is None else version_files(c, mv),
            "terms": terms,  # the profile (name and digest) and margin the decision was taken under
            "evidence_run": evidence_run,
            "reason": reason,
            "previous": previous,  # the digest of the sanction this one follows ("" for the first)
            "figure": figure or {},
            "at": time.time(),
        }
    )


def param_value(name: str, alias: str) -> str:
    return f"{name}@{alias}"


@dataclass(frozen=True)
class Holder:
    """The sanctioned holder of an alias (version None: the chain puts nothing there that still exists)."""

    version: str | None
    run_id: str | None = None
    deleted: tuple[str, ...] = ()  # sanctioned versions, newer in the chain, that no longer exist
    changed: tuple[str, ...] = ()  # newer sanctioned versions whose files changed since their sanction
    head: str = ""  # the digest of the chain's head: what the next sanction names as previous
    findings: tuple[str, ...] = ()  # runs that claim a sanction and do not hold a valid one, forks, lost links
    damaged: bool = False  # a sanction file was overwritten or deleted: held at the newest verifiable head
    record: dict[str, Any] | None = None  # the holder's own sanction (what it was promoted on)


def holder(c: Any, name: str, alias: str, trust: Any = None) -> Holder:
    """Where the chain of signed sanctions of `alias` for the model now called `name` puts it: the newest
    verifiable head, walked back past versions deleted or changed since. A link that cannot be read (its
    file overwritten or deleted) is a finding; the links around it still hold, so one bad file never leaves
    an alias unguarded, and the next signed sanction mends the chain."""
    rm = c.get_registered_model(name)
    valid, findings, tampered = _chain_links(c, rm, alias, trust)
    named = {r.get("previous") for _, r in valid.values()}
    heads = [d for d in valid if d not in named]
    if len(heads) > 1:
        findings.append(
            f"the chain reads as {len(heads)} pieces around its unreadable link(s); the newest signed head is held"
            if tampered else f"the chain forks into {len(heads)} heads; the newest signed one is read"
        )  # fmt: skip
    newest = sorted(valid, key=lambda d: _at(valid[d][1]), reverse=True)
    head = max(heads, key=lambda d: _at(valid[d][1]), default="")
    deleted, changed, seen = [], [], set()
    digest = head
    while digest:
        seen.add(digest)
        run_id, record = valid[digest]
        version = record.get("version")
        done = _held(c, name, version, record)
        if done == "cleared":  # cleared on purpose (recertify demoted it, say): nothing holds the alias
            return Holder(None, run_id, tuple(deleted), tuple(changed), head, tuple(findings), bool(tampered), record)
        if done == "held":
            return Holder(str(version), run_id, tuple(deleted), tuple(changed), head, tuple(findings),
                          bool(tampered), record)  # fmt: skip
        (deleted if done == "deleted" else changed).append(str(version))
        digest = record.get("previous", "")
        if digest not in valid or digest in seen:  # a link lost before it: the newest older one still signed
            older = [d for d in newest if d not in seen and _at(valid[d][1]) < _at(record)]
            digest = older[0] if older and digest else ""
    return Holder(None, None, tuple(deleted), tuple(changed), head, tuple(findings), bool(tampered))


def _at(record: dict[str, Any]) -> float:
    value = record.get("at", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def _held(c: Any, name: str, version: Any, record: dict[str, Any]) -> str:
    """What one sanction says now: `cleared`, `held` (its version exists, as promoted), `deleted`, `changed`."""
    from mlflow.exceptions import MlflowException

    if version is None:
        return "cleared"
    try:
        mv = c.get_model_version(name, str(version))
    except MlflowException:
        return "deleted"
    if int(mv.creation_timestamp or 0) != record.get("version_created"):
        return "deleted"  # the number was reused by another version
    if record.get("files") != _files_or_none(c, mv):
        return "changed"  # what would be served is not what was decided on
    return "held"


def links(c: Any, name: str, alias: str, trust: Any = None) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every valid sanction of `alias` for the model now called `name`, by digest: (audit run id, record)."""
    return _chain_links(c, c.get_registered_model(name), alias, trust)[0]


def _files_or_none(c: Any, mv: Any) -> dict[str, str] | None:
    """The version's files as they are now; None when they cannot be read (a config.json that is no longer
    JSON, say): such a version is not what was decided on."""
    from common.errors import BadInput

    try:
        return version_files(c, mv)
    except BadInput:
        return None


def _chain_links(c: Any, rm: Any, alias: str, trust: Any) -> tuple[dict, list[str], list[str]]:
    """Every valid sanction of this model and alias by digest (run id, record); what else claimed to be one."""
    from registry.access.runs import all_experiment_ids, runs_with_param
    from registry.ledger.trust import load_trust

    # every experiment, deleted ones too: the audit experiment renamed or deleted by hand hides no sanction
    experiments = all_experiment_ids(c)
    identity = model_identity(rm)
    trust = trust or load_trust()
    valid: dict[str, tuple[str, dict]] = {}
    findings, tampered, junk = [], [], 0
    for run in runs_with_param(c, experiments, PARAM, param_value(rm.name, alias)):
        logged = run.data.params.get(DIGEST_PARAM)
        if not logged:  # `audit.move_alias` logs it with every sanction: without it, a run made by hand
            junk += 1
            continue
        raw = read_bytes(c, run)
        if raw is None or logged != hashlib.sha256(raw).hexdigest():  # deleted or overwritten: a link may be gone
            what = "is missing" if raw is None else "was overwritten after it was written"
            kept = _parse((run.data.params.get(RECORD_PARAM) or "").encode() or None)
            if kept is None or _refusal(kept, identity, alias, trust):
                tampered.append(run.info.run_id)
                findings.append(f"audit run {run.info.run_id}: its sanction.json {what}")
                continue
            findings.append(f"audit run {run.info.run_id}: its sanction.json {what}; the link is read from the "
                            "signed copy its run keeps as a param")  # fmt: skip
            raw = json.dumps(kept).encode()
        record = _parse(raw)
        why = _refusal(record, identity, alias, trust)
        if why:
            junk += 1
            continue
        valid.setdefault(signing.digest(record), (run.info.run_id, record))  # a copy is the same link
    if junk:
        findings.append(f"{junk} audit run(s) claim a sanction of `{alias}` and hold no valid one (ignored)")
    return valid, findings, tampered


def _refusal(record: dict[str, Any] | None, identity: dict[str, Any], alias: str, trust: Any) -> str | None:
    """Why a record is not a sanction of this alias for this very model (None: it is)."""
    from registry.ledger.trust import PROMOTER

    if record is None:
        return "no sanction"
    why = signing.verify(record, PROMOTER, trust)
    if why:
        return why
    if record.get("kind") != "sanction" or record.get("model") != identity or record.get("alias") != alias:
        return "a sanction of another model or alias"
    return None


def _parse(raw: bytes | None) -> dict[str, Any] | None:
    try:
        record = json.loads(raw) if raw is not None else None
    except (ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def read_bytes(c: Any, run: Any) -> bytes | None:
    """The sanction file an audit run (a Run, or its id) holds, as stored (None: none readable)."""
    from registry.access.runs import artifact_bytes

    return artifact_bytes(c, run, SANCTION_FILE)


def read(c: Any, run_id: str) -> dict[str, Any] | None:
    """The sanction an audit run holds, unverified (None: none readable); `holder` verifies it."""
    return _parse(read_bytes(c, run_id))
