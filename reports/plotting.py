"""The one place matplotlib is set up: a headless backend (steps run without a display, in CI and on
servers), chosen before pyplot is first imported; and a figure logged to the run, then closed."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported on first use: a step that draws nothing never pays for it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def log_figure(fig, artifact_file: str) -> None:
    """`mlflow.log_figure`, then the figure closed: pyplot keeps every figure it made until it is closed."""
    import mlflow  # only where a figure is logged: the reports themselves need no MLflow

    try:
        mlflow.log_figure(fig, artifact_file)
    finally:
        pyplot().close(fig)
