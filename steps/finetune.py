"""`finetune`: an Optuna study over DeepSpeed training runs, warm-started from a registry version (or
from scratch); every trial is a nested MLflow run, the best drafter becomes a new registry version.

The step is wiring: the study (sampler, storage, budget) lives in `tuning.study`, a trial in
`tuning.trial`, the ranks under a launcher in `tuning.ranks`, registration in `tuning.register`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import Any

from common.errors import BadInput
from common.paths import MINIWORLD
from drafter.memory_plan import GIB
from drafter.train import TrainConfig
from steps._cli import log_params, none_if_empty, parser, run_step, step_run
from steps._inputs import integer
from tuning.outcome import counted_trials, finish, verdict
from tuning.space import DEFAULT_BASELINE, DEFAULT_SPACE


def build() -> argparse.ArgumentParser:
    p = parser("finetune", __doc__)
    p.add_argument("--init", default="models:/k2.5-mini-eagle3@imported", help="registry URI, folder, or 'scratch'")
    p.add_argument("--data", required=True, help="hidden-state dataset folder (make_data)")
    p.add_argument("--val_data", default="none", help="validation dataset (none: hold out 10%% of --data)")
    p.add_argument("--profile", default="kimi-k2.5-8xrtxpro6000", help="validation drafts its draft_steps deep")
    p.add_argument("--n_trials", default="4", help="trials of the whole study, all workers together")
    p.add_argument("--max_steps", default="150")
    p.add_argument("--batch_size", default="8", help="the global batch (split over the ranks of a launcher)")
    p.add_argument("--ds_config", default="zero0", help="a name in configs/deepspeed or a path")
    p.add_argument("--storage", default="auto", help="Optuna storage URL (auto: an SQLite file beside mlflow.db)")
    p.add_argument("--study", default="auto", help="study name (auto: from init and dataset digest)")
    p.add_argument("--search_space", default=str(DEFAULT_SPACE))
    p.add_argument("--baseline", default=str(DEFAULT_BASELINE), help="settings enqueued as trial 0 ('none': no)")
    p.add_argument("--fixed_params", default="none", help="JSON of TrainConfig values used instead of a search")
    p.add_argument(
        "--checkpoints", default="auto", help="trial checkpoints, shared by all workers (auto: beside the study)"
    )
    p.add_argument("--seed", default="0")
    p.add_argument("--arch", default=str(MINIWORLD / "aq-mini-eagle3"), help="drafter config for init=scratch")
    p.add_argument("--name", default="auto", help="registered model (auto: the init's, or <target>-eagle3)")
    p.add_argument("--alias", default="candidate", help="alias for the registered best version ('none' for none)")
    p.add_argument("--val_every", default="25")
    p.add_argument(
        "--heartbeat",
        default="30",
        help="seconds between trial heartbeats (RDB storages); a trial "
        "silent for 3 heartbeats is failed and retried by the next worker, from its last checkpoint",
    )
    p.add_argument(
        "--memory_limit_gib", default="auto",
        help="memory one rank may use (auto: what the GPU or this host has free); checked before any data is read",
    )  # fmt: skip
    p.add_argument(
        "--packing", default="yes", choices=["yes", "no"],
        help="pack a batch's samples into rows (no: pad each to the batch's longest)",
    )  # fmt: skip
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


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


def checkpoint_root(arg: str, storage_url: str) -> Path:
    """Where trial checkpoints live: given, or beside an SQLite study (one machine, many workers)."""
    if none_if_empty(arg):
        return Path(arg)
    if storage_url.startswith("sqlite:///"):
        return Path(storage_url.removeprefix("sqlite:///")).parent / "trial-checkpoints"
    return Path.home() / ".cache" / "drafterops" / "trial-checkpoints"  # pass a shared folder across machines


class OverBudget(Exception):
    """This worker's trial raced past the study's budget: handed back before it ran."""


def run(args: argparse.Namespace) -> int:
    import mlflow
    import optuna

    from drafter.data import HiddenStateDataset, split_indices
    from drafter.train import TrainingDiverged, ensure_distributed, is_rank0, load_ds_config, micro_batch
    from registry import naming
    from serving.profile import load_profile
    from tuning import memory
    from tuning import study as studies
    from tuning.ranks import follow_trials, lead_trials
    from tuning.register import default_name, prepare_init, register_best
    from tuning.space import load_settings, load_space
    from tuning.trial import Study, run_trial

    alias = none_if_empty(args.alias)
    if alias:  # checked before any work: a serving alias is promote's alone
        naming.check_alias(alias)
    if none_if_empty(args.name):
        naming.check_name(args.name)
    n_trials, max_steps, seed = (
        integer(args.n_trials, "n_trials", 1),
        integer(args.max_steps, "max_steps", 1),
        integer(args.seed, "seed", 0),
    )
    profile = load_profile(args.profile)
    fixed = _fixed(args.fixed_params)
    base = TrainConfig(
        max_steps=max_steps,
        batch_size=integer(args.batch_size, "batch_size", 1),
        seed=seed,
        ds_config=args.ds_config,
        val_every=integer(args.val_every, "val_every", 1),
        val_draft_steps=profile.draft_steps,
        packing=args.packing == "yes",
    )
    limit = memory.memory_limit(args.memory_limit_gib)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    micro_batch(int((fixed or {}).get("batch_size", base.batch_size)), world)  # divisible, before any work
    load_ds_config(args.ds_config, base, max_steps)  # a config that does not parse fails before anything
    space = load_space(args.search_space) if fixed is None else {}
    baseline = load_settings(args.baseline, space) if fixed is None and none_if_empty(args.baseline) else None
    worst = memory.worst_case(base, space, fixed)
    configs = memory.ds_configs(worst, space, max_steps)
    memory_plan = memory.check(memory.init_config(args.init, args.arch), worst, configs, world, limit)
    dataset = HiddenStateDataset(args.data)
    val_dataset = HiddenStateDataset(args.val_data) if none_if_empty(args.val_data) else None
    multi = world > 1  # under the deepspeed/torchrun launcher
    if multi:
        import torch.distributed as dist

        ensure_distributed()
        if not is_rank0():
            dist.barrier()  # rank 0 resolves (and downloads) the init first
    rank0 = is_rank0()
    base_model, dcfg, parent = prepare_init(args.init, dataset, args.arch)
    if multi and rank0:
        dist.barrier()
    train_idx = list(range(len(dataset))) if val_dataset else split_indices(len(dataset), base.val_fraction, seed)[0]
    storage_url = studies.storage_url(none_if_empty(args.storage) or studies.default_storage())
    study_name = none_if_empty(args.study) or f"finetune-{args.init.replace('/', '_')}-{dataset.digest[:10]}"
    study, sampler_seed, created = None, None, False
    if rank0:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = studies.make_storage(storage_url, integer(args.heartbeat, "heartbeat", 1))
        study, sampler_seed, created = studies.open_study(storage, study_name, seed, n_trials)
        if created and fixed is not None:
            study.enqueue_trial({}, user_attrs={"fixed": True})
        elif created and baseline:
            study.enqueue_trial({k: baseline[k] for k in space if k in baseline}, user_attrs={"baseline": True})
    shared = Study(
        study=study, base_model=base_model, drafter_config=dcfg, dataset=dataset, val_dataset=val_dataset,
        train_indices=train_idx, base=base, space=space, fixed=fixed,
        checkpoints=checkpoint_root(args.checkpoints, storage_url), world_size=world, rank0=rank0,
        progress=args.progress,
    )  # fmt: skip

    def objective(trial: Any) -> float:
        if rank0 and not multi and studies.over_budget(study, trial.number, n_trials):
            trial.set_user_attr("over_budget", True)
            study.stop()
            raise OverBudget()
        return run_trial(trial, shared)

    if multi and not rank0:
        follow_trials(objective)
        return 0
    name = none_if_empty(args.name) or (parent.name if parent is not None else None) or default_name(dataset)
    with step_run("finetune", run_name=f"finetune {'scratch' if args.init == 'scratch' else 'warm'}"):
        log_params(
            {
                "init": args.init, "data": args.data, "val_data": none_if_empty(args.val_data),
                "profile": profile.name, "n_trials": n_trials, "max_steps": max_steps, "batch_size": base.batch_size,
                "ds_config": args.ds_config, "storage": storage_url.split("@")[-1], "study": study_name,
                "seed": seed, "fixed_params": args.fixed_params, "baseline": args.baseline if baseline else None,
                "checkpoints": shared.checkpoints, "name": name, "alias": alias, "heartbeat": args.heartbeat,
                "val_draft_steps": profile.draft_steps, "sampler_seed": sampler_seed,
                "tpe_startup_trials": studies.startup_trials(n_trials), "world_size": world,
                "packing": args.packing, "memory_limit_gib": limit,
            }
        )  # fmt: skip
        mlflow.log_dict(memory_plan.to_json(), "memory_plan.json")
        mlflow.log_metrics(
            {
                "memory_plan_per_rank_gib": memory_plan.per_rank / GIB,
                "memory_available_gib": memory_plan.available / GIB,
            }
        )
        mlflow.set_tags({"dataset_digest": dataset.digest, "optuna.study": study_name, "optuna.created": created})
        if multi:
            lead_trials(study, objective, n_trials)
        elif studies.counted(study) < n_trials:
            study.optimize(
                objective, catch=(TrainingDiverged, OverBudget), callbacks=[studies.stop_at_budget(n_trials)]
            )
        kind = "scratch" if args.init == "scratch" else "warm"
        best = finish(study, study_name, kind)
        log_params({f"best.{k}": v for k, v in (best.user_attrs.get("settings") or best.params).items()})
        best_dir = Path(
            mlflow.artifacts.download_artifacts(
                run_id=best.user_attrs["mlflow_run_id"],
                artifact_path="drafter",
                dst_path=str(shared.checkpoints / "best"),
            )
        )
        version = register_best(best_dir, name, parent, dataset, best, alias, mlflow.active_run().info.run_id)
        shutil.rmtree(best_dir.parent, ignore_errors=True)
        mlflow.set_tag("mlflow.note.content", verdict(study, best, f"models:/{name}/{version}"))
    states = [t.state.name for t in counted_trials(study)]
    print(
        f"finetune: best trial {best.number} val_sim_accept_len {best.value:.3f} at {profile.draft_steps} draft steps "
        f"({states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned, {states.count('FAIL')} failed) "
        f"-> models:/{name}/{version}"
    )
    return 0


def main(argv: list[str] | None = None) -> None:
    run_step("finetune", build, run, argv)


if __name__ == "__main__":
    main()
