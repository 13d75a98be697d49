"""`evaluate`: acceptance measured offline (hidden-state data) and online (speculative decoding against
the target), projected onto a deployment profile; tags the registry version with the figures."""

from __future__ import annotations

import argparse
from pathlib import Path

from drafter.compat import check_compat, drafter_facts, passed, target_facts
from drafter.cost import BOUNDS, break_even_accept_len, load_profile
from drafter.errors import BadInput, InternalError
from drafter.operating_report import depth_sentences, operating_metrics, served_vs_predicted
from drafter.workload_report import (
    MeasuredClass,
    by_class,
    class_markdown,
    class_positions,
    class_table,
    classes_figure,
    figure_metrics,
    workload_figures,
)
from registry import evidence
from steps._cli import (
    MAX_CONCURRENCY,
    MAX_ROUNDS,
    integer,
    log_figure,
    log_params,
    none_if_empty,
    parser,
    run_step,
    step_run,
)
from steps.import_drafter import MINIWORLD


def build() -> argparse.ArgumentParser:
    p = parser("evaluate", __doc__)
    p.add_argument("--model", default="models:/k2.5-mini-eagle3@imported", help="registry URI, folder or hub id")
    p.add_argument("--target", default=str(MINIWORLD / "k2.5-mini"))
    p.add_argument("--data", default="none", help="held-out hidden-state dataset (offline acceptance); optional")
    p.add_argument(
        "--prompts",
        default="auto",
        help="auto: the prompts the profile pins (every traffic class; the only evaluation that counts as "
        "evidence); a JSON Lines file to measure other prompts (never evidence); none to skip",
    )
    p.add_argument("--class", dest="traffic_class", default="none", help="measure one traffic class of the profile")
    p.add_argument("--profile", default="kimi-k2.5-8xrtxpro6000")
    p.add_argument("--draft_steps", default="auto", help="k (auto: the profile's)")
    p.add_argument("--temperature", default="auto", help="auto: the profile's; 0 greedy; > 0 lossless sampling")
    p.add_argument("--max_new_tokens", default="auto", help="auto: the profile's eval_max_new_tokens")
    p.add_argument("--limit", default="0", help="prompts to decode per class (0: all; fewer is never evidence)")
    p.add_argument("--seed", default="0")
    p.add_argument(
        "--engine",
        default="in-process",
        choices=["in-process", "vllm", "sglang"],
        help="where acceptance is measured: the project's decoder, or a serving engine's server",
    )
    p.add_argument("--endpoint", default="none", help="a server you already run (its URL) instead of launching one")
    p.add_argument(
        "--engine_python", default="none", help="the engine's interpreter (none: $DRAFTEROPS_VLLM_PYTHON, else the env "
        "`python -m engines.environment` created)",
    )  # fmt: skip
    p.add_argument("--concurrency", default="4", help="requests in flight for the served-throughput figure")
    p.add_argument(
        "--rounds", default="2", help="served timing rounds, both servers in turn each round (more: a tighter speed-up)"
    )
    p.add_argument(
        "--reference",
        default="in-process",
        choices=["in-process", "none"],
        help="decode the same prompts with the project's decoder to check the engine (none: a target too big here)",
    )
    p.add_argument("--agreement_tolerance", default="0.02", help="engine vs in-process accept_len, relative")
    p.add_argument(
        "--agreement_prompts",
        default="0.8",
        help="share of prompts whose engine and in-process cycles must be identical",
    )
    p.add_argument(
        "--handed_aux_ids",
        default="auto",
        help="aux layer ids handed to the engine as they are (auto: the drafter's, translated to the engine's reading)",
    )
    p.add_argument(
        "--format", dest="drafter_format", default="plain", choices=["plain", "speculators"],
        help="the folder handed to the engine: the plain EAGLE-3 layout, or vLLM's speculators format",
    )  # fmt: skip
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _num(value: str, name: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise BadInput(f"--{name} must be a number, got {value!r}") from None


def resolve(model: str):
    """(drafter folder, ModelVersion or None)."""
    if model.startswith("models:/"):
        from registry import store

        mv = store.get_version(model)
        return store.download_version(f"models:/{mv.name}/{mv.version}").folder, mv
    from registry.resolve import resolve_drafter

    return resolve_drafter(model).folder, None


def run(args: argparse.Namespace) -> int:
    import mlflow

    from drafter.checkpoint import load_drafter
    from drafter.evaluation import acceptance_figure, break_even_figure, evaluate_online
    from drafter.target import load_target

    profile = load_profile(args.profile)
    k = profile.draft_steps
    if none_if_empty(args.draft_steps):
        k = integer(args.draft_steps, "draft_steps", 1, BOUNDS["draft_steps"])
    temperature = _num(args.temperature, "temperature") if none_if_empty(args.temperature) else profile.eval_temperature
    if not (0 <= temperature < float("inf")):
        raise BadInput(f"--temperature must be a finite number >= 0, got {args.temperature}")
    max_new = (
        integer(args.max_new_tokens, "max_new_tokens", 1)
        if none_if_empty(args.max_new_tokens)
        else profile.eval_max_new_tokens
    )
    limit, seed = integer(args.limit, "limit"), integer(args.seed, "seed", 0, 2**32 - 1)
    base_profile, deployment = profile, profile.with_draft_steps(k)
    profile = deployment.binding()  # figures against the operating point with the highest break-even
    data_dir = none_if_empty(args.data)
    classes, scope = prompt_classes(args, base_profile, limit)
    if not data_dir and not classes:
        raise BadInput("give --prompts (online) and/or --data (offline)")
    records = [r for c in classes for r in c.records] or None
    folder, mv = resolve(args.model)
    warn_contamination(mv, classes)
    checks = check_compat(drafter_facts(folder), target_facts(args.target))
    if not passed(checks):
        bad = "; ".join(f"{c.name}: expected {c.expected}, got {c.actual}" for c in checks if c.ok is False)
        raise BadInput(f"drafter {args.model} does not fit target {args.target}: {bad}")
    engine = args.engine
    endpoint = none_if_empty(args.endpoint)
    if endpoint and engine == "in-process":
        raise BadInput("--endpoint needs --engine vllm or --engine sglang")
    reference = args.reference == "in-process" or engine == "in-process"
    if not records and engine != "in-process":
        raise BadInput(f"--engine {engine} measures on prompts: give --prompts")
    served = engine_settings(args) if engine != "in-process" else None  # first: the reference takes minutes
    if engine != "in-process":
        check_engine_reachable(engine, endpoint, none_if_empty(args.engine_python))
    target = load_target(args.target, progress=args.progress) if reference or data_dir else None
    drafter = (
        load_drafter(folder, embedding=target.embedding_weight.detach().float()).eval() if target is not None else None
    )
    metrics: dict[str, float] = {}
    offline_acc, dataset_digest = None, ""
    if data_dir:
        from drafter.data import HiddenStateDataset
        from drafter.train import check_fit, offline_stats

        ds = HiddenStateDataset(data_dir)
        check_fit(drafter.config, ds)
        dataset_digest = ds.index.get("digest", "")
        stats = offline_stats(drafter, ds, list(range(len(ds))), ds.target_head()[drafter.t2d].float(), k)
        offline_acc = stats.conditional_acceptance
        metrics["sim_accept_len"] = stats.sim_accept_len
        metrics.update({f"offline_acc_pos_{i}": a for i, a in enumerate(offline_acc)})
    online = None
    if records and reference:
        online = evaluate_online(target, drafter, records, k, max_new, temperature, seed, args.progress)
        if online.mismatches:
            raise InternalError(
                f"greedy speculative output differed from the target's on {online.mismatches} "
                "prompts: a decoding bug, not a drafter property"
            )
        host = host_profile()
        metrics.update(online.metrics(profile, host))
        if online.truncated:
            print(f"evaluate: warning: {online.truncated} prompts were cut from the left to fit the target context")
        if host is not None and abs(metrics["host_projection_error"]) > STALE:
            print(
                f"evaluate: warning: profile 'host' projects a {metrics['host_speedup_projected']:.2f}x speed-up "
                f"here, measured {metrics['host_speedup']:.2f}x ({100 * metrics['host_projection_error']:+.0f}%): "
                "the profile is stale; rerun `python -m bench.host_profile`"
            )
    run = None
    if engine != "in-process":
        run, agreement = serve_and_measure(
            args, served, engine, endpoint, folder, records, k, max_new, temperature, seed, online
        )
        metrics.update(run.metrics())
        metrics.update(agreement)
        lo, hi = metrics["engine_accept_len_ci_low"], metrics["engine_accept_len_ci_high"]
        if online is not None:
            metrics["inprocess_accept_len"] = online.accept_len
        metrics.update(headline(run.accept_len, lo, hi, profile))
    metrics["break_even_accept_len"] = break_even_accept_len(profile)
    measured = run if run is not None else online
    by_class = None
    if measured is not None:
        by_class = workload_figures(classes, measured.per_prompt, profile)
        metrics.update(figure_metrics(*by_class, profile))
        if run is None and len(classes) > 1:  # the decoding trace gives each class its acceptance by position
            metrics.update(class_positions(classes, online.accepted, k))
        metrics.update(operating_metrics(deployment, metrics["accept_len"], measured.acc_pos, k))
        if run is not None:
            metrics["engine_delivered_share"] = run.delivered_share
            metrics.update(
                served_vs_predicted(deployment, k, run.accept_len, served_speedups(metrics), run.delivered_share)
            )
    name = f"{mv.name}/v{mv.version}" if mv is not None else Path(folder).name
    with step_run("evaluate", run_name=f"evaluate {name.split('/')[-1]} @ {profile.name}"):
        log_params(
            {
                "model": args.model,
                "target": args.target,
                "data": data_dir,
                "prompts": scope,
                "class": none_if_empty(args.traffic_class) or "none",
                "profile": profile.name,
                "draft_steps": k,
                "temperature": temperature,
                "max_new_tokens": max_new,
                "limit": limit,
                "engine": engine,
                "endpoint": endpoint,
                "reference": args.reference,
                "concurrency": args.concurrency,
                "rounds": args.rounds if engine == "vllm" and not endpoint else "none",  # only launched vLLM
                "handed_aux_ids": args.handed_aux_ids,
                "format": args.drafter_format,
                "agreement_tolerance": args.agreement_tolerance,
                "agreement_prompts": args.agreement_prompts,
            }
        )
        if run is not None:
            mlflow.set_tags(
                {
                    "engine": engine,
                    "engine_version": run.engine_version,
                    "engine.aux_handed": str(run.aux["handed_ids"]),
                }
            )
            mlflow.log_dict(run.aux, "engine_aux_layers.json")
            for log in run.logs:
                if Path(log).is_file():
                    mlflow.log_artifact(log, "engine_logs")
        model_id = link_version(mv, name, profile.name, metrics)
        if by_class is not None and len(classes) > 1:  # the run's description shows every class too
            note = mlflow.get_run(mlflow.active_run().info.run_id).data.tags.get("mlflow.note.content", "")
            mlflow.set_tag("mlflow.note.content", f"{note}\n\n{class_markdown(*by_class)}".strip())
        mlflow.log_metrics(metrics, model_id=model_id)  # also on the version's model page
        if online is not None or run is not None:
            figure_source = run if run is not None else online
            ci = (metrics["accept_len_ci_low"], metrics["accept_len_ci_high"])
            where = f" ({run.engine_version})" if run is not None else ""
            log_figure(
                acceptance_figure(offline_acc, figure_source.acc_pos, f"{name}: acceptance by position{where}"),
                "acceptance_by_position.png",
            )
            log_figure(
                break_even_figure(
                    metrics["accept_len"], ci, metrics["break_even_accept_len"], k, f"{name} on {profile.name}{where}"
                ),
                "accept_len_vs_break_even.png",
            )
            if by_class is not None and len(classes) > 1:
                log_figure(
                    classes_figure(*by_class, profile, f"{name} on {profile.name}{where}"), "accept_len_by_class.png"
                )
                mlflow.log_table(class_table(*by_class, profile), artifact_file="classes.json")
        elif offline_acc is not None:
            log_figure(
                acceptance_figure(None, offline_acc, f"{name}: offline acceptance"), "acceptance_by_position.png"
            )
        if measured is not None and records:
            evidence.log_record(
                evidence_record(
                    mv, folder, args.target, base_profile, k, scope, classes, temperature, max_new,
                    measured, dataset_digest, metrics.get("sim_accept_len"),
                )
            )  # fmt: skip
        if mv is not None and measured is not None and scope == evidence.WORKLOAD:
            from registry import describe, naming, store

            c = store.client()
            figures = {"break_even": metrics["break_even_accept_len"], "draft_steps": k}
            for key in ("accept_len", "accept_len_ci_low", "accept_len_ci_high", "projected_tps", "sim_accept_len"):
                if key in metrics:
                    figures[key] = metrics[key]
            for key, value in figures.items():
                c.set_model_version_tag(
                    mv.name,
                    mv.version,
                    naming.eval_tag(profile.name, key),
                    repr(float(value)) if isinstance(value, float) else str(value),  # rounded where shown, never here
                )
            # pointers for the UI to the latest record; decisions read the records themselves
            c.set_model_version_tag(
                mv.name, mv.version, naming.eval_tag(profile.name, "run"), mlflow.active_run().info.run_id
            )
            describe.set_section(
                c, mv.name, mv.version, f"evaluation:{profile.name}",
                evaluation_section(
                    profile.name, metrics, k, len(records), mlflow.active_run().info.run_id,
                    run.engine_version if run is not None else "in-process", by_class, scope,
                ),
            )  # fmt: skip
            describe.refresh_model_page(c, mv.name)  # its latest evaluation, in the every-version table
    print(summary(name, profile.name, metrics))
    if measured is not None:
        print(f"evaluate: {deployment.basis()}")
        for line in depth_sentences(deployment, metrics["accept_len"], measured.acc_pos, k):
            print(f"evaluate: recommended depth: {line}")
    return 0


def served_speedups(m: dict[str, float]) -> dict[int, float]:
    """Served decode speed-ups by concurrency (batch 1 is concurrency 1), prefill left out."""
    out = {1: m["served_speedup"]} if "served_speedup" in m else {}
    for key, value in m.items():
        if key.startswith("served_decode_speedup_c"):
            out[int(key.rsplit("_c", 1)[1])] = value
    return out


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


def check_engine_reachable(engine: str, endpoint: str | None, python: str | None) -> None:
    """Before any decoding (the in-process reference takes minutes): a user's endpoint must be a speculative
    vLLM server, and a launched engine needs its interpreter with the engine installed."""
    from engines import environment, vllm

    if endpoint:
        vllm.check_endpoint(endpoint.rstrip("/"), spec=engine == "vllm")
    else:
        environment.engine_version(environment.find_python(engine, python), engine)


def engine_settings(args) -> tuple[int, int, float, float, list[int] | None]:
    """The serving-engine settings, each checked (finite, in range): concurrency, rounds, agreement
    tolerance, share of prompts that must agree, aux ids handed as they are (None: translated)."""
    concurrency = integer(args.concurrency, "concurrency", 1, MAX_CONCURRENCY)
    rounds = integer(args.rounds, "rounds", 1, MAX_ROUNDS)
    tolerance, agreement = (
        _num(args.agreement_tolerance, "agreement_tolerance"),
        _num(args.agreement_prompts, "agreement_prompts"),
    )
    if not 0 <= tolerance < 1:
        raise BadInput(f"--agreement_tolerance must be a number in [0, 1), got {args.agreement_tolerance!r}")
    if not 0 <= agreement <= 1:
        raise BadInput(f"--agreement_prompts must be a share in [0, 1], got {args.agreement_prompts!r}")
    handed = None
    if none_if_empty(args.handed_aux_ids):
        try:
            handed = [int(x) for x in args.handed_aux_ids.split(",")]
        except ValueError:
            raise BadInput(f"--handed_aux_ids must be comma-separated integers, got {args.handed_aux_ids!r}") from None
    return concurrency, rounds, tolerance, agreement, handed


def serve_and_measure(args, served, engine, endpoint, folder, records, k, max_new, temperature, seed, online):
    """The drafter on a serving engine (`served`: engine_settings), checked against the project's own decoding
    when it ran."""
    from drafter.evaluation import encode_prompts, stop_token, target_tokenizer
    from engines import harness
    from engines.vllm import Settings

    concurrency, rounds, tolerance, agreement, handed = served
    tokenizer, context = target_tokenizer(args.target)
    prompts, _ = encode_prompts(tokenizer, records, context, max_new, k)
    settings = Settings(
        k=k, max_new_tokens=max_new, temperature=temperature, seed=seed, stop_token_id=stop_token(tokenizer),
        concurrency=concurrency, max_model_len=context, rounds=rounds,
    )  # fmt: skip
    return harness.measure_checked(
        engine, Path(folder), Path(args.target), [p.tolist() for p in prompts], settings,
        reference=(online.outputs, online.per_prompt) if online is not None else None,
        tolerance=tolerance, min_prompts=agreement,
        python=none_if_empty(args.engine_python), endpoint=endpoint, handed_ids=handed, progress=args.progress,
        fmt=args.drafter_format,
    )  # fmt: skip


def headline(accept_len: float, lo: float, hi: float, profile) -> dict[str, float]:
    """The figures a decision and the version page read, from the engine's measurement."""
    from drafter.cost import projected_tps

    tps = projected_tps(accept_len, profile)
    return {
        "accept_len": accept_len,
        "accept_len_ci_low": lo,
        "accept_len_ci_high": hi,
        "projected_tps": tps,
        "projected_speedup": tps / profile.baseline_tps,
    }


def evaluation_section(
    profile: str, m: dict[str, float], k: int, prompts: int, run_id: str, engine: str = "in-process",
    figures=None, scope: str = "workload",
) -> str:  # fmt: skip
    """What the version page says about its latest evaluation on a profile: the verdict, then each class."""
    from registry.describe import run_md

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
    from drafter.prompts import file_digest, read_prompts

    chosen, name = none_if_empty(args.prompts), none_if_empty(args.traffic_class)
    if args.prompts in ("none", ""):
        return [], "none"
    if chosen and name:
        raise BadInput("give --class (one of the profile's traffic classes) or --prompts (a file), not both")
    if chosen:
        from drafter.workload import prompt_key

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
    return out, (f"class:{name}" if name else evidence.WORKLOAD)


def warn_contamination(mv, classes: list[MeasuredClass]) -> None:
    """Say at once when the version (or a version it descends from) was trained on these prompts."""
    if mv is None or not classes:
        return
    from drafter.workload import prompt_key
    from registry import lineage, store

    trained = lineage.training_prompt_keys(store.client(), mv)
    for c in classes:
        overlap = sum(prompt_key(r) in trained for r in c.records)
        if overlap:
            print(
                f"evaluate: warning: v{mv.version} was trained on {overlap} of these prompts (class {c.name}): "
                "not evidence for any profile that pins them"
            )


STALE = 0.10  # a host profile that mis-projects what this host measures by more than this is stale


def host_profile():
    """This host's measured profile (configs/profiles/host.yaml), if there is one."""
    from drafter.cost import PROFILE_DIR

    return load_profile("host") if (PROFILE_DIR / "host.yaml").is_file() else None


def evidence_record(
    mv, folder, target, profile, k, scope, classes, temperature, max_new, measured, dataset_digest, sim_accept_len
):
    """The whole evaluation as evidence: what was measured, on what, under which conditions."""
    import torch
    import transformers

    from drafter.fingerprint import target_digest
    from drafter.workload import prompt_key
    from registry import store
    from registry.evidence import ClassCounts, EvidenceRecord

    in_process_version = f"torch {torch.__version__}, transformers {transformers.__version__}"
    counts = [
        ClassCounts(c.name, c.share, c.sha256, [prompt_key(r) for r in c.records], per)
        for c, per in by_class(classes, measured.per_prompt)
    ]
    return EvidenceRecord(
        model=mv.name if mv is not None else "",
        version=str(mv.version) if mv is not None else "",
        drafter_files=store.drafter_files(folder),
        weights_sha256=store.weights_sha256(store.file_hashes(folder)),
        profile=profile.name,
        profile_digest=profile.digest,
        profile_values=profile.values(),
        draft_steps=k,
        target=str(target),
        target_digest=target_digest(target),
        temperature=temperature,
        max_new_tokens=max_new,
        engine=getattr(measured, "engine", "in-process"),
        engine_version=getattr(measured, "engine_version", None) or in_process_version,
        classes=counts,
        scope=scope,
        dataset_digest=dataset_digest,
        sim_accept_len=sim_accept_len,
        aux_layers=getattr(measured, "aux", None) or None,
        acc_pos=[float(a) for a in measured.acc_pos],
        endpoint=getattr(measured, "endpoint", ""),
        drafter_attested=getattr(measured, "attested", True),
    )


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
            + " ".join(f"{m[f'engine_acc_pos_{i}']:.3f}" for i in range(8) if f"engine_acc_pos_{i}" in m)
        )
        if "served_tps_baseline" in m:
            lines.append(
                f"  served: {m['served_tps_baseline']:.1f} -> {m['served_tps_spec']:.1f} tok/s at batch 1 "
                f"({m['served_speedup']:.2f}x)"
                + "".join(
                    f"; {m[key]:.1f} -> {m[key.replace('baseline', 'spec')]:.1f} tok/s at concurrency "
                    f"{key.rsplit('_c', 1)[1]}"
                    for key in m
                    if key.startswith("served_tps_baseline_c")
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
