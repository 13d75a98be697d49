"""Identities of what an evaluation was measured on, so that evidence can be bound to its conditions.

A target's identity is its config plus the safetensors headers of its weights (names, shapes, dtypes,
offsets): read from headers alone, it tells k2-mini from k2.5-mini, or a target whose weights were
swapped for another layout, without hashing gigabytes. (A prompt's identity is serving.workload.prompt_key.)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from common.errors import BadInput


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def target_digest(source: str | Path) -> str:
    """sha256 over the target's config.json and its weights' headers (local folders); hub ids are
    resolved through the local hub cache only when they were downloaded before."""
    from drafter.checkpoint import read_file_header

    folder = Path(source)
    if not folder.is_dir():
        from drafter.target import resolve_local

        folder, _ = resolve_local(str(source))
    config = folder / "config.json"
    if not config.is_file():
        raise BadInput(f"{folder}: target has no config.json")
    try:
        cfg = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadInput(f"{config}: not valid JSON") from None
    headers = {}
    for path in sorted(folder.glob("*.safetensors")):
        headers[path.name] = {k: [v.dtype, list(v.shape)] for k, v in read_file_header(path).items()}
    return _sha({"config": cfg, "weights": headers})
