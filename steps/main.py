"""`main`: the whole pipeline on the mini world, one parent run with every step as a child run.

import aq-mini-eagle3 -> shape gate vs k2.5-mini -> capture the K2.5 fine-tuning and validation data ->
fine-tune (Optuna) from @imported -> train a scratch drafter on the same data and budget (the seed's own
drafter) -> gate both -> evaluate the three on the same prompts and profile -> promote the candidate.
Steps already finished with the same inputs are reused, so a rerun after a kill continues.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import metric_names as names
from common.errors import INTERNAL_ERROR, BadInput, DrafterOpsError, GateRefused
from common.paths import MINIWORLD
from reports.plotting import log_figure
from steps._cli import log_params, run_link, run_step, step_run
from steps._params import Param, Spec

ROOT = Path(__file__).resolve().parent.parent


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
            help="end with `compare`: the three drafters and the mini world's K2.5-era family drafters (families), "
            "the three alone (drafters), or no bake-off",
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


class StepFailed(DrafterOpsError):
    """A step exited with a code the pipeline did not expect: main passes on bad input (2) and treats
    anything else (a crash, a kill) as an internal error (3)."""

    def __init__(self, entry: str, code: int, run_id: str) -> None:
        super().__init__(f"step {entry} failed with exit code {code} (run {run_id}); see its output above")
        self.exit_code = code if code == 2 else INTERNAL_ERROR


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Pipeline:
    """Runs entry points as nested `mlflow run`s, reusing finished ones with the same inputs."""

    def __init__(self, client: Any, experiment_id: str) -> None:
        self.client = client
        self.experiment_id = experiment_id
        self.log: list[str] = []

    def key(self, entry: str, params: dict[str, str]) -> str:
        blob = json.dumps({"entry": entry, "params": params}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def finished(self, key: str, ok_codes: tuple[int, ...]):
        """The latest run of this step with these inputs that ended with an expected exit code. The
        cache key is set only after the process exited with one; a crashed (3), refused-input (2) or
        killed step has none, or a code not in ok_codes, and runs again."""
        runs = self.client.search_runs(
            [self.experiment_id],
            filter_string=f"tags.`drafterops.cache_key` = '{key}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        if not runs or runs[0].info.status == "RUNNING":
            return None
        code = runs[0].data.tags.get("drafterops.exit_code")
        return runs[0] if code is not None and int(code) in ok_codes else None

    def exit_code(self, submitted: Any) -> int:
        """The code the step recorded on its run; a step that recorded none crashed before it could, or
        was killed (the launcher's own code says only 'failed')."""
        recorded = self.client.get_run(submitted.run_id).data.tags.get("drafterops.exit_code")
        if recorded is not None:
            return int(recorded)
        return 0 if submitted.get_status() == "FINISHED" else INTERNAL_ERROR

    def step(self, entry: str, params: dict[str, Any], ok_codes: tuple[int, ...] = (0,)) -> tuple[str, int]:
        """(child run id, exit code). A previous finished run with the same inputs is reused."""
        import mlflow

        params = {k: str(v) for k, v in params.items()}
        key = self.key(entry, params)
        done = self.finished(key, ok_codes)
        if done is not None:
            code = int(done.data.tags["drafterops.exit_code"])
            self.log.append(f"{entry}: reused run {done.info.run_id[:8]} (exit {code})")
            print(f"main: {entry} already done with these inputs (run {done.info.run_id[:8]}), reused")
            return done.info.run_id, code
        print(f"main: {entry} ...", flush=True)
        t0 = time.perf_counter()
        # the launcher (a child `mlflow run`) logs "ERROR ... Run failed" for any nonzero exit, an
        # expected refusal included; main reads the step's own code and speaks for it instead
        with _env(MLFLOW_LOGGING_LEVEL="CRITICAL"):
            submitted = mlflow.projects.run(
                str(ROOT),
                entry_point=entry,
                parameters=params,
                env_manager="local",
                experiment_id=self.experiment_id,
                synchronous=False,
            )
        submitted.wait()
        code = self.exit_code(submitted)
        run_id = submitted.run_id
        seconds = time.perf_counter() - t0
        self.log.append(f"{entry}: run {run_id[:8]}, exit {code}, {seconds:.0f} s")
        if code not in ok_codes:
            raise StepFailed(entry, code, run_id)
        if code == 1:  # a gate's "no" is an expected outcome here: not a red "Failed" in the run list
            self.client.set_tag(run_id, "drafterops.outcome", "refused")
            self.client.set_terminated(run_id, "FINISHED")
        self.client.set_tag(run_id, "drafterops.cache_key", key)
        return run_id, code


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
    from registry.access import naming, store
    from registry.ledger import reconcile
    from serving.profile import load_profile

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
        bakeoff = bake_off(p, c, chain, args)
        served = calibrated_lines(
            p, Path(args.workdir).resolve(), args.calibrate, chain.results, load_profile(args.profile).draft_steps
        )
        seconds = time.perf_counter() - t_start
        text = summary(chain.name, chain.results, args.profile, chain.decision, seconds, [*bakeoff, *served],
                       where_now(c, chain.name, chain.drafters))  # fmt: skip
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
    best = {k.removeprefix("best."): v for k, v in c.get_run(ft_run).data.params.items() if k.startswith("best.")}
    fixed = json.dumps({k: _typed(v) for k, v in sorted(best.items())})
    sc_run, _ = p.step("finetune", {**ft, "init": "scratch", "n_trials": "1", "fixed_params": fixed, "alias": "none",
                                    "name": chain.name, "study": f"scratch-{ft_run[:8]}"})  # fmt: skip
    chain.scratch = version_from_run(c, chain.name, sc_run)
    for label in ("fine-tuned", "scratch"):
        p.step("shape_gate", {"model": f"models:/{chain.name}/{chain.drafters[label]}", "target": TARGET},
               ok_codes=(0, 1))  # fmt: skip


def evaluate_all(p: Pipeline, c: Any, chain: Chain, args: argparse.Namespace) -> None:
    """The three drafters on the same pinned prompts and profile (the evaluation that counts as evidence)."""
    for label, version in chain.drafters.items():
        ev_run, _ = p.step("evaluate", {"model": f"models:/{chain.name}/{version}", "target": TARGET,
                                        "data": str(chain.data["val"]), "profile": args.profile,
                                        "limit": args.limit, "max_new_tokens": args.max_new_tokens})  # fmt: skip
        chain.results[label] = (version, c.get_run(ev_run).data.metrics)


FAMILY_DRAFTERS = ("ls-mini-eagle3-mla", "nv-mini-eagle3", "rh-mini-eagle3")  # miniworld/families.py


def bake_off(p: Pipeline, c: Any, chain: Chain, args: argparse.Namespace) -> list[str]:
    """`compare` of the three drafters (their evidence reused) and the K2.5-era family drafters, paired on
    the profile's workload: its verdict and ranking for the summary."""
    if args.bakeoff == "no":
        return []
    candidates = [f"models:/{chain.name}/{v}" for v in chain.drafters.values()]
    if args.bakeoff == "families":
        candidates += [str(MINIWORLD / name) for name in FAMILY_DRAFTERS if (MINIWORLD / name).is_dir()]
    run_id, _ = p.step("compare", {"candidates": ",".join(candidates), "profile": args.profile}, ok_codes=(0, 1))
    text = c.get_run(run_id).data.tags.get("mlflow.note.content", "")
    return ["", "### Bake-off (`compare`, paired on the same prompts)", "", *text.strip().splitlines()]


def publish(chain: Chain, text: str, seconds: float, profile: str) -> None:
    """The summary as the run's description, the drafters side by side (figure and table), the headline metrics."""
    import mlflow
    import pandas as pd

    results = chain.results
    mlflow.log_text(text + "\n", "summary.md")
    mlflow.set_tag("mlflow.note.content", text)  # the run's description in the UI is its summary
    log_figure(comparison_figure(results, profile), "drafters_vs_break_even.png")
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


def where_now(c: Any, name: str, drafters: dict[str, str]) -> str:
    """'fine-tuned v2 is `candidate`, ...': where each drafter of this run stands in the registry now."""
    aliases = dict(getattr(c.get_registered_model(name), "aliases", {}) or {})
    by_version: dict[str, list[str]] = {}
    for alias, version in aliases.items():
        by_version.setdefault(str(version), []).append(f"`{alias}`")
    parts = [f"{label} v{v} is {' and '.join(sorted(by_version[v])) if v in by_version else 'on no alias'}"
             for label, v in drafters.items()]  # fmt: skip
    return "Where each drafter is now: " + "; ".join(parts) + "."


def engine_ready(wanted: str) -> bool:
    """Whether to calibrate: `auto` only where the engine's environment already exists."""
    if wanted == "no":
        return False
    from engines import environment

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
    from serving.profile import load_profile

    out = work / "profiles" / "host-vllm.yaml"
    out.parent.mkdir(parents=True, exist_ok=True)
    p.step("calibrate", {"out": str(out), "overwrite": "yes"})
    profile = load_profile(str(out))
    lines = ["", f"On this machine's vLLM ({profile.basis()}), at k={k}:", "",
             "| drafter | " + " | ".join(f"break-even c{op.concurrency} / predicted speed-up" for op in
                                         profile.operating_points) + " |",
             "|---" * (len(profile.operating_points) + 1) + "|"]  # fmt: skip
    for label, (version, m) in results.items():
        cells = [
            f"{op.break_even(k):.3f} / {m['accept_len'] / op.break_even(k):.2f}x" for op in profile.operating_points
        ]
        lines.append(f"| {label} v{version} | " + " | ".join(cells) + " |")
    return lines


def comparison_figure(results: dict[str, tuple[str, dict[str, float]]], profile: str):
    from reports.acceptance import drafters_figure

    rows = [
        (f"{label} v{version}", m["accept_len"], m["accept_len_ci_low"], m["accept_len_ci_high"])
        for label, (version, m) in results.items()
    ]
    any_m = next(iter(results.values()))[1]
    k = len([key for key in any_m if key.startswith("acc_pos_")])  # one per draft step
    return drafters_figure(rows, any_m["break_even_accept_len"], k, f"drafters on {profile}")


def _typed(value: str) -> Any:
    for cast in (int, float):
        try:
            return cast(value)
        except ValueError:
            continue
    return value


def version_from_run(c: Any, name: str, run_id: str) -> str:
    """The version a finetune run registered (its source tag names the run)."""
    from registry.access import naming

    for mv in c.search_model_versions(f"name={naming.quote_filter_value(name)}"):
        if mv.tags.get("source") == f"run:{run_id}":
            return str(mv.version)
    raise BadInput(f"finetune run {run_id} registered no version of {name}")


def summary(
    name: str,
    results: dict[str, tuple[str, dict[str, float]]],
    profile: str,
    decision: str,
    seconds: float,
    served: list[str] | None = None,
    where: str = "",
) -> str:
    be_all = next(iter(results.values()))[1].get("break_even_accept_len", float("nan"))
    winners = [f"{label} v{v}" for label, (v, m) in results.items() if m.get("accept_len_ci_low", 0) > be_all]
    label, (version, top) = max(results.items(), key=lambda item: item[1][1].get("accept_len", 0.0))
    headline = (
        f"**{', '.join(winners)} beat{'s' if len(winners) == 1 else ''} break-even ({be_all:.2f})** "
        "with the whole 95% interval above it."
        if winners
        else f"**No drafter beats break-even ({be_all:.2f}) on {profile}.** The best, {label} v{version}, "
        f"reaches {top.get('accept_len', 0):.3f} [{top.get('accept_len_ci_low', 0):.3f}, "
        f"{top.get('accept_len_ci_high', 0):.3f}]: speculative decoding with it would be slower than plain decoding."
    )
    lines = [
        f"## drafterops main: {name} on {profile}",
        "",
        headline,
        "",
        *([where, ""] if where else []),
        "| drafter | version | accept_len [95% CI] | sim_accept_len | projected tok/s | break-even | beats it |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, (version, m) in results.items():
        be = m.get("break_even_accept_len", float("nan"))
        L, lo, hi = m.get("accept_len", float("nan")), m.get("accept_len_ci_low", 0), m.get("accept_len_ci_high", 0)
        verdict = "yes" if lo > be else ("mean only" if be < L else "no")
        lines.append(
            f"| {label} | v{version} | {L:.3f} [{lo:.3f}, {hi:.3f}] | {m.get('sim_accept_len', 0):.3f} | "
            f"{m.get('projected_tps', 0):.1f} | {be:.2f} | {verdict} |"
        )
    lines += class_lines(results)
    lines += class_lines(results, names.CONTEXT)
    lines += served or []
    lines += ["", f"promotion: {decision}", f"wall time: {seconds / 60:.1f} min"]
    return "\n".join(lines)


def class_lines(results: dict[str, tuple[str, dict[str, float]]], prefix: str = names.CLASS) -> list[str]:
    """Each drafter per traffic class and for the mix (prefix "class_"), or per context length ("ctx_"):
    accept_len [95% CI] and projected speed-up."""
    from serving.workload import context_buckets

    metrics = next(iter(results.values()))[1]
    groups = names.groups(metrics, prefix, "accept_len")
    if not groups:
        return []
    mix = prefix == names.CLASS
    if not mix:  # context buckets, shortest first, named as lengths
        groups = [n for n in context_buckets() if n in groups]
    heads = groups if mix else [f"{n} tokens" for n in groups]
    lines = ["", "| drafter | " + " | ".join(heads) + (" | traffic mix |" if mix else " |"),
             "|---" * (len(groups) + 1 + mix) + "|"]  # fmt: skip

    def cell(m: dict[str, float], n: str) -> str:
        at = lambda figure: m[names.per_group(prefix, n, figure)]  # noqa: E731
        return f"{at('accept_len'):.2f} [{at('accept_len_ci_low'):.2f}, {at('accept_len_ci_high'):.2f}] " \
               f"{at('projected_speedup'):.2f}x"  # fmt: skip

    for label, (version, m) in results.items():
        cells = [cell(m, n) if names.per_group(prefix, n, "accept_len") in m else "-" for n in groups]
        if mix:
            cells.append(f"{m['accept_len']:.2f} [{m['accept_len_ci_low']:.2f}, {m['accept_len_ci_high']:.2f}] "
                         f"{m['projected_speedup']:.2f}x")  # fmt: skip
        lines.append(f"| {label} v{version} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    run_step("main", build, run, argv)


if __name__ == "__main__":
    main()
