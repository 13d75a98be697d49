"""The deployment a profile stands for, as evidence must match it: its target (by digest), who may
have measured it, and whether its break-even was measured by calibrate (signed) or typed by hand.

The registered model's `target` tag is informative only: a tag anyone with store access can edit never
decides which target evidence must have been measured on. That comes from the profile: the target
digest calibrate signed into it, else the digest of the `target:` a hand-written profile names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import BadInput
from registry.ledger import signing
from registry.ledger.trust import EVALUATOR, Trust, load_trust, parse_keys
from serving.cost import break_even_accept_len
from serving.profile import Profile

SIGNED_FIELDS = (signing.ALGORITHM, signing.KEY_ID, signing.SIGNATURE)


def trust_for(profile: Profile) -> Trust:
    """The trust file's keys, narrowed to the profile's own `trusted_evaluators` when it names some."""
    trust = load_trust()
    if profile.trusted_evaluators:
        keys = parse_keys(profile.trusted_evaluators, f"profile {profile.name}: trusted_evaluators")
        trust = trust.narrowed(keys, f"profile {profile.name}'s trusted_evaluators")
    return trust


def calibration_payload(profile: Profile) -> dict[str, Any]:
    """What calibrate signs: every value decisions read and the whole provenance block (target digest included)."""
    return {"kind": "calibration", "profile": profile.name, "values": profile.values(), "measured": profile.measured}


def sign_calibration(profile: Profile, key: signing.Key | None = None) -> dict[str, str]:
    signed = signing.sign(calibration_payload(profile), key)
    return {k: signed[k] for k in SIGNED_FIELDS}


@dataclass(frozen=True)
class Deployment:
    target: str  # a folder or hub id ("" when the profile names none)
    digest: str  # the target digest evidence must carry ("" when none can be known)
    trust: Trust
    calibrated: bool  # measured by calibrate and signed by a trusted evaluator
    basis: str  # where the break-even comes from, said in every decision
    refusal: str = ""  # why no evidence can count under this profile ("": it can)
    precision: str = ""  # what the target is served at: its own precision, or the one calibrate served it at


def deployment(profile: Profile) -> Deployment:
    """The profile's deployment, checked: the calibration's signature, the target, the break-evens."""
    from drafter.analysis.fingerprint import target_digest

    trust = trust_for(profile)
    claims = profile.calibrated
    why = _calibration_refusal(profile, trust) if claims else "not calibrated"
    calibrated = claims and not why
    target = profile.target or str(profile.measured.get("target") or "")
    if calibrated:
        signer = trust.entry(EVALUATOR, profile.signed.get(signing.KEY_ID))
        basis = profile.basis() + f" (signed by {signer[0] if signer else 'an unknown key'})"
        digest = str(profile.measured.get("target_digest") or "")
    else:
        basis = (
            f"break-even assumed, not measured (profile {profile.name}: its calibration {why}, so it is read as a "
            "hand-written profile)"
            if claims
            else profile.basis()
        )
        digest = target_digest(target) if target else ""
    refusal = ""
    if not digest:
        refusal = (
            f"profile {profile.name} names no deployment target (`target:`), so no evidence can be bound to one"
            if not target
            else f"profile {profile.name}'s calibration recorded no target digest: recalibrate"
        )
    low = free_cycles(profile)
    if low:
        conc, be = low[0]
        where = "" if conc is None else f" at concurrency {conc}"
        refusal = (
            f"profile {profile.name}: a speculative cycle "
            + ("timed" if claims else "written as")
            + f" no dearer than plain decoding (break-even {be:.3f} <= 1{where}), which no real "
            "engine does: it would pass a drafter that accepts nothing, so it stands as no evidence; "
            + ("remeasure with more rounds" if claims else "fix baseline_tps or the cycle's timings")
        )
    return Deployment(target, digest, trust, calibrated, basis, refusal, _precision(profile, target, calibrated))


def free_cycles(profile: Profile) -> list[tuple[int | None, float]]:
    """(concurrency, break-even) of every point priced no dearer than a plain step (break-even <= 1), a point without
    traffic too: the watch reads every point, and such a timing is no timing wherever it sits."""
    every = [profile.at(op) for op in profile.operating_points] or [profile]
    return [(p.concurrency, be) for p in every if (be := break_even_accept_len(p)) <= 1]


def _precision(profile: Profile, target: str, calibrated: bool) -> str:
    """The precision evidence must be measured at: the one calibrate served the target at, else the
    target's own (its checkpoint's); "" when the profile names no target."""
    from drafter.model.target import target_precision

    if calibrated:  # calibrations before the precision was recorded served the target at float32
        return str(profile.measured.get("target_precision") or "float32")
    return target_precision(target) if target else ""


def basis_of(profile: Profile) -> str:
    """Where the profile's break-even comes from, as decisions say it: "measured by calibrate" only for a
    calibration whose signature holds (when nothing here can check it, the profile's claim, said as one)."""
    if not profile.calibrated:
        return profile.basis()
    try:
        return deployment(profile).basis
    except BadInput as exc:
        return profile.basis() + f" (its signature not checked here: {exc})"


def _calibration_refusal(profile: Profile, trust: Trust) -> str:
    """Why the profile's calibration does not hold ("" when it does)."""
    if not profile.signed:
        return "is not signed (written before calibrations were signed, or by hand)"
    why = signing.verify({**calibration_payload(profile), **profile.signed}, EVALUATOR, trust)
    return "" if why is None else f"does not verify: {why}"


def check_target(deployment: Deployment) -> None:
    """Bad input when a decision cannot know which target evidence must have been measured on."""
    if deployment.refusal and not deployment.digest:
        raise BadInput(deployment.refusal)
