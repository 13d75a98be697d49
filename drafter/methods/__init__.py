"""Draft methods, one module each (one registration line each): EAGLE-3, the project's own format and the
default, and the others, found by their config.

Every method module gives `NAME`, `LABEL` (as a user writes it), `VLLM_METHOD` and `SGLANG_ALGORITHM` (the
engines' names for it), `SHAPE` (chain or block), `drafter_passes(k)` (what its cycle costs in drafter passes),
`reads` (the target layers and width it reads), `fit_checks` (the gate's checks against a target), `check_width`,
`load` and `offline_stats`; `VLLM_FLAGS` (beside `method` in vLLM's speculative config) and `SGLANG_REFUSAL` where
SGLang cannot serve it (`SGLANG_ALGORITHM` None). The others also give `detect(raw config) -> bool`,
`owns(model) -> bool`, `train` and `held_out` (finetune's trial), `read_config` (every field checked) and `CONFIG`
(the class it returns), `scratch`, `check_scratch` and `config_reads` (finetune from scratch), `checked_header`,
`pass_parameters`, `save` and `export_for` (their makers' layout). EAGLE-3 is read by drafter/formats and gated by
drafter/analysis/compat.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

from common.errors import BadInput
from drafter.methods import dflash, eagle3, peagle

DEFAULT = eagle3
METHODS: tuple[ModuleType, ...] = (dflash, peagle)  # detected by config; anything else is read as DEFAULT


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
    archs = raw.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise BadInput(f"{path}: field 'architectures' is {archs!r}, not a list of names")
    method = method_of(raw)
    return (method, raw) if method is not None else None


def config_method(config: Any) -> ModuleType:
    """The method whose `read_config` made `config` (EAGLE-3 for its own DrafterConfig), by each method's CONFIG."""
    return next((m for m in METHODS if isinstance(config, m.CONFIG)), DEFAULT)


def config_file_method(path: Path) -> tuple[ModuleType, Any] | None:
    """(the method, its checked config) when the config file at `path` is another method's; None for EAGLE-3's
    (or a file that is no JSON object: EAGLE-3's reader then says what is wrong with it, naming the file)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    method = method_of(raw) if isinstance(raw, dict) else None
    return (method, method.read_config(raw, str(path))) if method is not None else None


def model_method(model: Any) -> ModuleType:
    """The method whose network `model` is (EAGLE-3 for None or its own network), by each method's `owns`."""
    return next((m for m in METHODS if model is not None and m.owns(model)), DEFAULT)


def named(name: str) -> ModuleType:
    """The method module called `name` (as Exported records it)."""
    found = next((m for m in (DEFAULT, *METHODS) if name == m.NAME), None)
    if found is None:
        raise BadInput(f"unknown draft method {name!r} (known: {', '.join(m.NAME for m in (DEFAULT, *METHODS))})")
    return found


def folder_method_or_default(folder: str | Path) -> ModuleType:
    """The method a drafter folder drafts with (EAGLE-3 unless its config names another)."""
    found = folder_method(folder)
    return DEFAULT if found is None else found[0]


def method_for(folder: str | Path, name: str | None = None) -> ModuleType:
    """The method `name` says (a folder not yet where it will be served from: export's serve.sh), else the folder's."""
    return named(name) if name else folder_method_or_default(folder)


def vllm_flags(m: ModuleType) -> dict[str, Any]:
    """What vLLM's --speculative-config needs beside `method` for this method (P-EAGLE: parallel_drafting)."""
    return dict(getattr(m, "VLLM_FLAGS", {}))


def sglang_algorithm(m: ModuleType) -> str:
    """SGLang's --speculative-algorithm for this method; bad input naming why where SGLang cannot serve it."""
    if m.SGLANG_ALGORITHM is None:
        raise BadInput(m.SGLANG_REFUSAL)
    return m.SGLANG_ALGORITHM


def require_fit(folder: str | Path, target: str | Path, refusal: str) -> None:
    """The shape gate's checks from headers, by the drafter's own method: bad input (`refusal: what differs`) when
    the drafter cannot run on the target, so nothing is measured or exported with a drafter that does not fit."""
    from drafter.analysis.compat import require_passed

    require_passed(folder_method_or_default(folder).fit_checks(Path(folder), target), refusal)
