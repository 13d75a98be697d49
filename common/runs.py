"""How a library service logs into the MLflow run of the step that called it. The step owns its run (the
experiment, the exit code, the marks a failure leaves: cli/step.open_run); a service says which step's run
it is, its name, its params, and the words they were asked in (a param shows what was asked, and
`resolved.<name>` what ran, where the two differ)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

# (step, run name, params, asked) -> the run, open while the service logs into it
OpenRun = Callable[[str, str, Mapping[str, object], Mapping[str, object]], AbstractContextManager[Any]]
