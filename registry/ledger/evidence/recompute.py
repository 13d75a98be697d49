"""What the promotion rule reads for one version, recomputed now from its signed records and its files:
never from a tag."""

from __future__ import annotations

from typing import Any

from registry.ledger.evidence.verify import Found, deciding, mismatches, pinned_keys, records_for
from registry.ledger.policy import Evidence
from serving.cost import break_even_accept_len
from serving.profile import Profile
from serving.workload import class_figures, context_figures


def recompute(c: Any, mv: Any, profile: Profile, dep: Any = None, holder: bool = False,
              decide_on: str | None = None) -> Evidence:  # fmt: skip
    """Everything the promotion rule depends on for one version, recomputed now: the shape gate from
    the version's headers against the profile's deployment target, the digest of every file the engine
    loads, the target's identity, and the least favourable standing record on the profile's pinned
    prompts. Tags are never read. Runs that are not evidence are ignored and said as findings.

    `holder`: the version holds the alias, and its figure is what a candidate must not fall short of: a lost
    record of it is a finding, never a block (a block would freeze production on it). `decide_on`: only that
    run's record decides (recertify's fresh measurement); every other run is at most a finding."""
    from drafter.analysis.compat import verdict
    from drafter.methods import folder_method_or_default
    from registry.access import store
    from registry.ledger.deployment import deployment, free_cycles
    from registry.ledger.lineage import lineage, overlap

    dep = dep or deployment(profile)
    _, folder = store.version_folder(f"models:/{mv.name}/{mv.version}")
    gate = verdict(folder_method_or_default(folder).fit_checks(folder, dep.target)) if dep.target else None
    files = store.drafter_files(folder)
    found = records_for(c, mv.name, str(mv.version), dep.trust)
    pinned = pinned_keys(profile)
    known = lineage(c, mv, folder=folder)
    remembered = {key for rec in found.records for key in rec.trained_on}  # signed when evaluated
    findings = found.findings()
    if decide_on is not None or holder:
        findings += [f"evaluation run {run} is not usable evidence ({why}): not counted" for run, _, why in
                     found.unusable]  # fmt: skip
        records = [r for r in found.records if decide_on is None or r.run_id == decide_on]
        found = Found(records, [], found.planted)
    contaminated = overlap(known.keys | remembered, pinned)
    matching, refused = [], []
    for rec in found.records:
        why = mismatches(rec, profile, dep.digest, files, pinned, (mv.name, str(mv.version)), dep.precision)
        (refused if why else matching).append((rec, why))
    standing = deciding([r for r, _ in matching], profile.eval_temperature == 0)
    # an unusable run stands in the way until an evaluation on the pinned prompts with the same engine, made
    # after it was found unusable, acknowledges it (greedy and sampled alike): an overwrite after the fact
    # blocks again, and one engine's evaluation never lifts another's lost record
    acknowledged = {(rec.engine, run) for rec, _ in matching for run in rec.acknowledged}
    blocking = [
        (run, why) for run, engine, why in found.unusable
        if not any(r == run and engine in ("", e) for e, r in acknowledged)
    ]  # fmt: skip
    # records match the profile as written; the break-even is the one this drafter's draft steps cost
    from drafter.analysis.step_cost import priced_for_folder

    _, priced, pricing = priced_for_folder(profile, folder)
    points = priced.serving_points()
    ops = tuple((p.concurrency, _share(profile, p), break_even_accept_len(p)) for p in points if p.concurrency)
    basis = "; ".join(part for part in (dep.basis, pricing) if part)
    base = Evidence(str(mv.version), gate, dep.target or None, classes=(), min_share=profile.min_share,
                    class_floor=profile.class_floor, contaminated=contaminated, operating_points=ops,
                    basis=basis, lineage_problems=tuple(known.problems),
                    context_floors=profile.context_floors, findings=tuple(findings), priced=priced)  # fmt: skip
    if dep.refusal:
        return _with(base, note=dep.refusal)
    low = free_cycles(priced)  # the profile as written is above 1; this drafter's own cycle may be priced below it
    if low:
        conc, be = low[0]
        where = "" if conc is None else f" at concurrency {conc}"
        note = (
            f"profile {profile.name}, priced for this drafter (a {priced.draft_shape} cycle): its cycle costs no "
            f"more than plain decoding (break-even {be:.3f} <= 1{where}), so a drafter that accepts nothing "
            "would pass; it stands as no evidence"
        )
        return _with(base, note=note)
    if blocking:
        run, why = blocking[-1]
        note = (
            f"evaluation run {run} is not usable evidence ({why}); it stands in the way until a newer "
            f"evaluation on {profile.name}'s pinned prompts"
        )
        return _with(base, note=note, unusable=True)
    if not standing:
        if not found.records:
            note = f"never evaluated (no evaluation record of v{mv.version})"
        else:
            same_name = [rw for rw in refused if rw[0].profile == profile.name]
            rec, why = (same_name or refused)[-1]
            note = (
                f"none of {len(found.records)} evaluation(s) counts for {profile.name}: latest run {rec.run_id}: "
                + "; ".join(why)
            )
        return _with(base, note=note)
    rec = min(standing, key=lambda r: r.ci()[0])
    lo, _ = rec.ci()
    be = break_even_accept_len(priced.binding())  # every class must clear the hardest operating point
    classes, _ = class_figures([(c.name, c.share, c.per_prompt) for c in rec.classes], be)
    note = (
        f"{rec.num_prompts} pinned prompts in {len(rec.classes)} class(es), {rec.draft_steps} draft steps, "
        f"engine {rec.engine}"
    )
    if len(standing) > 1:
        note += f"; the least favourable of {len(standing)} standing evaluations"
    contexts = rec.contexts
    by_context = tuple(context_figures(rec.per_prompt, contexts, be)) if contexts is not None else None
    return _with(base, accept_len=rec.accept_len, ci_low=lo, break_even=be, run_id=rec.run_id, note=note,
                 classes=tuple(classes), acc_pos=tuple(rec.acc_pos), contexts=by_context)  # fmt: skip


def _share(profile: Profile, view: Profile) -> float:
    return next(op.share for op in profile.operating_points if op.concurrency == view.concurrency)


def _with(base: Evidence, **changes: Any) -> Evidence:
    from dataclasses import replace

    return replace(base, **changes)
