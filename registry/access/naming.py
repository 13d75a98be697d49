"""Registered-model names and the fixed tag/alias vocabulary of docs/design.md."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from common.errors import BadInput

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"  # the embedded default store, in the working folder
PROJECT_EXPERIMENT = "drafterops"  # where the steps log unless MLFLOW_EXPERIMENT_NAME/_ID say otherwise
EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's runs view (model training), not its GenAI traces
ALIASES = ("imported", "candidate", "staging", "production")
AUDIT_EXPERIMENT = "drafterops-audit"  # every alias move and deletion, one run each
PROTECTED_ALIASES = ("staging", "production")  # serving aliases: they move only through `promote`
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
LEGACY_STAGE = {"staging": "Staging", "production": "Production"}

TAG_SOURCE = "source"
TAG_SHA256 = "sha256"
TAG_TRAINED_FOR = "trained_for"
TAG_PARENT = "parent"
TAG_DATASET = "dataset_digest"
TAG_REPLIES = "dataset.replies"  # who wrote the training replies: "as shipped" or the target (make_data --regenerate)
TAG_GATE = "shape_gate"
TAG_GATE_TARGET = "shape_gate.target"
TAG_PROMOTION = "promotion"
TAG_COMPLETE = "drafterops.complete"  # set last, just before an alias: a version without it is a crash leftover
MODEL_TAG_TARGET = "target"


def target_slug(target: str) -> str:
    """'moonshotai/Kimi-K2.5' -> 'kimi-k2.5'; 'miniworld/k2.5-mini/' -> 'k2.5-mini'."""
    name = Path(str(target).rstrip("/").removeprefix("hf://").split("@")[0]).name
    slug = re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-.")
    return slug or "target"


def check_name(name: str, what: str = "--name") -> str:
    """A registered-model name goes into search filters, URIs and cache paths: letters, digits, '.',
    '_' and '-' only, no '..', so it can break none of them."""
    if not SAFE_NAME.fullmatch(name) or ".." in name:
        raise BadInput(
            f"{what} {name!r} is not a valid model name (letters, digits, '.', '_', '-'; at most 128; no '..')"
        )
    return name


def check_alias(alias: str, what: str = "--alias") -> str:
    """An alias a step other than `promote` may set: never a protected serving alias."""
    if alias in PROTECTED_ALIASES:
        raise BadInput(f"{what} {alias!r}: {' and '.join(PROTECTED_ALIASES)} move only through `promote`")
    if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", alias) or alias.isdigit() or alias.lower() == "latest":
        raise BadInput(f"{what} {alias!r} is not a valid alias (letters, digits, '_', '-'; not a number)")
    return alias


def quote_filter_value(value: str) -> str:
    """A string literal for an MLflow search filter (values here are validated names and versions)."""
    if "'" in value or "\\" in value or "\n" in value:
        raise ValueError(f"refusing to put {value!r} into a search filter")
    return f"'{value}'"


def model_name_for(target: str, method: str = "eagle3") -> str:
    """The registered model a target's drafters of one draft method (drafter/methods NAME) go to by default."""
    return f"{target_slug(target)}-{method}"


def eval_tag(profile: str, key: str) -> str:
    return f"eval.{profile}.{key}"


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI)


def use_default_store() -> None:
    """MLFLOW_TRACKING_URI, when the user set none: the embedded store in the working folder."""
    os.environ.setdefault("MLFLOW_TRACKING_URI", DEFAULT_TRACKING_URI)


def pin_default_store(project: Path) -> None:
    """For a pipeline run from a folder other than the project's: `mlflow run` starts each step in the
    project's folder, where the relative default would name another store than the one the pipeline opened,
    so the default becomes the working folder's store by its absolute path. A path an SQLite URL would read
    otherwise (%, ?, #) is bad input rather than a store somewhere else."""
    if tracking_uri() != DEFAULT_TRACKING_URI or Path.cwd().resolve() == project.resolve():
        return  # a store the user named, or the project's own folder (`mlflow run .`)
    if any(ch in str(Path.cwd()) for ch in "%?#"):
        raise BadInput(
            f"{Path.cwd()}: a folder whose path has %, ? or # cannot hold the default store; run from another "
            "folder or set MLFLOW_TRACKING_URI"
        )
    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def same_target(a: str, b: str) -> bool:
    """Two ways of naming one target: the same folder (however written) or the same hub id."""
    pa, pb = Path(a), Path(b)
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a.rstrip("/") == b.rstrip("/")


def run_label(mv: Any, target: str) -> str:
    """A version as a run's name gives it: `v3` in the target's own model, `ls-mini-eagle3-mla v1` in another
    (a bake-off's public drafters), so that no two steps' runs share a name."""
    return f"v{mv.version}" if mv.name == model_name_for(target) else f"{mv.name} v{mv.version}"
