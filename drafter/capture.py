"""Capture a hidden-state dataset from a target: prompts -> target forward -> shards on disk."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from common import failpoints
from common.errors import BadInput
from drafter.data import DatasetComplete, DatasetWriter, Sample
from drafter.prompts import TokenizedPrompt, tokenize_record
from drafter.target import Target


def bytes_per_token(hidden_size: int) -> int:
    """aux (3H) + last (H) in bf16, plus input id, target token (int32) and mask (bool)."""
    return 2 * 4 * hidden_size + 4 + 4 + 1


@dataclass
class CapturePlan:
    prompts: list[TokenizedPrompt]
    num_tokens: int
    truncated: int
    estimated_bytes: int


def plan_capture(target: Target, records: list[dict[str, Any]], max_len: int) -> CapturePlan:
    """Tokenize everything first: bad prompts fail before a byte is written, and the size is known."""
    if target.tokenizer is None:
        raise BadInput(f"{target.folder}: target has no tokenizer files; cannot tokenize prompts")
    limit = max_len
    ctx = getattr(target.model.config, "max_position_embeddings", None)
    if ctx:
        limit = min(limit, int(ctx))
    prompts = [tokenize_record(target.tokenizer, r, limit) for r in records]
    prompts = [p for p in prompts if len(p.input_ids) >= 2]
    if not prompts:
        raise BadInput("no prompt has at least 2 tokens")
    n = sum(len(p.input_ids) for p in prompts)
    return CapturePlan(prompts, n, sum(p.truncated for p in prompts), n * bytes_per_token(target.config.hidden_size))


@torch.no_grad()
def capture(
    target: Target,
    plan: CapturePlan,
    out: Path,
    layer_ids: list[int],
    meta: dict[str, Any],
    shard_tokens: int = 65536,
    progress: bool = True,
    on_sample: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run the target over every prompt and write the dataset; resumes an interrupted capture."""
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
    bar = tqdm(
        total=sum(len(p.input_ids) for p in todo), unit="tok", desc="capture", disable=not progress, unit_scale=True
    )
    for k, prompt in enumerate(todo):
        ids = torch.tensor([prompt.input_ids])
        res = target.forward(ids)
        writer.add(
            Sample(
                input_ids=ids[0],
                loss_mask=torch.tensor(prompt.loss_mask, dtype=torch.bool),
                aux_hidden=res.aux_hidden[0],
                last_hidden=res.last_hidden[0],
                target_token=res.logits[0].argmax(-1),
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
    from drafter.target import load_target

    target = load_target(target_ref, progress=progress)
    target.check_layer_ids(layer_ids)
    meta = {"target": str(target_ref), "layer_ids": layer_ids, "hidden_size": target.config.hidden_size,
            "vocab_size": target.config.vocab_size}  # fmt: skip
    return capture(target, plan_capture(target, records, max_len), out, layer_ids, meta, progress=progress)
