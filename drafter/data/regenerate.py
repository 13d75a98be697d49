"""Assistant turns written by the target itself before capture (`make_data --regenerate`).

A drafter learns to predict its target; trained on replies some other model wrote, it learns that model,
and acceptance after training is low with no error anywhere (speculators #751, SpecForge #128: "regenerate
the responses with the target"). Each assistant turn, in order, is replaced by what the target writes
after the conversation so far (the turns before it already regenerated), through the chat template, up
to the template's end-of-turn token or `max_new_tokens`. Plain-text records have no turns and are kept.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from common.errors import BadInput

MARK = "\u00a7\u00a7reply\u00a7\u00a7"

# prompt ids -> the target's continuation ids (stopping at one of the stop ids, which it may include)
Writer = Callable[[list[int], list[int]], list[int]]


@dataclass
class Regenerated:
    records: list[dict[str, Any]]
    turns: int  # assistant turns the target wrote
    changed: int  # of them, how many differ from the shipped text
    records_changed: int


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The token the chat template closes an assistant turn with (read off a rendered turn), and EOS."""
    if not getattr(tokenizer, "chat_template", None):
        raise BadInput("--regenerate needs the target's chat template (its tokenizer has none)")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": MARK}], tokenize=False
    )
    after = text.split(MARK, 1)[1] if MARK in text else ""
    ids = list(tokenizer(after, add_special_tokens=False)["input_ids"])[:1]
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise BadInput("the chat template closes an assistant turn with nothing, and the tokenizer has no EOS")
    return sorted(set(ids))


def until_stop(ids: list[int], stop: list[int]) -> list[int]:
    """A reply up to (not including) its first stop token."""
    for i, t in enumerate(ids):
        if t in stop:
            return ids[:i]
    return ids


def count_changes(shipped: list[dict[str, Any]], written: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(assistant turns, turns whose text changed, records with a changed turn)."""
    turns = changed = records = 0
    for a, b in zip(shipped, written, strict=True):
        pairs = [(x, y) for x, y in zip(a.get("messages", []), b.get("messages", []), strict=True)
                 if x.get("role") == "assistant"]  # fmt: skip
        diff = sum(x.get("content") != y.get("content") for x, y in pairs)
        turns, changed, records = turns + len(pairs), changed + diff, records + (diff > 0)
    return turns, changed, records


def regenerate(
    records: list[dict[str, Any]], tokenizer: Any, write: Writer, max_new_tokens: int, max_prompt: int | None = None,
    progress: bool = True,
) -> Regenerated:  # fmt: skip
    """Every assistant turn rewritten by `write`, in order; what changed counted. A turn whose conversation
    so far already holds `max_prompt` tokens (capture cuts there) and the turns after it are kept as shipped."""
    stop = end_of_turn_ids(tokenizer)
    out = []
    todo = sum(1 for r in records for m in r.get("messages", []) if m.get("role") == "assistant")
    bar = tqdm(total=todo, desc="regenerate", unit="turn", disable=not progress)
    for rec in records:
        if "messages" not in rec:
            out.append(rec)
            continue
        messages: list[dict[str, Any]] = []
        past_cut = False
        for msg in rec["messages"]:
            if msg.get("role") != "assistant" or past_cut:
                messages.append(dict(msg))
                continue
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            if max_prompt is not None and len(ids) >= max_prompt:
                past_cut = True
                messages.append(dict(msg))
                continue
            reply = until_stop(write(ids, stop), stop)[:max_new_tokens]
            messages.append({**msg, "content": tokenizer.decode(reply, skip_special_tokens=True)})
            bar.update(1)
        out.append({**rec, "messages": messages})
    bar.close()
    return Regenerated(out, *count_changes(records, out))
