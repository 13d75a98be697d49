"""`evaluate`: acceptance measured offline (hidden-state data) and online (speculative decoding against
the target), projected onto a deployment profile; tags the registry version with the figures."""

from __future__ import annotations

import argparse
from pathlib import Path

from drafter.compat import check_compat, drafter_facts, passed, target_facts
from drafter.cost import break_even_accept_len, load_profile
from drafter.errors import BadInput, InternalError
from registry import evidence
from steps._cli import log_params, none_if_empty, parser, run_step, step_run
from steps.import_drafter import MINIWORLD


def build() -> argparse.ArgumentParser:
    p = parser("evaluate", __doc__)
    p.add_argument("--model", default="models:/k2.5-mini-eagle3@imported", help="registry URI, folder or hub id")
    p.add_argument("--target", default=str(MINIWORLD / "k2.5-mini"))
    p.add_argument("--data", default="none", help="held-out hidden-state dataset (offline acceptance); optional")
    p.add_argument(
        "--prompts",
        default=str(MINIWORLD / "prompts" / "k2.5-test.jsonl"),
        help="held-out prompts (online acceptance); empty to skip",
    )
    p.add_argument("--profile", default="kimi-k2.5-8xrtxpro6000")
    p.add_argument("--draft_steps", default="auto", help="k (auto: the profile's)")
    p.add_argument("--temperature", default="0", help="0 for greedy; > 0 for lossless sampling")
    p.add_argument("--max_new_tokens", default="64")
    p.add_argument("--limit", default="20", help="prompts to decode (0: all)")
    p.add_argument("--seed", default="0")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _num(value: str, name: str, kind=float):
    try:
        return kind(float(value)) if kind is int else kind(value)
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
    from drafter.prompts import read_prompts
    from drafter.target import load_target

    profile = load_profile(args.profile)
    k = _num(args.draft_steps, "draft_steps", int) if none_if_empty(args.draft_steps) else profile.draft_steps
    if k < 1:
        raise BadInput(f"--draft_steps must be >= 1, got {k}")
    temperature = _num(args.temperature, "temperature")
    if temperature < 0:
        raise BadInput(f"--temperature must be >= 0, got {temperature}")
    max_new, limit, seed = (
        _num(args.max_new_tokens, "max_new_tokens", int),
        _num(args.limit, "limit", int),
        _num(args.seed, "seed", int),
    )
    base_profile, profile = profile, profile.with_draft_steps(k)
    data_dir, prompts_path = none_if_empty(args.data), none_if_empty(args.prompts)
    if not data_dir and not prompts_path:
        raise BadInput("give --prompts (online) and/or --data (offline)")
    records = read_prompts(prompts_path, limit or None) if prompts_path else None
    folder, mv = resolve(args.model)
    checks = check_compat(drafter_facts(folder), target_facts(args.target))
    if not passed(checks):
        bad = "; ".join(f"{c.name}: expected {c.expected}, got {c.actual}" for c in checks if c.ok is False)
        raise BadInput(f"drafter {args.model} does not fit target {args.target}: {bad}")
    target = load_target(args.target)
    drafter = load_drafter(folder, embedding=target.embedding_weight.detach().float()).eval()
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
    if records:
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
    metrics["break_even_accept_len"] = break_even_accept_len(profile)
    name = f"{mv.name}/v{mv.version}" if mv is not None else Path(folder).name
    with step_run("evaluate", run_name=f"evaluate {name.split('/')[-1]} @ {profile.name}"):
        log_params(
            {
                "model": args.model,
                "target": args.target,
                "data": data_dir,
                "prompts": prompts_path,
                "profile": profile.name,
                "draft_steps": k,
                "temperature": temperature,
                "max_new_tokens": max_new,
                "limit": limit,
            }
        )
        model_id = link_version(mv, name, profile.name, metrics)
        mlflow.log_metrics(metrics, model_id=model_id)  # also on the version's model page
        if online is not None:
            ci = (metrics["accept_len_ci_low"], metrics["accept_len_ci_high"])
            mlflow.log_figure(
                acceptance_figure(offline_acc, online.acc_pos, f"{name}: acceptance by position"),
                "acceptance_by_position.png",
            )
            mlflow.log_figure(
                break_even_figure(
                    online.accept_len, ci, metrics["break_even_accept_len"], k, f"{name} on {profile.name}"
                ),
                "accept_len_vs_break_even.png",
            )
        elif offline_acc is not None:
            mlflow.log_figure(
                acceptance_figure(None, offline_acc, f"{name}: offline acceptance"), "acceptance_by_position.png"
            )
        if online is not None and records:
            evidence.log_record(
                evidence_record(
                    mv, folder, args.target, base_profile, k, prompts_path, records, temperature, max_new, online,
                    dataset_digest, metrics.get("sim_accept_len"),
                )
            )  # fmt: skip
        if mv is not None and online is not None:
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
                    f"{value:.4f}" if isinstance(value, float) else str(value),
                )
            # pointers for the UI to the latest record; decisions read the records themselves
            c.set_model_version_tag(
                mv.name, mv.version, naming.eval_tag(profile.name, "run"), mlflow.active_run().info.run_id
            )
            describe.set_section(
                c, mv.name, mv.version, f"evaluation:{profile.name}",
                evaluation_section(profile.name, metrics, k, len(records), mlflow.active_run().info.run_id),
            )  # fmt: skip
    print(summary(name, profile.name, metrics))
    return 0


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


def evaluation_section(profile: str, m: dict[str, float], k: int, prompts: int, run_id: str) -> str:
    """What the version page says about its latest evaluation on a profile."""
    be, L, lo, hi = m["break_even_accept_len"], m["accept_len"], m["accept_len_ci_low"], m["accept_len_ci_high"]
    verdict = "beats break-even" if lo > be else ("above break-even on the mean only" if be < L else "below break-even")
    return (
        f"## Evaluation on `{profile}`: {verdict}\n\n"
        "| accept_len [95% CI] | break-even | projected tok/s | sim_accept_len | draft steps | prompts | engine | run |"
        "\n|---|---|---|---|---|---|---|---|\n"
        f"| **{L:.3f}** [{lo:.3f}, {hi:.3f}] | {be:.2f} | {m['projected_tps']:.1f} ({m['projected_speedup']:.2f}x) | "
        f"{m.get('sim_accept_len', float('nan')):.3f} | {k} | {prompts} | in-process | `{run_id}` |\n"
    )


STALE = 0.10  # a host profile that mis-projects what this host measures by more than this is stale


def host_profile():
    """This host's measured profile (configs/profiles/host.yaml), if there is one."""
    from drafter.cost import PROFILE_DIR

    return load_profile("host") if (PROFILE_DIR / "host.yaml").is_file() else None


def evidence_record(
    mv, folder, target, profile, k, prompts_path, records, temperature, max_new, online, dataset_digest, sim_accept_len
):
    """The whole evaluation as evidence: what was measured, on what, under which conditions."""
    import torch
    import transformers

    from drafter.fingerprint import records_digest, target_digest
    from registry import store
    from registry.evidence import EvidenceRecord

    return EvidenceRecord(
        model=mv.name if mv is not None else "",
        version=str(mv.version) if mv is not None else "",
        weights_sha256=store.weights_sha256(store.file_hashes(folder)),
        profile=profile.name,
        profile_digest=profile.digest,
        profile_values=profile.values(),
        draft_steps=k,
        target=str(target),
        target_digest=target_digest(target),
        prompts=str(prompts_path),
        prompts_digest=records_digest(records),
        num_prompts=len(records),
        temperature=temperature,
        max_new_tokens=max_new,
        engine="in-process",
        engine_version=f"torch {torch.__version__}, transformers {transformers.__version__}",
        per_prompt=online.per_prompt,
        dataset_digest=dataset_digest,
        sim_accept_len=sim_accept_len,
    )


def summary(name: str, profile: str, m: dict[str, float]) -> str:
    lines = [f"evaluate {name} on {profile}:"]
    if "accept_len" in m:
        lines.append(
            f"  accept_len {m['accept_len']:.3f} [{m['accept_len_ci_low']:.3f}, {m['accept_len_ci_high']:.3f}]"
            f"  break-even {m['break_even_accept_len']:.2f}  projected {m['projected_tps']:.1f} tok/s "
            f"({m['projected_speedup']:.2f}x)"
        )
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
