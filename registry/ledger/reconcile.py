"""One reconciliation of the registry with its sanctioned decisions, whatever happened while nobody watched.

For every registered model and every serving alias, the alias must point where the newest valid
sanction (registry.ledger.sanction) put it; the legacy stage mirrors it (Production/Staging on that version
alone). An alias moved by hand, a stage set by hand, a version deleted under an alias, a model renamed or
re-created under the old name: each is put back (or cleared when no sanctioned version exists) and each
action is audited. The guard runs this on start, on every webhook delivery and on a timer;
`python -m steps.guard --reconcile` runs it once (a cron job or a CI step where no webhook can be
installed); `promote`, `main` and `shape_gate` warn when they see a disagreement.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from registry.access import naming
from registry.ledger import audit, sanction


def disagreements(c: Any, name: str) -> list[str]:
    """Read-only: what differs from the sanctioned state for one model (one line each)."""
    out = []
    versions = {str(mv.version): mv for mv in c.search_model_versions(f"name={naming.quote_filter_value(name)}")}
    aliases = {a: str(v) for a, v in (c.get_registered_model(name).aliases or {}).items()}
    for alias in naming.PROTECTED_ALIASES:
        held = sanction.holder(c, name, alias).version
        current = aliases.get(alias)
        if current != held:
            out.append(
                f"{name}: `{alias}` points at {f'v{current}' if current else 'nothing'}, the last sanctioned "
                f"decision put it at {f'v{held}' if held else 'nothing'}"
            )
        stage = naming.LEGACY_STAGE[alias]
        staged = sorted(v for v, mv in versions.items() if mv.current_stage == stage)
        if staged != ([held] if held else []):
            out.append(f"{name}: legacy stage {stage} is on {staged or 'nothing'}, sanctioned {held or 'nothing'}")
    return out


def reconcile_model(c: Any, name: str, why: str = "reconcile") -> list[str]:
    """Restore one model's serving aliases and legacy stages; returns what was done."""
    actions = []
    for alias in naming.PROTECTED_ALIASES:
        held = sanction.holder(c, name, alias)
        current = audit.current_alias_version(c, name, alias)
        actions += _findings(c, name, alias, current, held, why)
        lost = f" (sanctioned v{', v'.join(held.deleted)} no longer exist{'s' if len(held.deleted) == 1 else ''})"
        lost = lost if held.deleted else ""
        if held.changed:
            lost += f" (the files of sanctioned v{', v'.join(held.changed)} changed since their promotion)"
        if current != held.version:
            if held.version is None:
                if current is not None:
                    c.delete_registered_model_alias(name, alias)
                action = (
                    f"cleared `{alias}` (was {f'v{current}' if current else 'nothing'}): no sanctioned version{lost}"
                )
            else:
                c.set_registered_model_alias(name, alias, held.version)
                action = f"`{alias}` back from {f'v{current}' if current else 'nothing'} to v{held.version}, where " \
                         f"promote put it{lost}"  # fmt: skip
            actions.append(_audit(c, name, alias, current, held, action, why))
        actions += _stages(c, name, alias, held, why)
    return actions


def _findings(c: Any, name: str, alias: str, current: str | None, held: sanction.Holder, why: str) -> list[str]:
    """Audit lines, each written once: a sanctioned version deleted (or changed) under the alias, an
    overwritten sanction, runs that claim to be sanctions and are not."""
    said = []
    lines = [f"sanctioned v{v} of `{alias}` no longer exists" for v in held.deleted]
    lines += [f"the files of sanctioned v{v} of `{alias}` changed since their promotion" for v in held.changed]
    lines += list(held.findings)
    if held.damaged:
        lines.append(
            f"`{alias}` held where the newest verifiable sanction puts it "
            f"({f'v{held.version}' if held.version else 'nothing'}): a newer link may be lost"
        )
    for line in lines:
        once = f"{name}@{alias}:{line}"[:500]
        if audit.record_once(c, once, name, current or "none", f"guard:finding:{alias}", f"{line}. Found by {why}.",
                             alias=alias, delivery=why):  # fmt: skip
            said.append(f"{name}: {line}")
    return said


def _stages(c: Any, name: str, alias: str, held: sanction.Holder, why: str) -> list[str]:
    stage = naming.LEGACY_STAGE[alias]
    done = []
    for mv in c.search_model_versions(f"name={naming.quote_filter_value(name)}"):
        v = str(mv.version)
        if mv.current_stage == stage and v != held.version:
            _transition(c, name, v, "Archived")
            done.append(_audit(c, name, alias, v, held, f"legacy stage {stage} taken off v{v} (not sanctioned)", why))
        elif v == held.version and mv.current_stage != stage:
            _transition(c, name, v, stage)
            done.append(_audit(c, name, alias, v, held, f"legacy stage {stage} restored on v{v}", why))
    return done


def _transition(c: Any, name: str, version: str, stage: str) -> None:
    with warnings.catch_warnings(), contextlib.suppress(Exception):  # stages are deprecated; mirrored while supported
        warnings.simplefilter("ignore")
        c.transition_model_version_stage(name, version, stage, archive_existing_versions=False)


def _audit(c: Any, name: str, alias: str, current: str | None, held: sanction.Holder, action: str, why: str) -> str:
    audit.record(
        c,
        name,
        current or "none",
        f"guard:revert:{alias}",
        f"{action}. Found by {why}.",
        alias=alias,
        attempted=current or "",
        restored=held.version or "",
        sanction_run=held.run_id or "",
        delivery=why,
    )
    return f"{name}: {action}"


def reconcile(c: Any, why: str = "reconcile") -> list[str]:
    """Every registered model, every serving alias, every legacy stage."""
    from registry.ledger.trust import load_trust

    load_trust()  # bad input, before anything moves, where nothing can be verified
    actions = []
    for rm in c.search_registered_models(max_results=1000):
        try:
            actions += reconcile_model(c, rm.name, why)
        except Exception as exc:  # one model that cannot be read leaves the others guarded
            what = str(exc).splitlines()[0][:200] if str(exc) else ""
            actions.append(f"{rm.name}: could not be reconciled ({exc.__class__.__name__}: {what})")
    return actions


def warn_if_disagreeing(c: Any, name: str, who: str) -> None:
    """One line on stderr when the registry disagrees with its sanctioned decisions."""
    import sys

    from mlflow.exceptions import MlflowException

    from common.errors import BadInput

    try:
        lines = disagreements(c, name)
    except (MlflowException, BadInput):  # nothing to verify sanctions with here: the guard's job, not this step's
        return
    if lines:
        print(
            f"{who}: warning: {lines[0]}" + (f" (and {len(lines) - 1} more)" if len(lines) > 1 else "")
            + "; run `python -m steps.guard --reconcile`",
            file=sys.stderr,
        )  # fmt: skip
