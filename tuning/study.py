"""One study, many workers: its storage, its sampler, its budget and its figures.

- The sampler is TPE with a start-up phase sized to the budget (a third of the trials, at least 2):
  Optuna's default of 10 random trials is never left by a study of 4, which is then a random search.
  Multivariate, so that related settings (peak_lr and warm-up) are modelled together; `constant_liar`
  so that concurrent workers do not propose the trial another worker is running.
- Each worker seeds its sampler apart: the worker that creates the study uses the training seed (so a
  single-worker study is reproducible); a worker joining an existing study draws a fresh seed. The
  seed is logged (param `sampler_seed`).
- `n_trials` is the budget of the whole study: a worker claims a trial only while the study holds
  fewer than n_trials live or finished trials, and gives back a claim that raced past the budget.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from common.errors import BadInput
from reports.plotting import pyplot
from tuning.workers import fail_gone_trials, retried_number, retry_callback

OBJECTIVE = "val_sim_accept_len"


def default_storage() -> str:
    """An SQLite file next to the MLflow database (embedded default)."""
    from registry.access.naming import tracking_uri

    uri = tracking_uri()
    if uri.startswith("sqlite:///"):
        return f"sqlite:///{Path(uri.removeprefix('sqlite:///')).parent / 'optuna.db'}"
    return "sqlite:///optuna.db"


def storage_url(url: str) -> str:
    """The documented `postgresql://` URL, with the driver this project installs (psycopg 3)."""
    if url.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_storage(url: str, heartbeat: int = 30) -> Any:
    import optuna
    from optuna.storages import RDBStorage

    url = storage_url(url)
    if url.startswith(("sqlite:", "postgresql", "mysql")):
        # heartbeats: a trial whose worker died is marked failed and re-queued, not lost
        try:
            return RDBStorage(
                url,
                heartbeat_interval=heartbeat,
                grace_period=3 * heartbeat,
                heartbeat_stale_trial_callback=retry_callback(),
                engine_kwargs={"pool_pre_ping": True} if not url.startswith("sqlite") else None,
            )
        except ModuleNotFoundError as exc:
            raise BadInput(
                f"--storage {url.split('@')[-1]}: driver missing ({exc.name}); pip install '.[postgres]'"
            ) from None
    if url.endswith(".journal") or url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        return JournalStorage(JournalFileBackend(url.removeprefix("journal:")))
    return optuna.storages.get_storage(url)


def startup_trials(n_trials: int) -> int:
    return max(2, n_trials // 3)


def open_study(storage: Any, name: str, seed: int, n_trials: int, pruner: Any = None) -> tuple[Any, int, bool]:
    """(study, sampler seed, created here). Creating is atomic in the storage, so exactly one of
    several workers started together creates the study and the others join it."""
    import optuna

    def sampler(sampler_seed: int) -> Any:
        return optuna.samplers.TPESampler(
            seed=sampler_seed,
            n_startup_trials=startup_trials(n_trials),
            multivariate=True,
            constant_liar=True,
        )

    pruner = pruner or optuna.pruners.MedianPruner(n_startup_trials=1, n_warmup_steps=0)
    try:
        study = optuna.create_study(
            study_name=name, storage=storage, direction="maximize", sampler=sampler(seed), pruner=pruner
        )
        return study, seed, True
    except optuna.exceptions.DuplicatedStudyError:
        joined = int.from_bytes(os.urandom(4), "little") & 0x7FFFFFFF
        study = optuna.load_study(study_name=name, storage=storage, sampler=sampler(joined), pruner=pruner)
        fail_gone_trials(study)  # a worker of this host that is gone: failed (and re-queued) at once
        optuna.storages.fail_stale_trials(study)  # any other dead worker's trial, once its heartbeat is stale
        return study, joined, False


def budget_used(trials: list[Any], before: int | None = None) -> int:
    """Trials (numbered below `before`, if given) that count against the study's budget: finished
    (complete, pruned, failed) or running. Not counted: a trial not begun (WAITING), one handed back
    over budget, and a failed trial that was retried (its retry counts instead)."""
    retried = {retried_number(t) for t in trials} - {None}
    return sum(
        1
        for t in trials
        if (before is None or t.number < before)
        and t.state.name in ("COMPLETE", "PRUNED", "RUNNING", "FAIL")
        and not t.user_attrs.get("over_budget")
        and t.number not in retried
    )


def counted(study: Any) -> int:
    return budget_used(study.get_trials(deepcopy=False))


def over_budget(study: Any, number: int, n_trials: int) -> bool:
    """Did trial `number` start after the budget was spent by the trials before it?"""
    return budget_used(study.get_trials(deepcopy=False), before=number) >= n_trials


def stop_at_budget(n_trials: int) -> Any:
    """A study.optimize callback: stop this worker once the whole study has used its budget."""

    def callback(study: Any, _trial: Any) -> None:
        if counted(study) >= n_trials:
            study.stop()

    return callback


def claim_trial(study: Any, n_trials: int) -> Any | None:
    """A new trial of the study if its budget has room, else None. A claim that raced another
    worker's past the budget is handed back (told FAIL, marked over_budget) before it runs."""
    import optuna
    from optuna.trial import TrialState

    fail_gone_trials(study)
    optuna.storages.fail_stale_trials(study)
    if counted(study) >= n_trials:
        return None
    trial = study.ask()
    if over_budget(study, trial.number, n_trials):
        trial.set_user_attr("over_budget", True)
        study.tell(trial, state=TrialState.FAIL)
        return None
    return trial


def history_figure(study: Any, title: str | None = None):
    """Every trial against the objective: completed trials as dots, pruned ones as crosses at their
    last reported value, failed ones along the bottom, and the best so far."""
    plt = pyplot()
    from optuna.trial import TrialState

    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {
        TrialState.COMPLETE: ("o", "tab:blue", "completed"),
        TrialState.PRUNED: ("x", "tab:orange", "pruned (last value)"),
    }
    shown: set[str] = set()
    best, points = float("-inf"), []
    for t in sorted(study.trials, key=lambda t: t.number):
        value = t.value
        if t.state == TrialState.PRUNED and t.intermediate_values:
            value = t.intermediate_values[max(t.intermediate_values)]
        if t.state in styles and value is not None:
            marker, color, label = styles[t.state]
            ax.scatter(t.number, value, marker=marker, color=color, label=None if label in shown else label, zorder=3)
            shown.add(label)
        if t.state == TrialState.COMPLETE:
            best = max(best, t.value)
        if best > float("-inf"):
            points.append((t.number, best))
    if points:
        ax.step([n for n, _ in points], [b for _, b in points], where="post", color="tab:green", label="best so far")
    failed = [t.number for t in study.trials if t.state == TrialState.FAIL and not t.user_attrs.get("over_budget")]
    if failed:
        ax.scatter(failed, [ax.get_ylim()[0]] * len(failed), marker="v", color="tab:red", label="failed")
    first = study.trials[0] if study.trials else None
    if first is not None and first.user_attrs.get("baseline") and first.value is not None:
        ax.annotate("baseline", (0, first.value), textcoords="offset points", xytext=(5, 5), fontsize=8)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # trials are whole
    ax.set_xlabel("trial")
    ax.set_ylabel(f"{OBJECTIVE}\n(objective, higher is better)")
    ax.set_title(title or f"{len(study.trials)} trials")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)  # beside, never over a point
    fig.tight_layout()
    return fig


def log_figures(study: Any, title: str | None = None) -> None:
    """The study's history, Optuna's intermediate values, and parameter importances when there is
    something to attribute (else the tag `optuna.importance` says why not)."""
    import warnings

    plt = pyplot()  # the backend set before Optuna's matplotlib module imports pyplot
    import mlflow
    import optuna
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as ovm

    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    fig = history_figure(study, title)
    mlflow.log_figure(fig, "optuna_history.png")
    plt.close(fig)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if any(t.intermediate_values for t in study.trials):
            ax = ovm.plot_intermediate_values(study)
            ax.set_ylabel(f"{OBJECTIVE} at each validation")
            mlflow.log_figure(ax.figure, "optuna_intermediate_values.png")
        why = None
        if len(done) < 2:
            why = f"{len(done)} completed trial(s); importances need at least 2"
        elif not {k for t in done for k in t.params}:
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
