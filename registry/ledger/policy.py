"""The promotion rule, pure and testable: a drafter reaches a serving stage only when it is known to fit
the target and measurably beats break-even on the deployment it would serve.

production: (1) the shape gate, recomputed from headers, passed against this registered model's
target (against its weights, not its config alone); (2) an evaluation whose conditions match the
profile (its values, not its name), the target, the draft depth and the version's weights, on at
least the profile's min_prompts; (3) its accept_len_ci_low > break-even recomputed from the profile;
(4) not worse than the current production version on the same evidence (by more than `margin`).
and (5) no traffic class with at least the profile's min_share of the traffic projected slower than
class_floor times plain decoding, and the classes under min_share, taken together, held to the same floor
when together they carry min_share or more (slow traffic split into small classes is still slow traffic).
With a workload, accept_len is the traffic mix's (share-weighted).
staging: (1) (a config-only gate will do), (2) and the mix's accept_len > break-even.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from registry.access import naming
from serving.workload import ClassFigure


@dataclass(frozen=True)
class Evidence:
    """What was recomputed for one version on one profile: the shape gate from headers, and the
    evaluation record that matches the profile, target, draft depth and weights (none: not evaluated)."""

    version: str
    gate: str | None = None
    gate_target: str | None = None
    accept_len: float | None = None
    ci_low: float | None = None
    break_even: float | None = None
    run_id: str | None = None
    note: str = ""
    classes: tuple[ClassFigure, ...] = ()  # per traffic class, from the deciding record
    min_share: float = 0.05
    class_floor: float = 1.0
    unusable: bool = False  # a record that fails its signature or bounds stands in the way
    contaminated: dict[str, int] = field(default_factory=dict)  # class -> pinned prompts it was trained on
    # (concurrency, share, break-even) per operating point that carries traffic; empty: one hand-written point
    operating_points: tuple[tuple[int, float, float], ...] = ()
    basis: str = ""  # where the break-even comes from (measured by calibrate, or assumed)
    acc_pos: tuple[float, ...] = ()  # the deciding record's acceptance by draft position (for the depth to serve)
    lineage_problems: tuple[str, ...] = ()  # lineage records that cannot be read as logged: training data unknown
    contexts: tuple[ClassFigure, ...] | None = None  # per context bucket (None: measured without lengths)
    context_floors: tuple[tuple[str, float], ...] = ()  # the profile's floors per context bucket
    findings: tuple[str, ...] = ()  # runs that claim to be evidence and are not: ignored, and said
    priced: Any = None  # the profile as this version's own cycle prices it (drafter/analysis/step_cost)


@dataclass(frozen=True)
class Reason:
    rule: str
    ok: bool
    detail: str


@dataclass
class Decision:
    stage: str
    version: str
    reasons: list[Reason] = field(default_factory=list)

    @property
    def allowed(self) -> bool:
        return all(r.ok for r in self.reasons)

    evidence_run: str | None = None

    def summary(self) -> str:
        verdict = "promoted" if self.allowed else "refused"
        failed = [r.detail for r in self.reasons if not r.ok]
        used = f" (evidence: run {self.evidence_run})" if self.evidence_run else ""
        assumed = any(r.rule == "break-even basis" and "assumed" in r.detail for r in self.reasons)
        basis = "; break-even assumed, not measured" if assumed else ""
        return f"{verdict} to {self.stage}" + (": " + "; ".join(failed) if failed else "") + used + basis


def decide(
    candidate: Evidence,
    stage: str,
    model_target: str | None,
    incumbent: Evidence | None = None,
    margin: float = 0.0,
) -> Decision:
    if stage not in ("staging", "production"):
        raise ValueError(f"stage must be staging or production, got {stage!r}")
    d = Decision(stage, candidate.version, evidence_run=candidate.run_id)
    good = ("passed",) if stage == "production" else ("passed", "passed-config-only")
    gate_ok = candidate.gate in good and (
        model_target is None or candidate.gate_target is None or naming.same_target(candidate.gate_target, model_target)
    )
    if candidate.gate not in good:
        gate_detail = f"shape gate {candidate.gate or 'never run'}" + (
            " (production needs a gate against the target's weights)" if candidate.gate == "passed-config-only" else ""
        )
    elif not gate_ok:
        gate_detail = f"shape gate passed for {candidate.gate_target}, not for {model_target}"
    else:
        gate_detail = f"shape gate passed for {candidate.gate_target}"
    d.reasons.append(Reason("shape_gate", gate_ok, gate_detail))
    if candidate.basis:
        d.reasons.append(Reason("break-even basis", True, candidate.basis))
    evaluated = candidate.accept_len is not None and candidate.break_even is not None
    detail = candidate.note or ("evaluated on the profile" if evaluated else "never evaluated on this profile")
    if evaluated and candidate.run_id:
        detail = f"evaluation run {candidate.run_id}" + (f" ({candidate.note})" if candidate.note else "")
    d.reasons.append(Reason("evaluated", evaluated, detail))
    if candidate.contaminated:
        spots = "; ".join(
            f"evaluated on {n} prompts it was trained on (class {c})" for c, n in candidate.contaminated.items()
        )
        d.reasons.append(Reason("not trained on its evaluation", False, spots))
    if candidate.lineage_problems:
        d.reasons.append(Reason("not trained on its evaluation", False, "; ".join(candidate.lineage_problems)))
    if not evaluated:
        return d
    L = candidate.accept_len
    points = candidate.operating_points or ((None, 1.0, candidate.break_even),)
    for conc, share, be in points:
        at = "" if conc is None else f" at concurrency {conc}"
        where = "" if conc is None else f" at concurrency {conc} ({share:.0%} of traffic)"
        if stage == "staging":
            ok = be < L
            d.reasons.append(
                Reason(
                    f"beats break-even{at}", ok, f"accept_len {L:.3f} {'>' if ok else '<='} break-even {be:.3f}{where}"
                )
            )
            continue
        lo = candidate.ci_low
        ok = lo is not None and lo > be
        d.reasons.append(
            Reason(
                f"ci_low beats break-even{at}",
                ok,
                "no confidence interval recorded"
                if lo is None
                else f"accept_len_ci_low {lo:.3f} {'>' if ok else '<='} break-even {be:.3f}{where}",
            )
        )
    if stage == "staging":
        return d
    _class_floor(d, candidate)
    _context_floors(d, candidate)
    if incumbent is None or incumbent.version == candidate.version:
        d.reasons.append(
            Reason(
                "not worse than production",
                True,
                "no other production version" if incumbent is None else "already the production version",
            )
        )
    elif incumbent.unusable:  # a broken record must not make the incumbent look unevaluated
        d.reasons.append(
            Reason("not worse than production", False, f"production v{incumbent.version}: {incumbent.note}")
        )
    elif incumbent.accept_len is None:
        d.reasons.append(
            Reason(
                "not worse than production",
                True,
                f"production v{incumbent.version} was never evaluated on this profile",
            )
        )
    elif apart(candidate, incumbent):  # methods whose cycles cost apart: accept_len alone does not compare them
        mine, theirs = L / candidate.break_even, incumbent.accept_len / incumbent.break_even
        ok = theirs - margin / incumbent.break_even <= mine
        d.reasons.append(Reason("not worse than production", ok, f"projected speed-up {mine:.3f}x (accept_len {L:.3f} "
                                f"/ its break-even {candidate.break_even:.3f}) vs production v{incumbent.version} "
                                f"{theirs:.3f}x ({incumbent.accept_len:.3f} / {incumbent.break_even:.3f}; margin "
                                f"{margin:g} accept_len)"))  # fmt: skip
    else:
        ok = incumbent.accept_len - margin <= L
        d.reasons.append(
            Reason(
                "not worse than production",
                ok,
                f"accept_len {L:.3f} vs production v{incumbent.version} {incumbent.accept_len:.3f} (margin {margin:g})",
            )
        )
    return d


def apart(a: Evidence, b: Evidence) -> bool:
    """Two versions whose own cycles price break-even apart on this profile (another draft method, or draft steps
    priced by size): they are compared by projected speed-up, accept_len over each one's own break-even."""
    return bool(a.break_even and b.break_even) and abs(a.break_even - b.break_even) > 1e-9


def _class_floor(d: Decision, ev: Evidence) -> None:
    """No class that carries real traffic may be served slower than the floor (one row per class), nor the
    classes under min_share together once their shares add up to it."""
    if len(ev.classes) == 1 and ev.classes[0].name == "all":
        return
    for c in ev.classes:
        counts = c.share >= ev.min_share
        ok = c.speedup >= ev.class_floor or not counts
        verdict = "" if counts else f"; under min_share {ev.min_share:g}, not held to the floor alone"
        d.reasons.append(
            Reason(
                f"class {c.name} ({c.share:.0%} of traffic)",
                ok,
                f"class {c.name}: accept_len {c.accept_len:.3f} [{c.ci_low:.3f}, {c.ci_high:.3f}] projects "
                f"{c.speedup:.2f}x plain decoding, floor {ev.class_floor:g}x{verdict}",
            )
        )

    small = [c for c in ev.classes if c.share < ev.min_share]
    if len(small) < 2:
        return  # one class under min_share is judged alone, above
    share = sum(c.share for c in small)
    speedup = small_classes_speedup(small)
    held = share >= ev.min_share
    names = ", ".join(c.name for c in small)
    d.reasons.append(
        Reason(
            f"classes under min_share together ({share:.0%} of traffic)",
            speedup >= ev.class_floor or not held,
            f"classes {names} together: {share:.0%} of traffic projects {speedup:.2f}x plain decoding, floor "
            f"{ev.class_floor:g}x" + ("" if held else f"; under min_share {ev.min_share:g} even together"),
        )
    )


CONTEXT_MIN_PROMPTS = 8  # a floored bucket reached by fewer prompts gives no interval worth holding a floor to


def _context_floors(d: Decision, ev: Evidence) -> None:
    """Each context bucket the profile sets a floor for must be measured on at least CONTEXT_MIN_PROMPTS
    prompts and project at least that floor at the low end of its interval: a drafter that fails on long
    conversations does not pass on short ones, nor on one lucky long prompt. A bucket no pinned prompt
    reaches, or a record without context lengths, cannot show it does."""
    for name, floor in ev.context_floors:
        rule = f"context {name}"
        if ev.contexts is None:
            why = "the evaluation recorded no context lengths (made before they were recorded): evaluate again"
            d.reasons.append(Reason(rule, False, f"context {name}: {why}"))
            continue
        fig = next((c for c in ev.contexts if c.name == name), None)
        if fig is None or fig.prompts < CONTEXT_MIN_PROMPTS:
            reached = "no pinned prompt reaches" if fig is None else f"only {fig.prompts} pinned prompts reach"
            why = (
                f"{reached} this length, so its floor {floor:g}x cannot be checked: pin at least "
                f"{CONTEXT_MIN_PROMPTS} that do"
            )
            d.reasons.append(Reason(rule, False, f"context {name}: {why}"))
            continue
        low = fig.speedup * fig.ci_low / fig.accept_len if fig.accept_len > 0 else 0.0
        d.reasons.append(
            Reason(
                rule,
                low >= floor,
                f"context {name} ({fig.prompts} prompts): accept_len {fig.accept_len:.3f} [{fig.ci_low:.3f}, "
                f"{fig.ci_high:.3f}] projects {fig.speedup:.2f}x plain decoding, {low:.2f}x at its interval's "
                f"low end, floor {floor:g}x",
            )
        )


def small_classes_speedup(classes: list[ClassFigure] | tuple[ClassFigure, ...]) -> float:
    """The speed-up of several classes' traffic served together: their tokens over the time they take, each
    class's time being its share over its own speed-up (a share-weighted harmonic mean)."""
    if any(c.speedup <= 0 for c in classes):
        return 0.0
    return sum(c.share for c in classes) / sum(c.share / c.speedup for c in classes)
