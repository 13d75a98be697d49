"""`recertify`: production's evidence checked against today's conditions. When the deployment target, the
engine version, the profile or its pinned workload moved since the holder was promoted, the holder is
evaluated again on the new conditions, compared paired per prompt with its recorded evidence, and kept,
kept with a warning, or demoted by the promotion rule (exit 1); every outcome is an audit line.

    python -m steps.recertify --model k2.5-mini-eagle3 --profile kimi-k2.5-8xrtxpro6000
    python -m steps.recertify --model k2.5-mini-eagle3 --profile host-vllm --engine vllm   # the served figure
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.spec import Param, Spec, spec
from cli.step import log_params, open_run, run_step, step_run
from common.errors import BadInput
from common.values import none_if_empty, number
from evaluation.request import Asked, require_evaluator_key
from evaluation.service import evaluate
from pipeline.promotion import require_promoter_key
from registry.access import naming
from registry.ledger import signing
from serving.profile import load_profile

if TYPE_CHECKING:
    from pipeline.recertification import Request

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


def run(args: argparse.Namespace) -> int:
    # deferred: torch comes with these, and --help or refused input needs none of it
    from pipeline.recertification import measure, settle
    from registry.access import store

    request = parse(args)
    c = store.client()
    with step_run("recertify", run_name=f"recertify {request.name} {request.stage}"):
        log_params({"model": request.name, "profile": request.profile.name, "stage": request.stage,
                    "engine": request.engine, "tolerance": request.tolerance, "always": request.always})  # fmt: skip
        outcome = measure(
            c, request, evaluate_again
        )  # the evaluation, when one is needed, is a run nested under this one
        settle(c, request, outcome)
    print("\n".join([f"recertify {request.name} {request.stage} on {request.profile.name}:", *outcome.lines,
                     f"recertify: {outcome.action}"]))  # fmt: skip
    return 1 if outcome.action == "demote" else 0  # superseded: nothing moved, and it says so


def parse(args: argparse.Namespace) -> Request:
    """The arguments checked, the model found and both keys in their roles, before anything is measured: the
    evaluator's key signs the new record, the promoter's (the signing key) a demotion. One person holding both
    roles passes one key; a team passes the evaluator's with --evaluator_key."""
    # deferred: mlflow, and torch with the modules below, take seconds; --help or refused input needs neither
    from mlflow.exceptions import MlflowException

    from pipeline.recertification import Request
    from registry.access import store

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


def evaluate_again(r: Request, mv: Any, target: str) -> None:
    """The holder evaluated on today's conditions by the evaluation service (its own run and signed record),
    asked as `evaluate` would be: its run shows what it was asked, not what recertify was."""
    # deferred: torch comes with these, and --help or refused input needs none of it

    asked = spec("evaluate").asked(model=f"models:/{mv.name}/{mv.version}", target=target, profile=r.profile_arg,
                                   engine=r.engine, progress=False)  # fmt: skip
    evaluate(Asked(**asked), open_run)


def main(argv: list[str] | None = None) -> None:
    run_step("recertify", build, run, argv)


if __name__ == "__main__":
    main()
