"""The production watch's records and its policy: a signed live baseline, and what a drop leads to.

- The baseline production's live acceptance settled on after promotion is signed with the watch's
  promoter key and kept in an audit run, found by a param (`drafterops.watch_baseline`, which nobody can
  change) naming what was watched as a sanction names it: the registered model by name and creation time
  (a model re-created under the old name is another model), the alias, the version and the served name
  of the drafter's files. A watch that restarts reads it back, from whichever active experiment holds it
  (the audit experiment renamed hides nothing), instead of learning a new one from traffic that may
  already have drifted. A record that does not verify is a finding and is ignored, as any planted run is.
- Every signature is made with a key the trust file lists as a promoter in service *as it reads now*: a
  long-running watch whose key is retired while it runs stops signing and says so.
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

BASELINE_PARAM = "drafterops.watch_baseline"  # Subject.key(): what finds a baseline
BASELINE_FILE = "watch_baseline.json"
BASELINE_RECORD_PARAM = "drafterops.watch_baseline_record"  # the signed record itself: nobody can change it
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

    @classmethod
    def read(cls, raw: dict[str, Any], where: str) -> Policy:
        """A profile's `watch` section, its numbers read as numbers (YAML reads `1e6` as a string), checked."""
        unknown = sorted(set(raw) - set(cls.__dataclass_fields__))
        if unknown:
            raise BadInput(f"{where}: unknown field(s) {', '.join(unknown)}")
        values = dict(raw)
        for key, kind in (("tolerance", float), ("false_alarm_intervals", float), ("baseline_intervals", int)):
            if key in values and not isinstance(values[key], bool):
                try:
                    number = float(values[key])
                except (TypeError, ValueError):
                    raise BadInput(f"{where}: {key} must be a number, not {values[key]!r}") from None
                if kind is int and number != int(number):
                    raise BadInput(f"{where}: {key} must be a whole number, not {values[key]!r}")
                values[key] = kind(number)
        for key in ("action", "command", "webhook"):
            if key in values and not isinstance(values[key], str):
                raise BadInput(f"{where}: {key} must be text, not {values[key]!r}")
        return cls(**values).check(where)

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


@dataclass(frozen=True)
class Subject:
    """What a watch watches, as a sanction names it: the registered model (name and the creation time the
    store stamped), the alias, the version, and the served name of the files the engines load."""

    name: str
    created: int
    alias: str
    version: str
    served: str

    def key(self) -> str:
        return f"{self.name}@{self.created}@{self.alias}@{self.version}@{self.served}"

    def fields(self) -> dict[str, Any]:
        return {"model": {"name": self.name, "created": self.created}, "alias": self.alias,
                "version": str(self.version), "served": self.served}  # fmt: skip


def key_in_service() -> None:
    """The trust file, read now (not at start), lists this process's key as a promoter in service; BadInput,
    saying so, when it was retired or removed meanwhile."""
    from registry.ledger.trust import PROMOTER, require_in_service

    require_in_service(PROMOTER, "the watch stops signing: restart it with a promoter key in service")


def sign(payload: dict[str, Any]) -> dict[str, Any]:
    """Signed with this process's key, only while it is in service."""
    key_in_service()
    return signing.sign(payload)


def signed_baseline(who: Subject, baseline: Baseline, endpoints: list[str], engine_version: str,
                    tolerance: float) -> dict[str, Any]:  # fmt: skip
    return sign(
        {
            "kind": "watch-baseline",
            **who.fields(),
            "baseline": baseline.to_dict(),
            "tolerance": tolerance,
            "endpoints": endpoints,
            "engine_version": engine_version,
            "at": time.time(),
        }
    )


def record_baseline(c: Any, who: Subject, record: dict[str, Any]) -> str:
    """The signed baseline as an audit line of its own; returns its run id."""
    from registry.ledger import audit

    b = record["baseline"]
    summary = (f"live baseline of v{who.version} @{who.alias}: accept_len {b['accept_len']:.3f} over "
               f"{b['intervals']} intervals ({b['drafts']:.0f} verify cycles)")  # fmt: skip
    params = {BASELINE_PARAM: who.key(), **signing.as_param(record, BASELINE_RECORD_PARAM)}
    return audit.record(
        c,
        who.name,
        who.version,
        f"watch:{who.alias}:baseline",
        summary,
        summary=summary,
        files={BASELINE_FILE: json.dumps(record, indent=1)},
        params=params,
        alias=who.alias,
    )


def recorded_baseline(c: Any, who: Subject, trust: Any) -> tuple[Baseline | None, list[str]]:
    """The newest baseline for this very holder whose signature holds under a trusted promoter key, found in
    every active experiment, and what was wrong with the others (planted, edited, another holder's)."""
    from registry.access.runs import active_experiment_ids, artifact_bytes, runs_with_param

    found, findings = None, []
    for run in runs_with_param(c, active_experiment_ids(c), BASELINE_PARAM, who.key()):
        raw = artifact_bytes(c, run.info.run_id, BASELINE_FILE)
        try:
            record = json.loads(raw or b"")
        except ValueError:
            record = None
        kept = run.data.params.get(BASELINE_RECORD_PARAM)
        if _refusal(record, who, trust) and kept:  # the file damaged: the signed copy the run keeps as a param
            findings.append(f"baseline run {run.info.run_id}: its {BASELINE_FILE} does not verify; read from the "
                            "signed copy its run keeps as a param")  # fmt: skip
            record = json.loads(kept)
        why = _refusal(record, who, trust)
        if why:
            findings.append(f"baseline run {run.info.run_id}: {why}; ignored")
            continue
        found = Baseline.from_dict(record["baseline"])  # oldest first: the newest valid one wins
    return found, findings


def _refusal(record: Any, who: Subject, trust: Any) -> str | None:
    if not isinstance(record, dict):
        return "no readable baseline file"
    why = signing.verify(record, "promoter", trust)
    if why:
        return why
    if record.get("kind") != "watch-baseline" or any(record.get(k) != v for k, v in who.fields().items()):
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


def signed_action(who: Subject, action: str, reason: str, detail: dict[str, Any]) -> dict:
    return sign({"kind": "watch-action", **who.fields(), "action": action, "reason": reason, "detail": detail,
                 "at": time.time()})  # fmt: skip


def record_action(c: Any, who: Subject, record: dict[str, Any]) -> str:
    """The action's audit line, its signed record beside it."""
    from registry.ledger import audit

    return audit.record(c, who.name, who.version, f"watch:{who.alias}:{record['action']}", record["reason"],
                        summary=record["reason"], files={ACTION_FILE: json.dumps(record, indent=1)},
                        alias=who.alias)  # fmt: skip


def demote(c: Any, who: Subject, reason: str, evidence_run: str, terms: str) -> str | None:
    """Clear the alias with a signed sanction (registry.ledger.audit.move_alias) if the version still holds it, after
    claiming the chain's next link as promote and recertify do (registry.ledger.succession: a demotion never forks
    the chain). None once the clearing holds; else why not (another decision moved the alias meanwhile, or the
    clearing written does not read back as the chain's head): the watch acts only on what it watched."""
    from registry.ledger import audit, sanction, succession

    held = sanction.holder(c, who.name, who.alias)
    if held.version != str(who.version):
        return f"{who.alias} was moved by another decision meanwhile (it holds {held.version or 'nothing'})"
    key_in_service()  # refused before the chain is claimed
    try:
        with succession.next_link(c, who.name, who.alias, held.head,
                                  lambda: sanction.holder(c, who.name, who.alias).head) as claim:  # fmt: skip
            audit.move_alias(c, who.name, who.alias, None, reason, by_promote=True, evidence_run=evidence_run,
                             terms=terms, claim=claim)  # fmt: skip
    except succession.Lost:
        return f"{who.alias} was moved by another decision meanwhile"
    after = sanction.holder(c, who.name, who.alias)
    if after.version is not None:
        return (f"the clearing written does not hold: the chain still reads v{after.version} "
                f"({'; '.join(after.findings) or 'its record did not verify: is this host clock ahead?'})")  # fmt: skip
    return None
