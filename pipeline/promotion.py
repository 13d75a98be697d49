"""Promotion as a service: the promotion rule applied to a version's recomputed evidence against the sanctioned
holder, and published (its run, audit line, version page; the alias moved last, on the chain's next signed link).
The promote step calls it with its own parameters, compare for a bake-off's winner; recertify and watch check the
promoter's key with it, and export and watch read the depth a serving alias was decided at."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InternalError
from common.runs import OpenRun
from common.values import number
from reports.promotion import verdict
from serving.profile import Profile, load_profile


@dataclass(frozen=True)
class Terms:
    """A promotion as asked, checked: which version, to which stage, under which profile, with what margin."""

    model: str  # a registry URI, as given
    profile: Profile
    stage: str  # staging or production
    margin: float  # production: how much worse than the incumbent is tolerated (accept_len)


def check(model: str, profile: str, stage: str, margin: str) -> Terms:
    """The terms read from the words they were given in."""
    loaded = load_profile(profile)
    # a margin past 1 token a cycle makes the rule say nothing
    return Terms(model, loaded, stage, number(margin, "margin", 0, 1, "between 0 and 1 (accept_len)"))


@dataclass
class Judgement:
    """The rule's decision on a version, with the evidence it recomputed and the text that explains it."""

    mv: Any
    candidate: Any
    decision: Any
    depth: str
    lines: list[str]
    head: str  # the sanction chain's head, read once under the registry lock: the next sanction follows it

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


ROUNDS = 20  # decisions taken again after losing the chain's next link to another promote, at most


def promote(terms: Terms, open_run: OpenRun, asked: Mapping[str, object]) -> int:
    """The rule applied under the registry's lock and published (its run, audit line, page; the alias moved last,
    on the chain's next link): 0 promoted, 1 refused. A key no trust list names as a promoter is refused first."""
    from common import failpoints
    from registry.access import store
    from registry.ledger import sanction, succession

    require_promoter_key()
    stage = terms.stage
    c = store.client()
    moved: list[str] = []
    for _ in range(ROUNDS):
        with store.registry_lock():  # one local store: nothing else moves between the read and the move
            judgement = judge(c, terms, moved)
            failpoints.hit("promote:judged")
            if not judgement.decision.allowed:
                print(judgement.text)
                publish(c, terms, judgement, open_run, asked)
                return 1
            name = judgement.mv.name
            try:  # a shared server: the compare-and-set on the chain's head decides who writes the next link
                with succession.next_link(c, name, stage, judgement.head,
                                          lambda n=name: sanction.holder(c, n, stage).head) as claim:  # fmt: skip
                    failpoints.hit("promote:claimed")
                    print(judgement.text)
                    publish(c, terms, judgement, open_run, asked, claim)
                    return 0
            except succession.Lost as lost:
                moved.append(f"{lost}; decided again against its new head")
    raise InternalError(f"the chain of {stage} kept moving under {ROUNDS} decisions in a row; try again")


def require_promoter_key(then: str = "") -> None:
    """A promotion signs a sanction: a key no trust list names as a promoter in service (an evaluator's, a
    retired one) is refused before anything is read or written."""
    from registry.ledger.trust import PROMOTER, require_in_service

    require_in_service(PROMOTER, then)


def judge(c: Any, terms: Terms, moved: list[str] = ()) -> Judgement:
    """The candidate's and the incumbent's evidence recomputed from their records, and the rule applied;
    `moved`: why this decision is taken again (another promote wrote the chain's next link first)."""
    from registry.access import store
    from registry.ledger import audit, policy, reconcile, sanction
    from registry.ledger.deployment import check_target, deployment
    from registry.ledger.evidence import recompute as evidence_recompute

    profile, stage = terms.profile, terms.stage
    mv = store.get_version(terms.model, c)
    reconcile.warn_if_disagreeing(c, mv.name, "promote")
    dep = deployment(profile)
    check_target(dep)
    candidate = evidence_recompute.recompute(c, mv, profile, dep)
    incumbent, note = None, ""
    held = sanction.holder(c, mv.name, stage)  # the chain's holder, not the live alias (which anyone moves)
    if held.version is not None:
        cur = c.get_model_version(mv.name, held.version)
        incumbent = candidate if str(cur.version) == str(mv.version) else holder_evidence(c, cur, held, profile, dep)
    live = audit.current_alias_version(c, mv.name, stage)
    if live != held.version:
        note = f"the {stage} alias points at {f'v{live}' if live else 'nothing'}; the sanctioned holder is " \
               f"{f'v{held.version}' if held.version else 'nothing'}, and the rule compares against it"  # fmt: skip
    decision = policy.decide(candidate, stage, dep.target or None, incumbent, terms.margin)
    lines = [f"promote models:/{mv.name}/{mv.version} to {stage} on {profile.name}:", "",
             "| rule | verdict | detail |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {r.rule} | {'ok' if r.ok else 'NO'} | {r.detail} |" for r in decision.reasons]
    depth = recommended_depth(candidate.priced or profile, candidate)  # priced as the version's own cycle
    if depth:
        lines.append(f"\nserve at: {depth} (evaluated at k={profile.draft_steps}; another depth is another deployment)")
    if note:
        lines.append(f"\nnote: {note}")
    lines += [f"\nnote: {why}" for why in moved]
    seen = [*candidate.findings, *(incumbent.findings if incumbent is not None and incumbent is not candidate else ())]
    lines += [f"\nfinding: {line}" for line in [*held.findings, *seen]]
    lines.append(f"\npromote: {decision.summary()}")
    return Judgement(mv, candidate, decision, depth, lines, held.head)


def holder_evidence(c: Any, mv: Any, held: Any, profile: Any, dep: Any) -> Any:
    """The holder's figure a candidate must not fall short of: its standing records (runs that are not evidence,
    or that can no longer be read, are findings and never freeze production on it); with none, the figure its
    sanction signed under this very profile; with neither, when a record of it was lost, no comparison at all
    passes for one (re-evaluate the holder)."""
    from dataclasses import replace

    from registry.ledger.evidence import recompute as evidence_recompute

    ev = evidence_recompute.recompute(c, mv, profile, dep, holder=True)
    if ev.accept_len is not None:
        return ev
    figure = (held.record or {}).get("figure") or {}
    signed = figure.get("accept_len")
    if figure.get("profile_digest") == profile.digest and isinstance(signed, (int, float)) and signed == signed:
        return replace(ev, accept_len=float(signed), note="the figure its sanction signed")
    if any("not usable evidence" in line for line in ev.findings):
        lost = f"its evaluation on {profile.name} can no longer be read, and its sanction signs no figure under " \
               "this profile: re-evaluate it"  # fmt: skip
        return replace(ev, unusable=True, note=lost)
    return ev


def publish(c: Any, terms: Terms, j: Judgement, open_run: OpenRun, asked: Mapping[str, object],
            claim: Any = None) -> None:  # fmt: skip
    """The run, the audit line, the version's tag and page; the alias moves last, after every record."""
    import mlflow

    from registry.access import describe, naming
    from registry.ledger import audit

    mv, decision, depth = j.mv, j.decision, j.depth
    profile, stage, margin = terms.profile, terms.stage, terms.margin
    outcome = "promoted" if decision.allowed else "refused"
    params = {"model": terms.model, "profile": profile.name, "stage": stage, "margin": margin}
    with open_run("promote", f"promote v{mv.version} -> {stage}: {outcome}", params, asked):
        mlflow.log_text(j.text + "\n", "promotion.md")
        mlflow.set_tag("mlflow.note.content", verdict(mv.version, stage, decision, j.candidate) + "\n\n" + j.text)
        mlflow.log_metrics(gap_metrics(j.candidate))
        mlflow.set_tags({"promotion": decision.summary()[:4000], "promotion.version": str(mv.version),
                         "promotion.evidence_run": decision.evidence_run or "",
                         "promotion.profile_digest": profile.digest[:16],
                         "promotion.recommended_depth": depth[:4000]})  # fmt: skip
        reasons = {r.rule: {"ok": r.ok, "detail": r.detail} for r in decision.reasons}
        audit.record(c, mv.name, mv.version, f"promote:{stage}:{'yes' if decision.allowed else 'no'}", reasons,
                     summary=decision.summary(), profile=profile.name, profile_digest=profile.digest[:16],
                     evidence_run=decision.evidence_run or "", recommended_depth=depth)  # fmt: skip
        c.set_model_version_tag(
            mv.name, mv.version, naming.TAG_PROMOTION, f"{decision.summary()} (profile {profile.name})"[:4000]
        )
        run = mlflow.active_run().info
        describe.set_section(
            c, mv.name, mv.version, f"promotion:{stage}",
            f"## Promotion to {stage} on `{profile.name}`: {outcome}"
            "\n\n" + "\n".join(j.lines[2:-1]) + f"\n\nDecided {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
            f"(run {describe.run_md(run.run_id, run.experiment_id)}; "
            f"evidence {describe.run_md(decision.evidence_run or '')}).",
        )  # fmt: skip
        if decision.allowed:  # the alias moves last, after every check and record
            audit.move_alias(c, mv.name, stage, mv.version, decision.summary(), by_promote=True,
                             evidence_run=decision.evidence_run or "", terms=f"{profile.name} "
                             f"{profile.digest[:16]}, margin {margin:g}", claim=claim,
                             figure={"accept_len": j.candidate.accept_len,
                                     "profile_digest": profile.digest})  # fmt: skip
        describe.refresh_model_page(c, mv.name, f"v{mv.version} -> {stage}: {decision.summary()}")


def gap_metrics(ev) -> dict[str, float]:
    """How far the deciding evidence is from break-even (> 0: short of it), as metrics a chart can show;
    the evidence's break-even is already the hardest operating point that carries traffic."""
    be = ev.break_even
    if ev.accept_len is None or be is None:
        return {}
    out = {"accept_len": ev.accept_len, "break_even_accept_len": be, "shortfall_vs_break_even": be - ev.accept_len}
    if ev.ci_low is not None:
        out |= {"accept_len_ci_low": ev.ci_low, "ci_low_shortfall": be - ev.ci_low}
    return out


def recommended_depth(profile, ev) -> str:
    """The depth to serve the version at on each operating point, from the deciding record's acceptance."""
    from reports.operating import depth_sentences

    if ev.accept_len is None:
        return ""
    return "; ".join(depth_sentences(profile, ev.accept_len, list(ev.acc_pos) or None, profile.draft_steps))


def decided_profile(c, run_id: str, k: int, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """speculation_profile.json for an export: the figures of the signed record the alias was decided on, when it
    carries verify-step histograms at the exported depth; else ModelOpt's unmeasured placeholder (`measured`
    false), so that a reader finds no figure rather than one measured at another depth or none at all."""
    from registry.ledger.evidence import record as evidence_record
    from registry.ledger.evidence import verify as evidence_verify
    from serving import speculation_profile as sp

    rec = None
    if run_id:
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = c.download_artifacts(run_id, evidence_record.EVIDENCE_FILE, tmp)
                rec = evidence_verify.read_record(Path(path).read_text(), run_id)
            except Exception:  # noqa: BLE001  (an unreadable record gives no figures: the placeholder says so)
                rec = None
    hist = rec.histograms() if rec is not None else None
    if hist is None or rec.draft_steps != k or not hist.verify_steps:
        return sp.stub(k, "eagle3", checkpoint)
    conditions = {"engine": rec.engine, "engine_version": rec.engine_version, "deployment_profile": rec.profile,
                  "prompts": rec.scope, "num_requests": len(hist.requests), "concurrency": 1,
                  "temperature": rec.temperature, "max_new_tokens": rec.max_new_tokens,
                  "target_precision": rec.target_precision, "evidence_run": run_id}  # fmt: skip
    return sp.build(hist, "eagle3", checkpoint, {"id": sp.checkpoint_id(rec.target)}, conditions)


def decision_of(c, name: str, aliases: list[str]) -> tuple[str, int | None]:
    """The evaluation run the serving alias was decided on, and its draft depth (from the signed record)."""
    from registry.ledger import sanction
    from registry.ledger.evidence import record as evidence_record
    from registry.ledger.evidence import verify as evidence_verify

    for alias in aliases:
        holder = sanction.holder(c, name, alias)
        record = sanction.read(c, holder.run_id) if holder.run_id else None
        run_id = (record or {}).get("evidence_run") or ""
        if not run_id:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            try:
                path = c.download_artifacts(run_id, evidence_record.EVIDENCE_FILE, tmp)
                return run_id, evidence_verify.read_record(Path(path).read_text(), run_id).draft_steps
            except Exception:  # noqa: BLE001  (an unreadable record gives no depth; --draft_steps then)
                return run_id, None
    return "", None
