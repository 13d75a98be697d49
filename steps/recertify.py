"""`recertify`: production's evidence checked against today's conditions. When the deployment target, the
engine version, the profile or its pinned workload moved since the holder was promoted, the holder is
evaluated again on the new conditions, compared paired per prompt with its recorded evidence, and kept,
kept with a warning, or demoted by the promotion rule (exit 1); every outcome is an audit line.

    python -m steps.recertify --model k2.5-mini-eagle3 --profile kimi-k2.5-8xrtxpro6000
    python -m steps.recertify --model k2.5-mini-eagle3 --profile host-vllm --engine vllm   # the served figure
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import BadInput
from common.values import number
from evaluation.request import Asked
from evaluation.service import evaluate
from serving.profile import load_profile
from steps._cli import log_params, open_run, run_step, step_run
from steps._params import Param, Spec, spec

SPEC = Spec(
    "recertify",
    __doc__,
    (
        Param("model", default="k2.5-mini-eagle3", help="registered model name"),
        Param("profile", default="kimi-k2.5-8xrtxpro6000"),
        Param("stage", default="production", choices=("staging", "production")),
        Param("engine", default="in-process", choices=("in-process", "vllm", "sglang")),
        Param("tolerance", default="0.02", help="paired accept_len change kept without a new decision"),
        Param("always", help="measure again even when no condition moved", flag=True, cli=True),
        Param(
            "evaluator_key",
            default="none",
            help="the key file the new evaluation is signed with (a "
            "trusted evaluator's; default: the signing key, which signs a demotion as a trusted promoter)",
            cli=True,
        ),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


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


def run(args: argparse.Namespace) -> int:
    from registry.access import store

    request = parse(args)
    c = store.client()
    with step_run("recertify", run_name=f"recertify {request.name} {request.stage}"):
        log_params({"model": request.name, "profile": request.profile.name, "stage": request.stage,
                    "engine": request.engine, "tolerance": request.tolerance, "always": request.always})  # fmt: skip
        outcome = measure(c, request)  # the evaluation, when one is needed, is a run nested under this one
        publish(c, request, outcome)
    print("\n".join([f"recertify {request.name} {request.stage} on {request.profile.name}:", *outcome.lines,
                     f"recertify: {outcome.action}"]))  # fmt: skip
    return 1 if outcome.action == "demote" else 0  # superseded: nothing moved, and it says so


def parse(args: argparse.Namespace) -> Request:
    """The arguments checked, the model found and both keys in their roles, before anything is measured: the
    evaluator's key signs the new record, the promoter's (the signing key) a demotion. One person holding both
    roles passes one key; a team passes the evaluator's with --evaluator_key."""
    from mlflow.exceptions import MlflowException

    from common.values import none_if_empty
    from evaluation.request import require_evaluator_key
    from pipeline.promotion import require_promoter_key
    from registry.access import naming, store
    from registry.ledger import signing

    naming.check_name(args.model, "--model")
    profile = load_profile(args.profile)
    tolerance = number(args.tolerance, "tolerance", 0, 1, "between 0 and 1 (relative)")
    named = none_if_empty(args.evaluator_key)
    evaluator = signing.Key(signing.read_private(Path(named)), named) if named else signing.load_key()
    with signing.signing_with(evaluator):
        require_evaluator_key(profile)  # it measures
    require_promoter_key()  # and may move the alias
    c = store.client()
    try:
        c.get_registered_model(args.model)
    except MlflowException:
        raise BadInput(f"--model {args.model}: no such registered model in {c.tracking_uri}") from None
    return Request(args.model, args.profile, profile, args.stage, args.engine, tolerance, args.always, evaluator)


def measure(c: Any, r: Request) -> Outcome:
    """The holder, what moved since its evidence, and (when something did) its evidence measured again."""
    from registry.access import store
    from registry.ledger import policy, sanction, signing
    from registry.ledger.deployment import check_target, deployment
    from registry.ledger.evidence import recompute as evidence_recompute
    from registry.ledger.evidence import verify as evidence_verify
    from registry.ledger.recertify import compare, verdict

    dep = deployment(r.profile)
    check_target(dep)
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
    from registry.ledger import sanction
    from registry.ledger.deployment import trust_for
    from registry.ledger.evidence import verify as evidence_verify

    record = sanction.read(c, held.run_id) or {}
    wanted = record.get("evidence_run")
    found = evidence_verify.records_for(c, r.name, held.version, trust_for(r.profile)).records
    return next((rec for rec in found if rec.run_id == wanted), None)


def conditions_moved(rec: Any, r: Request, dep: Any, files: dict[str, str]) -> list[str]:
    """What differs between the recorded evidence's conditions and today's (empty: nothing moved)."""
    from registry.ledger.evidence import verify as evidence_verify

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
        from engines.inprocess import in_process_version

        return in_process_version()
    from engines import environment

    return environment.engine_version(environment.find_python(engine), engine)


def evaluate_again(r: Request, mv: Any, target: str) -> None:
    """The holder evaluated on today's conditions by the evaluation service (its own run and signed record),
    asked as `evaluate` would be: its run shows what it was asked, not what recertify was."""
    asked = spec("evaluate").asked(model=f"models:/{mv.name}/{mv.version}", target=target, profile=r.profile_arg,
                                   engine=r.engine, progress=False)  # fmt: skip
    evaluate(Asked(**asked), open_run)


def publish(c: Any, r: Request, o: Outcome) -> None:
    """The run and the audit line; a demotion clears the alias with a signed sanction, last, after claiming the
    chain's next link with the same compare-and-set as promote's (a demotion never forks the chain)."""
    from registry.ledger import audit, sanction, succession

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

    from registry.ledger import audit

    mlflow.set_tag("mlflow.runName", f"recertify {r.name} {r.stage}: {o.action}")
    mlflow.set_tags({"recertify.action": o.action, "recertify.version": o.version,
                     "recertify.evidence_run": o.evidence_run})  # fmt: skip
    mlflow.set_tag("mlflow.note.content", "\n\n".join(o.lines))
    audit.record(c, r.name, o.version, f"recertify:{r.stage}:{o.action}", "\n".join(o.lines),
                 summary=o.lines[-1], profile=r.profile.name, evidence_run=o.evidence_run)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    run_step("recertify", build, run, argv)


if __name__ == "__main__":
    main()
