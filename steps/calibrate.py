"""`calibrate`: measure a deployment's cost model on its serving engine and write the profile the gate uses.

Plain decode tok/s per concurrency and the cost of one speculative cycle per (draft depth, concurrency),
timed from real cycles (vLLM's per-request counters; prefill left out), fitted as verify + k x draft_step.
Break-even is then plain_tps(c) x cycle_ms(k, c) / 1000 at each operating point. Either launches the
engine's servers here (one plain, one per depth; always stopped) or times servers you run
(--endpoint, --plain_endpoint).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cli.spec import Param, Spec
from cli.step import log_params, run_step, step_run
from common.errors import BadInput
from common.values import MAX_CONCURRENCY, MAX_ROUNDS, integer, integers, none_if_empty, traffic_shares
from reports import calibration as report
from reports.plotting import log_figure
from serving.profile import load_profile, profile_path

if TYPE_CHECKING:
    from pipeline.calibration import Calibration, Request, Timings

SPEC = Spec(
    "calibrate",
    __doc__,
    (
        Param("target", default="miniworld/k2.5-mini", in_repo=True),
        Param("engine", default="vllm", help="the serving engine (vLLM's counters)", choices=("vllm",)),
        Param("draft_steps", default="1,2,3,4", help="draft depths to time (auto with --endpoint: the servers')"),
        Param("concurrency", default="1,4", help="operating points: requests in flight"),
        Param("shares", default="auto", help="traffic share of each concurrency (auto: equal)"),
        Param("drafter", default="miniworld/aq-mini-eagle3", in_repo=True, help="the drafter cycles are timed with"),
        Param(
            "method_drafters",
            default="none",
            help="drafters of other methods (DFlash, P-EAGLE), comma-separated: "
            "each method's cycles timed by width, its break-even its own",
        ),
        Param("method_widths", default="2,4", help="widths (draft tokens) each --method_drafters drafter is timed at"),
        Param(
            "prompts",
            default="miniworld/prompts/k2.5-val.jsonl",
            in_repo=True,
            help="JSON Lines prompts sent to the servers",
        ),
        Param("limit", default="16", help="prompts per timing"),
        Param("max_new_tokens", default="64"),
        Param("rounds", default="2", help="timing rounds, every server in turn each round"),
        Param("out", default="none", help="the profile to write (configs/profiles/<name>.yaml)"),
        Param("overwrite", bare="yes", default="no", help="replace --out", choices=("yes", "no")),
        Param("eval_from", default="host", help="profile whose pinned prompts and eval settings are copied"),
        Param("serve_draft_steps", default="auto", help="the depth the deployment runs (auto: recommended)"),
        Param("endpoint", default="none", help="speculative server(s) you run, comma-separated"),
        Param("plain_endpoint", default="none", help="the same target served without speculation"),
        Param(
            "synthetic",
            bare="yes",
            default="no",
            help="also sweep accept_len with the engine's synthetic acceptance (vLLM on GPU)",
            choices=("yes", "no"),
        ),
        Param("engine_python", default="none"),
        Param("no-progress", flag=True, off=True, dest="progress", cli=True),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


def run(args: argparse.Namespace) -> int:
    # deferred: torch comes with these, and --help or refused input needs none of it
    from pipeline.calibration import conclude, measure, write_profile

    request = parse(args)
    timings = measure(request, lambda steps: progress_bar(args.progress, steps))
    cal = conclude(request, timings)
    profile = write_profile(request.out, cal.text)
    publish(args, request, timings, cal, profile)
    report_here(request, timings, cal)
    return 0


def parse(args: argparse.Namespace) -> Request:
    # deferred: torch comes with these, and --help or refused input needs none of it
    from pipeline.calibration import Request

    loads = integers(args.concurrency, "concurrency", 1, MAX_CONCURRENCY)
    shares = traffic_shares(args.shares, loads)
    limit = integer(args.limit, "limit", 1)
    max_new = integer(args.max_new_tokens, "max_new_tokens", 2)
    out = Path(none_if_empty(args.out) or "")
    if not none_if_empty(args.out) or out.suffix not in (".yaml", ".yml"):
        raise BadInput(f"--out must name the profile to write (a .yaml file), got {args.out!r}")
    if out.exists() and args.overwrite != "yes":
        raise BadInput(f"--out {out} exists (give --overwrite to replace it)")
    if not out.resolve().parent.is_dir():
        raise BadInput(f"--out {out}: folder {out.parent} does not exist")
    source = profile_path(args.eval_from)
    load_profile(str(source))  # checked before anything is measured
    endpoints = [u.strip().rstrip("/") for u in (none_if_empty(args.endpoint) or "").split(",") if u.strip()]
    plain_url = (none_if_empty(args.plain_endpoint) or "").rstrip("/")
    if bool(endpoints) != bool(plain_url):
        raise BadInput("--endpoint (speculative servers) and --plain_endpoint go together")
    if not endpoints:
        integers(args.draft_steps, "draft_steps", 1, MAX_CONCURRENCY)  # the depths to launch: checked up front
    rounds = integer(args.rounds, "rounds", 1, MAX_ROUNDS)
    named = none_if_empty(args.method_drafters) or ""
    method_drafters = tuple(d.strip() for d in named.split(",") if d.strip())
    if named and not method_drafters:
        raise BadInput(f"--method_drafters {named!r} names no drafter")
    if method_drafters and endpoints:
        raise BadInput("--method_drafters are timed on servers launched here, not with --endpoint")
    widths = tuple(integers(args.method_widths, "method_widths", 1, MAX_CONCURRENCY))
    command = " ".join(shlex.quote(a) for a in ["python", "-m", "steps.calibrate", *sys.argv[1:]])
    return Request(args.target, args.drafter, args.prompts, args.draft_steps, loads, shares, limit, max_new, rounds,
                   out, source, endpoints, plain_url, args.serve_draft_steps, none_if_empty(args.engine_python),
                   args.synthetic == "yes", command, method_drafters, widths)  # fmt: skip


def progress_bar(shown: bool, steps: int):
    """A bar over server starts and timings; each step's name is its description."""
    from tqdm.auto import tqdm  # deferred: tqdm.auto probes for a notebook

    bar = tqdm(total=steps, desc="calibrate", unit="step", disable=not shown)
    started = []

    def step(message: str) -> None:
        if started:  # the step before this one is done
            bar.update()
        started.append(message)
        bar.set_description(message)

    return bar, step


def publish(args: argparse.Namespace, request: Request, t: Timings, cal: Calibration, profile) -> None:
    """The run: params, each operating point's figures, the record, the profile, the figure and the logs."""
    import mlflow  # deferred: seconds to import, and --help needs none of it

    loads, out, depths, ops = request.loads, request.out, cal.depths, cal.ops
    engine = t.measured["engine"]
    with step_run("calibrate", run_name=f"calibrate {out.stem} on {engine}"):
        log_params({"target": args.target, "engine": args.engine, "draft_steps": ",".join(map(str, depths)),
                    "concurrency": ",".join(map(str, loads)),
                    "shares": ",".join(f"{request.shares[c]:g}" for c in loads),
                    "drafter": args.drafter, "prompts": args.prompts, "limit": args.limit,
                    "max_new_tokens": args.max_new_tokens, "out": str(out),
                    "endpoint": args.endpoint, "plain_endpoint": args.plain_endpoint})  # fmt: skip
        mlflow.log_metrics(report.operating_metrics(ops, depths))
        mlflow.log_dict(cal.record, "calibration.json")
        mlflow.log_artifact(str(out), "profile")
        log_figure(report.figure(ops, depths, cal.observed), "served_tps_vs_accept_len.png")
        for log in t.logs:
            if Path(log).is_file():
                mlflow.log_artifact(log, "engine_logs")
        mlflow.set_tag("mlflow.note.content", f"Wrote `{out}` ({profile.name}, digest {profile.digest[:12]}): "
                       f"{cal.record['recommended'] or ''}\n\n" + "\n".join(report.table(ops, depths))
                       + "".join(f"\n\nWarning: {w}." for w in cal.warnings))  # fmt: skip
        mlflow.set_tags({"profile": profile.name, "profile_digest": profile.digest[:16], "engine": engine,
                         "timing_inversions": str(len(cal.warnings))})  # fmt: skip


def report_here(request: Request, t: Timings, cal: Calibration) -> None:
    print("\n".join(report.table(cal.ops, cal.depths)))
    for line in cal.warnings:
        print(f"calibrate: warning: {line}", file=sys.stderr)
    choice = cal.choice
    print(f"calibrate: wrote {request.out} ({time.time() - t.t0:.0f} s)" + (f"; {choice.sentence()}" if choice else ""))


def main(argv: list[str] | None = None) -> None:
    run_step("calibrate", build, run, argv)


if __name__ == "__main__":
    main()
