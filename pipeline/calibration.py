"""calibrate as a service: plain decoding and speculative cycles timed on the engine's servers (launched here,
or run by the user), fitted into operating points (verify + k x draft_step per load), the depth to serve at
chosen, and the profile written whole and signed by the calibration key."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from common.errors import BadInput, InternalError
from common.prompt_files import file_digest, read_prompts
from common.values import MAX_CONCURRENCY, integer, integers, none_if_empty
from drafter.analysis.fingerprint import target_digest
from drafter.analysis.step_cost import folder_step_cost
from drafter.formats.checkpoint import load_config
from drafter.methods import require_fit
from engines import calibration, environment, export, vllm
from registry.ledger.deployment import sign_calibration
from reports import calibration as report
from serving.cycle_model import primary, recommend_depth
from serving.profile import load_profile

Progress = Callable[[int], tuple[Any, Callable[[str], None]]]  # steps -> (a bar to close, name the next step)


@dataclass(frozen=True)
class Request:
    """What to calibrate, as checked by the step: the target and drafter served, the prompts, the loads and
    their shares, where the servers are (none: launched here), and the profile to write."""

    target: str
    drafter: str
    prompts: str
    draft_steps: str  # depths to time (with endpoints: optional, one per endpoint)
    loads: list[int]
    shares: dict[int, float]
    limit: int
    max_new: int
    rounds: int
    out: Path
    source: Path  # the profile the evaluation settings are taken from
    endpoints: list[str]
    plain_url: str
    serve_draft_steps: str  # the depth the deployment runs ("": the recommended one)
    engine_python: str | None
    synthetic: bool
    command: str  # how calibrate was called, recorded in the profile
    method_drafters: tuple[str, ...] = ()  # drafters of other methods (DFlash, P-EAGLE), each timed by width
    method_widths: tuple[int, ...] = ()


@dataclass
class Timings:
    """What the servers measured: plain decoding per load, cycles per (depth, load), and their provenance."""

    plain: dict
    spec: dict
    measured: dict
    logs: list[str]
    prompts_digest: str
    t0: float
    # per other method (drafter/methods NAME): the drafter timed, and its own plain and speculative timings by width
    methods: dict = field(default_factory=dict)


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


def measure(request: Request, progress: Progress) -> Timings:
    """Plain and speculative cycles timed on servers the user runs, or on servers launched here."""
    prompts, digest, s = encode(request)
    t0 = time.time()
    methods: dict = {}
    if request.endpoints:
        plain, spec, measured = time_endpoints(request, prompts, s, progress)
        logs = []
    else:
        plain, spec, measured, logs, methods = time_launched(request, prompts, s, progress)
    measured["prompts_count"] = len(prompts)
    measured["target_precision"] = s.dtype
    return Timings(plain, spec, measured, logs, digest, t0, methods)


def encode(request: Request):
    """The prompts as token ids (as evaluate sends them), the prompt file's digest, and the request settings."""
    from drafter.decode.evaluation import encode_prompts, stop_token, target_tokenizer  # deferred: transformers
    from drafter.model.target import target_precision

    path = Path(request.prompts)
    records = read_prompts(path, request.limit)
    tokenizer, context = target_tokenizer(request.target)
    ids, _ = encode_prompts(tokenizer, records, context, request.max_new, 64)
    s = vllm.Settings(
        k=1,
        max_new_tokens=request.max_new,
        stop_token_id=stop_token(tokenizer),
        max_model_len=context,
        dtype=target_precision(request.target),
    )  # served at its own precision, as the deployment serves it
    return [p.tolist() for p in ids], file_digest(path), s


def time_launched(request: Request, prompts, s, progress: Progress):
    """One plain server and one speculative server per depth, launched here."""
    from registry.access.resolve import resolve_model  # deferred: torch comes with the registry's store

    depths = integers(request.draft_steps, "draft_steps", 1, MAX_CONCURRENCY)
    folder, mv = resolve_model(request.drafter)
    require_fit(folder, request.target, f"drafter {request.drafter} does not fit target {request.target}")
    other_folders = method_folders(request)  # every one checked before the engine is looked for
    python = environment.find_python("vllm", request.engine_python)
    version = environment.engine_version(python)
    workdir = Path(tempfile.mkdtemp(prefix="drafterops-calibrate-"))
    exported = export.write(Path(folder), workdir / "drafter-vllm", "vllm", depths[-1], request.target)
    served = calibration.Served(python, version, Path(exported.target), exported.folder, workdir)
    others = {name: (label, exported_for(Path(f), workdir, name, request, python, version))
              for name, (label, f) in other_folders.items()}  # fmt: skip
    widths = list(request.method_widths)
    per_round = request.rounds * len(request.loads)
    bar, step = progress(1 + len(depths) + per_round + len(others) * (2 + len(widths) + per_round))
    try:
        plain, spec, logs = calibration.measure_launched(served, prompts, s, depths, request.loads, step,
                                                         request.rounds)  # fmt: skip
        methods = {}
        for name, (label, other) in others.items():  # a plain server again beside each: the host's drift cancels
            m_plain, m_spec, m_logs = calibration.measure_launched(other, prompts, s, widths, request.loads, step,
                                                                   request.rounds)  # fmt: skip
            methods[name] = {"drafter": label, "plain": m_plain, "spec": m_spec}
            logs += m_logs
        bar.update()
    finally:
        bar.close()
    measured = {
        "engine": version,
        "target": str(request.target),
        "target_digest": target_digest(request.target),
        "drafter": f"models:/{mv.name}/{mv.version}" if mv is not None else str(request.drafter),
        "drafter_aux_layer_ids": list(load_config(folder).aux_layer_ids),
        "hardware": hardware(logs),
    }
    if not measured["hardware"].startswith("cpu"):  # what its draft steps read (drafter.analysis.step_cost): the size
        # other drafters' steps are priced by; a CPU's step is bound by its operations instead (not recorded)
        measured["drafter_step_params"] = folder_step_cost(folder).per_step
    if request.synthetic:
        ok, why = calibration.synthetic_supported(version)
        if not ok:
            print(f"calibrate: {why}")
            measured["synthetic"] = why
        else:
            measured["synthetic_sweep"] = calibration.synthetic_sweep(served, prompts, s, depths, request.loads[0])
    if methods:
        measured["method_drafters"] = {name: m["drafter"] for name, m in methods.items()}
        measured["method_widths"] = widths
    return plain, spec, measured, logs, methods


def method_folders(request: Request) -> dict[str, tuple[str, str]]:
    """Each --method_drafters drafter (one per method other than the chain --drafter's), fitted to the target:
    {method NAME: (what is timed, its folder)}."""
    from drafter.methods import DEFAULT, folder_method_or_default
    from registry.access.resolve import resolve_model  # deferred: torch comes with the registry's store

    out: dict[str, tuple[str, str]] = {}
    for given in request.method_drafters:
        folder, mv = resolve_model(given)
        method = folder_method_or_default(folder)
        if method is DEFAULT:
            raise BadInput(f"--method_drafters {given} is an {method.LABEL} drafter: its cycles are --drafter's")
        if method.NAME in out:
            raise BadInput(f"--method_drafters names two {method.LABEL} drafters ({out[method.NAME][0]}, {given})")
        require_fit(folder, request.target, f"drafter {given} does not fit target {request.target}")
        method.check_width(Path(folder), max(request.method_widths), "--method_widths")
        out[method.NAME] = (f"models:/{mv.name}/{mv.version}" if mv is not None else str(given), str(folder))
    return out


def exported_for(folder: Path, workdir: Path, name: str, request: Request, python: Path, version: str):
    """How to serve another method's drafter: exported for vLLM at the widest width timed."""
    exported = export.write(folder, workdir / f"drafter-{name}", "vllm", max(request.method_widths), request.target)
    return calibration.Served(python, version, Path(exported.target), exported.folder, workdir)


def time_endpoints(request: Request, prompts, s, progress: Progress):
    """Servers the user runs: each speculative one's depth read from its counters (or --draft_steps)."""
    endpoints, plain_url, loads = request.endpoints, request.plain_url, request.loads
    vllm.check_endpoint(plain_url, spec=False)
    wanted = none_if_empty(request.draft_steps)
    given = integers(request.draft_steps, "draft_steps", 1, MAX_CONCURRENCY) if wanted else []
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
    bar, step = progress(len(loads) * request.rounds)
    try:
        plain, spec = calibration.measure_endpoints(depths, plain_url, prompts, s, loads, step, request.rounds)
        bar.update()
    finally:
        bar.close()
    measured = {
        "engine": "vllm (endpoint)",
        "endpoints": {str(k): u for k, u in depths.items()},
        "plain_endpoint": plain_url,
        "target": str(request.target),
        "hardware": "as served at the endpoints",
    }
    if len(depths) == 1:
        print("calibrate: one depth timed: the whole cycle is verify_ms (give a server per depth to split it)")
    return plain, spec, measured


def hardware(logs: list[str]) -> str:
    """The platform the engine detected (its log), and the host's CPU."""
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
    loads, plain, spec = request.loads, t.plain, t.spec
    depths = sorted(spec)
    ops = report.operating_points(
        {c: plain[c].tps for c in loads}, {k: {c: spec[k][c].cycle_ms for c in loads} for k in depths}, request.shares
    )
    method_cycles = {name: report.method_cycles(m["plain"], m["spec"], plain) for name, m in t.methods.items()}
    ops = tuple(replace(op, method_cycles=tuple(sorted((name, by_c[op.concurrency])
                                                       for name, by_c in method_cycles.items())))
                for op in ops)  # fmt: skip
    deepest = spec[depths[-1]][loads[0]]
    acc_pos = [
        n / r if r else 0.0
        for n, r in zip(deepest.accepted_at, [deepest.cycles, *deepest.accepted_at][:-1], strict=True)
    ]
    choice = recommend_depth(acc_pos, primary(ops), depths) if acc_pos else None
    wanted = none_if_empty(request.serve_draft_steps)
    serve_k = integer(request.serve_draft_steps, "serve_draft_steps", 1) if wanted else (
        choice.k if choice else depths[0]
    )  # fmt: skip
    measured = t.measured
    measured.update(target=str(request.target), target_digest=deployed_target_digest(request.target))
    measured.update(
        date=time.strftime("%Y-%m-%d"), draft_steps=depths, concurrency=loads, prompts=str(request.prompts),
        prompts_sha256=t.prompts_digest, max_new_tokens=request.max_new, command=request.command,
    )  # fmt: skip
    source, out = request.source, request.out
    description = (
        f"Measured by calibrate on {measured['engine']} ({measured['hardware']}): plain decode and speculative "
        f"cycles at depths {depths} and concurrency {loads}; evaluation settings from {source.stem}."
    )
    text = report.profile_text(out.stem, description, ops, serve_k, measured,
                               report.eval_fields_from(yaml.safe_load(source.read_text()), source, out))  # fmt: skip
    warnings = report.inversions(ops, depths) + report.method_inversions(ops)
    record = {
        "plain": {str(c): plain[c].to_dict() for c in loads},
        "spec": {str(k): {str(c): spec[k][c].to_dict() for c in loads} for k in depths},
        "operating_points": [op.identity() | {"residuals_ms": op.residuals()} for op in ops],
        "methods": {
            name: {
                "drafter": m["drafter"],
                "plain": {str(c): m["plain"][c].to_dict() for c in loads},
                "spec": {str(k): {str(c): by_c[c].to_dict() for c in loads} for k, by_c in m["spec"].items()},
            }
            for name, m in t.methods.items()
        },
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
    try:
        return target_digest(target)
    except BadInput as exc:
        print(f"calibrate: warning: {exc}; the profile records no target digest, so no evidence can count "
              "under it until it is recalibrated where the target's files are", file=sys.stderr)  # fmt: skip
        return ""


def write_profile(out: Path, text: str) -> Any:
    """The profile written whole and signed by this calibration's key (a partial file, checked by loading
    it, then renamed over `out`): numbers edited later no longer verify, and read as a hand-written profile."""
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
