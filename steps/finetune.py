"""`finetune`: an Optuna study over DeepSpeed training runs, warm-started from a registry version (or
from scratch); every trial is a nested MLflow run, the best drafter becomes a new registry version."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from drafter.errors import BadInput
from drafter.train import TrainConfig
from steps._cli import log_params, none_if_empty, parser, run_step, step_run
from steps.import_drafter import MINIWORLD

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def build() -> argparse.ArgumentParser:
    p = parser("finetune", __doc__)
    p.add_argument("--init", default="models:/k2.5-mini-eagle3@imported", help="registry URI, folder, or 'scratch'")
    p.add_argument("--data", required=True, help="hidden-state dataset folder (make_data)")
    p.add_argument("--n_trials", default="4")
    p.add_argument("--max_steps", default="150")
    p.add_argument("--batch_size", default="8")
    p.add_argument("--ds_config", default="zero0", help="a name in configs/deepspeed or a path")
    p.add_argument("--storage", default="auto", help="Optuna storage URL (auto: an SQLite file beside mlflow.db)")
    p.add_argument("--study", default="auto", help="study name (auto: from init and dataset digest)")
    p.add_argument("--search_space", default=str(CONFIGS / "search_space.yaml"))
    p.add_argument("--fixed_params", default="none", help="JSON of TrainConfig values used instead of a search")
    p.add_argument("--seed", default="0")
    p.add_argument("--arch", default=str(MINIWORLD / "aq-mini-eagle3"), help="drafter config for init=scratch")
    p.add_argument("--name", default="auto", help="registered model (auto: the init's, or <target>-eagle3)")
    p.add_argument("--alias", default="candidate", help="alias for the registered best version ('none' for none)")
    p.add_argument("--val_every", default="25")
    p.add_argument(
        "--heartbeat",
        default="30",
        help="seconds between trial heartbeats (RDB storages); a trial "
        "silent for 3 heartbeats is failed and retried by the next worker",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p


def _int(value: str, name: str, low: int = 1) -> int:
    try:
        out = int(float(value))
    except (TypeError, ValueError):
        raise BadInput(f"--{name} must be an integer, got {value!r}") from None
    if out < low:
        raise BadInput(f"--{name} must be >= {low}, got {out}")
    return out


def load_space(path: str) -> dict[str, dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{path}: search space file not found")
    try:
        space = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise BadInput(f"{path}: not valid YAML ({exc.__class__.__name__})") from None
    fields = set(TrainConfig.__dataclass_fields__)
    if not isinstance(space, dict) or not space:
        raise BadInput(f"{path}: expected a mapping of TrainConfig fields to distributions")
    for key, spec in space.items():
        if key not in fields:
            raise BadInput(f"{path}: '{key}' is not a training setting ({', '.join(sorted(fields))})")
        if not isinstance(spec, dict) or spec.get("type") not in ("float", "int", "categorical"):
            raise BadInput(f"{path}: '{key}' needs type float, int or categorical")
    return space


def suggest(trial: Any, space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for key, spec in space.items():
        if spec["type"] == "float":
            out[key] = trial.suggest_float(key, float(spec["low"]), float(spec["high"]), log=bool(spec.get("log")))
        elif spec["type"] == "int":
            out[key] = trial.suggest_int(key, int(spec["low"]), int(spec["high"]))
        else:
            out[key] = trial.suggest_categorical(key, list(spec["choices"]))
    return out


def default_storage() -> str:
    """An SQLite file next to the MLflow database (embedded default)."""
    from registry.naming import tracking_uri

    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        return f"sqlite:///{Path(uri.removeprefix('sqlite:///')).parent / 'optuna.db'}"
    return "sqlite:///optuna.db"


def make_storage(url: str, heartbeat: int = 30):
    import optuna
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

    if url.startswith(("sqlite:", "postgresql", "mysql")):
        # heartbeats: a trial whose worker died is marked failed and re-queued, not lost
        return RDBStorage(
            url,
            heartbeat_interval=heartbeat,
            grace_period=3 * heartbeat,
            heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=2),
            engine_kwargs={"pool_pre_ping": True} if not url.startswith("sqlite") else None,
        )
    if url.endswith(".journal") or url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
    return optuna.storages.get_storage(url)


def prepare_init(init: str, dataset: Any, arch: str):
    """(base drafter or None for scratch, DrafterConfig, ModelVersion or None); refuses an init whose
    shape gate has not passed for the dataset's target."""
    from drafter.checkpoint import load_drafter
    from drafter.config import DrafterConfig
    from drafter.train import attach_target_embedding, check_fit

    if init == "scratch":
        cfg = DrafterConfig.from_file(Path(arch) / "config.json" if Path(arch).is_dir() else arch)
        check_fit(cfg, dataset)
        return None, cfg, None
    mv = None
    if init.startswith("models:/"):
        from registry import naming, store

        mv = store.get_version(init)
        gate, gate_target = mv.tags.get(naming.TAG_GATE), mv.tags.get(naming.TAG_GATE_TARGET)
        if gate != "passed":
            raise BadInput(
                f"{init}: shape gate says {gate or 'nothing (never run)'}; run shape_gate against the "
                "dataset's target first"
            )
        data_target = str(dataset.index.get("target", ""))
        if data_target and gate_target and not naming.same_target(gate_target, data_target):
            raise BadInput(f"{init}: shape gate passed for {gate_target!r}, but the dataset is from {data_target!r}")
        folder = store.download_version(f"models:/{mv.name}/{mv.version}").folder
    else:
        from registry.resolve import resolve_drafter

        folder = resolve_drafter(init).folder
    model = load_drafter(folder)
    check_fit(model.config, dataset)
    attach_target_embedding(model, dataset)
    return model, model.config, mv


def run(args: argparse.Namespace) -> int:
    import mlflow
    import optuna

    from drafter.data import HiddenStateDataset, split_indices
    from drafter.train import TrainingDiverged, TrainingStopped, load_ds_config, scratch_drafter, train
    from registry import naming

    if none_if_empty(args.alias):  # checked before any work: a serving alias is promote's alone
        naming.check_alias(args.alias)
    if none_if_empty(args.name):
        naming.check_name(args.name)
    n_trials = _int(args.n_trials, "n_trials")
    max_steps = _int(args.max_steps, "max_steps")
    seed = _int(args.seed, "seed", 0)
    base_cfg = TrainConfig(
        max_steps=max_steps,
        batch_size=_int(args.batch_size, "batch_size"),
        seed=seed,
        ds_config=args.ds_config,
        val_every=_int(args.val_every, "val_every"),
    )
    load_ds_config(args.ds_config, base_cfg, max_steps)  # a config that does not parse fails before anything
    fixed = None
    if none_if_empty(args.fixed_params):
        try:
            fixed = json.loads(args.fixed_params)
        except json.JSONDecodeError:
            raise BadInput(f"--fixed_params is not JSON: {args.fixed_params!r}") from None
        unknown = set(fixed) - set(TrainConfig.__dataclass_fields__)
        if unknown:
            raise BadInput(f"--fixed_params: unknown settings {sorted(unknown)}")
    space = load_space(args.search_space) if fixed is None else {}
    dataset = HiddenStateDataset(args.data)
    multi = int(os.environ.get("WORLD_SIZE", "1")) > 1  # under the deepspeed/torchrun launcher
    rank0 = True
    if multi:
        import torch.distributed as dist

        from drafter.train import ensure_distributed, is_rank0

        ensure_distributed()
        rank0 = is_rank0()
        if not rank0:
            dist.barrier()  # rank 0 resolves (and downloads) the init first
    base_model, dcfg, parent = prepare_init(args.init, dataset, args.arch)
    if multi and rank0:
        dist.barrier()
    train_idx, _ = split_indices(len(dataset), base_cfg.val_fraction, seed)
    storage_url = none_if_empty(args.storage) or default_storage()
    study_name = none_if_empty(args.study) or f"finetune-{args.init.replace('/', '_')}-{dataset.digest[:10]}"
    study = None
    if rank0:
        storage = make_storage(storage_url, _int(args.heartbeat, "heartbeat"))
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            study_name=study_name,
            storage=storage,
            direction="maximize",
            load_if_exists=True,
            sampler=optuna.samplers.TPESampler(seed=seed),
            pruner=optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0),
        )
        if fixed is not None:
            study.enqueue_trial({}, user_attrs={"fixed": True})
    trial_root = Path(tempfile.mkdtemp(prefix="drafterops-trials-")) if rank0 else None
    if multi:  # every rank checkpoints into the same folder, as DeepSpeed expects
        shared = [str(trial_root) if rank0 else None]
        dist.broadcast_object_list(shared, src=0)
        trial_root = Path(shared[0])
    parent_name = parent.name if parent is not None else None
    name = none_if_empty(args.name) or parent_name or _default_name(dataset)

    def objective(trial: optuna.Trial) -> float:
        params = dict(fixed) if fixed is not None else suggest(trial, space)
        number = trial.number
        trial.set_user_attr("settings", params)  # collective under a launcher: every rank calls it
        cfg = replace(base_cfg, **params, checkpoint_dir=str(trial_root / f"ckpt-{number}"))
        model = scratch_drafter(dcfg, dataset, train_idx, seed) if base_model is None else _copy(base_model)
        label = ", ".join(f"{k} {v:.2g}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(params.items()))
        run_ctx = (
            mlflow.start_run(run_name=f"trial {number} ({label})"[:250], nested=True)
            if rank0
            else contextlib.nullcontext()
        )
        track = Tracker(rank0)
        pruned_at = None
        with run_ctx as run:
            trial.set_user_attr("mlflow_run_id", run.info.run_id if rank0 else None)
            track.log_params({**cfg.to_params(), "trial": number})

            def on_step(step: int, m: dict[str, float]) -> None:
                if step % 5 == 0 or step == cfg.max_steps:
                    track.log_metrics(m, step=step)

            def on_validate(step: int, stats: Any) -> bool:
                value = stats.sim_accept_len
                track.log_metrics(
                    {
                        "val_sim_accept_len": value,
                        **{f"val_acc_pos_{i}": a for i, a in enumerate(stats.conditional_acceptance)},
                    },
                    step=step,
                )
                trial.report(value, step)
                return trial.should_prune()

            try:
                result = train(model, dataset, cfg, on_step=on_step, on_validate=on_validate, progress=args.progress)
            except TrainingStopped as stop:  # expected: its run ends FINISHED, named and tagged as pruned
                pruned_at = stop.step
                track.set_tags(
                    {
                        "trial_state": "PRUNED",
                        "pruned_at_step": stop.step,
                        "mlflow.runName": f"trial {number} pruned at step {stop.step}",
                    }
                )
            except TrainingDiverged as err:
                track.set_tags({"trial_state": "FAILED", "failed_at_step": err.step})
                raise
            if pruned_at is None and rank0:
                from drafter.checkpoint import save_drafter

                mlflow.log_metrics({"tokens_per_s": result.tokens / max(result.seconds, 1e-9)})
                mlflow.set_tag("trial_state", "COMPLETE")
                out = trial_root / f"trial-{number}"
                save_drafter(result.model, out, include_embedding=False)
                mlflow.log_artifacts(str(out), "drafter")  # in the shared store: any worker can register it
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(cfg.checkpoint_dir, ignore_errors=True)
        if pruned_at is not None:
            raise optuna.TrialPruned(f"pruned at step {pruned_at}")
        return result.val.sim_accept_len

    if multi and not rank0:
        follow_trials(objective)
        return 0
    with step_run("finetune", run_name=f"finetune {'scratch' if args.init == 'scratch' else 'warm'}"):
        log_params(
            {
                "init": args.init,
                "data": args.data,
                "n_trials": n_trials,
                "max_steps": max_steps,
                "ds_config": args.ds_config,
                "storage": storage_url,
                "study": study_name,
                "seed": seed,
                "fixed_params": args.fixed_params,
                "name": name,
                "alias": none_if_empty(args.alias),
                "heartbeat": args.heartbeat,
            }
        )
        mlflow.set_tags({"dataset_digest": dataset.digest, "optuna.study": study_name})
        from optuna.study import MaxTrialsCallback
        from optuna.trial import TrialState

        if multi:
            lead_trials(study, objective, n_trials)
        else:
            study.optimize(
                objective,
                n_trials=n_trials,
                catch=(TrainingDiverged,),
                callbacks=[MaxTrialsCallback(n_trials, states=(TrialState.COMPLETE, TrialState.PRUNED))],
            )
        states = [t.state.name for t in study.trials]
        mlflow.log_metrics(
            {
                "trials_complete": states.count("COMPLETE"),
                "trials_pruned": states.count("PRUNED"),
                "trials_failed": states.count("FAIL"),
            }
        )
        log_study_figures(study)
        complete = [t for t in study.trials if t.state == TrialState.COMPLETE and "mlflow_run_id" in t.user_attrs]
        if not complete:
            raise BadInput(f"no trial of study {study_name!r} completed; nothing registered")
        best = max(complete, key=lambda t: t.value)
        mlflow.log_metric("best_val_sim_accept_len", best.value)
        log_params({f"best.{k}": v for k, v in best.params.items()})
        best_dir = Path(
            mlflow.artifacts.download_artifacts(
                run_id=best.user_attrs["mlflow_run_id"], artifact_path="drafter", dst_path=str(trial_root)
            )
        )
        version = register_best(
            best_dir, name, parent, dataset, best, none_if_empty(args.alias), mlflow.active_run().info.run_id
        )
    shutil.rmtree(trial_root, ignore_errors=True)
    print(
        f"finetune: best trial {best.number} val_sim_accept_len {best.value:.3f} "
        f"({states.count('COMPLETE')} complete, {states.count('PRUNED')} pruned, {states.count('FAIL')} failed) "
        f"-> models:/{name}/{version}"
    )
    return 0


class Tracker:
    """mlflow.<call> on rank 0, a no-op on the other ranks (one MLflow run per trial, not one per rank)."""

    def __init__(self, active: bool) -> None:
        self.active = active

    def __getattr__(self, name: str) -> Any:
        import mlflow

        return getattr(mlflow, name) if self.active else (lambda *a, **k: None)


def lead_trials(study: Any, objective: Any, n_trials: int) -> None:
    """Rank 0 under a launcher: ask/tell each trial and tell the other ranks to run it too, so every
    rank trains the same trial (Optuna's TorchDistributedTrial carries its parameters and pruning)."""
    import optuna
    import torch
    import torch.distributed as dist
    from optuna.trial import TrialState
    from optuna_integration import TorchDistributedTrial

    from drafter.train import TrainingDiverged

    for _ in range(n_trials):
        dist.broadcast(torch.tensor([1]), src=0)
        trial = study.ask()
        try:
            study.tell(trial, objective(TorchDistributedTrial(trial)))
        except optuna.TrialPruned:
            study.tell(trial, state=TrialState.PRUNED)
        except TrainingDiverged:
            study.tell(trial, state=TrialState.FAIL)
    dist.broadcast(torch.tensor([0]), src=0)


def follow_trials(objective: Any) -> None:
    """The other ranks: run whatever trial rank 0 announces until it says there are no more."""
    import optuna
    import torch
    import torch.distributed as dist
    from optuna_integration import TorchDistributedTrial

    from drafter.train import TrainingDiverged

    while True:
        flag = torch.tensor([0])
        dist.broadcast(flag, src=0)
        if int(flag) == 0:
            return
        with contextlib.suppress(optuna.TrialPruned, TrainingDiverged):  # rank 0 records the outcome
            objective(TorchDistributedTrial(None))


def _copy(model: Any) -> Any:
    import copy

    clone = copy.deepcopy(model)
    clone.has_embedding = True
    return clone


def _default_name(dataset: Any) -> str:
    from registry.naming import model_name_for

    return model_name_for(str(dataset.index.get("target", "target")))


def register_best(
    folder: Path, name: str, parent: Any, dataset: Any, trial: Any, alias: str | None, run_id: str
) -> str:
    from registry import store

    hashes = store.file_hashes(folder)
    c = store.client()
    target = str(dataset.index.get("target", ""))
    with store.registry_lock():
        if not _exists(c, name):
            store.ensure_registered_model(c, name, target)
        same = store.find_complete_version(c, name, store.weights_sha256(hashes))
        if same is not None:  # another worker of the same study registered this trial already
            return str(same.version)
        return _register(c, folder, name, parent, dataset, trial, alias, run_id, hashes, target)


def _register(
    c: Any,
    folder: Path,
    name: str,
    parent: Any,
    dataset: Any,
    trial: Any,
    alias: str | None,
    run_id: str,
    hashes: dict[str, str],
    target: str,
) -> str:
    from registry import audit, naming, store

    tags = {
        naming.TAG_SOURCE: f"run:{run_id}",
        naming.TAG_SHA256: store.weights_sha256(hashes),
        naming.TAG_TRAINED_FOR: naming.target_slug(target),
        naming.TAG_DATASET: dataset.digest,
        "optuna.trial": str(trial.number),
        "val_sim_accept_len": f"{trial.value:.4f}",
    }
    if parent is not None:
        tags[naming.TAG_PARENT] = f"models:/{parent.name}/{parent.version}"
    from drafter.checkpoint import read_header
    from registry.describe import contents, upsert_section

    settings = trial.user_attrs.get("settings") or trial.params
    what = f"## Fine-tuned from `{tags[naming.TAG_PARENT]}`" if parent is not None else "## Trained from scratch"
    desc = (
        f"{what}\n\n- **trained for**: `{tags[naming.TAG_TRAINED_FOR]}`\n"
        f"- **dataset**: `{dataset.digest}` ({len(dataset)} samples)\n- **finetune run**: `{run_id}`\n"
        f"- **best trial**: {trial.number}, val sim_accept_len {trial.value:.3f}\n\n"
        "### Settings\n\n| setting | value |\n|---|---|\n"
        + "\n".join(f"| {k} | {_fmt(v)} |" for k, v in sorted(settings.items()))
        + "\n"
    )
    desc = upsert_section(desc, "contents", contents(hashes, read_header(folder)))
    mv = store.register_drafter(folder, name, tags, desc)
    if alias:
        audit.move_alias(c, name, alias, mv.version, f"best of finetune run {run_id} (trial {trial.number})")
    return str(mv.version)


def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _exists(c: Any, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        c.get_registered_model(name)
        return True
    except MlflowException:
        return False


OBJECTIVE = "val_sim_accept_len"


def study_history_figure(study: Any):
    """Every trial of the study against the objective: completed trials as dots, pruned ones as
    crosses at their last reported value, failed ones along the bottom, and the best so far."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.trial import TrialState

    fig, ax = plt.subplots(figsize=(7, 4))
    best, best_line = float("-inf"), []
    styles = {
        TrialState.COMPLETE: ("o", "tab:blue", "completed"),
        TrialState.PRUNED: ("x", "tab:orange", "pruned (last value)"),
    }
    shown: set[str] = set()
    for t in sorted(study.trials, key=lambda t: t.number):
        value = (
            t.value
            if t.state == TrialState.COMPLETE
            else (t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None)
        )
        if t.state in styles and value is not None:
            marker, color, label = styles[t.state]
            ax.scatter(t.number, value, marker=marker, color=color, label=None if label in shown else label, zorder=3)
            shown.add(label)
        if t.state == TrialState.COMPLETE:
            best = max(best, t.value)
        best_line.append((t.number, best if best > float("-inf") else None))
    points = [(n, b) for n, b in best_line if b is not None]
    if points:
        ax.step([n for n, _ in points], [b for _, b in points], where="post", color="tab:green", label="best so far")
    failed = [t.number for t in study.trials if t.state == TrialState.FAIL]
    if failed:
        ax.scatter(failed, [ax.get_ylim()[0]] * len(failed), marker="v", color="tab:red", label="failed")
    ax.set_xlabel("trial")
    ax.set_ylabel(f"{OBJECTIVE} (objective, higher is better)")
    ax.set_title(f"study {study.study_name[:60]}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    return fig


def log_study_figures(study: Any) -> None:
    """The study's history (objective named, pruned trials shown), Optuna's intermediate values, and
    parameter importances when there is something to attribute (else a tag says why not)."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import mlflow
    import optuna
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as ovm

    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    mlflow.log_figure(study_history_figure(study), "optuna_history.png")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if any(t.intermediate_values for t in study.trials):
            ax = ovm.plot_intermediate_values(study)
            ax.set_ylabel(f"{OBJECTIVE} at each validation")
            mlflow.log_figure(ax.figure, "optuna_intermediate_values.png")
        searched = {k for t in done for k in t.params}
        why = None
        if len(done) < 2:
            why = f"{len(done)} completed trial(s); importances need at least 2"
        elif not searched:
            why = "no searched parameters (fixed settings)"
        else:
            try:
                importances = optuna.importance.get_param_importances(study)
                ax = ovm.plot_param_importances(study)
                ax.set_xlabel(f"importance for {OBJECTIVE} (fANOVA)")
                mlflow.log_figure(ax.figure, "optuna_param_importances.png")
                mlflow.log_dict(importances, "optuna_param_importances.json")
            except (ValueError, RuntimeError) as exc:
                why = f"not computable: {str(exc).splitlines()[0][:200]}"
        mlflow.set_tag("optuna.importance", why or "optuna_param_importances.png")


def main(argv: list[str] | None = None) -> None:
    run_step("finetune", build, run, argv)


if __name__ == "__main__":
    main()
