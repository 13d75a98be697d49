"""An evaluation from start to end: asked, checked, measured, published in its own run and said on the
terminal. The evaluate step calls it with its own parameters; compare and recertify with theirs (the profile's
settings, on one engine), each evaluation its own run nested under theirs."""

from __future__ import annotations

from dataclasses import asdict, replace

from common.runs import OpenRun
from evaluation import publish
from evaluation.conditions import deployment_target, measuring_precision, priced, warn_other_target
from evaluation.contamination import warn_contamination
from evaluation.measure import Evaluation, measure
from evaluation.request import Asked, Request, check
from registry.ledger.deployment import basis_of
from reports.evaluation import summary
from reports.operating import depth_sentences


def evaluate(asked: Asked, open_run: OpenRun) -> Evaluation:
    """Every check before anything is measured, the measurement, its run, then the figures on the terminal."""
    # torch: the drafter's files are read once the arguments are known good
    from drafter.methods import folder_method_or_default, require_fit
    from registry.access.resolve import resolve_model

    request = check(asked)
    folder, mv = resolve_model(asked.model)
    trained_on = warn_contamination(mv, request.classes)
    require_fit(folder, asked.target, f"drafter {asked.model} does not fit target {asked.target}")
    folder_method_or_default(folder).check_width(folder, request.k, "draft steps (--draft_steps or the profile's)")
    request = priced(request, folder)
    dep, digest = deployment_target(request)
    request = replace(request, precision=measuring_precision(request, dep, digest))
    warn_other_target(request, dep, digest)
    evaluation = measure(request, folder, mv)
    evaluation.trained_on = trained_on
    with open_run("evaluate", publish.run_name(request, evaluation), publish.run_params(request), asdict(asked)):
        publish.log(request, evaluation)
    report(request, evaluation)
    return evaluation


def report(request: Request, ev: Evaluation) -> None:
    """The figures on the terminal, then the deployment's basis and the depth to serve at."""
    print(summary(ev.name, request.binding.name, ev.metrics))
    if ev.measured is not None:
        print(f"evaluate: {basis_of(request.deployment)}")
        for line in depth_sentences(request.deployment, ev.metrics["accept_len"], ev.measured.acc_pos, request.k):
            print(f"evaluate: recommended depth: {line}")
