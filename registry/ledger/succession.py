"""Who writes the next link of a sanction chain: a compare-and-set on the chain's head, made from the one
create-if-absent every MLflow store does atomically, whoever runs it and however many servers front it:
an experiment's name is unique.

A decision that will move a serving alias read the chain's head H when it judged. Before it writes anything
it claims "the link after H" by creating the experiment named for (model, alias, H, attempt 0). Exactly
one process succeeds; it writes its sanction (previous = H) and then deletes the claim (deleted experiments
keep their names, so the claim is never made again). A process that finds the claim taken waits until it is
released and then re-reads the chain: the head has moved, so it judges again against the new holder (the
promote that lost re-decides, against what the winner installed). A claim carries its maker's signature (a
trusted promoter's): one planted by hand counts for nothing anywhere, neither waited for nor taken as a
takeover. A claim released without a sanction (its
decision failed) is followed by attempt 1, and so on; a claim held longer than STALE_S by a process that
died (on a local SQLite store, any claim found under the registry's file lock) is taken over the same way,
and the dead process, should it wake, finds the next attempt claimed and writes nothing. An in-process lock
plays no part: two processes, or two machines, on one server serialise.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from registry.ledger import signing

PREFIX = "drafterops-claim"
SIGNED_TAG = "drafterops.claim"  # the claim signed by the promoter making it
STALE_S = 120.0  # a claim held longer than this belongs to a process that died (its writes take seconds)
POLL_S = 0.1


class Lost(Exception):
    """Another decision wrote (or is writing) the link after the head this one judged on: judge again."""


@dataclass(frozen=True)
class Claim:
    """The right to write the sanction that follows `head` in the chain of `model@alias`."""

    model: str
    alias: str
    head: str  # the digest the new sanction names as previous ("" for the first)
    attempt: int
    experiment_id: str
    name: str


def claim_name(rm: Any, alias: str, head: str, attempt: int) -> str:
    """One name per (registered model by name and creation time, alias, head, attempt), short enough for
    any store (a hash: the experiment's tags say it in words)."""
    key = f"{rm.name}\n{int(rm.creation_timestamp or 0)}\n{alias}\n{head}"
    return f"{PREFIX}/{hashlib.sha256(key.encode()).hexdigest()[:40]}/{attempt}"


@contextmanager
def next_link(c: Any, name: str, alias: str, head: str, head_now: Callable[[], str]) -> Iterator[Claim]:
    """Hold the claim on the link after `head` while the body writes it; Lost when the chain moved on (or is
    being moved on) from `head`. `head_now` re-reads the chain's head. On a local SQLite store the caller holds
    the registry's file lock, so a claim found there was left by a process that died: not waited for."""
    from registry.access.store import locked_locally

    claim = take(c, name, alias, head, head_now, patient=not locked_locally())
    try:
        yield claim
    finally:
        release(c, claim)


def take(c: Any, name: str, alias: str, head: str, head_now: Callable[[], str], patient: bool = True) -> Claim:
    from mlflow.exceptions import MlflowException

    rm = c.get_registered_model(name)
    attempt = 0
    while True:
        experiment = claim_name(rm, alias, head, attempt)
        signed = json.dumps(signing.sign({"kind": "claim", "name": experiment}))  # a claim nobody else can plant
        try:
            eid = c.create_experiment(experiment, tags={SIGNED_TAG: signed, "model": f"{name}@{alias}",
                                                        "head": head or "none", "attempt": str(attempt)})  # fmt: skip
            return Claim(name, alias, head, attempt, eid, experiment)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        if _wait_while_held(c, experiment, patient) and head_now() != head:
            raise Lost(f"the chain of {name}@{alias} moved on while this decision was taken")
        attempt += 1  # released (or abandoned, or planted) without a sanction after `head`: the next attempt


def _wait_while_held(c: Any, experiment: str, patient: bool = True) -> bool:
    """Until the claim is released, or so old that its holder must have died (True: a real claim, the chain may
    have moved); False at once for a claim no trusted promoter signed (planted to stall promotions)."""
    while True:
        found = c.get_experiment_by_name(experiment)
        if found is not None and not _signed(found, experiment):
            return False
        if found is None or found.lifecycle_stage == "deleted":
            return True
        if not patient or time.time() - (found.creation_time or 0) / 1000 > STALE_S:
            return True
        time.sleep(POLL_S)


def _signed(experiment: Any, name: str) -> bool:
    from registry.ledger.trust import PROMOTER, load_trust

    try:
        record = json.loads(experiment.tags.get(SIGNED_TAG, ""))
    except ValueError:
        return False
    if not isinstance(record, dict) or record.get("kind") != "claim" or record.get("name") != name:
        return False
    return signing.verify(record, PROMOTER, load_trust()) is None


def still_mine(c: Any, claim: Claim) -> bool:
    """No later attempt took the claim over (checked just before the sanction is written): only a claim a
    trusted promoter signed takes one over; an experiment of that name made by hand counts for nothing."""
    rm = c.get_registered_model(claim.model)
    name = claim_name(rm, claim.alias, claim.head, claim.attempt + 1)
    later = c.get_experiment_by_name(name)
    return later is None or not _signed(later, name)


def release(c: Any, claim: Claim) -> None:
    """Delete the claim: its name stays taken (a deleted experiment keeps it), waiters re-read the chain."""
    from mlflow.exceptions import MlflowException

    with contextlib.suppress(MlflowException):  # already released: nothing to do
        c.delete_experiment(claim.experiment_id)
