"""The production watch's records and its policy: a signed live baseline, and what a drop leads to.

- The baseline production's live acceptance settled on after promotion is signed with the watch's
  promoter key and kept in an audit run, found by a param (`drafterops.watch_baseline`, which nobody can
  change) naming the model, alias and version: a watch that restarts reads it back instead of learning a
  new one from traffic that may already have drifted. A record that does not verify is a finding and is
  ignored, as any planted run is.
- A drop detected by serving/drift.py leads to an action by the profile's policy: `warn` (an audit line,
  a tag on the watch's run, the operator's command or webhook) or `demote`, which warns at the first
  detection and clears the alias with a signed sanction at the second (the statistic starts again after
  each, so the second is fresh evidence that the drop persists). The watch never promotes.
- Findings (a counter reset, an endpoint down or gone, another model served, a missing metric, an engine
  version that changed) are said once each; they are never alarms and never actions.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from common.errors import BadInput
from registry.ledger import signing
from serving.drift import Baseline

BASELINE_PARAM = "drafterops.watch_baseline"  # "<model>@<alias>@<version>": what finds a baseline
BASELINE_FILE = "watch_baseline.json"
ACTION_FILE = "watch_action.json"
ACTIONS = ("warn", "demote")


@dataclass(frozen=True)
class Policy:
    """What a detected drop leads to, and the test's terms (a profile's `watch` section, or the defaults)."""

    action: str = "warn"
    tolerance: float = 0.02  # the relative drop to detect (vLLM's own acceptance test holds 2%)
    false_alarm_intervals: float = 1e6  # at most one false alarm in this many intervals (per the whole watch)
    baseline_intervals: int = 20  # intervals pooled into the baseline at least (its overdispersion needs them)
    command: str = ""  # run (no shell) on every action, with DRAFTEROPS_WATCH_* in its environment
    webhook: str = ""  # POSTed a JSON line on every action

    def check(self, where: str) -> Policy:
        if self.action not in ACTIONS:
            raise BadInput(f"{where}: policy action must be one of {', '.join(ACTIONS)}, not {self.action!r}")
        if not 0 < self.tolerance < 0.5:
            raise BadInput(f"{where}: tolerance must be between 0 and 0.5 (relative), not {self.tolerance!r}")
        if not self.false_alarm_intervals >= 100:
            raise BadInput(f"{where}: false_alarm_intervals must be at least 100, not {self.false_alarm_intervals!r}")
        if self.baseline_intervals < 5:
            raise BadInput(f"{where}: baseline_intervals must be at least 5 (the traffic's spread is measured on them)")
        if self.webhook and not self.webhook.startswith(("http://", "https://")):
            raise BadInput(f"{where}: webhook must be an http(s) URL, not {self.webhook!r}")
        return self


def baseline_key(name: str, alias: str, version: str) -> str:
    return f"{name}@{alias}@{version}"


def signed_baseline(name: str, alias: str, version: str, baseline: Baseline, endpoints: list[str],
                    engine_version: str, tolerance: float) -> dict[str, Any]:  # fmt: skip
    return signing.sign(
        {
            "kind": "watch-baseline",
            "model": name,
            "alias": alias,
            "version": str(version),
            "baseline": baseline.to_dict(),
            "tolerance": tolerance,
            "endpoints": endpoints,
            "engine_version": engine_version,
            "at": time.time(),
        }
    )


def record_baseline(c: Any, name: str, alias: str, version: str, record: dict[str, Any]) -> str:
    """The signed baseline as an audit line of its own; returns its run id."""
    from registry.ledger import audit

    b = record["baseline"]
    summary = (f"live baseline of v{version} @{alias}: accept_len {b['accept_len']:.3f} over {b['intervals']} "
               f"intervals ({b['drafts']:.0f} verify cycles)")  # fmt: skip
    return audit.record(c, name, version, f"watch:{alias}:baseline", summary, summary=summary,
                        files={BASELINE_FILE: json.dumps(record, indent=1)},
                        params={BASELINE_PARAM: baseline_key(name, alias, version)}, alias=alias)  # fmt: skip


def recorded_baseline(c: Any, name: str, alias: str, version: str, trust: Any) -> tuple[Baseline | None, list[str]]:
    """The newest baseline for this holder whose signature holds under a trusted promoter key, and what was
    wrong with the others (planted, edited, another holder's)."""
    from registry.access.runs import artifact_bytes, runs_with_param
    from registry.ledger.audit import _audit_experiment

    found, findings = None, []
    for run in runs_with_param(c, [_audit_experiment(c)], BASELINE_PARAM, baseline_key(name, alias, version)):
        raw = artifact_bytes(c, run.info.run_id, BASELINE_FILE)
        try:
            record = json.loads(raw or b"")
        except ValueError:
            record = None
        why = _refusal(record, name, alias, version, trust)
        if why:
            findings.append(f"baseline run {run.info.run_id}: {why}; ignored")
            continue
        found = Baseline.from_dict(record["baseline"])  # oldest first: the newest valid one wins
    return found, findings


def _refusal(record: Any, name: str, alias: str, version: str, trust: Any) -> str | None:
    if not isinstance(record, dict):
        return "no readable baseline file"
    why = signing.verify(record, "promoter", trust)
    if why:
        return why
    if (record.get("kind"), record.get("model"), record.get("alias"), record.get("version")) != (
        "watch-baseline", name, alias, str(version)):  # fmt: skip
        return "signed for another holder"
    try:
        Baseline.from_dict(record["baseline"])
    except (KeyError, TypeError, ValueError):
        return "not a baseline"
    return None


def next_action(policy: Policy, detections: int) -> str:
    """The action for the `detections`-th detection of a drop (1 = the first) under `policy`."""
    if policy.action == "demote" and detections >= 2:
        return "demote"
    return "warn"


def signed_action(name: str, alias: str, version: str, action: str, reason: str, detail: dict[str, Any]) -> dict:
    return signing.sign({"kind": "watch-action", "model": name, "alias": alias, "version": str(version),
                         "action": action, "reason": reason, "detail": detail, "at": time.time()})  # fmt: skip


def record_action(c: Any, name: str, alias: str, version: str, record: dict[str, Any]) -> str:
    """The action's audit line, its signed record beside it."""
    from registry.ledger import audit

    return audit.record(c, name, version, f"watch:{alias}:{record['action']}", record["reason"],
                        summary=record["reason"], files={ACTION_FILE: json.dumps(record, indent=1)},
                        alias=alias)  # fmt: skip


def demote(c: Any, name: str, alias: str, version: str, reason: str, evidence_run: str, terms: str) -> bool:
    """Clear the alias with a signed sanction (registry.ledger.audit.move_alias) if the version still holds it, after
    claiming the chain's next link as promote and recertify do (registry.ledger.succession: a demotion never forks
    the chain). False when another decision moved the alias meanwhile: the watch acts only on what it watched."""
    from registry.ledger import audit, sanction, succession

    held = sanction.holder(c, name, alias)
    if held.version != str(version):
        return False
    try:
        with succession.next_link(c, name, alias, held.head, lambda: sanction.holder(c, name, alias).head) as claim:
            audit.move_alias(c, name, alias, None, reason, by_promote=True, evidence_run=evidence_run, terms=terms,
                             claim=claim)  # fmt: skip
    except succession.Lost:
        return False
    return True
