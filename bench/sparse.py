"""Sparse safetensors files: real headers over a hole, so real-size shapes cost no disk or time."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

SIZES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4, "BOOL": 1}


def write_sparse_safetensors(
    path: Path, tensors: dict[str, tuple[str, list[int] | tuple[int, ...]]], data: dict[str, torch.Tensor] | None = None
) -> int:
    """Write a header for `tensors` and extend the file over a hole; returns the logical size.

    `data` fills chosen (small) tensors with real values, e.g. a drafter's d2t/t2d."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = SIZES[dtype] * math.prod(shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with Path(path).open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        fh.truncate(8 + len(raw) + offset)
        for name, tensor in (data or {}).items():
            fh.seek(8 + len(raw) + header[name]["data_offsets"][0])
            fh.write(tensor.contiguous().numpy().tobytes())
    return 8 + len(raw) + offset


def k2_vocab_maps(vocab: int = 163840, draft: int = 32000) -> dict[str, torch.Tensor]:
    """Consistent d2t/t2d of the K2 drafter's sizes (the first `draft` ids, every fifth one)."""
    chosen = torch.arange(0, vocab, vocab // draft)[:draft]
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    return {"d2t": (chosen - torch.arange(draft)).to(torch.int64), "t2d": t2d}
