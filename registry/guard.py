"""The registry guards its own gate: a serving alias stays only where a `promote` decision put it.

MLflow's registry webhooks (`model_version_alias.created` / `.deleted`, HMAC-signed) tell the guard of
every alias move made through the tracking server: the UI's alias pencil, any API client, `promote`.
The sanctioned holder of a serving alias is the version named by the latest `alias:<alias>` record in
the audit trail that a `promote:<alias>:yes` decision for the same version accounts for. Any other
state is reverted to it (or the alias removed when there is none) and the revert is audited.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Any

from registry import audit, naming

SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_HEADER = "X-MLflow-Delivery-Id"
MAX_SKEW_S = 300  # older deliveries are replays
EVENTS = ("model_version_alias.created", "model_version_alias.deleted")


def signature_ok(secret: str, headers: dict[str, str], body: bytes, now: float | None = None) -> bool:
    """MLflow's scheme: v1,base64(HMAC-SHA256(secret, f"{delivery_id}.{timestamp}.{body}")), fresh."""
    sig, stamp, delivery = (headers.get(h, "") for h in (SIGNATURE_HEADER, TIMESTAMP_HEADER, DELIVERY_HEADER))
    if not (secret and sig.startswith("v1,") and stamp.isdigit() and delivery):
        return False
    if abs((now or time.time()) - int(stamp)) > MAX_SKEW_S:
        return False
    try:
        signed = f"{delivery}.{stamp}.".encode() + body
    except (TypeError, ValueError):
        return False
    expected = base64.b64encode(hmac.new(secret.encode(), signed, hashlib.sha256).digest()).decode()
    return hmac.compare_digest(expected, sig[3:])


@dataclass(frozen=True)
class Move:
    name: str
    alias: str
    version: str | None  # None for a deletion


def parse_event(payload: Any) -> Move | None:
    """The alias move a webhook payload reports, or None when it concerns no serving alias."""
    if not isinstance(payload, dict) or payload.get("entity") != "model_version_alias":
        return None
    data = payload.get("data")
    if not isinstance(data, dict):
        raise ValueError("payload has no 'data' object")
    name, alias = data.get("name"), data.get("alias")
    if not isinstance(name, str) or not isinstance(alias, str):
        raise ValueError("payload 'data' needs string 'name' and 'alias'")
    if alias not in naming.PROTECTED_ALIASES:
        return None
    naming.check_name(name, "payload name")
    version = data.get("version") if payload.get("action") == "created" else None
    return Move(name, alias, str(version) if version is not None else None)


def sanctioned_holder(c: Any, name: str, alias: str) -> str | None:
    """The version `promote` last put under `alias` (None: promote never did)."""
    exp = c.get_experiment_by_name(audit.AUDIT_EXPERIMENT)
    if exp is None:
        return None
    q = naming.quote_filter_value
    runs = c.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.model = {q(name)} and tags.decision = {q(f'alias:{alias}')}",
        order_by=["attributes.start_time DESC"],
        max_results=50,
    )
    for run in runs:
        version = run.data.tags.get("version", "")
        if not version.isdigit():
            continue
        yes = c.search_runs(
            [exp.experiment_id],
            filter_string=f"tags.model = {q(name)} and tags.version = {q(version)} "
            f"and tags.decision = {q(f'promote:{alias}:yes')}",
            max_results=1,
        )
        if yes and yes[0].info.start_time <= run.info.start_time:
            return version
    return None


def enforce(c: Any, move: Move, delivery: str = "") -> str | None:
    """Put the alias back where promote left it if it is anywhere else; returns what was done."""
    holder = sanctioned_holder(c, move.name, move.alias)
    current = audit.current_alias_version(c, move.name, move.alias)
    if current == holder:
        return None
    if holder is None:
        c.delete_registered_model_alias(move.name, move.alias)
        action = f"removed {move.alias} from v{current} (no promote decision ever put it anywhere)"
    else:
        c.set_registered_model_alias(move.name, move.alias, holder)
        action = f"moved {move.alias} back from v{current or 'none'} to v{holder}, where promote put it"
    audit.record(
        c,
        move.name,
        current or "none",
        f"guard:revert:{move.alias}",
        f"An unsanctioned move of `{move.alias}` (to {f'v{move.version}' if move.version else 'nowhere'}) "
        f"was reverted: {action}. Webhook delivery {delivery or 'unknown'}.",
        alias=move.alias,
        attempted=move.version or "",
        restored=holder or "",
        delivery=delivery,
    )
    return action
