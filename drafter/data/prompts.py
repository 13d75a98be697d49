"""Prompt records (read by common.prompt_files) into token ids and a loss mask over the assistant's tokens.

Each line is {"messages": [{"role": ..., "content": ...}, ...]} or {"text": ...}. Conversations go
through the tokenizer's chat template when it has one; the mask covers what the assistant says (its
turn's header, the generation prompt, excluded). Plain text is all loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.errors import BadInput


@dataclass
class TokenizedPrompt:
    input_ids: list[int]
    loss_mask: list[bool]
    truncated: bool


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
