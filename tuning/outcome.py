"""What a study came to, said on the `finetune` run: the counts, the figures, the best trial (marked
on its own run), how far it moved from the baseline, and a verdict sentence that opens the run's
description ("the baseline won, gain 0, 2 of 3 trials pruned at step 25")."""

from __future__ import annotations

from typing import Any

from common.errors import BadInput
from tuning.study import OBJECTIVE


def counted_trials(study: Any) -> list[Any]:
    """The study's trials, less those stopped only because the budget was spent."""
    return [t for t in study.trials if not t.user_attrs.get("over_budget")]


def finish(study: Any, study_name: str, kind: str) -> Any:
    """Counts, figures and the best trial on the step's run; the best trial's run renamed `... best`.
    The caller logs the best settings as params (`best.<name>`)."""
    import mlflow
    from optuna.trial import TrialState

    from tuning.study import log_figures

    trials = counted_trials(study)
    states = [t.state.name for t in trials]
    mlflow.log_metrics(
        {
            "trials_complete": states.count("COMPLETE"),
            "trials_pruned": states.count("PRUNED"),
            "trials_failed": states.count("FAIL"),
        }
    )
    complete = [t for t in trials if t.state == TrialState.COMPLETE and "mlflow_run_id" in t.user_attrs]
    best = max(complete, key=lambda t: t.value) if complete else None
    title = f"finetune {kind}: {len(trials)} trials" + (f", best trial {best.number}" if best else "")
    log_figures(study, title)
    if best is None:
        raise BadInput(f"no trial of study {study_name!r} completed; nothing registered")
    mlflow.log_metric("best_val_sim_accept_len", best.value)
    baseline = next((t for t in complete if t.user_attrs.get("baseline")), None)
    if baseline is not None:
        mlflow.log_metric("baseline_val_sim_accept_len", baseline.value)
        mlflow.log_metric("best_gain_over_baseline", best.value - baseline.value)
    mark_best(best)
    return best


def mark_best(best: Any) -> None:
    """The best trial's run says so in its name and a tag, so the run list shows which one won."""
    import contextlib

    from mlflow.exceptions import MlflowException

    from registry.access.store import client

    run_id = best.user_attrs.get("mlflow_run_id")
    if not run_id:
        return
    c = client()
    with contextlib.suppress(MlflowException):
        name = c.get_run(run_id).info.run_name or f"trial {best.number}"
        if not name.endswith(" best"):
            c.set_tag(run_id, "mlflow.runName", f"{name} best"[:250])
        c.set_tag(run_id, "optuna.best", "true")


def verdict(study: Any, best: Any, uri: str) -> str:
    """One sentence first: who won and by how much, what pruning and failures cost, what was registered."""
    from optuna.trial import TrialState

    trials = counted_trials(study)
    baseline = next((t for t in trials if t.user_attrs.get("baseline") and t.state == TrialState.COMPLETE), None)
    if baseline is None:
        head = f"**Best: trial {best.number}, {OBJECTIVE} {best.value:.3f}**"
    elif best.number == baseline.number:
        head = f"**The baseline won** (trial {best.number}, {OBJECTIVE} {best.value:.3f}; gain 0)"
    else:
        head = (
            f"**Trial {best.number} beat the baseline by {best.value - baseline.value:+.3f}** "
            f"({OBJECTIVE} {best.value:.3f} against {baseline.value:.3f})"
        )
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    failed = [t for t in trials if t.state == TrialState.FAIL]
    parts = [head, f"{len(pruned)} of {len(trials)} trials pruned"]
    if pruned:
        steps = sorted({max(t.intermediate_values) for t in pruned if t.intermediate_values})
        parts[-1] += f" (at step {', '.join(map(str, steps))})" if steps else ""
    if failed:
        parts.append(f"{len(failed)} failed")
    return "; ".join(parts) + f"; registered as `{uri}`."
