"""Alias moves with an audit trail. Aliases are the source of truth; the legacy stage is mirrored.

Every move is one run in the `drafterops-audit` experiment (who, when, which alias, from which
version to which, why), so the MLflow UI lists the history and nothing is lost to tag size limits."""

from __future__ import annotations

import contextlib
import getpass
import hashlib
import json
import time
import warnings
from typing import Any

from registry.access import naming


def _audit_experiment(c: Any) -> str:
    """The audit experiment, made on first use; one deleted by hand is restored, and said so: a decision is
    never written into a deleted experiment (nor lost with one)."""
    exp = c.get_experiment_by_name(naming.AUDIT_EXPERIMENT)
    if exp is not None and exp.lifecycle_stage == "deleted":
        import sys

        c.restore_experiment(exp.experiment_id)
        print(f"drafterops: the audit experiment {naming.AUDIT_EXPERIMENT} had been deleted; restored, since "
              "every decision is recorded there", file=sys.stderr)  # fmt: skip
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(naming.AUDIT_EXPERIMENT)
    except Exception:  # created meanwhile by a concurrent decision
        return c.get_experiment_by_name(naming.AUDIT_EXPERIMENT).experiment_id


def current_alias_version(c: Any, name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(c.get_model_version_by_alias(name, alias).version)
    except MlflowException:
        return None


def record(
    c: Any,
    name: str,
    version: str,
    decision: str,
    reasons: dict[str, Any] | str,
    summary: str | None = None,
    files: dict[str, str] | None = None,
    params: dict[str, str] | None = None,
    **extra: str,
) -> str:
    """One audit run for a decision (alias move, refusal, gate result); `summary` is the one-line
    reason the runs list shows (else one is made from `reasons`)."""
    exp = _audit_experiment(c)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    tags = {
        "model": name,
        "version": str(version),
        "decision": decision,
        "actor": getpass.getuser(),
        "time": when,
        "mlflow.runName": f"{decision} {name}/v{version}",
        **{k: str(v) if v not in (None, "") else "none" for k, v in extra.items()},
    }
    text = reasons if isinstance(reasons, str) else json.dumps(reasons, indent=2, default=str)
    # readable where the UI shows runs: the reason in the list, the whole text as the description
    tags["reason"] = _one_line(summary or reasons)
    tags["mlflow.note.content"] = text if isinstance(reasons, str) else f"```json\n{text}\n```"
    run = c.create_run(exp, tags=tags)
    c.log_text(run.info.run_id, text, "reasons.json" if not isinstance(reasons, str) else "reasons.md")
    for artifact, content in (files or {}).items():
        c.log_text(run.info.run_id, content, artifact)
    for key, value in (params or {}).items():  # set once, never changed: what finds the run later
        c.log_param(run.info.run_id, key, value)
    c.set_terminated(run.info.run_id)
    return run.info.run_id


def _one_line(reasons: dict[str, Any] | str, limit: int = 500) -> str:
    if isinstance(reasons, str):
        line = " ".join(reasons.split())
    else:
        line = str(reasons.get("reason") or reasons.get("why") or "; ".join(f"{k}: {v}" for k, v in reasons.items()))
    return line if len(line) <= limit else line[: limit - 1] + "…"


def move_alias(
    c: Any, name: str, alias: str, version: str | None, reason: str, by_promote: bool = False, evidence_run: str = "",
    terms: str = "", claim: Any = None, figure: dict[str, Any] | None = None,
) -> str | None:  # fmt: skip
    """Point `alias` at `version` (None: clear it), mirror the legacy stage, mark the replaced version;
    returns it. Serving aliases move only when the promotion rule said yes (`by_promote`), and then with a
    signed sanction (registry.ledger.sanction) written before the alias moves, chained after the head the decision
    read and claimed (registry.ledger.succession: `claim`, whose head the sanction names as previous)."""
    if alias in naming.PROTECTED_ALIASES and not by_promote:
        naming.check_alias(alias)  # raises: no step but `promote` may move a serving alias
    previous = current_alias_version(c, name, alias)
    files, params = {}, {}
    if alias in naming.PROTECTED_ALIASES:
        from registry.ledger import sanction, signing, succession

        if claim is None or (claim.model, claim.alias) != (name, alias):
            raise ValueError(
                f"moving {name}@{alias} needs the claim on its chain's next link (registry.ledger.succession)"
            )
        if not succession.still_mine(c, claim):  # taken over after this process stalled: write nothing
            raise succession.Lost(f"the claim on {name}@{alias} was taken over while this decision stalled")
        mv = None if version is None else c.get_model_version(name, str(version))
        signed = sanction.payload(c, c.get_registered_model(name), mv, alias, evidence_run, reason, terms, claim.head,
                                  figure)  # fmt: skip
        files[sanction.SANCTION_FILE] = text = json.dumps(signed, indent=1)
        params = {sanction.PARAM: sanction.param_value(name, alias),
                  sanction.DIGEST_PARAM: hashlib.sha256(text.encode()).hexdigest(),
                  **signing.as_param(signed, sanction.RECORD_PARAM)}  # fmt: skip
    record(c, name, version or "none", f"alias:{alias}", reason, files=files, params=params, alias=alias,
           previous=previous or "none")  # fmt: skip
    if version is None:
        if previous is not None:
            c.delete_registered_model_alias(name, alias)
        stage = naming.LEGACY_STAGE.get(alias)
        if stage and previous:
            mirror_stage(c, name, previous, "Archived")
    else:
        c.set_registered_model_alias(name, alias, str(version))
        stage = naming.LEGACY_STAGE.get(alias)
        if stage:
            mirror_stage(c, name, str(version), stage)
    if previous and previous != str(version):
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        by = f"by version {version}" if version is not None else "(cleared)"
        c.set_model_version_tag(name, previous, f"replaced.{alias}", f"{when} {by}")
    from registry.access.describe import refresh_model_page

    refresh_model_page(c, name)
    return previous


def record_once(c: Any, once: str, name: str, version: str, decision: str, reasons: str, **extra: str) -> bool:
    """An audit line written once for `once` (a param on the run, which nobody can change): a guard that
    reconciles every minute says a loss once, not every minute. False when it was already said."""
    from registry.access.runs import runs_with_param

    if runs_with_param(c, [_audit_experiment(c)], ONCE_PARAM, once):
        return False
    record(c, name, version, decision, reasons, params={ONCE_PARAM: once}, **extra)
    return True


ONCE_PARAM = "drafterops.once"


def mirror_stage(c: Any, name: str, version: str, stage: str) -> None:
    """Legacy stages (deprecated in MLflow 3): mirrored quietly while the server supports them."""
    with warnings.catch_warnings(), contextlib.suppress(Exception):
        warnings.simplefilter("ignore")
        c.transition_model_version_stage(name, version, stage, archive_existing_versions=True)
