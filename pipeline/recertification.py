"""recertify as a service: the holder of a serving alias, what moved since the evidence it was promoted on
(the deployment's target, the engine's version, the profile or its pinned workload), that evidence measured
again when something did, compared paired per prompt, and the outcome settled: kept, kept with a warning, or
the alias cleared by a signed sanction after claiming the chain's next link (never a fork)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from common.errors import BadInput
from engines import environment
from engines.inprocess import in_process_version
from registry.access import store
from registry.ledger import audit, policy, sanction, signing, succession
from registry.ledger.deployment import check_target, deployment, trust_for
from registry.ledger.evidence import recompute as evidence_recompute
from registry.ledger.evidence import verify as evidence_verify
from registry.ledger.recertify import compare, verdict


@dataclass
class Request:
    name: str
    profile_arg: str  # as given: evaluate reads the same file
    profile: Any
    stage: str
    engine: str
    tolerance: float
    always: bool
    evaluator: Any  # the key the new evaluation is signed with (registry.ledger.signing.Key)


@dataclass
class Outcome:
    version: str
    action: str  # unchanged, keep, warn or demote
    lines: list[str]
    evidence_run: str = ""
    head: str = ""  # the chain's head the decision read: a demotion's sanction follows it


def measure(c: Any, r: Request, evaluate_again: Callable[[Request, Any, str], None]) -> Outcome:
    """The holder, what moved since its evidence, and (when something did) its evidence measured again by
    `evaluate_again(request, version, target)` (the evaluation service, asked as `evaluate` would be)."""
    dep = deployment(r.profile)
    check_target(dep)
    if dep.refusal:  # before anything is measured: a profile that passes what accepts nothing decides nothing
        raise BadInput(f"--profile: {dep.refusal}")
    held = sanction.holder(c, r.name, r.stage)
    if held.version is None:
        raise BadInput(f"{r.name}: no sanctioned version holds {r.stage}; nothing to re-certify")
    mv = c.get_model_version(r.name, held.version)
    recorded = recorded_evidence(c, held, r)
    folder = store.version_folder(f"models:/{r.name}/{held.version}")[1]
    moved = conditions_moved(recorded, r, dep, store.drafter_files(folder))
    if not moved and not r.always:
        return Outcome(held.version, "unchanged", [f"v{held.version}: its evidence still matches today's conditions"])
    lines = [f"v{held.version}: " + ("; ".join(moved) if moved else "measured again (--always)")]
    before = {rec.run_id for rec in evidence_verify.records_for(c, r.name, held.version, dep.trust).records}
    with signing.signing_with(r.evaluator):
        evaluate_again(r, mv, dep.target)
    made = [
        rec
        for rec in evidence_verify.records_for(c, r.name, held.version, dep.trust).records
        if rec.run_id not in before
    ]
    new = max(made, key=lambda rec: rec.created)
    now = evidence_recompute.recompute(c, mv, r.profile, dep, decide_on=new.run_id)  # the new record decides
    decision = policy.decide(now, r.stage, dep.target or None)
    said = verdict(compare(recorded, new, r.tolerance) if recorded else None, decision)
    found = [f"finding: {line}" for line in [*held.findings, *now.findings]]
    return Outcome(held.version, said.action, lines + found + said.lines, new.run_id, held.head)


def recorded_evidence(c: Any, held: Any, r: Request) -> Any:
    """The record the holder was promoted on (named by its signed sanction), or None when it cannot be read."""
    record = sanction.read(c, held.run_id) or {}
    wanted = record.get("evidence_run")
    found = evidence_verify.records_for(c, r.name, held.version, trust_for(r.profile)).records
    return next((rec for rec in found if rec.run_id == wanted), None)


def conditions_moved(rec: Any, r: Request, dep: Any, files: dict[str, str]) -> list[str]:
    """What differs between the recorded evidence's conditions and today's (empty: nothing moved)."""
    if rec is None:
        return ["the evidence it was promoted on cannot be read"]
    moved = evidence_verify.mismatches(rec, r.profile, dep.digest, files, precision=dep.precision)
    now = current_engine_version(r.engine)
    if rec.engine != r.engine:
        moved.append(f"promoted on {rec.engine}, re-certified on {r.engine}")
    elif now != rec.engine_version:
        moved.append(f"engine {rec.engine_version} then, {now} now")
    return moved


def current_engine_version(engine: str) -> str:
    if engine == "in-process":
        return in_process_version()
    return environment.engine_version(environment.find_python(engine), engine)


def settle(c: Any, r: Request, o: Outcome) -> None:
    """The run's tags and the audit line; a demotion clears the alias with a signed sanction, last, after claiming the
    chain's next link with the same compare-and-set as promote's (a demotion never forks the chain)."""
    if o.action == "demote":
        try:
            with succession.next_link(c, r.name, r.stage, o.head,
                                      lambda: sanction.holder(c, r.name, r.stage).head) as claim:  # fmt: skip
                record(c, r, o)
                audit.move_alias(c, r.name, r.stage, None, f"recertify: {o.lines[-1]}", by_promote=True,
                                 evidence_run=o.evidence_run, terms=f"{r.profile.name} {r.profile.digest[:16]}",
                                 claim=claim)  # fmt: skip
                return
        except succession.Lost:
            o.action = "superseded"
            o.lines.append(f"not demoted: {r.stage} was moved by another decision meanwhile; run recertify again")
    record(c, r, o)


def record(c: Any, r: Request, o: Outcome) -> None:
    import mlflow

    mlflow.set_tag("mlflow.runName", f"recertify {r.name} {r.stage}: {o.action}")
    mlflow.set_tags({"recertify.action": o.action, "recertify.version": o.version,
                     "recertify.evidence_run": o.evidence_run})  # fmt: skip
    mlflow.set_tag("mlflow.note.content", "\n\n".join(o.lines))
    audit.record(c, r.name, o.version, f"recertify:{r.stage}:{o.action}", "\n".join(o.lines),
                 summary=o.lines[-1], profile=r.profile.name, evidence_run=o.evidence_run)  # fmt: skip
