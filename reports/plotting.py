"""The one place matplotlib is set up: a headless backend (steps run without a display, in CI and on
servers), chosen before pyplot is first imported."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported on first use: a step that draws nothing never pays for it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
