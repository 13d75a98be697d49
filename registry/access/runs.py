"""Runs found by a param: MLflow sets a param once and lets nobody change or delete it, so what a decision
finds this way cannot be hidden by editing tags, and no search window leaves anything out."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any


def runs_with_param(c: Any, experiments: list[str], key: str, value: str) -> list[Any]:
    """Every run (active or deleted, any state) of these experiments with param `key` = `value`, oldest
    first, page by page: a param is set once and never changed, so nobody can hide a run from this."""
    from mlflow.entities import ViewType

    from registry.access.naming import quote_filter_value

    runs, token = [], None
    while True:
        page = c.search_runs(
            experiments,
            filter_string=f"params.`{key}` = {quote_filter_value(value)}",
            run_view_type=ViewType.ALL,
            order_by=["attributes.start_time ASC"],
            max_results=1000,
            page_token=token,
        )
        runs += list(page)
        token = page.token
        if not token:
            return runs


def all_experiment_ids(c: Any) -> list[str]:
    """Every experiment of the store, active or deleted, page by page (a store holds more than one page of them:
    each promotion leaves a deleted claim, registry.ledger.succession)."""
    from mlflow.entities import ViewType

    return _experiment_ids(c, ViewType.ALL)


def active_experiment_ids(c: Any) -> list[str]:
    """Every experiment of the store that is not deleted, page by page: what a record may be read from when a
    deleted experiment must not count (a watch's baseline)."""
    from mlflow.entities import ViewType

    return _experiment_ids(c, ViewType.ACTIVE_ONLY)


def _experiment_ids(c: Any, view: Any) -> list[str]:
    ids, token = [], None
    while True:
        page = c.search_experiments(view_type=view, max_results=1000, page_token=token)
        ids += [e.experiment_id for e in page]
        token = page.token
        if not token:
            return ids


def artifact_bytes(c: Any, run: Any, path: str) -> bytes | None:
    """One artifact of a run (a Run, or its id), as stored (None: not there or not readable). Given the Run,
    read straight from its artifact location (which the server fixed when the run was made): one request, not
    the three a lookup by id costs, which a chain of many sanctions read by every decision adds up."""
    from mlflow.exceptions import MlflowException
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    with tempfile.TemporaryDirectory() as tmp:
        try:
            if isinstance(run, str):
                return Path(c.download_artifacts(run, path, tmp)).read_bytes()
            return Path(get_artifact_repository(run.info.artifact_uri).download_artifacts(path, tmp)).read_bytes()
        except (MlflowException, OSError):
            return None
