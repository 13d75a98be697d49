"""`probe`: will a drafter trained on one target transfer to another? On the same prompts, how close
the new target's hidden states are to the old one's at each aux layer the drafter reads (mean cosine,
linear CKA) and after the final norm, how often the two pick the same next token, and the drafter's
zero-shot offline acceptance on each (as evaluate's offline column computes it)."""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cli.spec import Param, Spec
from cli.step import log_params, run_step, step_run
from common.errors import BadInput
from common.prompt_files import read_prompts
from common.values import integer, none_if_empty
from registry.access import describe
from reports.plotting import log_figure
from reports.probe import figure
from serving.cost import break_even_accept_len
from serving.profile import load_profile

SPEC = Spec(
    "probe",
    __doc__,
    (
        Param("drafter", default="models:/k2.5-mini-eagle3@imported", help="registry URI, folder or hub id"),
        Param("old_target", default="miniworld/k2-mini", in_repo=True, help="the target the drafter was trained on"),
        Param("new_target", default="miniworld/k2.5-mini", in_repo=True, help="the target it should serve"),
        Param("prompts", default="miniworld/prompts/k2.5-val.jsonl", in_repo=True),
        Param(
            "class",
            default="none",
            help="the profile's traffic class to probe on (its pinned prompts instead of --prompts)",
            dest="traffic_class",
        ),
        Param("limit", default="40", help="prompts to use (0: all)"),
        Param("profile", default="kimi-k2.5-8xrtxpro6000", help="zero-shot acceptance at its draft steps"),
        Param("max_len", default="512", cli=True),
        Param("no-progress", flag=True, off=True, dest="progress", cli=True),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


@dataclass
class Probe:
    """What was measured: the states' similarity per layer, the drafter's zero-shot figures on each target,
    and the words and table that say what they mean."""

    label: str
    mv: Any
    records: int
    sim: Any
    old: Any
    new: Any
    line: str
    against: str
    table: str
    break_even: float
    old_name: str
    new_name: str


def run(args: argparse.Namespace) -> int:
    limit, max_len = integer(args.limit, "limit"), integer(args.max_len, "max_len", 2)
    profile = load_profile(args.profile)
    probe = measure(args, profile, limit, max_len)
    print(f"probe {probe.label}: {probe.old_name} -> {probe.new_name} on {probe.sim.tokens} tokens\n\n{probe.table}"
          f"\n\nprobe: {probe.line}\n{probe.against}")  # fmt: skip
    publish(args, profile, limit, max_len, probe)
    return 0


def measure(args: argparse.Namespace, profile: Any, limit: int, max_len: int) -> Probe:
    """Both targets' states captured on the same prompts, compared layer by layer, and the drafter run zero-shot
    on each."""
    # deferred: torch comes with these, and --help or refused input needs none of it
    from drafter.analysis.probe import compare, verdict
    from drafter.data.capture import capture_records
    from drafter.data.dataset import HiddenStateDataset
    from drafter.formats.checkpoint import load_drafter
    from drafter.model.config import check_depth
    from drafter.train.loop import attach_target_embedding, check_fit, offline_stats
    from registry.access.resolve import resolve_model

    k = profile.draft_steps
    traffic_class = none_if_empty(args.traffic_class)
    if traffic_class:
        records = profile.traffic_class(traffic_class).records()[: limit or None]
        args.prompts = f"class:{traffic_class}"
    else:
        records = read_prompts(args.prompts, limit or None)
    folder, mv = resolve_model(args.drafter)
    drafter = load_drafter(folder)
    check_depth(drafter.config, k, "the profile's draft steps")  # a window the chain outreaches drafts otherwise
    layers = list(drafter.config.aux_layer_ids)
    zero_shot, datasets = {}, {}
    with tempfile.TemporaryDirectory(prefix="drafterops-probe-") as tmp:
        for side, path in (("old", args.old_target), ("new", args.new_target)):
            capture_records(path, records, Path(tmp) / side, layers, max_len, args.progress)
            ds = datasets[side] = HiddenStateDataset(Path(tmp) / side)
            check_fit(drafter.config, ds)
            attach_target_embedding(drafter, ds)
            rows = ds.target_head()[drafter.t2d].float()
            zero_shot[side] = offline_stats(drafter.eval(), ds, list(range(len(ds))), rows, k)
        try:
            sim = compare(datasets["old"], datasets["new"], layers)
        except ValueError as exc:
            raise BadInput(f"{args.old_target} vs {args.new_target}: {exc}") from None
    old, new = zero_shot["old"], zero_shot["new"]
    be = break_even_accept_len(profile.binding())
    gap = be - new.sim_accept_len
    against = (
        f"Zero-shot on the new target: sim_accept_len {new.sim_accept_len:.2f} against break-even {be:.2f} on "
        f"`{profile.name}` ({'short by' if gap > 0 else 'above it by'} {abs(gap):.2f}). "
        f"Measured on {len(records)} prompts ({sim.tokens} tokens)."
    )
    label = f"{mv.name} v{mv.version}" if mv is not None else Path(folder).name
    return Probe(label, mv, len(records), sim, old, new, verdict(sim, old.sim_accept_len, new.sim_accept_len), against,
                 probe_table(sim, old, new, k), be, Path(str(args.old_target)).name,
                 Path(str(args.new_target)).name)  # fmt: skip


def probe_table(sim: Any, old: Any, new: Any, k: int) -> str:
    return "\n".join(
        ["| states | mean cosine | linear CKA |", "|---|---|---|"]
        + [f"| {'layer ' + s.layer if s.layer != 'final' else 'final norm'} | {s.cosine:.3f} | {s.cka:.3f} |"
           for s in sim.layers]
        + ["", "| zero-shot | " + " | ".join(f"acc_pos_{i}" for i in range(k)) + " | sim_accept_len |",
           "|---|" + "---|" * (k + 1)]
        + [f"| {side} target | " + " | ".join(f"{a:.3f}" for a in st.conditional_acceptance)
           + f" | {st.sim_accept_len:.3f} |" for side, st in (("old", old), ("new", new))]
    )  # fmt: skip


def publish(args: argparse.Namespace, profile: Any, limit: int, max_len: int, pr: Probe) -> None:
    """The run (metrics, verdict, table, figure) and, for a registry version, its tags and page."""
    import mlflow  # deferred: mlflow takes seconds to import, and --help or refused input needs none of it

    sim, old, new, k = pr.sim, pr.old, pr.new, profile.draft_steps
    with step_run("probe", run_name=f"probe {pr.label}: {pr.old_name} -> {pr.new_name}"):
        log_params({"drafter": args.drafter, "old_target": args.old_target, "new_target": args.new_target,
                    "prompts": args.prompts, "limit": limit, "profile": profile.name, "draft_steps": k,
                    "max_len": max_len})  # fmt: skip
        metrics = {f"probe_cos_{s.layer}": s.cosine for s in sim.layers}
        metrics |= {f"probe_cka_{s.layer}": s.cka for s in sim.layers}
        metrics |= {"probe_token_agreement": sim.token_agreement, "zero_shot_sim_accept_len_old": old.sim_accept_len,
                    "zero_shot_sim_accept_len_new": new.sim_accept_len, "break_even_accept_len": pr.break_even,
                    "shortfall_vs_break_even": pr.break_even - new.sim_accept_len,
                    "prompts": pr.records}  # fmt: skip
        for side, st in (("old", old), ("new", new)):
            metrics |= {f"zero_shot_acc_pos_{i}_{side}": a for i, a in enumerate(st.conditional_acceptance)}
        mlflow.log_metrics(metrics)
        mlflow.set_tags(
            {"probe.verdict": pr.line, "mlflow.note.content": f"**{pr.line}**\n\n{pr.against}\n\n{pr.table}"}
        )
        mlflow.log_text(pr.table + f"\n\n{pr.line}\n", "probe.md")
        title = f"{pr.label}: {pr.old_name} -> {pr.new_name}"
        log_figure(figure(sim, old.conditional_acceptance, new.conditional_acceptance, title), "probe.png")
        if pr.mv is not None:
            tag_version(pr, mlflow.active_run().info.run_id)


def tag_version(pr: Probe, run_id: str) -> None:
    # deferred: torch comes with these, and --help or refused input needs none of it
    from registry.access import store

    c, mv, sim = store.client(), pr.mv, pr.sim
    tags = {"verdict": pr.line, "run": run_id, "token_agreement": f"{sim.token_agreement:.4f}",
            "zero_shot_sim_accept_len": f"{pr.new.sim_accept_len:.4f}",
            **{f"cos_{s.layer}": f"{s.cosine:.4f}" for s in sim.layers}}  # fmt: skip
    for key, value in tags.items():
        c.set_model_version_tag(mv.name, mv.version, f"probe.{pr.new_name}.{key}", value[:5000])
    describe.set_section(
        c, mv.name, mv.version, f"probe:{pr.new_name}",
        f"## Probe {pr.old_name} -> {pr.new_name}\n\n{pr.line}\n\n{pr.against}\n\n{pr.table}\n\n"
        f"Run {describe.run_md(run_id)}.",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    run_step("probe", build, run, argv)


if __name__ == "__main__":
    main()
