"""compare's bake-off as a service: candidates found (registered, or staged for import and matched by content),
gated against the profile's target, registered once they pass, evaluated where no signed evidence stands, flagged
when trained on the pinned prompts, ranked by the traffic mix with paired intervals, and the winner handed to the
promotion service when the bake-off allows. Each service logs its own run, nested under compare's."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.errors import GateRefused, InternalError
from common.runs import OpenRun
from evaluation.request import Asked
from evaluation.service import evaluate

if TYPE_CHECKING:
    from pipeline.importing import Staged


@dataclass
class Candidate:
    arg: str  # as given
    sha: str  # its identity by content (registry.access.identity): the same drafter named twice is one candidate
    mv: Any = None  # the registered version (after import, for a folder or hub id)
    staged: Staged | None = None  # to import once it passes the gate
    record: Any = None  # the evidence record it is ranked on
    evaluated: bool = False  # measured by this compare (else reused)
    gate: str = ""
    incumbent: bool = False  # production's holder (named, or added to be compared with)
    named: bool = False  # its label names the registered model too (candidates of several models)
    flag: str = ""  # why it can never be the winner (trained on the pinned prompts, lineage unknown)

    @property
    def label(self) -> str:
        return f"{self.mv.name}/v{self.mv.version}" if self.named else f"v{self.mv.version}"


@dataclass
class Request:
    """A bake-off as asked and checked: the candidates found, the profile, where they are measured, and how the
    services it calls log (`open_run`) and are asked (`asked_of(step, **given)`: that step's parameters)."""

    profile_arg: str  # as given: evaluate and promote read the same file
    profile: Any
    dep: Any
    engine: str
    promote: bool
    progress: bool
    candidates: list[Candidate]
    open_run: OpenRun
    asked_of: Callable[..., dict[str, Any]]


def bake_off(c: Any, request: Request) -> tuple[list[Candidate], Outcome]:
    """Inside the compare run: every candidate gated (from headers, before anything is registered: a failure leaves
    no version), the staged ones registered, measured where no evidence stands, flagged, ranked and decided."""
    gated = gate(request)
    register(request, gated)
    measure(c, request, gated)
    flag_contaminated(c, request, gated)
    return gated, decide(c, request, gated)


def find(c: Any, name: str, target: str, tmp: Path) -> Candidate:
    """A registry URI as the version it names; a folder or hub id read as import_drafter reads it (layout,
    headers against the config), matched to a registered version by content (the values of its tensors and its
    config, registry.access.identity), never by a tag."""
    from registry.access import naming, store
    from registry.access.identity import content_identity, find_by_content, version_identity

    if name.startswith("models:/"):
        mv = store.get_version(name, c)
        return Candidate(name, version_identity(c, mv), mv)
    from pipeline.importing import stage

    staged = stage(name, None, tmp)
    identity = content_identity(staged.folder)
    mv = find_by_content(c, [import_name(name), naming.model_name_for(target)], identity)
    return Candidate(name, identity, mv, None if mv is not None else staged)


def import_name(source: str) -> str:
    """The registered model a bake-off imports a folder or hub id into: its own name (a public drafter is
    its own model, never a version of the team's chain, whose `imported` alias stays where it is)."""
    from registry.access import naming

    base = re.sub(r"[^A-Za-z0-9._-]", "-", source.rstrip("/").split("@")[0].split("/")[-1]) or "drafter"
    return naming.check_name(base.strip(".")[:128] or "drafter", "candidate")


def register(request: Request, gated: list[Candidate]) -> None:
    """Import each staged candidate that passed the gate with import_drafter's own registration (a nested run,
    alias `imported`), under its own model name (import_name), then record its gate on the new version."""
    from pipeline.importing import register as import_
    from registry.access import store

    for cand in gated:
        if cand.staged is None:
            continue
        name = import_name(cand.arg)
        asked = request.asked_of("import_drafter", source=cand.arg, target=request.dep.target, name=name)
        done = import_(cand.staged, cand.arg, request.dep.target, request.open_run, asked, name)
        cand.mv = store.client().get_model_version(done.name, done.version)
        print(f"compare: {cand.arg} imported as models:/{done.name}/{done.version}")
        shape_gate_of(cand, request, f"models:/{done.name}/{done.version}", publish=True)
    several = len({cand.mv.name for cand in gated}) > 1
    for cand in gated:
        cand.named = several


def incumbents(c: Any, candidates: list[Candidate], target: str) -> list[Candidate]:
    """Production's sanctioned holder of each registered model the candidates belong to (as `promote` reads
    it, from the signed chain): a candidate when named, else added to the bake-off, so every candidate is
    compared with it, paired."""
    from mlflow.exceptions import MlflowException

    from registry.access import naming
    from registry.ledger import sanction

    added = []
    names = {cand.mv.name if cand.mv is not None else naming.model_name_for(target) for cand in candidates}
    for name in sorted(names):
        try:
            held = sanction.holder(c, name, "production").version
        except MlflowException:  # no such registered model yet: its first import makes it
            continue
        if held is None:
            continue
        mine = [x for x in candidates if x.mv is not None and (x.mv.name, str(x.mv.version)) == (name, str(held))]
        if mine:
            mine[0].incumbent = True
            continue
        mv = c.get_model_version(name, held)
        added.append(Candidate(f"models:/{name}@production", mv.tags.get(naming.TAG_SHA256) or f"{name}/{held}", mv,
                               incumbent=True))  # fmt: skip
    return added


def gate(request: Request) -> list[Candidate]:
    """Every candidate through the shape gate against the profile's target, from headers: a registered one on
    its version (its run and version tags), a folder or hub id on its staged files, before anything is
    registered (a candidate that fails leaves no version behind). The ones that fail leave the bake-off, said
    on the terminal."""
    passed = []
    for cand in request.candidates:
        staged = cand.staged is not None
        where = str(cand.staged.folder) if staged else f"models:/{cand.mv.name}/{cand.mv.version}"
        result = shape_gate_of(cand, request, where, publish=not staged)
        if result.ok:
            passed.append(cand)
        else:
            label = cand.arg if staged else f"{cand.arg} ({cand.label})"
            print(f"compare: {label} fails the shape gate against {request.dep.target}: {result.lines[-1]}; left out"
                  + (" (not registered)" if staged else ""))  # fmt: skip
    if not passed:
        raise GateRefused(f"no candidate passes the shape gate against {request.dep.target}")
    return passed


def shape_gate_of(cand: Candidate, request: Request, where: str, publish: bool) -> Any:
    """The shape gate of one candidate (`where`: its registry URI or staged folder); its run and, for a version,
    its tags when `publish`."""
    from pipeline import gate as shape_gate

    result = shape_gate.measure(where, request.dep.target)
    if publish:
        asked = request.asked_of("shape_gate", model=where, target=request.dep.target)
        shape_gate.publish(result, request.open_run, asked, " (bake-off)")
    cand.gate = result.result
    return result


def flag_contaminated(c: Any, request: Request, gated: list[Candidate]) -> None:
    """A candidate whose lineage (registry.ledger.lineage: its runs, its weights by value, near-copies) or whose record
    says it was trained on pinned prompts, or whose lineage cannot be read, is flagged: ranked and shown, never
    the winner (promote would refuse it: its figure measures memory)."""
    from registry.ledger.evidence.verify import pinned_keys
    from registry.ledger.lineage import lineage, overlap

    pinned = pinned_keys(request.profile)
    for cand in gated:
        known = lineage(c, cand.mv)
        spots = overlap(known.keys | set(cand.record.trained_on), pinned)
        if spots:
            cand.flag = "trained on pinned prompts: " + ", ".join(f"{n} of class {k}" for k, n in spots.items())
        elif known.problems:
            cand.flag = f"its training data cannot be known ({known.problems[0]})"


def measure(c: Any, request: Request, gated: list[Candidate]) -> None:
    """The evaluation service (its run nested here, its signed record) for each candidate without valid evidence,
    asked as `evaluate` would be with the profile's settings on the bake-off's engine."""
    from registry.ledger.bakeoff import reusable_record

    for cand in gated:
        if cand.record is not None:
            print(f"compare: {cand.label} reuses evaluation run {cand.record.run_id}")
            continue
        asked = request.asked_of("evaluate", model=f"models:/{cand.mv.name}/{cand.mv.version}",
                                 target=request.dep.target, profile=request.profile_arg, engine=request.engine,
                                 progress=request.progress)  # fmt: skip
        evaluate(Asked(**asked), request.open_run)
        cand.record = reusable_record(c, cand.mv, request.profile, request.dep, request.engine)
        if cand.record is None:
            raise InternalError(f"evaluate measured {cand.label} but left no record that stands for "
                                f"{request.profile.name}")  # fmt: skip
        cand.evaluated = True


@dataclass
class Outcome:
    ranking: Any
    figures: Any
    break_even: dict[str, float]  # per drafter: its draft steps priced by what they read
    incumbent: str | None
    text: str
    verdict: str
    final: str
    code: int
    compare_link: str
    run_id: str = ""
    promotion: str = ""
    seconds: float = 0.0
    winner: str | None = None  # the first in the ranking that is not flagged
    flags: dict[str, str] = field(default_factory=dict)  # label -> why it can never be the winner
    per_request: dict[str, float] = field(default_factory=dict)  # label -> the mix's per-request mean


def decide(c: Any, request: Request, gated: list[Candidate]) -> Outcome:
    """The ranking and its tables; with --promote, the winner handed to `promote` when the bake-off allows."""
    import mlflow

    from drafter.analysis.step_cost import priced_for_folder
    from drafter.methods import folder_method_or_default
    from registry.access import store
    from registry.ledger.bakeoff import classes_of, may_promote
    from registry.ledger.deployment import free_cycles
    from reports import bakeoff as report
    from serving.acceptance import mix_per_request
    from serving.cost import break_even_accept_len
    from serving.paired import rank
    from serving.workload import class_figures

    profile = request.profile
    # each drafter's break-even at the hardest operating point, its draft steps priced by what they read
    be, pricing, methods = {}, {}, {}
    for cand in gated:
        _, folder = store.version_folder(f"models:/{cand.mv.name}/{cand.mv.version}")
        methods[cand.label] = folder_method_or_default(folder)  # read from its files, as its pricing is
        shaped, priced, said = priced_for_folder(profile, folder)
        be[cand.label] = break_even_accept_len(priced.binding())
        if low := free_cycles(priced):  # its cycle priced no dearer than plain decoding: any figure would "pay"
            cand.flag = cand.flag or (f"its own {priced.draft_shape} cycle costs no more than plain decoding here "
                                      f"(break-even {low[0][1]:.3f} <= 1): no evidence")  # fmt: skip
        pricing[f"- {cand.label}: {said}" if priced is not shaped else said] = None  # "not priced" said once
    counts = {cand.label: classes_of(cand.record, profile) for cand in gated}
    ranking = rank(counts, break_even=be)  # by projected speed-up where the candidates' cycles cost apart
    figures = {label: class_figures(parts, be[label]) for label, parts in counts.items()}
    per_request = {label: mix_per_request([(share, per) for _, share, per in parts]) for label, parts in counts.items()}
    pooled = {label: f[1].accept_len for label, f in figures.items()}  # flips read an accept_len order only
    flipped = report.flips(ranking.order, pooled, per_request) if ranking.by == "accept_len" else []
    incumbent = next((cand.label for cand in gated if cand.incumbent), None)
    evidence = {cand.label: f"{'evaluated' if cand.evaluated else 'reused'} {cand.record.run_id[:8]}" for cand in gated}
    flags = {cand.label: cand.flag for cand in gated if cand.flag}
    winner = next((label for label in ranking.order if label not in flags), None)  # a flagged one never is
    verdict = report.verdict(ranking, figures, be, profile.name, incumbent, flags)
    if len({m.NAME for m in methods.values()}) > 1 and winner is not None:  # the answer names its method
        verdict += f" Its method: {methods[winner].LABEL}; each candidate is priced at its own method's cycle."
    if flipped:
        verdict += " " + " ".join(flipped)
    code, final, promotion = 0, "ranked; nothing promoted (no --promote)", ""
    if request.promote and winner is None:
        code, promotion = 1, "not promoted: every candidate is flagged"
        final = promotion
    elif request.promote:
        versus = ranking.between(winner, incumbent) if incumbent not in (None, winner) else None
        check = may_promote(winner, incumbent, versus)
        if check.allowed:
            code = promote_winner(next(x for x in gated if x.label == winner), request)
            said = "promoted to production" if code == 0 else "refused by the promotion rule"
            promotion = f"{check.reason}; promote: {said}"
        else:
            code, promotion = 1, f"not promoted: {check.reason}"
        final = promotion
        verdict += f" {promotion[0].upper()}{promotion[1:]}."
    floor, share = profile.class_floor, profile.min_share

    def named(cand: Candidate) -> str:
        method = methods[cand.label]
        holder = " (production's holder)" if cand.incumbent else ""
        return f"- {cand.label}: {cand.arg} ({method.NAME}, {method.SHAPE}){holder}"

    who = "\n".join(named(cand) for cand in gated)
    left_out = [f"- {cand.arg}: shape gate {cand.gate}" for cand in request.candidates if cand not in gated]
    run = mlflow.active_run().info
    link = compare_runs_link(c, [cand.record.run_id for cand in gated])
    text = "\n".join([
        verdict, "", f"## compare on {profile.name} ({request.engine}, k={profile.draft_steps})", "", who,
        *(["", "Left out:", *left_out] if left_out else []), "",
        report.markdown(ranking, figures, be, floor, share, incumbent, evidence, flags, per_request), "",
        *([said for said in pricing if said] + [""] if any(pricing) else []),
        "Every pair (paired: the same prompts resampled for both; unpaired: each resampled on its own):", "",
        report.pairs_markdown(ranking), "", f"The child evaluations side by side: {link}",
    ])  # fmt: skip
    return Outcome(ranking, figures, be, incumbent, text, verdict, final, code, link, run.run_id, promotion,
                   winner=winner, flags=flags, per_request=per_request)  # fmt: skip


def promote_winner(cand: Candidate, request: Request) -> int:
    """The promotion rule, as `promote` applies it (its own run, audit line and sanction): 0 promoted, 1 refused."""
    from pipeline import promotion

    asked = request.asked_of("promote", model=f"models:/{cand.mv.name}/{cand.mv.version}", profile=request.profile_arg,
                             stage="production")  # fmt: skip
    terms = promotion.check(asked["model"], asked["profile"], asked["stage"], asked["margin"])
    return promotion.promote(terms, request.open_run, asked)


def compare_runs_link(c: Any, run_ids: list[str]) -> str:
    """MLflow's compare-runs view of these runs (the UI's own route: JSON lists of run and experiment ids)."""
    runs = list(dict.fromkeys(run_ids))
    experiments = list(dict.fromkeys(c.get_run(r).info.experiment_id for r in runs))
    return (f"http://127.0.0.1:5000/#/compare-runs?runs={json.dumps(runs, separators=(',', ':'))}"
            f"&experiments={json.dumps(experiments, separators=(',', ':'))}")  # fmt: skip
