"""Measure a drafter on a serving engine, and catch the engine's faults instead of averaging them in.

What is handed to the engine is prepared here: the target as the engine loads it (engines/target_view),
the drafter exported in the engine's reading of the aux layer ids (drafter/aux_layers). Afterwards,
greedy output with the drafter must equal greedy output without it and the project's own greedy
decoding, and, when the project's decoder ran the same drafter on the same prompts, the engine's
accept_len must agree with it: a speculative engine that changes the output, or feeds the drafter
other layers than it was trained on, is a fault (exit 3 naming the engine and the first differing
prompt), never a figure.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.errors import BadInput, InternalError
from drafter.formats import aux_layers
from drafter.formats.checkpoint import load_config
from drafter.methods import folder_method
from engines import environment, export, sglang, vllm
from engines.measurement import EngineRun, Launch, first_difference
from engines.protocol import Job
from serving.cost import projected_tps
from serving.profile import Profile

ENGINES = ("vllm", "sglang")
PRECISION_TOLERANCE = 0.05  # a run below float32: its accept_len against the engine's own at float32


def run_engine(
    engine: str,
    folder: Path,
    target: Path,
    prompts: list[list[int]],
    settings: vllm.Settings,
    python: str | None = None,
    endpoint: str | None = None,
    handed_ids: list[int] | None = None,
    workdir: Path | None = None,
    progress: bool = True,
    check: Callable[[EngineRun], None] | None = None,
    fmt: str = "plain",
) -> EngineRun:
    """Serve `target` with the drafter in `folder` on `engine` (or measure a user's `endpoint`);
    `check` is called on the speculative half as soon as it is measured."""
    aux = _aux_record(folder, engine, handed_ids)
    if fmt not in ("plain", "speculators") or (fmt == "speculators" and engine != "vllm"):
        raise BadInput(f"--format {fmt} is not one {engine} serves (plain; speculators on vllm)")
    if endpoint:
        run = vllm.measure_endpoint(endpoint, f"{engine} (endpoint)", prompts, settings, progress)
        run.engine, run.aux = engine, aux
        if check is not None:
            check(run)
        return run
    py = environment.find_python(engine, python)
    version = environment.engine_version(py, engine)
    workdir = Path(workdir or tempfile.mkdtemp(prefix=f"drafterops-{engine}-"))
    kind = "speculators" if fmt == "speculators" else engine
    exported = export.write(Path(folder), workdir / f"drafter-{kind}", kind, settings.k, target, handed_ids)
    launch = Launch(py, version, Path(exported.target), exported.folder, workdir, exported.aux, fmt == "speculators")
    return (vllm if engine == "vllm" else sglang).measure(launch, prompts, settings, progress, check)


def _aux_record(folder: Path, engine: str, handed_ids: list[int] | None) -> dict:
    """Which target layers the engine feeds the drafter (another draft method's folder says so itself)."""
    if folder_method(folder) is not None:
        return {"engine": engine, "project_ids": None, "handed_ids": handed_ids, "matches_training": True}
    return aux_layers.mapping(list(load_config(folder).aux_layer_ids), engine, handed_ids)


def measure_checked(
    engine: str,
    folder: Path,
    target: Path,
    prompts: list[list[int]],
    settings: vllm.Settings,
    reference: tuple[list[list[int]], list[tuple[int, int]]] | None,
    tolerance: float,
    min_prompts: float,
    **kw,
) -> tuple[EngineRun, dict[str, float]]:
    """run_engine with the fault checks: against the project's decoding (`reference`: its greedy
    outputs and per-prompt cycles) as soon as the speculative half is measured, and against the engine's
    own plain decoding at the end. Returns the run and the agreement figures."""
    outputs, per_prompt = reference if reference is not None else (None, None)
    agreement: dict[str, float] = {}

    def check(run: EngineRun) -> None:
        check_lossless(run, outputs, settings.temperature)
        agreement.update(check_agreement(run, per_prompt, tolerance, min_prompts))

    run = run_engine(engine, folder, target, prompts, settings, check=check, **kw)
    check_lossless(run, outputs, settings.temperature)
    return run, agreement


def histogram_agreement(run: EngineRun, reference: Any) -> dict[str, float]:
    """The share of requests whose verify-step histogram the engine returned is the project's own, request by
    request, at one precision ({} where either has none)."""
    theirs, ours = run.histograms, getattr(reference, "histograms", None) if reference is not None else None
    if not theirs or not ours or len(theirs) != len(ours):
        return {}
    same = sum(tuple(a) == tuple(b) for a, b in zip(theirs, ours, strict=True))
    return {"engine_histogram_agreement": same / len(ours)}


def check_lossless(run: EngineRun, reference: list[list[int]] | None, temperature: float) -> None:
    """Greedy output must be the same with the drafter, without it, and in the project's decoder."""
    if temperature > 0:
        return
    pairs = [("without the drafter", run.outputs_base), ("from the project's greedy decoding", reference)]
    for what, other in pairs:
        if other is None:
            continue
        i = first_difference(run.outputs_spec, other)
        if i is not None:
            a, b = run.outputs_spec[i], other[i]
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            raise InternalError(
                f"{run.engine_version}: greedy output with the drafter differs from the output {what} on "
                f"prompt {i} (first at token {at}): the engine is not lossless here, so no figure is reported"
                + (f"; logs: {', '.join(run.logs)}" if run.logs else "")
            )


def check_agreement(
    run: EngineRun, inprocess: list[tuple[int, int]] | None, tolerance: float, min_prompts: float
) -> dict[str, float]:
    """How far the engine's figures are from the project's decoder on the same prompts: the pooled
    accept_len (relative) and the share of prompts whose (tokens, cycles) are identical. Beyond
    `tolerance`, or identical on fewer than `min_prompts` of the prompts, it is a fault: the two decode
    the same greedy sequences, so they differ only when the drafter saw other inputs (most often aux
    layers handed in the wrong convention, which can move the pooled figure by under 1%)."""
    if not inprocess:
        return {}
    from serving.workload import pooled

    reference = pooled(inprocess)
    diff = run.accept_len / reference - 1
    same = sum(a == b for a, b in zip(run.per_prompt, inprocess, strict=True)) / len(inprocess)
    if abs(diff) > tolerance or same < min_prompts:
        aux = run.aux
        flags = [f for f, on in (aux.get("norm_flags_read") or {}).items() if on]
        if flags:
            raise InternalError(
                f"{run.engine_version} disagrees with the project's decoder on the same prompts: accept_len "
                f"{run.accept_len:.3f} vs {reference:.3f}, per-prompt cycles identical on {100 * same:.0f}% of "
                f"prompts: it read {', '.join(flags)} as true and built another network than the plain EAGLE-3 "
                "drafter the project trained"
            )
        raise InternalError(
            f"{run.engine_version} disagrees with the project's decoder on the same prompts: accept_len "
            f"{run.accept_len:.3f} vs {reference:.3f} ({100 * diff:+.1f}%, tolerance {100 * tolerance:g}%), "
            f"per-prompt cycles identical on {100 * same:.0f}% of prompts (needs {100 * min_prompts:g}%). "
            f"The drafter was handed aux ids {aux.get('handed_ids')}, which {run.engine} reads as "
            f"'{aux.get('engine_reads_id_as')}': target layer outputs {aux.get('target_layer_outputs_fed')} "
            f"(trained on {aux.get('project_ids')})"
        )
    return {"engine_vs_inprocess": diff, "engine_prompt_agreement": same}


@dataclass(frozen=True)
class Checks:
    """How a served measurement is held to the project's decoding: accept_len within `tolerance`
    (relative), identical cycles on at least `min_prompts` of the prompts; `handed_ids`: aux ids handed to
    the engine as they are (None: the drafter's, translated to the engine's reading)."""

    tolerance: float = 0.02
    min_prompts: float = 0.8
    handed_ids: list[int] | None = None


@dataclass
class ServedRun:
    """A served measurement as a Measurement: the engine's own figures, its agreement with the project's
    decoding, and (when that ran) the reference's figures too."""

    run: EngineRun
    agreement: dict[str, float]
    reference: Any = None  # the in-process Measurement of the same job, if it ran
    held_at: str = ""  # the precision the agreement was measured at, where not the run's (float32 below it)

    engine = property(lambda self: self.run.engine)
    engine_version = property(lambda self: self.run.engine_version)
    aux = property(lambda self: self.run.aux)
    endpoint = property(lambda self: self.run.endpoint)
    attested = property(lambda self: self.run.attested)
    per_prompt = property(lambda self: self.run.per_prompt)
    acc_pos = property(lambda self: self.run.acc_pos)
    accept_len = property(lambda self: self.run.accept_len)
    display = property(lambda self: self.run.engine_version)
    title_suffix = property(lambda self: f" ({self.run.engine_version})")
    accepted = None  # a server reports counters, not each cycle's acceptance
    histograms = property(lambda self: self.run.histograms)  # each request's, where the engine returns them
    outputs = property(lambda self: self.run.outputs_spec)

    def warnings(self, profile: Profile) -> list[str]:
        return []

    def metrics(self, profile: Profile) -> dict[str, float]:
        # the reference's own figures where it ran at the run's precision (held at float32: its accept_len only)
        m = self.reference.metrics(profile) if self.reference is not None and not self.held_at else {}
        m.update(self.run.metrics())
        m.update(self.agreement)
        if self.reference is not None:
            m["inprocess_accept_len"] = self.reference.accept_len
        m.update(headline(self.run.accept_len, m["engine_accept_len_ci_low"], m["engine_accept_len_ci_high"], profile))
        m["engine_delivered_share"] = self.run.delivered_share
        return m

    def artifacts(self) -> dict[str, Any]:
        return {
            "tags": {
                "engine": self.run.engine,
                "engine_version": self.run.engine_version,
                "engine.aux_handed": str(self.run.aux["handed_ids"]),
                **({"engine.agreement_precision": self.held_at} if self.held_at else {}),
            },
            "dicts": {"engine_aux_layers.json": self.run.aux},
            "logs": list(self.run.logs),
        }


def headline(accept_len: float, lo: float, hi: float, profile: Profile) -> dict[str, float]:
    """The figures a decision and the version page read, from the engine's measurement."""
    tps = projected_tps(accept_len, profile)
    return {
        "accept_len": accept_len,
        "accept_len_ci_low": lo,
        "accept_len_ci_high": hi,
        "projected_tps": tps,
        "projected_speedup": tps / profile.baseline_tps,
    }


class ServingEngine:
    """vLLM or SGLang: a server launched here with the drafter exported for it (or a user's `endpoint`),
    fed the prompts as the target's tokenizer encodes them, and held to the project's decoding."""

    def __init__(
        self, name: str, settings: vllm.Settings, checks: Checks, endpoint: str | None = None,
        python: str | None = None, fmt: str = "plain",
    ) -> None:  # fmt: skip
        self.name, self.settings, self.checks = name, settings, checks
        self.endpoint, self.python, self.fmt = endpoint, python, fmt

    def check_reachable(self) -> None:
        if self.endpoint:
            vllm.check_endpoint(self.endpoint.rstrip("/"), spec=self.name == "vllm")
        else:
            environment.engine_version(environment.find_python(self.name, self.python), self.name)

    def measure(self, job: Job, reference: Any = None) -> ServedRun:
        from drafter.decode.evaluation import encode_prompts, stop_token, target_tokenizer

        tokenizer, context = target_tokenizer(job.target)
        prompts, _ = encode_prompts(tokenizer, job.records, context, job.max_new_tokens, job.k)
        settings = replace(
            self.settings, k=job.k, max_new_tokens=job.max_new_tokens, temperature=job.temperature, seed=job.seed,
            stop_token_id=stop_token(tokenizer), max_model_len=context,
        )  # fmt: skip
        run, agreement = measure_checked(
            self.name, Path(job.folder), Path(job.target), [p.tolist() for p in prompts], settings,
            reference=(reference.outputs, reference.per_prompt) if reference is not None else None,
            tolerance=self.checks.tolerance, min_prompts=self.checks.min_prompts,
            python=self.python, endpoint=self.endpoint, handed_ids=self.checks.handed_ids, progress=job.progress,
            fmt=self.fmt,
        )  # fmt: skip
        return ServedRun(run, {**agreement, **histogram_agreement(run, reference)}, reference)

    def measure_held(self, job: Job, reference: Any) -> ServedRun:
        """A measurement below float32: the engine held to `reference` (the project's decoder at float32)
        at float32, then measured at the deployment's precision, its greedy output with and without the
        drafter identical and its accept_len within PRECISION_TOLERANCE of its own at float32 (near-ties
        move it by about 1% on the mini world; a drafter loaded or counted otherwise moves it more)."""
        checked = self.conformance(job, reference)
        run = self.measure(job)
        moved = run.accept_len / checked.accept_len - 1
        if abs(moved) > PRECISION_TOLERANCE:
            raise InternalError(
                f"{run.engine_version}: accept_len {run.accept_len:.3f} at {self.settings.dtype} against "
                f"{checked.accept_len:.3f} at float32 on the same prompts ({100 * moved:+.1f}%, tolerance "
                f"{100 * PRECISION_TOLERANCE:g}%): more than rounding moves it, so no figure is reported"
            )
        agreement = {**checked.agreement, "engine_vs_float32": moved}  # the histograms' agreement: at float32 too
        return replace(run, agreement=agreement, reference=reference, held_at="float32")

    def conformance(self, job: Job, reference: Any) -> ServedRun:
        """The engine held to the project's decoding at float32, where both compute one arithmetic: the
        speculative server alone, its greedy output and per-prompt cycles against `reference` (the
        project's decoder at float32), faults raised as in measure. Below float32 the engine's kernels
        and the project's round near-ties differently (on the mini world at bf16, 7 of 12 prompts part
        within 32 tokens, at logit gaps of at most 0.0625), which would hide the faults this check is
        for. Returns the float32 run with its agreement figures."""
        settings = replace(self.settings, dtype="float32", baseline=False)
        at32 = ServingEngine(self.name, settings, self.checks, self.endpoint, self.python, self.fmt)
        return at32.measure(job, reference)
