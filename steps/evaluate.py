"""`evaluate`: acceptance measured offline (hidden-state data) and online (speculative decoding against
the target), projected onto a deployment profile; tags the registry version with the figures."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import metric_names as names
from common.errors import BadInput
from common.values import MAX_CONCURRENCY, MAX_ROUNDS, integer, none_if_empty, number
from drafter.analysis.compat import require_fit
from registry.access.naming import run_label
from registry.access.resolve import resolve_model
from registry.ledger.evidence import record as ev_record
from registry.ledger.evidence import verify as ev_verify
from reports.acceptance import acceptance_figure, break_even_figure
from reports.operating import depth_sentences, operating_metrics, served_vs_predicted
from reports.plotting import log_figure
from reports.workload import (
    MeasuredClass,
    by_class,
    class_markdown,
    class_positions,
    class_table,
    classes_figure,
    context_metrics,
    contexts_figure,
    figure_metrics,
    workload_figures,
)
from serving.cost import break_even_accept_len
from serving.profile import BOUNDS, Profile, load_profile
from serving.workload import context_figures
from steps._cli import log_params, run_step, step_run
from steps._params import Param, Spec

if TYPE_CHECKING:
    from engines.protocol import Engine, Measurement


SPEC = Spec(
    "evaluate",
    __doc__,
    (
        Param("model", default="models:/k2.5-mini-eagle3@imported", help="registry URI, folder or hub id"),
        Param("target", default="miniworld/k2.5-mini", in_repo=True),
        Param(
            "dtype",
            default="auto",
            help="the target's (and the drafter's) precision, in-process and served (auto: the "
            "one the profile's deployment serves it at, else the target checkpoint's own)",
        ),
        Param("data", default="none", help="held-out hidden-state dataset (offline acceptance); optional"),
        Param(
            "prompts",
            default="auto",
            help="auto: the prompts the profile pins (every traffic class; the only evaluation that counts as "
            "evidence); a JSON Lines file to measure other prompts (never evidence); none to skip",
        ),
        Param("class", default="none", help="measure one traffic class of the profile", dest="traffic_class"),
        Param("profile", default="kimi-k2.5-8xrtxpro6000"),
        Param("draft_steps", default="auto", help="k (auto: the profile's)"),
        Param("temperature", default="auto", help="auto: the profile's; 0 greedy; > 0 lossless sampling"),
        Param("max_new_tokens", default="auto", help="auto: the profile's eval_max_new_tokens"),
        Param("limit", default="0", help="prompts to decode per class (0: all; fewer is never evidence)"),
        Param("seed", default="0", cli=True),
        Param(
            "engine",
            default="in-process",
            help="where acceptance is measured: the project's decoder, or a serving engine's server",
            choices=("in-process", "vllm", "sglang"),
        ),
        Param("endpoint", default="none", help="a server you already run (its URL) instead of launching one"),
        Param(
            "engine_python",
            default="none",
            help="the engine's interpreter (none: $DRAFTEROPS_VLLM_PYTHON, else the env "
            "`python -m engines.environment` created)",
        ),
        Param("concurrency", default="4", help="requests in flight for the served-throughput figure"),
        Param(
            "rounds",
            default="2",
            help="served timing rounds, both servers in turn each round (more: a tighter speed-up)",
        ),
        Param(
            "reference",
            default="in-process",
            help="decode the same prompts with the project's decoder to check the engine (none: a target too big here)",
            choices=("in-process", "none"),
        ),
        Param("agreement_tolerance", default="0.02", help="engine vs in-process accept_len, relative", cli=True),
        Param(
            "agreement_prompts",
            default="0.8",
            help="share of prompts whose engine and in-process cycles must be identical",
            cli=True,
        ),
        Param(
            "handed_aux_ids",
            default="auto",
            help="aux layer ids handed to the engine as they are (auto: the drafter's, in the engine's reading)",
            cli=True,
        ),
        Param(
            "format",
            default="plain",
            help="the folder handed to the engine: the plain EAGLE-3 layout, or vLLM's speculators format",
            choices=("plain", "speculators"),
            dest="drafter_format",
        ),
        Param("no-progress", flag=True, off=True, dest="progress", cli=True),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


@dataclass(frozen=True)
class Request:
    """An evaluation as asked, every argument checked: what to measure, on which prompts, under which
    profile, and on which engine."""

    args: argparse.Namespace
    profile: Profile  # as named: evidence is bound to it
    deployment: Profile  # at the measured depth: the operating points the depth sentences read
    binding: Profile  # the operating point with the highest break-even: the figures are projected on it
    k: int
    temperature: float
    max_new: int
    limit: int
    seed: int
    data: str | None
    classes: list[MeasuredClass]
    scope: str
    engine: str
    endpoint: str | None
    served: tuple[int, int, float, float, list[int] | None] | None  # engine_settings, for a serving engine
    precision: str = "auto"  # the target's and the drafter's, in-process and served (resolved once it fits)

    @property
    def records(self) -> list[dict] | None:
        return [r for c in self.classes for r in c.records] or None

    @property
    def reference(self) -> bool:
        """The project's decoder runs too: as the engine, or as the reference a served figure must agree with."""
        return self.args.reference == "in-process" or self.engine == "in-process"


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


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from drafter.formats.checkpoint import load_config
    from drafter.model.config import check_depth

    request = parse(args)
    folder, mv = resolve_model(args.model)
    trained_on = warn_contamination(mv, request.classes)
    require_fit(folder, args.target, f"drafter {args.model} does not fit target {args.target}")
    check_depth(load_config(folder), request.k, "draft steps (--draft_steps or the profile's)")
    request = priced(request, folder)
    dep, digest = deployment_target(request)
    request = replace(request, precision=measuring_precision(request, dep, digest))
    warn_other_target(request, dep, digest)
    evaluation = measure(request, folder, mv)
    evaluation.trained_on = trained_on
    publish(request, evaluation)
    report(request, evaluation)
    return 0


def parse(args: argparse.Namespace) -> Request:
    """The arguments checked against the profile: bad input before anything is loaded."""
    profile = load_profile(args.profile)
    k = integer(args.draft_steps, "draft_steps", 1, BOUNDS["draft_steps"]) if none_if_empty(args.draft_steps) else (
        profile.draft_steps
    )  # fmt: skip
    temperature = (
        number(args.temperature, "temperature", 0) if none_if_empty(args.temperature) else profile.eval_temperature
    )
    max_new = (
        integer(args.max_new_tokens, "max_new_tokens", 1)
        if none_if_empty(args.max_new_tokens)
        else profile.eval_max_new_tokens
    )
    limit, seed = integer(args.limit, "limit"), integer(args.seed, "seed", 0, 2**32 - 1)
    deployment = profile.with_draft_steps(k)
    data = none_if_empty(args.data)
    classes, scope = prompt_classes(args, profile, limit)
    require_evaluator_key(profile)
    if not data and not classes:
        raise BadInput("give --prompts (online) and/or --data (offline)")
    engine, endpoint = args.engine, none_if_empty(args.endpoint)
    if endpoint and engine == "in-process":
        raise BadInput("--endpoint needs --engine vllm or --engine sglang")
    if not classes and engine != "in-process":
        raise BadInput(f"--engine {engine} measures on prompts: give --prompts")
    served = engine_settings(args) if engine != "in-process" else None  # first: the reference takes minutes
    from drafter.model.target import check_precision

    return Request(
        args, profile, deployment, deployment.binding(), k, temperature, max_new, limit, seed, data, classes, scope,
        engine, endpoint, served, check_precision(args.dtype),
    )  # fmt: skip


def priced(request: Request, folder: Path) -> Request:
    """The figures projected at this drafter's own draft-step cost (serving.cost.priced_for); the evidence
    stays bound to the profile as written, and promote prices it again from the weights."""
    from dataclasses import replace

    from drafter.analysis.step_cost import folder_step_cost
    from serving.cost import priced_for

    deployment, pricing = priced_for(request.deployment, folder_step_cost(folder).per_step)
    if deployment is not request.deployment:
        print(f"evaluate: {pricing}")
    return replace(request, deployment=deployment, binding=deployment.binding())


def deployment_target(request: Request) -> tuple[Any, str]:
    """The profile's deployment (None when it names no target: promote says why, where it matters) and
    this evaluation's target digest, read once for the precision and the warning below."""
    from drafter.analysis.fingerprint import target_digest
    from registry.ledger.deployment import deployment

    try:
        dep = deployment(request.profile)
        return dep, target_digest(request.args.target) if dep.digest else ""
    except BadInput:
        return None, ""


def measuring_precision(request: Request, dep: Any, digest: str) -> str:
    """--dtype as given; auto: the precision the profile's deployment serves its target at (what calibrate
    served it at, else its own) when this is that target, so the record counts there; else the target's own."""
    from drafter.model.target import target_precision

    args = request.args
    if args.dtype != "auto":
        return args.dtype
    if dep is not None and dep.precision and dep.digest and digest == dep.digest:
        return dep.precision
    return target_precision(args.target)


def warn_other_target(request: Request, dep: Any, digest: str) -> None:
    """Say at once when the target measured on is not the profile's deployment target: the record will then
    count for no decision on this profile."""
    if request.scope != ev_record.WORKLOAD or dep is None:
        return
    if dep.digest and digest != dep.digest:
        print(f"evaluate: warning: {request.args.target} is not {request.profile.name}'s deployment target "
              f"({dep.target}): this record will count for no decision on it")  # fmt: skip
    elif dep.precision and request.precision != dep.precision:
        print(f"evaluate: warning: the target runs at {request.precision} here; {request.profile.name} serves it "
              f"at {dep.precision}: this record will count for no decision on it")  # fmt: skip


def require_evaluator_key(profile: Any) -> None:
    """An evaluation signs evidence: a key no trust list names as an evaluator (a promoter's, say) is refused
    before anything is measured, since its record would count for nothing."""
    from registry.ledger.deployment import trust_for
    from registry.ledger.signing import load_key
    from registry.ledger.trust import EVALUATOR

    key, trust = load_key(), trust_for(profile)
    if trust.name(EVALUATOR, key.id) is None:
        raise BadInput(f"{key.origin}: signing key {key.id} is not a trusted evaluator ({trust.origin}): "
                       "its evidence would count for nothing")  # fmt: skip


def serving_engine(request: Request) -> Engine | None:
    """The serving engine that measures (None: the project's own decoder does): the one place the engine's
    name is read."""
    if request.engine == "in-process":
        return None
    from engines.harness import Checks, ServingEngine
    from engines.vllm import Settings

    concurrency, rounds, tolerance, agreement, handed = request.served
    settings = Settings(k=request.k, max_new_tokens=request.max_new, concurrency=concurrency, rounds=rounds,
                        dtype=request.precision)  # fmt: skip
    checks = Checks(tolerance, agreement, handed)
    python = none_if_empty(request.args.engine_python)
    return ServingEngine(request.engine, settings, checks, request.endpoint, python, request.args.drafter_format)


def measure(request: Request, folder: Path, mv: Any) -> Evaluation:
    """Offline acceptance on held-out states, then the prompts decoded by each engine in turn (the
    project's own decoder first when it runs, then the serving engine held to it), projected onto the
    profile's binding operating point."""
    from drafter.formats.checkpoint import load_drafter
    from drafter.model.target import PRECISIONS, load_target
    from engines.inprocess import InProcess
    from engines.protocol import Job

    args = request.args
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
    target = load_target(args.target, dtype=dtype, progress=args.progress) if wanted else None
    drafter = (
        load_drafter(folder, dtype, embedding=target.embedding_weight.detach().to(dtype)).eval() if target else None
    )
    if request.data:
        measure_offline(request, drafter, out)
    if request.records:
        job = Job(Path(folder), Path(args.target), request.records, request.k, request.max_new,
                  request.temperature, request.seed, args.progress)  # fmt: skip
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
    return out


def warn(measured: Any, binding: Any) -> None:
    """Print what a measurement warns of (a stale host profile, truncated prompts)."""
    for line in measured.warnings(binding):
        print(f"evaluate: warning: {line}")


def measure_offline(request: Request, drafter: Any, out: Evaluation) -> None:
    """Teacher-forced acceptance on a held-out hidden-state dataset (sim_accept_len, offline_acc_pos_i)."""
    from drafter.data.dataset import HiddenStateDataset
    from drafter.train.loop import check_fit, offline_stats

    ds = HiddenStateDataset(request.data)
    check_fit(drafter.config, ds)
    out.dataset_digest = ds.index.get("digest", "")
    stats = offline_stats(drafter, ds, list(range(len(ds))), ds.target_head()[drafter.t2d].float(), request.k)
    out.offline_acc = stats.conditional_acceptance
    out.metrics["sim_accept_len"] = stats.sim_accept_len
    out.metrics.update({f"offline_acc_pos_{i}": a for i, a in enumerate(out.offline_acc)})


def measure_classes(request: Request, out: Evaluation) -> None:
    """Each traffic class's figures, the figures at each operating point, and what the served speed-ups
    say against the profile's prediction."""
    m, measured, k = out.metrics, out.measured, request.k
    out.by_class = workload_figures(request.classes, measured.per_prompt, request.binding)
    m.update(figure_metrics(*out.by_class, request.binding))
    from drafter.decode.evaluation import context_lengths

    out.contexts = context_lengths(request.args.target, request.records, request.max_new, k, measured.outputs)
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


def decoded_part(request: Request) -> str:
    """Said in the run's name where it decodes other than the whole pinned workload, so that a short
    evaluation and a bake-off's whole-workload one of the same version are told apart in the UI."""
    parts = [] if request.scope == ev_record.WORKLOAD else [request.scope.replace(":", " ", 1)]
    if request.limit:
        parts.append(f"at most {request.limit} prompt{'' if request.limit == 1 else 's'} a class")
    return f" ({', '.join(parts)})" if parts else ""


def publish(request: Request, ev: Evaluation) -> None:
    """The run (params, metrics, figures, the evidence record) and, for a registry version measured on the
    profile's pinned workload, its tags and its page."""
    import mlflow

    profile, m = request.binding, ev.metrics
    label = ev.name.split("/")[-1] if ev.mv is None else run_label(ev.mv, str(request.args.target))
    with step_run("evaluate", run_name=f"evaluate {label} @ {profile.name}{decoded_part(request)}"):
        log_params(run_params(request))
        if ev.measured is not None:
            keep = ev.measured.artifacts()
            if keep.get("tags"):
                mlflow.set_tags(keep["tags"])
            for artifact, content in keep.get("dicts", {}).items():
                mlflow.log_dict(content, artifact)
            for log in keep.get("logs", []):
                if Path(log).is_file():
                    mlflow.log_artifact(log, "engine_logs")
        model_id = link_version(ev.mv, ev.name, profile.name, m)
        if several_classes(request, ev):  # the run's description shows every class too
            note = mlflow.get_run(mlflow.active_run().info.run_id).data.tags.get("mlflow.note.content", "")
            mlflow.set_tag("mlflow.note.content", f"{note}\n\n{class_markdown(*ev.by_class)}".strip())
        mlflow.log_metrics(m, model_id=model_id)  # also on the version's model page
        log_figures(request, ev)
        if ev.measured is not None and request.records:
            ev_record.log_record(evidence_record(request, ev))
        if ev.mv is not None and ev.measured is not None and request.scope == ev_record.WORKLOAD:
            tag_version(request, ev, mlflow.active_run().info.run_id)


def several_classes(request: Request, ev: Evaluation) -> bool:
    return ev.by_class is not None and len(request.classes) > 1


def run_params(request: Request) -> dict[str, object]:
    args = request.args
    launched_vllm = request.engine == "vllm" and not request.endpoint
    return {
        "model": args.model,
        "target": args.target,
        "data": request.data,
        "prompts": request.scope,
        "class": none_if_empty(args.traffic_class) or "none",
        "profile": request.binding.name,
        "draft_steps": request.k,
        "temperature": request.temperature,
        "max_new_tokens": request.max_new,
        "limit": request.limit,
        "engine": request.engine,
        "endpoint": request.endpoint,
        "reference": args.reference,
        "concurrency": args.concurrency,
        "rounds": args.rounds if launched_vllm else "none",  # only launched vLLM times in rounds
        "handed_aux_ids": args.handed_aux_ids,
        "format": args.drafter_format,
        "agreement_tolerance": args.agreement_tolerance,
        "agreement_prompts": args.agreement_prompts,
    }


def log_figures(request: Request, ev: Evaluation) -> None:
    """Acceptance by position, accept_len against break-even, and each class (with its table)."""
    import mlflow

    m, k, profile = ev.metrics, request.k, request.binding
    if ev.measured is not None:
        where = ev.measured.title_suffix
        ci = (m["accept_len_ci_low"], m["accept_len_ci_high"])
        log_figure(
            acceptance_figure(ev.offline_acc, ev.measured.acc_pos, f"{ev.name}: acceptance by position{where}"),
            "acceptance_by_position.png",
        )
        log_figure(
            break_even_figure(
                m["accept_len"], ci, m["break_even_accept_len"], k, f"{ev.name} on {profile.name}{where}"
            ),
            "accept_len_vs_break_even.png",
        )
        if several_classes(request, ev):
            log_figure(
                classes_figure(*ev.by_class, profile, f"{ev.name} on {profile.name}{where}"), "accept_len_by_class.png"
            )
            mlflow.log_table(class_table(*ev.by_class, profile), artifact_file="classes.json")
        if ev.by_context:
            log_figure(
                contexts_figure(ev.by_context, profile, f"{ev.name}: accept_len by context length{where}"),
                "accept_len_by_context.png",
            )
    elif ev.offline_acc is not None:
        log_figure(
            acceptance_figure(None, ev.offline_acc, f"{ev.name}: offline acceptance"), "acceptance_by_position.png"
        )


def tag_version(request: Request, ev: Evaluation, run_id: str) -> None:
    """The version's eval tags on this profile (pointers for the UI; decisions read the records) and its page."""
    from registry.access import describe, naming, store

    c, mv, m, profile = store.client(), ev.mv, ev.metrics, request.binding
    figures = {"break_even": m["break_even_accept_len"], "draft_steps": request.k}
    for key in ("accept_len", "accept_len_ci_low", "accept_len_ci_high", "projected_tps", "sim_accept_len"):
        if key in m:
            figures[key] = m[key]
    for key, value in figures.items():
        shown = repr(float(value)) if isinstance(value, float) else str(value)  # rounded where shown, never here
        c.set_model_version_tag(mv.name, mv.version, naming.eval_tag(profile.name, key), shown)
    c.set_model_version_tag(mv.name, mv.version, naming.eval_tag(profile.name, "run"), run_id)
    describe.set_section(
        c, mv.name, mv.version, f"evaluation:{profile.name}",
        evaluation_section(profile.name, m, request.k, len(request.records), run_id, ev.measured.display, ev.by_class,
                           request.scope),
    )  # fmt: skip
    describe.refresh_model_page(c, mv.name)  # its latest evaluation, in the every-version table


def report(request: Request, ev: Evaluation) -> None:
    """The figures on the terminal, then the deployment's basis and the depth to serve at."""
    from registry.ledger.deployment import basis_of

    print(summary(ev.name, request.binding.name, ev.metrics))
    if ev.measured is not None:
        print(f"evaluate: {basis_of(request.deployment)}")
        for line in depth_sentences(request.deployment, ev.metrics["accept_len"], ev.measured.acc_pos, request.k):
            print(f"evaluate: recommended depth: {line}")


def served_speedups(m: dict[str, float]) -> dict[int, float]:
    """Served decode speed-ups by concurrency (batch 1 is concurrency 1), prefill left out."""
    out = {1: m["served_speedup"]} if "served_speedup" in m else {}
    return out | names.by_concurrency(m, "served_decode_speedup")


def link_version(mv, name: str, profile: str, metrics: dict[str, float]) -> str | None:
    """The run names the version it scored: a description linking the version page, and the version's
    logged model id, under which the metrics are logged too (its model page lists them)."""
    import mlflow

    if mv is None:
        return None
    model_id = mv.model_id or (mv.source.removeprefix("models:/") if str(mv.source).startswith("models:/m-") else None)
    line = f"Scores [{mv.name} v{mv.version}](#/models/{mv.name}/versions/{mv.version}) on `{profile}`"
    if "accept_len" in metrics:
        line += (
            f": accept_len {metrics['accept_len']:.3f} [{metrics['accept_len_ci_low']:.3f}, "
            f"{metrics['accept_len_ci_high']:.3f}] against break-even {metrics['break_even_accept_len']:.2f}"
        )
    mlflow.set_tag("mlflow.note.content", line + ".")
    return model_id


def engine_settings(args) -> tuple[int, int, float, float, list[int] | None]:
    """The serving-engine settings, each checked (finite, in range): concurrency, rounds, agreement
    tolerance, share of prompts that must agree, aux ids handed as they are (None: translated)."""
    concurrency = integer(args.concurrency, "concurrency", 1, MAX_CONCURRENCY)
    rounds = integer(args.rounds, "rounds", 1, MAX_ROUNDS)
    tolerance = number(args.agreement_tolerance, "agreement_tolerance", 0, 1, "a number in [0, 1)")
    if tolerance == 1:
        raise BadInput(f"--agreement_tolerance must be a number in [0, 1), got {args.agreement_tolerance!r}")
    agreement = number(args.agreement_prompts, "agreement_prompts", 0, 1, "a share in [0, 1]")
    handed = None
    if none_if_empty(args.handed_aux_ids):
        try:
            handed = [int(x) for x in args.handed_aux_ids.split(",")]
        except ValueError:
            raise BadInput(f"--handed_aux_ids must be comma-separated integers, got {args.handed_aux_ids!r}") from None
    return concurrency, rounds, tolerance, agreement, handed


def evaluation_section(
    profile: str, m: dict[str, float], k: int, prompts: int, run_id: str, engine: str = "in-process",
    figures=None, scope: str = "workload",
) -> str:  # fmt: skip
    """What the version page says about its latest evaluation on a profile: the verdict, then each class."""
    from registry.access.describe import run_md

    be, L, lo, hi = m["break_even_accept_len"], m["accept_len"], m["accept_len_ci_low"], m["accept_len_ci_high"]
    verdict = "beats break-even" if lo > be else ("above break-even on the mean only" if be < L else "below break-even")
    what = "the traffic mix" if figures is not None and len(figures[0]) > 1 else "the pinned prompts"
    text = (
        f"## Evaluation on `{profile}`: {what} {verdict}\n\n"
        "| accept_len [95% CI] | break-even | projected tok/s | sim_accept_len | draft steps | prompts | engine | run |"
        "\n|---|---|---|---|---|---|---|---|\n"
        f"| **{L:.3f}** [{lo:.3f}, {hi:.3f}] | {be:.2f} | {m['projected_tps']:.1f} ({m['projected_speedup']:.2f}x) | "
        f"{m.get('sim_accept_len', float('nan')):.3f} | {k} | {prompts} | {engine} | {run_md(run_id)} |\n"
    )
    if figures is not None and len(figures[0]) > 1:
        text += "\n" + class_markdown(*figures)
    return text


def prompt_classes(args: argparse.Namespace, profile, limit: int) -> tuple[list[MeasuredClass], str]:
    """(classes to decode, scope): the profile's pinned workload by default; one class of it with
    --class; a file of the user's with --prompts (measured, never evidence)."""
    from common.prompt_files import file_digest, read_prompts

    chosen, name = none_if_empty(args.prompts), none_if_empty(args.traffic_class)
    if args.prompts in ("none", ""):
        return [], "none"
    if chosen and name:
        raise BadInput("give --class (one of the profile's traffic classes) or --prompts (a file), not both")
    if chosen:
        from serving.workload import prompt_key

        path = Path(chosen)
        records = read_prompts(path, limit or None)
        repeats = len(records) - len({prompt_key(r) for r in records})
        if repeats:
            print(f"evaluate: warning: {path}: {repeats} prompts repeat; copies are not independent prompts")
        print(f"evaluate: {path.name} is not a prompt set {profile.name} pins: measured, but not evidence for it")
        return [MeasuredClass("prompts", 1.0, path, file_digest(path), records)], f"prompts:{path.name}"
    pinned = [profile.traffic_class(name)] if name else list(profile.workload)
    if not pinned:
        raise BadInput(
            f"profile {profile.name} pins no evaluation prompts (eval_prompts or workload); give --prompts FILE "
            "(measured, but never evidence for it)"
        )
    out = []
    for c in pinned:
        records = c.records()  # checks the file against its pinned digest
        if limit and limit < len(records):
            print(f"evaluate: warning: --limit {limit} decodes part of class {c.name}: not evidence for {profile.name}")
            records = records[:limit]
        out.append(MeasuredClass(c.name, 1.0 if name else c.share, c.prompts, c.sha256, records))
    return out, (f"class:{name}" if name else ev_record.WORKLOAD)


def warn_contamination(mv, classes: list[MeasuredClass]) -> list[str]:
    """Say at once when the version (or a version it descends from) was trained on these prompts; returns
    their keys, which the evidence record keeps (signed), so a lineage lost later is not forgotten."""
    if mv is None or not classes:
        return []
    from registry.access import store
    from registry.ledger import lineage
    from serving.workload import prompt_key

    trained = lineage.training_prompt_keys(store.client(), mv)
    for c in classes:
        overlap = sum(prompt_key(r) in trained for r in c.records)
        if overlap:
            print(
                f"evaluate: warning: v{mv.version} was trained on {overlap} of these prompts (class {c.name}): "
                "not evidence for any profile that pins them"
            )
    return sorted({prompt_key(r) for c in classes for r in c.records} & trained)


def evidence_record(request: Request, ev: Evaluation):
    """The whole evaluation as evidence: what was measured, on what, under which conditions."""
    from drafter.analysis.fingerprint import target_digest
    from registry.access import store
    from registry.ledger.evidence.record import ClassCounts, EvidenceRecord
    from serving.workload import prompt_key

    measured, mv, profile = ev.measured, ev.mv, request.profile
    counts = [
        ClassCounts(c.name, c.share, c.sha256, [prompt_key(r) for r in c.records], per, list(lengths))
        for (c, per), (_, lengths) in zip(
            by_class(request.classes, measured.per_prompt), by_class(request.classes, ev.contexts or []), strict=True
        )
    ]
    return EvidenceRecord(
        model=mv.name if mv is not None else "",
        version=str(mv.version) if mv is not None else "",
        drafter_files=store.drafter_files(ev.folder),
        weights_sha256=store.weights_sha256(store.file_hashes(ev.folder)),
        profile=profile.name,
        profile_digest=profile.digest,
        profile_values=profile.values(),
        draft_steps=request.k,
        target=str(request.args.target),
        target_digest=target_digest(request.args.target),
        target_precision="unknown" if measured.endpoint else request.precision,  # a user's server does not say
        temperature=request.temperature,
        max_new_tokens=request.max_new,
        engine=measured.engine,
        engine_version=measured.engine_version,
        classes=counts,
        scope=request.scope,
        dataset_digest=ev.dataset_digest,
        sim_accept_len=ev.metrics.get("sim_accept_len"),
        aux_layers=measured.aux or None,
        acc_pos=[float(a) for a in measured.acc_pos],
        endpoint=measured.endpoint,
        drafter_attested=measured.attested,
        acknowledged=unusable_runs(mv, profile),
        trained_on=ev.trained_on,
    )


def unusable_runs(mv: Any, profile: Any) -> list[str]:
    """The version's runs whose record is unusable now: this evaluation, newer than each, replaces them."""
    if mv is None:
        return []
    from registry.access import store
    from registry.ledger.deployment import trust_for

    found = ev_verify.records_for(store.client(), mv.name, str(mv.version), trust_for(profile))
    return [run for run, _, _ in found.unusable]


def summary(name: str, profile: str, m: dict[str, float]) -> str:
    lines = [f"evaluate {name} on {profile}:"]
    if "accept_len" in m:
        lines.append(
            f"  accept_len {m['accept_len']:.3f} [{m['accept_len_ci_low']:.3f}, {m['accept_len_ci_high']:.3f}]"
            f"  break-even {m['break_even_accept_len']:.2f}  projected {m['projected_tps']:.1f} tok/s "
            f"({m['projected_speedup']:.2f}x)"
        )
    if "engine_accept_len" in m:
        lines.append(
            f"  engine: accept_len {m['engine_accept_len']:.3f}"
            + (f" (in-process {m['inprocess_accept_len']:.3f})" if "inprocess_accept_len" in m else "")
            + "  acceptance by position "
            + " ".join(f"{m[names.engine(f'acc_pos_{i}')]:.3f}" for i in range(8) if names.engine(f"acc_pos_{i}") in m)
        )
        if "served_tps_baseline" in m:
            lines.append(
                f"  served: {m['served_tps_baseline']:.1f} -> {m['served_tps_spec']:.1f} tok/s at batch 1 "
                f"({m['served_speedup']:.2f}x)"
                + "".join(
                    f"; {base:.1f} -> {m[names.at_concurrency('served_tps_spec', c)]:.1f} tok/s at concurrency {c}"
                    for c, base in names.by_concurrency(m, "served_tps_baseline").items()
                )
            )
    if "host_tps_baseline" in m:
        lines.append(
            f"  host: {m['host_tps_baseline']:.1f} -> {m['host_tps_spec']:.1f} tok/s "
            f"({m['host_speedup']:.2f}x)  cond_acc {m['cond_acc']:.3f}"
            + (
                f"  (host profile projects {m['host_tps_projected']:.1f} tok/s, "
                f"speed-up {100 * m['host_projection_error']:+.1f}%)"
                if "host_tps_projected" in m
                else ""
            )
        )
    if "sim_accept_len" in m:
        lines.append(f"  sim_accept_len (offline) {m['sim_accept_len']:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    run_step("evaluate", build, run, argv)


if __name__ == "__main__":
    main()
