"""The registry guards its own gate: a serving alias stays only where a `promote` decision put it.

MLflow's registry webhooks (`model_version_alias.created` / `.deleted`, HMAC-signed) tell the guard of
every alias move made through the tracking server: the UI's alias pencil, any API client, `promote`.
Each verified delivery reconciles that model (registry.ledger.reconcile) against its signed sanctions
(registry.ledger.sanction); moves that raise no event (a legacy stage set by hand, a deleted version, anything
done while the guard was down) are caught by the reconciliation the guard runs on start and on a timer.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Any

from registry.access import naming

SIGNATURE_HEADER = "X-MLflow-Signature"
TIMESTAMP_HEADER = "X-MLflow-Timestamp"
DELIVERY_HEADER = "X-MLflow-Delivery-Id"
MAX_SKEW_S = 300  # older deliveries are replays
EVENTS = ("model_version_alias.created", "model_version_alias.deleted")


def header(headers: Any, name: str) -> str:
    """A header by name, whatever its case (HTTP/2 and many proxies lower-case them)."""
    want = name.lower()
    return next((str(v) for k, v in dict(headers).items() if str(k).lower() == want), "")


def signature_ok(secret: str, headers: Any, body: bytes, now: float | None = None) -> bool:
    """MLflow's scheme: v1,base64(HMAC-SHA256(secret, f"{delivery_id}.{timestamp}.{body}")), fresh."""
    sig, stamp, delivery = (header(headers, h) for h in (SIGNATURE_HEADER, TIMESTAMP_HEADER, DELIVERY_HEADER))
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
