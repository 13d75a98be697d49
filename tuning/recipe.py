"""The fine-tuning recipe behind `finetune`, shaped like a torchtune recipe: `setup` builds one thing at a
time (the memory check, the data, the init, the study), `train` runs the study's trials (on every rank under
a launcher), `register` makes the best trial a registry version. The step only parses its arguments into a
`FinetuneRequest`, opens the MLflow run and calls these in order."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drafter.train.loop import TrainConfig


@dataclass(frozen=True)
class FinetuneRequest:
    """The study as asked, every value checked."""

    init: str
    data: str
    val_data: str | None
    arch: str
    base: TrainConfig  # the settings every trial starts from (max_steps, batch, seed, validation depth)
    n_trials: int
    space: dict[str, dict[str, Any]]  # empty with `fixed`
    baseline: dict[str, Any] | None  # enqueued as trial 0
    fixed: dict[str, Any] | None  # one trial at these settings instead of a search
    storage: str | None  # None: an SQLite file beside mlflow.db
    study: str | None  # None: named from the init and the dataset's digest
    checkpoints: str | None  # None: beside the study
    heartbeat: int
    memory_limit: float | None  # bytes one rank may use (None: what the host has free)
    name: str | None
    alias: str | None
    progress: bool = True


class OverBudget(Exception):
    """This worker's trial raced past the study's budget: handed back before it ran."""


def checkpoint_root(given: str | None, storage_url: str) -> Path:
    """Where trial checkpoints live: given, or beside an SQLite study (one machine, many workers)."""
    if given:
        return Path(given)
    if storage_url.startswith("sqlite:///"):
        return Path(storage_url.removeprefix("sqlite:///")).parent / "trial-checkpoints"
    return Path.home() / ".cache" / "drafterops" / "trial-checkpoints"  # pass a shared folder across machines


class FinetuneRecipe:
    def __init__(self, request: FinetuneRequest) -> None:
        self.request = request
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.multi = self.world > 1  # under the deepspeed/torchrun launcher

    # --- setup -------------------------------------------------------------------------------------
    def setup(self) -> None:
        self._setup_memory()  # before any data is read
        self._setup_data()
        self._setup_init()
        self._setup_study()

    def _setup_memory(self) -> None:
        from tuning import memory

        r = self.request
        worst = memory.worst_case(r.base, r.space, r.fixed)
        configs = memory.ds_configs(worst, r.space, r.base.max_steps)
        self.memory_plan = memory.check(memory.init_config(r.init, r.arch), worst, configs, self.world, r.memory_limit)

    def _setup_data(self) -> None:
        from drafter.data.dataset import HiddenStateDataset, split_indices

        r = self.request
        self.dataset = HiddenStateDataset(r.data)
        self.val_dataset = HiddenStateDataset(r.val_data) if r.val_data else None
        self.train_idx = (
            list(range(len(self.dataset)))
            if self.val_dataset
            else split_indices(len(self.dataset), r.base.val_fraction, r.base.seed)[0]
        )

    def _setup_init(self) -> None:
        """The init resolved (and downloaded) by rank 0 first, then by the others from its cache."""
        from drafter.train.loop import ensure_distributed, is_rank0
        from tuning.register import default_name, init_digest, prepare_init

        if self.multi:
            import torch.distributed as dist

            ensure_distributed()
            if not is_rank0():
                dist.barrier()
        self.rank0 = is_rank0()
        self.base_model, self.drafter_config, self.parent = prepare_init(
            self.request.init, self.dataset, self.request.arch
        )
        if self.multi and self.rank0:
            dist.barrier()
        from drafter.methods import DEFAULT, config_method, model_method

        found = model_method(self.base_model) if self.base_model is not None else config_method(self.drafter_config)
        self.method = None if found is DEFAULT else found  # its own objective, layout and registered model
        parent_name = self.parent.name if self.parent is not None else None
        method = "eagle3" if self.method is None else self.method.NAME
        self.name = self.request.name or parent_name or default_name(self.dataset, method)
        self.init_digest = init_digest(self.request.init, self.parent)

    def _setup_study(self) -> None:
        """Rank 0 opens (or joins) the study and enqueues the baseline (or the fixed settings) as trial 0."""
        import optuna

        from tuning import study as studies
        from tuning.trial import Study

        r = self.request
        self.storage_url = studies.storage_url(r.storage or studies.default_storage())
        self.study_name = r.study or f"finetune-{r.init.replace('/', '_')}{arch_part(r)}-{self.dataset.digest[:10]}"
        self.study, self.sampler_seed, self.created = None, None, False
        if self.rank0:
            optuna.logging.set_verbosity(optuna.logging.WARNING)
            storage = studies.make_storage(self.storage_url, r.heartbeat)
            self.study, self.sampler_seed, self.created = studies.open_study(
                storage, self.study_name, r.base.seed, r.n_trials
            )
            if self.created and r.fixed is not None:
                self.study.enqueue_trial({}, user_attrs={"fixed": True})
            elif self.created and r.baseline:
                baseline = {k: r.baseline[k] for k in r.space if k in r.baseline}
                self.study.enqueue_trial(baseline, user_attrs={"baseline": True})
        self.shared = Study(
            study=self.study, base_model=self.base_model, drafter_config=self.drafter_config, dataset=self.dataset,
            val_dataset=self.val_dataset, train_indices=self.train_idx, base=r.base, space=r.space, fixed=r.fixed,
            checkpoints=checkpoint_root(r.checkpoints, self.storage_url), world_size=self.world, rank0=self.rank0,
            progress=r.progress, method=self.method,
        )  # fmt: skip

    # --- train ------------------------------------------------------------------------------------
    @property
    def leads(self) -> bool:
        """This process owns the study and the MLflow runs (rank 0, or the only process)."""
        return self.rank0

    def _objective(self, trial: Any) -> float:
        from tuning import study as studies
        from tuning.trial import run_trial

        if self.rank0 and not self.multi and studies.over_budget(self.study, trial.number, self.request.n_trials):
            trial.set_user_attr("over_budget", True)
            self.study.stop()
            raise OverBudget()
        return run_trial(trial, self.shared)

    def follow(self) -> None:
        """A rank other than 0: train each trial's share the leader hands out, until it says stop."""
        from tuning.ranks import follow_trials

        follow_trials(self._objective)

    def train(self) -> None:
        """The study's trials until its budget is spent (all workers together)."""
        from drafter.train.loop import TrainingDiverged
        from tuning import study as studies
        from tuning.ranks import lead_trials

        n = self.request.n_trials
        if self.multi:
            lead_trials(self.study, self._objective, n)
        elif studies.counted(self.study) < n:
            self.study.optimize(
                self._objective, catch=(TrainingDiverged, OverBudget), callbacks=[studies.stop_at_budget(n)]
            )

    # --- register ---------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        return "scratch" if self.request.init == "scratch" else "warm"

    def best(self) -> Any:
        """The best completed trial, with the study's counts and figures logged on the active run."""
        from tuning.outcome import finish

        return finish(self.study, self.study_name, self.kind)

    def register(self, best: Any, run_id: str) -> str:
        """The best trial's drafter as a new version of the registered model, with its figures and lineage;
        returns the version."""
        import mlflow

        from tuning.register import register_best

        self.shared.checkpoints.mkdir(parents=True, exist_ok=True)
        fetched = Path(tempfile.mkdtemp(prefix=".best-", dir=self.shared.checkpoints))  # its own, removed after
        best_dir = Path(
            mlflow.artifacts.download_artifacts(
                run_id=best.user_attrs["mlflow_run_id"], artifact_path="drafter", dst_path=str(fetched)
            )
        )
        try:
            return register_best(best_dir, self.name, self.parent, self.dataset, best, self.request.alias, run_id,
                                 self.init_digest)  # fmt: skip
        finally:
            shutil.rmtree(fetched, ignore_errors=True)


def arch_part(r: Any) -> str:
    """From scratch, the study is also the architecture's: another --arch on the same data is another study (its
    config.json's digest), never a resumed one that trained a network of another shape or method."""
    if r.init != "scratch":
        return ""
    import hashlib

    from tuning.register import arch_config_path

    try:
        return "-" + hashlib.sha256(arch_config_path(r.arch).read_bytes()).hexdigest()[:8]
    except OSError:
        return ""  # prepare_init has refused it, naming the file
