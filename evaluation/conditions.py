"""What an evaluation is measured under, worked out once its drafter is known: the figures priced at this
drafter's own draft-step cost, and the target's precision (the one the profile's deployment serves it at, so
that the record counts there), with a warning at once when the record will count for no decision."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from common.errors import BadInput
from drafter.analysis.fingerprint import target_digest
from evaluation.request import Request
from registry.ledger.deployment import deployment
from registry.ledger.evidence import record as ev_record


def priced(request: Request, folder: Path) -> Request:
    """The figures projected at this drafter's own cycle: its method's shape (a pass per draft, or one for the
    block) and its own pass cost (serving.cost.priced_for); the evidence stays bound to the profile as written,
    and promote prices it again from the weights."""
    from drafter.analysis.step_cost import priced_for_folder  # torch: read once the drafter is known

    shaped, priced_deployment, pricing = priced_for_folder(request.deployment, folder)
    if priced_deployment is not shaped:
        print(f"evaluate: {pricing}")
    return replace(request, deployment=priced_deployment, binding=priced_deployment.binding())


def deployment_target(request: Request) -> tuple[Any, str]:
    """The profile's deployment (None when it names no target: promote says why, where it matters) and
    this evaluation's target digest, read once for the precision and the warning below."""
    try:
        dep = deployment(request.profile)
        return dep, target_digest(request.asked.target) if dep.digest else ""
    except BadInput:
        return None, ""


def measuring_precision(request: Request, dep: Any, digest: str) -> str:
    """--dtype as given; auto: the precision the profile's deployment serves its target at (what calibrate
    served it at, else its own) when this is that target, so the record counts there; else the target's own."""
    from drafter.model.target import target_precision  # torch

    asked = request.asked
    if asked.dtype != "auto":
        return asked.dtype
    if dep is not None and dep.precision and dep.digest and digest == dep.digest:
        return dep.precision
    return target_precision(asked.target)


def warn_other_target(request: Request, dep: Any, digest: str) -> None:
    """Say at once when the target measured on is not the profile's deployment target: the record will then
    count for no decision on this profile."""
    if request.scope != ev_record.WORKLOAD or dep is None:
        return
    if dep.digest and digest != dep.digest:
        print(f"evaluate: warning: {request.asked.target} is not {request.profile.name}'s deployment target "
              f"({dep.target}): this record will count for no decision on it")  # fmt: skip
    elif dep.precision and request.precision != dep.precision:
        print(f"evaluate: warning: the target runs at {request.precision} here; {request.profile.name} serves it "
              f"at {dep.precision}: this record will count for no decision on it")  # fmt: skip
