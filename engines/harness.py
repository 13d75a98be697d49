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
from pathlib import Path

from drafter import aux_layers
from drafter.checkpoint import load_config
from drafter.errors import BadInput, InternalError
from engines import environment, export, sglang, vllm
from engines.measurement import EngineRun, Launch, first_difference

ENGINES = ("vllm", "sglang")


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
    cfg = load_config(folder)
    aux = aux_layers.mapping(list(cfg.aux_layer_ids), engine, handed_ids)
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
    from drafter.evaluation import pooled_accept_len

    reference = pooled_accept_len(inprocess)
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
