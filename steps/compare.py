"""`compare`: a paired bake-off of drafters on a profile's pinned workload. Imports what is not registered
yet, gates each candidate against the profile's target, evaluates on one engine with the profile's settings
only where no valid signed evidence exists (the rest is reused), ranks by the traffic mix with paired
per-prompt intervals (registry/ledger/bakeoff.py, serving/paired.py), and with --promote hands the winner to
`promote` when it beats the incumbent by a paired interval above zero.

    python -m steps.compare --candidates miniworld/aq-mini-eagle3,models:/k2.5-mini-eagle3@candidate \\
        --profile kimi-k2.5-8xrtxpro6000 [--promote]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from cli.spec import Param, Spec, spec
from cli.step import log_params, open_run, run_link, run_step, step_run
from common.errors import BadInput
from evaluation.request import require_evaluator_key
from pipeline import bakeoff
from pipeline.bakeoff import Candidate, Outcome, Request, find, incumbents
from pipeline.promotion import require_promoter_key
from registry.ledger.bakeoff import reusable_record
from registry.ledger.deployment import check_target, deployment
from reports import bakeoff as report
from reports import external
from reports.plotting import log_figure
from serving.profile import load_profile

SPEC = Spec("compare", __doc__, (
    Param("candidates", default="none", help="comma-separated drafters: models:/name/N, models:/name@alias, local "
          "folders or hub ids (none: only the --external files are shown)"),
    Param("profile", default="kimi-k2.5-8xrtxpro6000"),
    Param("engine", default="in-process", choices=("in-process", "vllm", "sglang"),
          help="where every candidate is measured (evidence of another engine is not reused)"),
    Param("promote", bare="yes", default="no", choices=("yes", "no"), help="promote the winner to production when "
          "the promotion rule allows it and it beats the incumbent by a paired interval above zero"),
    Param("external", default="none", help="comma-separated outside measurements (a speculation_profile.json, a "
          "speculators acceptance.csv) shown beside ours with their definition; never evidence"),
    Param("no-progress", flag=True, off=True, dest="progress", cli=True),
))  # fmt: skip


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


def run(args: argparse.Namespace) -> int:
    # deferred: torch comes with these, and --help or refused input needs none of it
    from registry.access import store

    outside = external.read_all(args.external)  # a bad file is refused before anything is read or written
    if str(args.candidates).strip().lower() in ("", "none"):
        if not outside:
            raise BadInput("--candidates: no candidate given (comma-separated registry URIs, folders or hub ids)")
        print(external.markdown(outside))
        return 0
    c = store.client()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))  # imports staged until registered
        request = parse(args, c, tmp)  # every check that can refuse: nothing is written before it passes
        t0 = time.perf_counter()
        with step_run("compare", run_name=f"compare {len(request.candidates)} drafters @ {request.profile.name}"):
            log_params({"candidates": args.candidates, "profile": request.profile.name, "engine": request.engine,
                        "promote": "yes" if request.promote else "no", "external": args.external})  # fmt: skip
            gated, outcome = bakeoff.bake_off(c, request)  # each service's run nested under this one
            outcome.seconds = time.perf_counter() - t0
            if outside:
                outcome.text += "\n\n" + external.markdown(outside)
            publish(request, gated, outcome)
    print(outcome.text)
    print(f"\ncompare: {outcome.final}\n  this run:      {run_link(c, outcome.run_id)}\n"
          f"  the children:  {outcome.compare_link}")  # fmt: skip
    return outcome.code


def parse(args: argparse.Namespace, c: Any, tmp: Path) -> Request:
    """The profile, its deployment, every candidate found (registered, or staged for import) and told apart,
    and the keys the bake-off will sign with."""
    profile = load_profile(args.profile)
    names = [x.strip() for x in str(args.candidates).split(",")]
    if not any(names):
        raise BadInput("--candidates: no candidate given (comma-separated registry URIs, folders or hub ids)")
    if "" in names:
        raise BadInput(f"--candidates: an empty entry in {args.candidates!r}")
    repeated = sorted({x for x in names if names.count(x) > 1})
    if repeated:
        raise BadInput(f"--candidates: {', '.join(repeated)} named more than once")
    if not profile.workload:
        raise BadInput(f"profile {profile.name} pins no evaluation prompts: a bake-off needs the same prompts for all")
    dep = deployment(profile)
    check_target(dep)
    candidates = [find(c, name, dep.target, tmp / f"c{i}") for i, name in enumerate(names)]
    same: dict[str, str] = {}
    for cand in candidates:
        if cand.sha in same:
            raise BadInput(f"--candidates: {same[cand.sha]} and {cand.arg} are the same weights and config")
        same[cand.sha] = cand.arg
    candidates += incumbents(c, candidates, dep.target)
    promote = args.promote == "yes"
    if promote:
        require_promoter_key()

    for cand in candidates:
        if cand.mv is not None:
            cand.record = reusable_record(c, cand.mv, profile, dep, args.engine)
    if any(cand.record is None for cand in candidates):
        require_evaluator_key(profile)  # it will measure: a key whose records would count for nothing is refused
    return Request(args.profile, profile, dep, args.engine, promote, args.progress, candidates, open_run, asked_of)


def asked_of(step: str, **given: object) -> dict[str, object]:
    """Another step's parameters at their defaults, `given` over them: how a service it calls is asked."""
    return spec(step).asked(**given)


def publish(request: Request, gated: list[Candidate], o: Outcome) -> None:
    """The parent run: the verdict first in its description, the ranking table, the figure, the pairs, the link."""
    import mlflow  # deferred: mlflow takes seconds to import, and --help or refused input needs none of it
    import pandas as pd

    profile, ranking = request.profile, o.ranking
    mlflow.set_tag("mlflow.note.content", o.text)
    mlflow.log_text(o.text + "\n", "compare.md")
    rows = report.rows(ranking, o.figures, o.break_even, profile.class_floor, profile.min_share, o.incumbent,
                       {cand.label: cand.record.run_id for cand in gated}, o.flags, o.per_request)  # fmt: skip
    mlflow.log_table(pd.DataFrame(rows), artifact_file="ranking.json")
    pairs = [{"a": a, "b": b, "difference": d.estimate, "paired_low": d.low, "paired_high": d.high,
              "unpaired_low": d.unpaired_low, "unpaired_high": d.unpaired_high, "paired_narrower": d.narrower,
              "tied": d.tied, "prompts": d.prompts} for (a, b), d in ranking.pairs.items()]  # fmt: skip
    if pairs:
        mlflow.log_table(pd.DataFrame(pairs), artifact_file="pairs.json")
    log_figure(report.figure(ranking, o.figures, o.break_even, profile.class_floor, profile.draft_steps,
                             f"bake-off on {profile.name}"), "compare.png")  # fmt: skip
    top = o.winner or ranking.order[0]
    mlflow.set_tags({"compare.winner": o.winner or "none (every candidate is flagged)",
                     "compare.compare_runs": o.compare_link,
                     "compare.flagged": ",".join(o.flags) or "none",
                     "compare.evaluated": ",".join(x.label for x in gated if x.evaluated) or "none",
                     "compare.reused": ",".join(x.label for x in gated if not x.evaluated) or "none",
                     "compare.outcome": o.final[:4000]})  # fmt: skip
    metrics = {"winner_accept_len": o.figures[top][1].accept_len, "break_even_accept_len": o.break_even[top],
               "evaluated": float(sum(x.evaluated for x in gated)), "compare_seconds": o.seconds}  # fmt: skip
    if pairs:
        metrics["median_paired_narrower"] = float(sorted(p["paired_narrower"] for p in pairs)[len(pairs) // 2])
    mlflow.log_metrics(metrics)


def main(argv: list[str] | None = None) -> None:
    run_step("compare", build, run, argv)


if __name__ == "__main__":
    main()
