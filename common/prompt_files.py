"""Prompt files (JSON Lines), read and checked line by line, and their digest: what a profile pins, what
make_data captures from and what evaluate decodes. No tokenizer here: drafter.data.prompts tokenizes.

Each line is {"messages": [{"role": ..., "content": ...}, ...]} or {"text": ...}.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from common.errors import BadInput


def read_prompts(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Every record checked; an error names the line. limit keeps the first N records."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}: prompts file not found")
    records = []
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise BadInput(f"{path}:{lineno}: not UTF-8 (byte {exc.start + 1} of the line)") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise BadInput(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            records.append(_check_record(rec, f"{path}:{lineno}"))
            if limit is not None and len(records) >= limit:
                break
    if not records:
        raise BadInput(f"{path}: no prompts (empty file)")
    return records


def _check_record(rec: Any, where: str) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise BadInput(f"{where}: expected a JSON object with 'messages' or 'text'")
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise BadInput(f"{where}: 'messages' must be a non-empty list")
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise BadInput(f"{where}: messages[{i}] needs string 'role' and 'content'")
        if not any(m["role"] == "user" for m in msgs):
            raise BadInput(f"{where}: the conversation has no user turn (a prompt needs something to answer)")
        return {"messages": msgs}
    if isinstance(rec.get("text"), str):
        return {"text": rec["text"]}
    raise BadInput(f"{where}: expected 'messages' (a list) or 'text' (a string)")


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
