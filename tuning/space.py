"""The search space (a YAML of TrainConfig fields and distributions) and the baseline trial."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from common.errors import BadInput
from drafter.train.loop import TrainConfig

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_SPACE = CONFIGS / "search_space.yaml"
DEFAULT_BASELINE = CONFIGS / "baseline_trial.yaml"


def _read_yaml(path: str | Path, what: str) -> Any:
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"{path}: {what} file not found")
    try:
        return yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise BadInput(f"{path}: not valid YAML ({exc.__class__.__name__})") from None


def _check_fields(path: str | Path, keys: Any) -> None:
    fields = set(TrainConfig.__dataclass_fields__)
    for key in keys:
        if key not in fields:
            raise BadInput(f"{path}: '{key}' is not a training setting ({', '.join(sorted(fields))})")


def load_space(path: str | Path) -> dict[str, dict[str, Any]]:
    space = _read_yaml(path, "search space")
    if not isinstance(space, dict) or not space:
        raise BadInput(f"{path}: expected a mapping of TrainConfig fields to distributions")
    _check_fields(path, space)
    for key, spec in space.items():
        if not isinstance(spec, dict) or spec.get("type") not in ("float", "int", "categorical"):
            raise BadInput(f"{path}: '{key}' needs type float, int or categorical")
    return space


def load_settings(path: str | Path, space: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Training settings (the baseline trial): TrainConfig fields with values inside the space."""
    settings = _read_yaml(path, "settings")
    if not isinstance(settings, dict) or not settings:
        raise BadInput(f"{path}: expected a mapping of TrainConfig fields to values")
    _check_fields(path, settings)
    for key, spec in (space or {}).items():
        value = settings.get(key)
        if value is None:
            continue
        if spec["type"] == "categorical":
            ok = value in spec["choices"]
        else:
            ok = float(spec["low"]) <= float(value) <= float(spec["high"])
        if not ok:
            raise BadInput(f"{path}: {key}={value} lies outside the search space")
    return settings


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
