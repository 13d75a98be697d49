"""Prompt files (JSON Lines) into token ids and a loss mask over the assistant's tokens.

Each line is {"messages": [{"role": ..., "content": ...}, ...]} or {"text": ...}. Conversations go
through the tokenizer's chat template when it has one; the mask covers what the assistant says (its
turn's header, the generation prompt, excluded). Plain text is all loss.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from drafter.errors import BadInput


@dataclass
class TokenizedPrompt:
    input_ids: list[int]
    loss_mask: list[bool]
    truncated: bool


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


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_record(tokenizer: Any, rec: dict[str, Any], max_len: int) -> TokenizedPrompt:
    if "text" in rec:
        ids = _encode(tokenizer, rec["text"])
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id, *ids]
        mask = [True] * len(ids)
    else:
        ids, mask = _tokenize_chat(tokenizer, rec["messages"])
    truncated = len(ids) > max_len
    return TokenizedPrompt(ids[:max_len], mask[:max_len], truncated)


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return text + ("assistant: " if generation_prompt else "")


def _tokenize_chat(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[bool]]:
    """Render prefix by prefix so that each piece of text is attributed to the message that added it."""
    ids: list[int] = []
    mask: list[bool] = []
    done = ""
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            header = _render(tokenizer, messages[:i], generation_prompt=True)
            if header.startswith(done) and len(header) > len(done):
                piece = _encode(tokenizer, header[len(done) :])
                ids += piece
                mask += [False] * len(piece)
                done = header
        full = _render(tokenizer, messages[: i + 1])
        if not full.startswith(done):
            raise BadInput("the tokenizer's chat template is not prefix-stable; cannot attribute tokens to turns")
        piece = _encode(tokenizer, full[len(done) :])
        ids += piece
        mask += [msg["role"] == "assistant"] * len(piece)
        done = full
    return ids, mask
