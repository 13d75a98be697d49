"""Capture a hidden-state dataset from a target: prompts -> the target's states -> shards on disk.

Where the states come from is a `StateSource`: the target loaded in this process (`Target`), or a
serving engine that runs it (engines/capture.py); the dataset is the same either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from common import failpoints
from common.errors import BadInput
from drafter.data.dataset import CapturedStates, DatasetComplete, DatasetWriter, Sample
from drafter.data.prompts import TokenizedPrompt, tokenize_record


def bytes_per_token(hidden_size: int) -> int:
    """aux (3H) + last (H) in bf16, plus input id, target token (int32) and mask (bool)."""
    return 2 * 4 * hidden_size + 4 + 4 + 1


class StateSource(Protocol):
    """What capture needs of a target: its tokenizer, context, head and embedding, and each prompt's states."""

    tokenizer: Any
    folder: Path

    @property
    def hidden_size(self) -> int: ...
    @property
    def context_length(self) -> int | None: ...
    @property
    def lm_head_weight(self) -> torch.Tensor: ...
    @property
    def embedding_weight(self) -> torch.Tensor | None: ...
    def set_aux_layers(self, layer_ids: list[int]) -> None: ...
    def capture_states(self, input_ids: list[int]) -> CapturedStates: ...


@dataclass(frozen=True)
class TargetFacts:
    """What planning a capture needs of a target, read from its files (no model, no server)."""

    folder: Path
    tokenizer: Any
    hidden_size: int
    context_length: int | None


@dataclass
class CapturePlan:
    prompts: list[TokenizedPrompt]
    num_tokens: int
    truncated: int
    estimated_bytes: int


def plan_capture(source: StateSource | TargetFacts, records: list[dict[str, Any]], max_len: int) -> CapturePlan:
    """Tokenize everything first: bad prompts fail before a byte is written, and the size is known."""
    if source.tokenizer is None:
        raise BadInput(f"{source.folder}: target has no tokenizer files; cannot tokenize prompts")
    if any("messages" in r for r in records) and not getattr(source.tokenizer, "chat_template", None):
        raise BadInput(
            f"{source.folder}: the prompts are chat messages and the target's tokenizer has no chat template "
            "(tokenizer_config.json 'chat_template' or chat_template.jinja)"
        )
    limit = max_len
    if source.context_length:
        limit = min(limit, int(source.context_length))
    prompts = [tokenize_record(source.tokenizer, r, limit) for r in records]
    prompts = [p for p in prompts if len(p.input_ids) >= 2]
    if not prompts:
        raise BadInput("no prompt has at least 2 tokens")
    n = sum(len(p.input_ids) for p in prompts)
    return CapturePlan(prompts, n, sum(p.truncated for p in prompts), n * bytes_per_token(source.hidden_size))


@torch.no_grad()
def capture(
    target: StateSource,
    plan: CapturePlan,
    out: Path,
    layer_ids: list[int],
    meta: dict[str, Any],
    shard_tokens: int = 65536,
    progress: bool = True,
    on_sample: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Take every prompt's states from the target and write the dataset; resumes an interrupted capture."""
    target.set_aux_layers(layer_ids)
    try:
        writer = DatasetWriter(Path(out), meta, shard_tokens=shard_tokens)
    except DatasetComplete as done:
        return done.index
    failpoints.hit("capture:after_partial")
    writer.write_head(target.lm_head_weight, target.embedding_weight)
    failpoints.hit("capture:after_head")
    start = writer.done_samples
    todo = plan.prompts[start:]
    if hasattr(target, "expect"):  # a served target takes the prompts ahead, to batch them
        target.expect([p.input_ids for p in todo])
    bar = tqdm(
        total=sum(len(p.input_ids) for p in todo), unit="tok", desc="capture", disable=not progress, unit_scale=True
    )
    for k, prompt in enumerate(todo):
        states = target.capture_states(prompt.input_ids)
        writer.add(
            Sample(
                input_ids=torch.tensor(prompt.input_ids),
                loss_mask=torch.tensor(prompt.loss_mask, dtype=torch.bool),
                aux_hidden=states.aux_hidden,
                last_hidden=states.last_hidden,
                target_token=states.target_token,
            )
        )
        bar.update(len(prompt.input_ids))
        failpoints.hit(f"capture:sample_{start + k + 1}")
        failpoints.hit(f"capture:shard_{len(writer.shards)}")
        if on_sample is not None:
            on_sample(start + k + 1)
    bar.close()
    failpoints.hit("capture:before_index")
    return writer.finish()


def capture_records(
    target_ref: str | Path, records: list[dict[str, Any]], out: Path, layer_ids: list[int], max_len: int = 512,
    progress: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Load the target, capture these prompts into `out` and let the target go (one in memory at a time)."""
    from drafter.model.target import load_target

    target = load_target(target_ref, progress=progress)
    target.check_layer_ids(layer_ids)
    meta = {"target": str(target_ref), "layer_ids": layer_ids, "hidden_size": target.config.hidden_size,
            "vocab_size": target.config.vocab_size}  # fmt: skip
    return capture(target, plan_capture(target, records, max_len), out, layer_ids, meta, progress=progress)
