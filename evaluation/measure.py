"""What an evaluation measures: offline acceptance on held-out states, then the prompts decoded by each
engine in turn (the project's own decoder first when it runs, then the serving engine held to it), projected
onto the profile's binding operating point, class by class and context by context."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import metric_names as names
from common.values import none_if_empty
from engines.vllm import Settings
from evaluation.request import Request
from reports.operating import operating_metrics, served_vs_predicted
from reports.workload import by_class, class_positions, context_metrics, figure_metrics, workload_figures
from serving.acceptance import Histograms, RequestHistogram
from serving.cost import break_even_accept_len
from serving.workload import context_figures

if TYPE_CHECKING:
    from engines.protocol import Engine, Measurement


@dataclass
class Evaluation:
    """What was measured: the drafter and its version, the figures, and the measurements they came from."""

    folder: Path
    mv: Any
    name: str
    metrics: dict[str, float] = field(default_factory=dict)
    offline_acc: list[float] | None = None
    dataset_digest: str = ""
    measured: Measurement | None = None
    by_class: Any = None
    contexts: list[int] | None = None  # each prompt's tokens, prompt plus reply (None: not known)
    by_context: list = field(default_factory=list)  # accept_len per context bucket
    trained_on: list[str] = field(default_factory=list)  # measured prompts its lineage was trained on
    histograms: Histograms | None = None  # every prompt's verify-step histogram (None: the engine gave none)


def serving_engine(request: Request) -> Engine | None:
    """The serving engine that measures (None: the project's own decoder does): the one place the engine's
    name is read."""
    if request.engine == "in-process":
        return None
    from engines.harness import Checks, ServingEngine  # torch: only a served evaluation needs the harness

    concurrency, rounds, tolerance, agreement, handed = request.served
    settings = Settings(k=request.k, max_new_tokens=request.max_new, concurrency=concurrency, rounds=rounds,
                        dtype=request.precision)  # fmt: skip
    checks = Checks(tolerance, agreement, handed)
    python = none_if_empty(request.asked.engine_python)
    return ServingEngine(request.engine, settings, checks, request.endpoint, python, request.asked.drafter_format)


def measure(request: Request, folder: Path, mv: Any) -> Evaluation:
    """Offline acceptance, then each engine's decoding of the prompts, projected onto the binding point."""
    # torch and the decoder: loaded once every argument and the drafter's fit were checked
    from drafter.methods import folder_method_or_default
    from drafter.model.target import PRECISIONS, load_target
    from engines.inprocess import InProcess
    from engines.protocol import Job

    asked = request.asked
    out = Evaluation(folder, mv, f"{mv.name}/v{mv.version}" if mv is not None else Path(folder).name)
    served = serving_engine(request)
    if served is not None:
        served.check_reachable()  # before any decoding: the in-process reference takes minutes
    # below float32 a served engine is held to the project's decoder at float32 (engines/harness.conformance);
    # a user's endpoint, which cannot be asked to serve at float32, is held to it as it serves
    held = served is not None and request.reference and request.precision != "float32"
    conform = held and not request.endpoint
    dtype = PRECISIONS["float32" if held else request.precision]  # the drafter runs at the target's
    wanted = request.reference or request.data
    target = load_target(asked.target, dtype=dtype, progress=asked.progress) if wanted else None
    method = folder_method_or_default(folder)
    drafter = method.load(folder, dtype, target.embedding_weight, target.lm_head_weight) if target else None
    if request.data:
        measure_offline(request, method, drafter, out)
    if request.records:
        job = Job(Path(folder), Path(asked.target), request.records, request.k, request.max_new,
                  request.temperature, request.seed, asked.progress)  # fmt: skip
        if conform:
            out.measured = served.measure_held(job, InProcess(target, drafter).measure(job))
        else:
            engines = [e for e in (InProcess(target, drafter) if request.reference else None, served) if e]
            for engine in engines:  # each held to the one before it
                out.measured = engine.measure(job, out.measured)
                warn(out.measured, request.binding)
        out.metrics.update(out.measured.metrics(request.binding))
    out.metrics["break_even_accept_len"] = break_even_accept_len(request.binding)
    if out.measured is not None:
        measure_classes(request, out)
        record_histograms(request, out)
    return out


def record_histograms(request: Request, out: Evaluation) -> None:
    """The record every acceptance figure derives from (serving/acceptance.py): each prompt's histogram with its
    class and context length, and the figures only it gives (the per-request mean, the marginals, the rate),
    named as the engine's where a serving engine measured them."""
    steps = out.measured.histograms
    if not steps:
        return
    contexts = out.contexts or [0] * len(steps)
    classes = [c.name for c, per in by_class(request.classes, steps) for _ in per]
    requests = zip(steps, classes, contexts, strict=True)
    out.histograms = Histograms(request.k, tuple(RequestHistogram(tuple(h), name, n) for h, name, n in requests))
    served = out.measured.engine != "in-process"
    for key, value in out.histograms.metrics().items():
        if key not in ("accept_len", "verify_steps"):  # accept_len: the measurement's own, already logged
            out.metrics[names.engine(key) if served else key] = value


def warn(measured: Any, binding: Any) -> None:
    """Print what a measurement warns of (a stale host profile, truncated prompts)."""
    for line in measured.warnings(binding):
        print(f"evaluate: warning: {line}")


def measure_offline(request: Request, method: Any, drafter: Any, out: Evaluation) -> None:
    """Teacher-forced acceptance on a held-out hidden-state dataset (sim_accept_len, offline_acc_pos_i), as the
    drafter's method counts it (drafter/methods)."""
    from drafter.data.dataset import HiddenStateDataset  # torch

    ds = HiddenStateDataset(request.data)
    out.dataset_digest = ds.index.get("digest", "")
    sim, out.offline_acc = method.offline_stats(drafter, ds, request.k)
    out.metrics["sim_accept_len"] = sim
    out.metrics.update({f"offline_acc_pos_{i}": a for i, a in enumerate(out.offline_acc)})


def measure_classes(request: Request, out: Evaluation) -> None:
    """Each traffic class's figures, the figures at each operating point, and what the served speed-ups
    say against the profile's prediction."""
    from drafter.decode.evaluation import context_lengths  # torch: the tokenizer's chat template

    m, measured, k = out.metrics, out.measured, request.k
    out.by_class = workload_figures(request.classes, measured.per_prompt, request.binding)
    m.update(figure_metrics(*out.by_class, request.binding))
    out.contexts = context_lengths(request.asked.target, request.records, request.max_new, k, measured.outputs)
    if out.contexts is not None:
        out.by_context = context_figures(measured.per_prompt, out.contexts, m["break_even_accept_len"])
        m.update(context_metrics(out.by_context, request.binding))
    if measured.accepted is not None and len(request.classes) > 1:
        m.update(class_positions(request.classes, measured.accepted, k))  # the decoding trace has them per class
    m.update(operating_metrics(request.deployment, m["accept_len"], measured.acc_pos, k))
    if "engine_delivered_share" in m:
        m.update(served_vs_predicted(
            request.deployment, k, measured.accept_len, served_speedups(m), m["engine_delivered_share"]
        ))  # fmt: skip


def served_speedups(m: dict[str, float]) -> dict[int, float]:
    """Served decode speed-ups by concurrency (batch 1 is concurrency 1), prefill left out."""
    out = {1: m["served_speedup"]} if "served_speedup" in m else {}
    return out | names.by_concurrency(m, "served_decode_speedup")
