"""`calibrate`: measure a deployment's cost model on its serving engine and write the profile the gate uses.

Plain decode tok/s per concurrency and the cost of one speculative cycle per (draft depth, concurrency),
timed from real cycles (vLLM's per-request counters; prefill left out), fitted as verify + k x draft_step.
Break-even is then plain_tps(c) x cycle_ms(k, c) / 1000 at each operating point. Either launches the
engine's servers here (one plain, one per depth; always stopped) or times servers you run
(--endpoint, --plain_endpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import metric_names as names
from common.errors import BadInput, InternalError
from common.values import MAX_CONCURRENCY, MAX_ROUNDS, integer, integers, none_if_empty
from reports.plotting import log_figure
from steps._cli import log_params, run_step, step_run
from steps._params import Param, Spec

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


def parse_shares(value: str, loads: list[int]) -> dict[int, float]:
    if not none_if_empty(value):
        return {c: 1 / len(loads) for c in loads}
    try:
        shares = [float(x) for x in value.split(",")]
    except ValueError:
        raise BadInput(f"--shares must be comma-separated numbers, got {value!r}") from None
    if len(shares) != len(loads) or any(not 0 <= s <= 1 for s in shares) or abs(sum(shares) - 1) > 1e-6:
        raise BadInput(f"--shares needs one share in [0, 1] per concurrency ({len(loads)}), summing to 1")
    return dict(zip(loads, shares, strict=True))


@dataclass(frozen=True)
class Request:
    args: argparse.Namespace
    loads: list[int]
    shares: dict[int, float]
    limit: int
    max_new: int
    out: Path
    source: Path  # the profile the evaluation settings are taken from
    endpoints: list[str]
    plain_url: str


@dataclass
class Timings:
    """What the servers measured: plain decoding per load, cycles per (depth, load), and their provenance."""

    plain: dict
    spec: dict
    measured: dict
    logs: list[str]
    prompts_digest: str
    t0: float


@dataclass
class Calibration:
    """The cost model fitted from the timings, and the profile text that carries it."""

    ops: list
    depths: list[int]
    choice: Any
    text: str
    observed: dict
    warnings: list[str]
    record: dict  # calibration.json


def run(args: argparse.Namespace) -> int:
    request = parse(args)
    timings = measure(request)
    cal = conclude(request, timings)
    profile = write_profile(request.out, cal.text)
    publish(request, timings, cal, profile)
    report(request, timings, cal)
    return 0


def parse(args: argparse.Namespace) -> Request:
    from serving.profile import load_profile, profile_path

    loads = integers(args.concurrency, "concurrency", 1, MAX_CONCURRENCY)
    shares = parse_shares(args.shares, loads)
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
    return Request(args, loads, shares, limit, max_new, out, source, endpoints, plain_url)


def measure(request: Request) -> Timings:
    """Plain and speculative cycles timed on servers the user runs, or on servers launched here."""
    args = request.args
    prompts, digest, s = encode(args, request.limit, request.max_new)
    t0 = time.time()
    if request.endpoints:
        plain, spec, measured = time_endpoints(args, request.endpoints, request.plain_url, prompts, request.loads, s)
        logs = []
    else:
        plain, spec, measured, logs = time_launched(args, prompts, request.loads, s)
    measured["prompts_count"] = len(prompts)
    measured["target_precision"] = s.dtype
    return Timings(plain, spec, measured, logs, digest, t0)


def encode(args, limit: int, max_new: int):
    """The prompts as token ids (as evaluate sends them), the prompt file's digest, and the request settings."""
    from common.prompt_files import file_digest, read_prompts
    from drafter.decode.evaluation import encode_prompts, stop_token, target_tokenizer
    from engines.vllm import Settings

    path = Path(args.prompts)
    records = read_prompts(path, limit)
    from drafter.model.target import target_precision

    tokenizer, context = target_tokenizer(args.target)
    ids, _ = encode_prompts(tokenizer, records, context, max_new, 64)
    s = Settings(
        k=1,
        max_new_tokens=max_new,
        stop_token_id=stop_token(tokenizer),
        max_model_len=context,
        dtype=target_precision(args.target),
    )  # served at its own precision, as the deployment serves it
    return [p.tolist() for p in ids], file_digest(path), s


def progress_bar(args, steps: int):
    """A bar over server starts and timings; each step's name is its description."""
    from tqdm.auto import tqdm

    bar = tqdm(total=steps, desc="calibrate", unit="step", disable=not args.progress)
    started = []

    def step(message: str) -> None:
        if started:  # the step before this one is done
            bar.update()
        started.append(message)
        bar.set_description(message)

    return bar, step


def time_launched(args, prompts, loads, s):
    """One plain server and one speculative server per depth, launched here."""
    import tempfile

    from drafter.analysis.compat import require_fit
    from drafter.analysis.step_cost import folder_step_cost
    from drafter.formats.checkpoint import load_config
    from engines import calibration, environment, export
    from registry.access.resolve import resolve_model

    depths = integers(args.draft_steps, "draft_steps", 1, MAX_CONCURRENCY)
    folder, mv = resolve_model(args.drafter)
    require_fit(folder, args.target, f"drafter {args.drafter} does not fit target {args.target}")
    python = environment.find_python("vllm", none_if_empty(args.engine_python))
    version = environment.engine_version(python)
    workdir = Path(tempfile.mkdtemp(prefix="drafterops-calibrate-"))
    exported = export.write(Path(folder), workdir / "drafter-vllm", "vllm", depths[-1], args.target)
    served = calibration.Served(python, version, Path(exported.target), exported.folder, workdir)
    rounds = integer(args.rounds, "rounds", 1, MAX_ROUNDS)
    bar, step = progress_bar(args, 1 + len(depths) + rounds * len(loads))
    try:
        plain, spec, logs = calibration.measure_launched(served, prompts, s, depths, loads, step, rounds)
        bar.update()
    finally:
        bar.close()
    from drafter.analysis.fingerprint import target_digest

    measured = {
        "engine": version,
        "target": str(args.target),
        "target_digest": target_digest(args.target),
        "drafter": f"models:/{mv.name}/{mv.version}" if mv is not None else str(args.drafter),
        "drafter_aux_layer_ids": list(load_config(folder).aux_layer_ids),
        "hardware": hardware(logs),
    }
    if not measured["hardware"].startswith("cpu"):  # what its draft steps read (drafter.analysis.step_cost): the size
        # other drafters' steps are priced by; a CPU's step is bound by its operations instead (not recorded)
        measured["drafter_step_params"] = folder_step_cost(folder).per_step
    if args.synthetic == "yes":
        ok, why = calibration.synthetic_supported(version)
        if not ok:
            print(f"calibrate: {why}")
            measured["synthetic"] = why
        else:
            measured["synthetic_sweep"] = calibration.synthetic_sweep(served, prompts, s, depths, loads[0])
    return plain, spec, measured, logs


def time_endpoints(args, endpoints, plain_url, prompts, loads, s):
    """Servers the user runs: each speculative one's depth read from its counters (or --draft_steps)."""
    from engines import calibration, vllm

    vllm.check_endpoint(plain_url, spec=False)
    given = integers(args.draft_steps, "draft_steps", 1, MAX_CONCURRENCY) if none_if_empty(args.draft_steps) else []
    if given and len(given) != len(endpoints):
        given = []
    depths = {}
    for i, url in enumerate(endpoints):
        vllm.check_endpoint(url, spec=True)
        k = calibration.server_depth(url) or (given[i] if given else None)
        if k is None:
            raise BadInput(f"{url}: its depth cannot be read from its counters; give --draft_steps, one per endpoint")
        if k in depths:
            raise BadInput(f"{url} and {depths[k]} both serve depth {k}")
        depths[k] = url
    rounds = integer(args.rounds, "rounds", 1, MAX_ROUNDS)
    bar, step = progress_bar(args, len(loads) * rounds)
    try:
        plain, spec = calibration.measure_endpoints(depths, plain_url, prompts, s, loads, step, rounds)
        bar.update()
    finally:
        bar.close()
    measured = {
        "engine": "vllm (endpoint)",
        "endpoints": {str(k): u for k, u in depths.items()},
        "plain_endpoint": plain_url,
        "target": str(args.target),
        "hardware": "as served at the endpoints",
    }
    if len(depths) == 1:
        print("calibrate: one depth timed: the whole cycle is verify_ms (give a server per depth to split it)")
    return plain, spec, measured


def hardware(logs: list[str]) -> str:
    """The platform the engine detected (its log), and the host's CPU."""
    import os
    import platform
    import re

    detected = ""
    for log in logs[:1]:
        try:
            m = re.search(r"device_config=(\w+)", Path(log).read_text(errors="replace"))
            detected = m.group(1) if m else ""
        except OSError:
            pass
    cpu = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    return (
        f"{detected or 'unknown'} platform; {cpu or platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    )


def conclude(request: Request, t: Timings) -> Calibration:
    """Operating points fitted from the timings, the depth to serve at, and the profile's text."""
    import yaml

    from reports import calibration as report
    from serving.cycle_model import primary, recommend_depth

    args, loads, plain, spec = request.args, request.loads, t.plain, t.spec
    depths = sorted(spec)
    ops = report.operating_points(
        {c: plain[c].tps for c in loads}, {k: {c: spec[k][c].cycle_ms for c in loads} for k in depths}, request.shares
    )
    deepest = spec[depths[-1]][loads[0]]
    acc_pos = [
        n / r if r else 0.0
        for n, r in zip(deepest.accepted_at, [deepest.cycles, *deepest.accepted_at][:-1], strict=True)
    ]
    choice = recommend_depth(acc_pos, primary(ops), depths) if acc_pos else None
    serve_k = integer(args.serve_draft_steps, "serve_draft_steps", 1) if none_if_empty(args.serve_draft_steps) else (
        choice.k if choice else depths[0]
    )  # fmt: skip
    measured = t.measured
    measured.update(target=str(args.target), target_digest=deployed_target_digest(args.target))
    measured.update(
        date=time.strftime("%Y-%m-%d"), draft_steps=depths, concurrency=loads, prompts=str(args.prompts),
        prompts_sha256=t.prompts_digest, max_new_tokens=request.max_new,
        command=" ".join(shlex.quote(a) for a in ["python", "-m", "steps.calibrate", *sys.argv[1:]]),
    )  # fmt: skip
    source, out = request.source, request.out
    description = (
        f"Measured by calibrate on {measured['engine']} ({measured['hardware']}): plain decode and speculative "
        f"cycles at depths {depths} and concurrency {loads}; evaluation settings from {source.stem}."
    )
    text = report.profile_text(out.stem, description, ops, serve_k, measured,
                               report.eval_fields_from(yaml.safe_load(source.read_text()), source, out))  # fmt: skip
    warnings = report.inversions(ops, depths)
    record = {
        "plain": {str(c): plain[c].to_dict() for c in loads},
        "spec": {str(k): {str(c): spec[k][c].to_dict() for c in loads} for k in depths},
        "operating_points": [op.identity() | {"residuals_ms": op.residuals()} for op in ops],
        "calibration_drafter_acc_pos": acc_pos,
        "recommended": choice.sentence() if choice else None,
        "timing_inversions": warnings,
        "measured": measured,
        "seconds": round(time.time() - t.t0, 1),
    }
    observed = {(k, c): (spec[k][c].accept_len, spec[k][c].tps) for k in depths for c in loads}
    return Calibration(ops, depths, choice, text, observed, warnings, record)


def deployed_target_digest(target: str) -> str:
    """The digest of the target the engine served, which evidence for this profile must then carry."""
    from drafter.analysis.fingerprint import target_digest

    try:
        return target_digest(target)
    except BadInput as exc:
        print(f"calibrate: warning: {exc}; the profile records no target digest, so no evidence can count "
              "under it until it is recalibrated where the target's files are", file=sys.stderr)  # fmt: skip
        return ""


def write_profile(out: Path, text: str) -> Any:
    """The profile written whole and signed by this calibration's key (a partial file, checked by loading
    it, then renamed over `out`): numbers edited later no longer verify, and read as a hand-written profile."""
    import yaml

    from registry.ledger.deployment import sign_calibration
    from serving.profile import load_profile

    tmp = out.with_name(f".{out.stem}.partial{out.suffix}")
    tmp.write_text(text)
    try:
        signed = sign_calibration(load_profile(str(tmp)))
        tmp.write_text(text.rstrip("\n") + "\n" + yaml.safe_dump({"signed": signed}, sort_keys=True))
        profile = load_profile(str(tmp))
    except BadInput as exc:
        tmp.unlink()
        raise InternalError(f"the profile calibrate measured does not load: {exc}") from None  # its own output
    tmp.replace(out)
    return profile


def publish(request: Request, t: Timings, cal: Calibration, profile: Any) -> None:
    """The run: params, each operating point's figures, the record, the profile, the figure and the logs."""
    import mlflow

    from reports import calibration as report

    args, loads, out, depths, ops = request.args, request.loads, request.out, cal.depths, cal.ops
    engine = t.measured["engine"]
    with step_run("calibrate", run_name=f"calibrate {out.stem} on {engine}"):
        log_params({"target": args.target, "engine": args.engine, "draft_steps": ",".join(map(str, depths)),
                    "concurrency": ",".join(map(str, loads)),
                    "shares": ",".join(f"{request.shares[c]:g}" for c in loads),
                    "drafter": args.drafter, "prompts": args.prompts, "limit": args.limit,
                    "max_new_tokens": args.max_new_tokens, "out": str(out),
                    "endpoint": args.endpoint, "plain_endpoint": args.plain_endpoint})  # fmt: skip
        mlflow.log_metrics(operating_metrics(ops, depths))
        mlflow.log_dict(cal.record, "calibration.json")
        mlflow.log_artifact(str(out), "profile")
        log_figure(report.figure(ops, depths, cal.observed), "served_tps_vs_accept_len.png")
        for log in t.logs:
            if Path(log).is_file():
                mlflow.log_artifact(log, "engine_logs")
        mlflow.set_tag("mlflow.note.content", f"Wrote `{out}` ({profile.name}, digest {profile.digest[:12]}): "
                       f"{cal.record['recommended'] or ''}\n\n" + "\n".join(table(ops, depths))
                       + "".join(f"\n\nWarning: {w}." for w in cal.warnings))  # fmt: skip
        mlflow.set_tags({"profile": profile.name, "profile_digest": profile.digest[:16], "engine": engine,
                         "timing_inversions": str(len(cal.warnings))})  # fmt: skip


def operating_metrics(ops, depths: list[int]) -> dict[str, float]:
    metrics = {}
    for op in ops:
        c = op.concurrency
        metrics[names.at_concurrency("plain_tps", c)] = op.plain_tps
        metrics[names.at_concurrency("verify_ms", c)] = op.verify_ms
        metrics[names.at_concurrency("draft_step_ms", c)] = op.draft_step_ms
        for k in depths:
            metrics[names.at_depth_and_concurrency("cycle_ms", k, c)] = op.cycle_ms(k)
            metrics[names.at_depth_and_concurrency("break_even", k, c)] = op.break_even(k)
    return metrics


def report(request: Request, t: Timings, cal: Calibration) -> None:
    print("\n".join(table(cal.ops, cal.depths)))
    for line in cal.warnings:
        print(f"calibrate: warning: {line}", file=sys.stderr)
    choice = cal.choice
    print(f"calibrate: wrote {request.out} ({time.time() - t.t0:.0f} s)" + (f"; {choice.sentence()}" if choice else ""))


def table(ops, depths) -> list[str]:
    head = "| concurrency | share | plain tok/s | " + " | ".join(f"k={k}: cycle ms / break-even" for k in depths)
    lines = [head + " | fit verify + k x step (ms) |", "|---" * (len(depths) + 4) + "|"]
    for op in ops:
        cells = " | ".join(f"{op.cycle_ms(k):.2f} / {op.break_even(k):.3f}" for k in depths)
        lines.append(f"| {op.concurrency} | {op.share:.0%} | {op.plain_tps:.1f} | {cells} | "
                     f"{op.verify_ms:.2f} + k x {op.draft_step_ms:.3f} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> None:
    run_step("calibrate", build, run, argv)


if __name__ == "__main__":
    main()
