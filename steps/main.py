"""`main`: the whole pipeline on the mini world, one parent run with every step as a child run.

import aq-mini-eagle3 -> shape gate vs k2.5-mini -> capture the K2.5 fine-tuning and validation data ->
fine-tune (Optuna) from @imported -> train a scratch drafter on the same data and budget (the seed's own
drafter) -> gate both -> evaluate the three on the same prompts and profile -> promote the candidate.
Steps already finished with the same inputs are reused, so a rerun after a kill continues.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cli.spec import Param, Spec
from cli.step import log_params, run_link, run_step, step_run
from common.errors import BadInput, GateRefused
from common.paths import MINIWORLD, ROOT
from engines import environment
from pipeline import public_drafters
from pipeline.nested import Pipeline, aliases_by_version, best_params, version_from_run
from registry.access import naming
from registry.ledger import reconcile
from reports import main_job
from reports.plotting import log_figure
from serving.profile import load_profile

SPEC = Spec(
    "main",
    __doc__,
    (
        Param("workdir", default="drafterops-work", help="where captured datasets go"),
        Param("profile", default="kimi-k2.5-8xrtxpro6000"),
        Param("n_trials", default="3"),
        Param("max_steps", default="150"),
        Param("limit", default="0", help="prompts decoded per traffic class (0: all; fewer is not evidence)"),
        Param("max_new_tokens", default="auto", help="auto: the profile's (another is not evidence)"),
        Param(
            "bakeoff",
            default="families",
            help="end with `compare`: the three drafters and the mini world's public ones, every family and method "
            "(families), the three alone (drafters), or no bake-off",
            choices=("families", "drafters", "no"),
        ),
        Param(
            "calibrate",
            default="auto",
            help="measure this machine's vLLM deployment (host-vllm) with calibrate; auto: when the engine's "
            "environment exists (it is never installed unasked)",
            choices=("auto", "yes", "no"),
        ),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


@dataclass
class Chain:
    """What the pipeline made, step by step: the versions it registered, the data it captured, each
    drafter's evaluation, and the promotion decision."""

    name: str
    imported: str = ""
    candidate: str = ""
    scratch: str = ""
    data: dict[str, Path] = field(default_factory=dict)
    results: dict[str, tuple[str, dict[str, float]]] = field(default_factory=dict)
    decision: str = ""

    @property
    def drafters(self) -> dict[str, str]:
        return {"imported": self.imported, "fine-tuned": self.candidate, "scratch": self.scratch}


def run(args: argparse.Namespace) -> int:
    # deferred: torch comes with these, and --help or refused input needs none of it
    from registry.access import store

    check_miniworld()
    naming.pin_default_store(ROOT)  # the steps start in the project's folder: they must find this store
    c = store.client()
    chain = Chain(naming.model_name_for(TARGET))
    t_start = time.perf_counter()
    with step_run("main") as parent:
        log_params(vars(args))
        p = Pipeline(c, parent.info.experiment_id)
        import_and_gate(p, c, chain)
        capture(p, chain, Path(args.workdir).resolve())
        train_both(p, c, chain, args)
        evaluate_all(p, c, chain, args)
        pr_run, _ = p.step(
            "promote", {"model": f"models:/{chain.name}/{chain.candidate}", "profile": args.profile}, ok_codes=(0, 1)
        )
        chain.decision = c.get_run(pr_run).data.tags.get("promotion", "")
        bakeoff, verdict = bake_off(p, c, chain, args)
        served = calibrated_lines(
            p, Path(args.workdir).resolve(), args.calibrate, chain.results, load_profile(args.profile).draft_steps
        )
        seconds = time.perf_counter() - t_start
        where = main_job.where_now(aliases_by_version(c, chain.name), chain.drafters)
        text = main_job.summary(chain.name, chain.results, args.profile, chain.decision, seconds,
                                [*bakeoff, *served], where, verdict)  # fmt: skip
        publish(chain, text, seconds, args.profile)
    print("\n".join(p.log))
    print(text)
    reconcile.warn_if_disagreeing(c, chain.name, "main")
    print(
        f"\nBrowse it: mlflow ui --backend-store-uri {c.tracking_uri}\n"
        f"  this run:  {run_link(c, parent.info.run_id)}\n"
        f"  the model: http://127.0.0.1:5000/#/models/{chain.name}"
    )
    return 0


TARGET = str(MINIWORLD / "k2.5-mini")
SOURCE = str(MINIWORLD / "aq-mini-eagle3")
PROMPTS = MINIWORLD / "prompts"


def check_miniworld() -> None:
    for needed in (TARGET, SOURCE, PROMPTS / "k2.5-train.jsonl"):
        if not Path(needed).exists():
            raise BadInput(f"{needed}: the mini world is missing; run `python -m miniworld.build`")


def import_and_gate(p: Pipeline, c: Any, chain: Chain) -> None:
    """The public drafter imported, then gated against the new target: the pipeline stops on a refusal."""
    p.step("import_drafter", {"source": SOURCE, "target": TARGET})
    chain.imported = c.get_model_version_by_alias(chain.name, "imported").version
    uri = f"models:/{chain.name}/{chain.imported}"
    _, gate = p.step("shape_gate", {"model": uri, "target": TARGET}, ok_codes=(0, 1))
    if gate == 1:
        raise GateRefused(f"shape gate failed for {uri} against {TARGET}: pipeline stopped")


def capture(p: Pipeline, chain: Chain, work: Path) -> None:
    """The new target's hidden states for the fine-tuning set and the validation set."""
    for split in ("train", "val"):
        out = work / "data" / f"k2.5-{split}"
        p.step("make_data", {"target": TARGET, "prompts": str(PROMPTS / f"k2.5-{split}.jsonl"), "out": str(out),
                             "drafter": f"models:/{chain.name}/{chain.imported}", "max_len": "256"})  # fmt: skip
        chain.data[split] = out


def train_both(p: Pipeline, c: Any, chain: Chain, args: argparse.Namespace) -> None:
    """The study warm-started from the import, then a scratch drafter at its best settings and budget;
    both gated against the target."""
    ft = {"data": str(chain.data["train"]), "val_data": str(chain.data["val"]), "profile": args.profile,
          "max_steps": args.max_steps, "seed": "0"}  # fmt: skip
    ft_run, _ = p.step("finetune", {**ft, "init": f"models:/{chain.name}/{chain.imported}", "n_trials": args.n_trials})
    chain.candidate = version_from_run(c, chain.name, ft_run)
    fixed = best_params(c, ft_run)
    sc_run, _ = p.step("finetune", {**ft, "init": "scratch", "n_trials": "1", "fixed_params": fixed, "alias": "none",
                                    "name": chain.name, "study": f"scratch-{ft_run[:8]}"})  # fmt: skip
    chain.scratch = version_from_run(c, chain.name, sc_run)
    for label in ("fine-tuned", "scratch"):
        p.step("shape_gate", {"model": f"models:/{chain.name}/{chain.drafters[label]}", "target": TARGET},
               ok_codes=(0, 1))  # fmt: skip


def evaluate_all(p: Pipeline, c: Any, chain: Chain, args: argparse.Namespace) -> None:
    """The three drafters on the same pinned prompts and profile (the evaluation that counts as evidence), and with
    a bake-off of every family the public drafters beside them (compare reuses it all), two at a time."""
    calls = [("evaluate", {"model": f"models:/{chain.name}/{version}", "target": TARGET, "data": str(chain.data["val"]),
                           "profile": args.profile, "limit": args.limit, "max_new_tokens": args.max_new_tokens}, (0,))
             for version in chain.drafters.values()]  # fmt: skip
    public = public_drafters.evaluations(p, c, TARGET, args.profile) if args.bakeoff == "families" else []
    for (label, version), (ev_run, _) in zip(chain.drafters.items(), p.steps(calls + public), strict=False):
        chain.results[label] = (version, c.get_run(ev_run).data.metrics)


def bake_off(p: Pipeline, c: Any, chain: Chain, args: argparse.Namespace) -> tuple[list[str], str]:
    """`compare` of the three drafters (their evidence reused) and the public ones (miniworld/families.py, methods.py),
    paired on the profile's workload: its ranking for the summary, and its verdict (the summary's first sentence)."""
    if args.bakeoff == "no":
        return [], ""
    candidates = [f"models:/{chain.name}/{v}" for v in chain.drafters.values()]
    if args.bakeoff == "families":
        candidates += public_drafters.folders()
    run_id, _ = p.step("compare", {"candidates": ",".join(candidates), "profile": args.profile}, ok_codes=(0, 1))
    text = c.get_run(run_id).data.tags.get("mlflow.note.content", "")
    verdict = text.strip().split("\n\n", 1)[0] if text.strip() else ""
    return ["", "### Bake-off (`compare`, paired on the same prompts)", "", *text.strip().splitlines()], verdict


def publish(chain: Chain, text: str, seconds: float, profile: str) -> None:
    """The summary as the run's description, the drafters side by side (figure and table), the headline metrics."""
    import mlflow  # deferred: mlflow and pandas take seconds to import, and --help needs neither
    import pandas as pd

    results = chain.results
    mlflow.log_text(text + "\n", "summary.md")
    mlflow.set_tag("mlflow.note.content", main_job.description(text))  # the UI's description: the summary
    log_figure(main_job.comparison_figure(results, profile), "drafters_vs_break_even.png")
    mlflow.log_metric("main_seconds", seconds)
    # one row per drafter, under the evaluate runs' own metric names (Compare lines those runs up)
    rows = [{"drafter": label, "version": v, **m} for label, (v, m) in results.items()]
    mlflow.log_table(pd.DataFrame(rows), artifact_file="drafters.json")
    best = max(results.values(), key=lambda vm: vm[1].get("accept_len", 0.0))[1]
    cand = results["fine-tuned"][1]
    mlflow.log_metrics(
        {
            "best_accept_len": best.get("accept_len", 0.0),
            "break_even_accept_len": best["break_even_accept_len"],
            # the candidate's gap to break-even (> 0: short of it), as promote measured it
            "shortfall_vs_break_even": cand["break_even_accept_len"] - cand["accept_len"],
            "ci_low_shortfall": cand["break_even_accept_len"] - cand["accept_len_ci_low"],
        }
    )
    mlflow.set_tag("promotion", chain.decision)


def engine_ready(wanted: str) -> bool:
    """Whether to calibrate: `auto` only where the engine's environment already exists."""
    if wanted == "no":
        return False
    try:
        environment.find_python("vllm")
        return True
    except BadInput:
        if wanted == "yes":
            raise
        print(f"main: no vLLM environment, calibrate skipped (`{environment.setup_command()}` creates one)")
        return False


def calibrated_lines(p: Pipeline, work: Path, wanted: str, results, k: int) -> list[str]:
    """Calibrate this machine's vLLM deployment and say what it predicts for each drafter's accept_len."""
    if not engine_ready(wanted):
        return []
    out = work / "profiles" / "host-vllm.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    p.step("calibrate", {"out": str(out), "overwrite": "yes", "method_drafters": public_drafters.method_drafters()})
    return main_job.calibrated_lines(load_profile(str(out)), results, k)


def main(argv: list[str] | None = None) -> None:
    run_step("main", build, run, argv)


if __name__ == "__main__":
    main()
