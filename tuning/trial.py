"""One trial of the study: train with the trial's settings (resuming from the trial's checkpoint when
a retry of a trial whose worker died), validate at the deployment's draft depth on the validation
set, report to the pruner, and keep the result in the trial's MLflow run."""

from __future__ import annotations

import contextlib
import copy
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from drafter.train.loop import TrainConfig
from tuning.ranks import Tracker
from tuning.space import suggest
from tuning.study import OBJECTIVE
from tuning.workers import RUN_TAG, WORKER_ATTR, retry_history, this_worker


@dataclass
class Study:
    """What every trial of one `finetune` shares."""

    study: Any | None  # the Optuna study (rank 0 only)
    base_model: Any | None  # warm start, or None for scratch
    drafter_config: Any
    dataset: Any
    val_dataset: Any | None
    train_indices: list[int]
    base: TrainConfig
    space: dict[str, dict[str, Any]]
    fixed: dict[str, Any] | None
    checkpoints: Path  # shared by every worker: the trial's checkpoint lives under its identity
    world_size: int
    rank0: bool
    progress: bool = True
    method: Any = None  # the init's draft method (drafter/methods) when not EAGLE-3: its own objective and layout


def _frozen(study: Any, number: int) -> Any:
    return next(t for t in study.get_trials(deepcopy=False) if t.number == number)


def checkpoint_key(study: Any, number: int) -> str:
    """A trial's identity across retries: the number of the first trial in its retry chain."""
    history = retry_history(_frozen(study, number))
    return f"trial-{history[0] if history else number}"


def fail_dead_runs(study: Any, number: int) -> None:
    """A retried trial's earlier attempts died with their worker: their MLflow runs, still RUNNING,
    end FAILED with the reason."""
    import mlflow

    earlier = set(retry_history(_frozen(study, number)))
    c = mlflow.MlflowClient()
    for t in study.get_trials(deepcopy=False):
        run_id = t.user_attrs.get("mlflow_run_id") if t.number in earlier else None
        if run_id and c.get_run(run_id).info.status == "RUNNING":
            c.set_tag(run_id, "trial_state", "FAILED")
            c.set_tag(run_id, "failed_because", f"worker lost (process gone or no heartbeat); retried as {number}")
            c.set_terminated(run_id, "FAILED")


def resumable_step(folder: Path) -> int:
    """The step of the DeepSpeed checkpoint in `folder` (0 when there is none)."""
    latest = folder / "latest"
    if not latest.is_file():
        return 0
    tag = latest.read_text().strip()
    return int(tag.removeprefix("step")) if tag.startswith("step") and tag[4:].isdigit() else 0


def run_trial(trial: Any, s: Study) -> float:
    """The objective: the trial's final validation figure at the deployment's draft depth."""
    import mlflow
    import optuna

    from drafter.formats.checkpoint import save_drafter
    from drafter.train.loop import TrainingDiverged, TrainingStopped, scratch_drafter, train

    params = dict(s.fixed) if s.fixed is not None else suggest(trial, s.space)
    number = trial.number
    key = checkpoint_key(s.study, number) if s.rank0 else None
    trial.set_user_attr("settings", params)  # collective under a launcher: every rank calls these
    trial.set_user_attr("checkpoint_key", key)
    key = trial.user_attrs["checkpoint_key"]
    ckpt = s.checkpoints / key
    cfg = replace(s.base, **params, checkpoint_dir=str(ckpt))
    if s.base_model is not None:
        model = _copy(s.base_model)
    elif s.method is None:
        model = scratch_drafter(s.drafter_config, s.dataset, s.train_indices, cfg.seed)
    else:  # another method's network from its config, fresh for this trial's seed
        model = s.method.scratch(s.drafter_config, s.dataset, s.train_indices, cfg.seed)
    resumed = resumable_step(ckpt)
    label = ", ".join(f"{k} {v:.2g}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(params.items()))
    role = "scratch" if s.base_model is None else "warm"
    role += " baseline" if trial.user_attrs.get("baseline") else ""
    run_name = f"trial {number} {role} ({label})"[:250]  # unique within the study; `finish` marks the best
    run_ctx = (
        mlflow.start_run(run_name=run_name, nested=True, experiment_id=mlflow.active_run().info.experiment_id)
        if s.rank0
        else None
    )  # a nested run goes to its parent's experiment only when told
    track = Tracker(s.rank0)
    pruned_at = None
    with run_ctx or contextlib.nullcontext() as run:
        trial.set_user_attr("mlflow_run_id", run.info.run_id if s.rank0 else None)
        trial.set_user_attr(WORKER_ATTR, this_worker() if s.rank0 else None)  # a rerun sees at once if it died
        if s.rank0:
            fail_dead_runs(s.study, number)
        micro = cfg.batch_size // s.world_size
        track.log_params(
            {
                **cfg.to_params(),
                "trial": number,
                "world_size": s.world_size,
                "micro_batch_per_rank": micro,
                "global_batch": cfg.batch_size,
            }
        )
        track.set_tags({"trial_checkpoint": str(ckpt), RUN_TAG: this_worker(),
                        **({"resumed_from_step": resumed} if resumed else {})})  # fmt: skip

        def on_step(step: int, m: dict[str, float]) -> None:
            if step % 5 == 0 or step == cfg.max_steps:
                track.log_metrics(m, step=step)

        def on_validate(step: int, stats: Any) -> bool:
            value = stats.sim_accept_len
            track.log_metrics(
                {OBJECTIVE: value, **{f"val_acc_pos_{i}": a for i, a in enumerate(stats.conditional_acceptance)}},
                step=step,
            )
            trial.report(value, step)
            return trial.should_prune()

        try:
            result = (train if s.method is None else s.method.train)(
                model, s.dataset, cfg, on_step=on_step, on_validate=on_validate, progress=s.progress,
                val_dataset=s.val_dataset,
            )  # fmt: skip
        except TrainingStopped as stop:  # expected: its run ends FINISHED, named and tagged as pruned
            pruned_at = stop.step
            track.set_tags(
                {
                    "trial_state": "PRUNED",
                    "pruned_at_step": stop.step,
                    "mlflow.runName": f"trial {number} {role} pruned at step {stop.step}",
                }
            )
        except TrainingDiverged as err:
            track.set_tags({"trial_state": "FAILED", "failed_at_step": err.step})
            if s.rank0:
                shutil.rmtree(ckpt, ignore_errors=True)
            raise
        if pruned_at is None and s.rank0:
            steady = max(result.seconds - result.warmup_seconds, 1e-9)  # compiling is paid once, not per token
            mlflow.log_metrics(
                {
                    "tokens_per_s": result.tokens / max(result.seconds, 1e-9),
                    "steady_tokens_per_s": result.tokens / steady,
                    "warmup_s": result.warmup_seconds,
                }
            )
            mlflow.set_tag("trial_state", "COMPLETE")
            out = s.checkpoints / f"{key}-export"
            if s.method is None:
                save_drafter(result.model, out, include_embedding=False)
            else:  # in its makers' layout, as it was imported
                s.method.save(result.model, out)
            mlflow.log_artifacts(str(out), "drafter")  # in the shared store: any worker can register it
            shutil.rmtree(out, ignore_errors=True)
    if s.rank0:
        shutil.rmtree(ckpt, ignore_errors=True)  # finished (complete or pruned): nothing to resume
    if pruned_at is not None:
        raise optuna.TrialPruned(f"pruned at step {pruned_at}")
    return result.val.sim_accept_len


def _copy(model: Any) -> Any:
    clone = copy.deepcopy(model)
    clone.has_embedding = True
    return clone
