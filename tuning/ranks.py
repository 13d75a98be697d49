"""Trials under a launcher (torchrun, `deepspeed --num_gpus N`): rank 0 owns the study and the MLflow
runs; every rank trains the same trial on its own part of each global batch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any


class Tracker:
    """mlflow.<call> on rank 0, a no-op on the other ranks (one MLflow run per trial, not one per rank)."""

    def __init__(self, active: bool) -> None:
        self.active = active

    def __getattr__(self, name: str) -> Any:
        import mlflow

        return getattr(mlflow, name) if self.active else (lambda *a, **k: None)


def lead_trials(study: Any, objective: Callable[[Any], float], n_trials: int) -> None:
    """Rank 0: claim each trial within the study's budget, tell the other ranks to run it too
    (Optuna's TorchDistributedTrial carries its parameters and pruning), record its outcome."""
    import optuna
    import torch
    import torch.distributed as dist
    from optuna.trial import TrialState
    from optuna_integration import TorchDistributedTrial

    from drafter.train.loop import TrainingDiverged
    from tuning.study import claim_trial

    while (trial := claim_trial(study, n_trials)) is not None:
        dist.broadcast(torch.tensor([1]), src=0)
        try:
            study.tell(trial, objective(TorchDistributedTrial(trial)))
        except optuna.TrialPruned:
            study.tell(trial, state=TrialState.PRUNED)
        except TrainingDiverged:
            study.tell(trial, state=TrialState.FAIL)
    dist.broadcast(torch.tensor([0]), src=0)


def follow_trials(objective: Callable[[Any], float]) -> None:
    """The other ranks: run whatever trial rank 0 announces until it says there are no more."""
    import optuna
    import torch
    import torch.distributed as dist
    from optuna_integration import TorchDistributedTrial

    from drafter.train.loop import TrainingDiverged

    while True:
        flag = torch.tensor([0])
        dist.broadcast(flag, src=0)
        if int(flag) == 0:
            return
        with contextlib.suppress(optuna.TrialPruned, TrainingDiverged):  # rank 0 records the outcome
            objective(TorchDistributedTrial(None))
