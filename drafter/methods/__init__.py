"""Draft methods other than EAGLE-3, one module each, found by their config (one registration line each).

A method module gives `NAME`, `detect(raw config) -> bool`, a config reader (`from_dict`, every field checked) and
`rules(...)`: the gate's contract against a target. EAGLE-3 (the project's own format) is read by drafter/formats
and gated by drafter/analysis/compat.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from common.errors import BadInput
from drafter.methods import dflash

METHODS: tuple[ModuleType, ...] = (dflash,)


def method_of(raw: dict[str, Any]) -> ModuleType | None:
    """The method whose layout a drafter config is in (None: EAGLE-3, read as the project reads it)."""
    return next((m for m in METHODS if m.detect(raw)), None)


def folder_method(folder: str | Path) -> tuple[ModuleType, dict[str, Any]] | None:
    """A local drafter folder's method and its raw config, when it is one of METHODS."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"{path}: not a readable JSON config ({type(exc).__name__})") from None
    if not isinstance(raw, dict):
        raise BadInput(f"{path}: not a JSON object")
    method = method_of(raw)
    return (method, raw) if method is not None else None
