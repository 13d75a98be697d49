"""An evaluation in its MLflow run: the params as asked and as resolved, the engine's artifacts, the metrics
(on the version's logged model too), the figures, the signed evidence record, and for a registry version
measured on the profile's pinned workload, its eval tags and its page. The step opens the run."""

from __future__ import annotations

from pathlib import Path

from common.values import none_if_empty
from evaluation.evidence import evidence_record
from evaluation.measure import Evaluation
from evaluation.request import Request
from registry.access import describe, naming
from registry.ledger.evidence import record as ev_record
from reports.acceptance import acceptance_figure, break_even_figure
from reports.evaluation import evaluation_section
from reports.plotting import log_figure
from reports.workload import class_markdown, class_table, classes_figure, contexts_figure


def run_name(request: Request, ev: Evaluation) -> str:
    """`evaluate <version> @ <profile>`, and what it decoded where that is not the whole pinned workload, so
    that a short evaluation and a bake-off's whole-workload one of the same version are told apart in the UI."""
    label = ev.name.split("/")[-1] if ev.mv is None else naming.run_label(ev.mv, str(request.asked.target))
    parts = [] if request.scope == ev_record.WORKLOAD else [request.scope.replace(":", " ", 1)]
    if request.limit:
        parts.append(f"at most {request.limit} prompt{'' if request.limit == 1 else 's'} a class")
    return f"evaluate {label} @ {request.binding.name}" + (f" ({', '.join(parts)})" if parts else "")


def run_params(request: Request) -> dict[str, object]:
    asked = request.asked
    launched_vllm = request.engine == "vllm" and not request.endpoint
    return {
        "model": asked.model,
        "target": asked.target,
        "data": request.data,
        "prompts": request.scope,
        "class": none_if_empty(asked.traffic_class) or "none",
        "profile": request.binding.name,
        "draft_steps": request.k,
        "temperature": request.temperature,
        "max_new_tokens": request.max_new,
        "limit": request.limit,
        "engine": request.engine,
        "endpoint": request.endpoint,
        "reference": asked.reference,
        "concurrency": asked.concurrency,
        "rounds": asked.rounds if launched_vllm else "none",  # only launched vLLM times in rounds
        "handed_aux_ids": asked.handed_aux_ids,
        "format": asked.drafter_format,
        "agreement_tolerance": asked.agreement_tolerance,
        "agreement_prompts": asked.agreement_prompts,
    }


def log(request: Request, ev: Evaluation) -> None:
    """Everything but the params, into the active run."""
    import mlflow  # deferred: the checks before a run is opened need no MLflow

    if ev.measured is not None:
        keep = ev.measured.artifacts()
        if keep.get("tags"):
            mlflow.set_tags(keep["tags"])
        for artifact, content in keep.get("dicts", {}).items():
            mlflow.log_dict(content, artifact)
        for engine_log in keep.get("logs", []):
            if Path(engine_log).is_file():
                mlflow.log_artifact(engine_log, "engine_logs")
    if request.deployment.draft_method:  # what the figures were priced as (drafter/methods NAME)
        mlflow.set_tag("draft_method", request.deployment.draft_method)
    model_id = link_version(ev, request.binding.name)
    if several_classes(request, ev):  # the run's description shows every class too
        note = mlflow.get_run(mlflow.active_run().info.run_id).data.tags.get("mlflow.note.content", "")
        mlflow.set_tag("mlflow.note.content", f"{note}\n\n{class_markdown(*ev.by_class)}".strip())
    mlflow.log_metrics(ev.metrics, model_id=model_id)  # also on the version's model page
    log_figures(request, ev)
    if ev.histograms is not None:
        log_histograms(request, ev)
    if ev.measured is not None and request.records:
        ev_record.log_record(evidence_record(request, ev))
    if ev.mv is not None and ev.measured is not None and request.scope == ev_record.WORKLOAD:
        tag_version(request, ev, mlflow.active_run().info.run_id)


def several_classes(request: Request, ev: Evaluation) -> bool:
    return ev.by_class is not None and len(request.classes) > 1


def link_version(ev: Evaluation, profile: str) -> str | None:
    """The run names the version it scored: a description linking the version page, and the version's
    logged model id, under which the metrics are logged too (its model page lists them)."""
    import mlflow

    mv, metrics = ev.mv, ev.metrics
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


def log_histograms(request: Request, ev: Evaluation) -> None:
    """The record every acceptance figure derives from, as a file and a table (the UI compares runs on either
    mean), and the portable speculation_profile.json (schema 1.0) that travels with the checkpoint."""
    import mlflow
    import pandas as pd

    mlflow.log_dict(ev.histograms.to_dict(), "acceptance_histogram.json")
    mlflow.log_table(pd.DataFrame(ev.histograms.rows()), artifact_file="acceptance_histogram_table.json")
    mlflow.log_dict(speculation_profile(request, ev), "speculation_profile.json")


def speculation_profile(request: Request, ev: Evaluation) -> dict[str, object]:
    """ModelOpt's schema 1.0 for this evaluation: the drafter and target it measured and the conditions."""
    from serving import speculation_profile as sp

    measured = ev.measured
    conditions = {"engine": measured.engine, "engine_version": measured.engine_version,
                  "deployment_profile": request.binding.name, "prompts": request.scope,
                  "num_requests": len(ev.histograms.requests), "concurrency": 1,
                  "temperature": request.temperature, "max_new_tokens": request.max_new,
                  "target_precision": request.precision}  # fmt: skip
    drafter = {"id": ev.name, "format": "eagle3", **({"model_version": str(ev.mv.version)} if ev.mv else {})}
    target = {"id": sp.checkpoint_id(str(request.asked.target))}
    return sp.build(ev.histograms, "eagle3", drafter, target, conditions)


def tag_version(request: Request, ev: Evaluation, run_id: str) -> None:
    """The version's eval tags on this profile (pointers for the UI; decisions read the records) and its page."""
    from registry.access import store  # torch

    c, mv, m, profile = store.client(), ev.mv, ev.metrics, request.binding
    figures = {"break_even": m["break_even_accept_len"], "draft_steps": request.k}
    for key in ("accept_len", "accept_len_ci_low", "accept_len_ci_high", "projected_tps", "sim_accept_len"):
        if key in m:
            figures[key] = m[key]
    for key, value in figures.items():
        shown = repr(float(value)) if isinstance(value, float) else str(value)  # rounded where shown, never here
        c.set_model_version_tag(mv.name, mv.version, naming.eval_tag(profile.name, key), shown)
    c.set_model_version_tag(mv.name, mv.version, naming.eval_tag(profile.name, "run"), run_id)
    section = evaluation_section(profile.name, m, request.k, len(request.records), describe.run_md(run_id),
                                 ev.measured.display, ev.by_class)  # fmt: skip
    describe.set_section(c, mv.name, mv.version, f"evaluation:{profile.name}", section)
    describe.refresh_model_page(c, mv.name)  # its latest evaluation, in the every-version table
