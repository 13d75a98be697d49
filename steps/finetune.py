"""`finetune`: an Optuna study over DeepSpeed training runs, warm-started from a registry version (or
from scratch); every trial is a nested MLflow run, the best drafter becomes a new registry version.

The step is wiring: the study (sampler, storage, budget) lives in `tuning.study`, a trial in
`tuning.trial`, the ranks under a launcher in `tuning.ranks`, registration in `tuning.register`."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from cli.spec import Param, Spec
from cli.step import log_params, run_step, step_run
from common.errors import BadInput
from common.values import integer, none_if_empty
from drafter.analysis.memory_plan import GIB
from drafter.train.loop import TrainConfig, load_ds_config, micro_batch
from registry.access import naming
from registry.access.naming import TAG_REPLIES
from serving.profile import load_profile
from tuning import study as studies
from tuning.outcome import counted_trials, verdict
from tuning.recipe import FinetuneRecipe, FinetuneRequest
from tuning.register import replies

SPEC = Spec(
    "finetune",
    __doc__,
    (
        Param("init", default="models:/k2.5-mini-eagle3@imported", help="registry URI, folder, or 'scratch'"),
        Param("data", help="hidden-state dataset folder (make_data)"),
        Param("val_data", default="none", help="validation dataset (none: hold out 10%% of --data)"),
        Param("profile", default="kimi-k2.5-8xrtxpro6000", help="validation drafts its draft_steps deep"),
        Param("n_trials", default="4", help="trials of the whole study, all workers together"),
        Param("max_steps", default="150"),
        Param("batch_size", default="8", help="the global batch (split over the ranks of a launcher)"),
        Param("ds_config", default="zero0", help="a name in configs/deepspeed or a path"),
        Param("storage", default="auto", help="Optuna storage URL (auto: an SQLite file beside mlflow.db)"),
        Param("study", default="auto", help="study name (auto: from init and dataset digest)"),
        Param("search_space", default="configs/search_space.yaml", in_repo=True, cli=True),
        Param(
            "baseline",
            default="configs/baseline_trial.yaml",
            in_repo=True,
            help="settings enqueued as trial 0 ('none': no)",
        ),
        Param("fixed_params", default="none", help="JSON of TrainConfig values used instead of a search"),
        Param("checkpoints", default="auto", help="trial checkpoints, shared by all workers (auto: beside the study)"),
        Param("seed", default="0"),
        Param(
            "arch", default="miniworld/aq-mini-eagle3", in_repo=True, help="drafter config for init=scratch", cli=True
        ),
        Param("name", default="auto", help="registered model (auto: the init's, or <target>-eagle3)"),
        Param("alias", default="candidate", help="alias for the registered best version ('none' for none)"),
        Param("val_every", default="25", cli=True),
        Param(
            "heartbeat",
            default="30",
            help="seconds between trial heartbeats (RDB storages); a trial "
            "silent for 3 heartbeats is failed and retried by the next worker, from its last checkpoint",
        ),
        Param(
            "memory_limit_gib",
            default="auto",
            help="memory one rank may use (auto: what the GPU or this host has free); checked before any data is read",
        ),
        Param(
            "packing",
            default="yes",
            help="pack a batch's samples into rows (no: pad each to the batch's longest)",
            choices=("yes", "no"),
        ),
        Param("no-progress", flag=True, off=True, dest="progress", cli=True),
    ),
)


def build() -> argparse.ArgumentParser:
    return SPEC.parser()


def _fixed(text: str) -> dict[str, Any] | None:
    if not none_if_empty(text):
        return None
    try:
        fixed = json.loads(text)
    except json.JSONDecodeError:
        raise BadInput(f"--fixed_params is not JSON: {text!r}") from None
    unknown = set(fixed) - set(TrainConfig.__dataclass_fields__)
    if unknown:
        raise BadInput(f"--fixed_params: unknown settings {sorted(unknown)}")
    return fixed


def run(args: argparse.Namespace) -> int:
    import mlflow  # deferred: mlflow takes seconds to import, and --help or refused input needs none of it

    request, profile = parse(args)
    recipe = FinetuneRecipe(request)
    recipe.setup()
    if recipe.multi and not recipe.leads:  # a follower rank: trials only, no runs of its own
        recipe.follow()
        return 0
    with step_run("finetune", run_name=f"finetune {recipe.kind}"):
        publish_setup(args, request, recipe, profile)
        recipe.train()
        best = recipe.best()
        log_params({f"best.{k}": v for k, v in (best.user_attrs.get("settings") or best.params).items()})
        version = recipe.register(best, mlflow.active_run().info.run_id)
        mlflow.set_tag("mlflow.note.content", verdict(recipe.study, best, f"models:/{recipe.name}/{version}"))
    states = [t.state.name for t in counted_trials(recipe.study)]
    print(
        f"finetune: best trial {best.number} val_sim_accept_len {best.value:.3f} at {profile.draft_steps} draft steps "
        f"({states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned, {states.count('FAIL')} failed) "
        f"-> models:/{recipe.name}/{version}"
    )
    return 0


def parse(args: argparse.Namespace) -> tuple[FinetuneRequest, Any]:
    """Every argument checked before any work: names, numbers, the DeepSpeed config, the search space."""
    # deferred: torch comes with these, and --help or refused input needs none of it
    from tuning import memory

    # deferred: torch comes with these, and --help or refused input needs none of it
    from tuning.space import load_settings, load_space

    alias = none_if_empty(args.alias)
    if alias:  # a serving alias is promote's alone
        naming.check_alias(alias)
    if none_if_empty(args.name):
        naming.check_name(args.name)
    n_trials, max_steps = integer(args.n_trials, "n_trials", 1), integer(args.max_steps, "max_steps", 1)
    seed = integer(args.seed, "seed", 0)
    profile = load_profile(args.profile)
    fixed = _fixed(args.fixed_params)
    base = TrainConfig(
        max_steps=max_steps, batch_size=integer(args.batch_size, "batch_size", 1), seed=seed, ds_config=args.ds_config,
        val_every=integer(args.val_every, "val_every", 1), val_draft_steps=profile.draft_steps,
        packing=args.packing == "yes",
    )  # fmt: skip
    limit = memory.memory_limit(args.memory_limit_gib)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro_batch(int((fixed or {}).get("batch_size", base.batch_size)), world)  # divisible by the ranks
    load_ds_config(args.ds_config, base, max_steps)  # a config that does not parse fails before anything
    space = load_space(args.search_space) if fixed is None else {}
    baseline = load_settings(args.baseline, space) if fixed is None and none_if_empty(args.baseline) else None
    request = FinetuneRequest(
        init=args.init, data=args.data, val_data=none_if_empty(args.val_data), arch=args.arch, base=base,
        n_trials=n_trials, space=space, baseline=baseline, fixed=fixed, storage=none_if_empty(args.storage),
        study=none_if_empty(args.study), checkpoints=none_if_empty(args.checkpoints),
        heartbeat=integer(args.heartbeat, "heartbeat", 1), memory_limit=limit, name=none_if_empty(args.name),
        alias=alias, progress=args.progress,
    )  # fmt: skip
    return request, profile


def publish_setup(args: argparse.Namespace, request: FinetuneRequest, recipe: Any, profile: Any) -> None:
    """The study's settings as params, the memory plan, and the tags that find the study again."""
    import mlflow  # deferred: mlflow takes seconds to import, and --help or refused input needs none of it

    base = request.base
    log_params(
        {
            "init": args.init, "data": args.data, "val_data": request.val_data,
            "profile": profile.name, "n_trials": request.n_trials, "max_steps": base.max_steps,
            "batch_size": base.batch_size, "ds_config": args.ds_config,
            "storage": recipe.storage_url.split("@")[-1], "study": recipe.study_name,
            "seed": base.seed, "fixed_params": args.fixed_params,
            "baseline": args.baseline if request.baseline else None,
            "checkpoints": recipe.shared.checkpoints, "name": recipe.name, "alias": request.alias,
            "heartbeat": args.heartbeat, "val_draft_steps": profile.draft_steps, "sampler_seed": recipe.sampler_seed,
            "tpe_startup_trials": studies.startup_trials(request.n_trials), "world_size": recipe.world,
            "packing": args.packing, "memory_limit_gib": request.memory_limit,
        }
    )  # fmt: skip
    if plan := recipe.memory_plan:  # None: another draft method's trial, which the plan does not model
        mlflow.log_metrics({"memory_plan_per_rank_gib": plan.per_rank / GIB, "memory_available_gib": plan.available / GIB})  # noqa: E501  # fmt: skip
    mlflow.log_dict(plan.to_json() if plan else {"planned": False, "why": "not an EAGLE-3 drafter"}, "memory_plan.json")
    mlflow.set_tags(
        {
            "dataset_digest": recipe.dataset.digest,
            "optuna.study": recipe.study_name,
            "optuna.created": recipe.created,
            TAG_REPLIES: replies(recipe.dataset),
        }  # fmt: skip
    )


def main(argv: list[str] | None = None) -> None:
    run_step("finetune", build, run, argv)


if __name__ == "__main__":
    main()
