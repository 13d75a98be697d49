"""Sparse safetensors files: real headers over a hole, so real-size shapes cost no disk or time."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

SIZES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4, "BOOL": 1}


def write_sparse_safetensors(path: Path, tensors: dict[str, tuple[str, list[int] | tuple[int, ...]]]) -> int:
    """Write a header for `tensors` and extend the file over a hole; returns the logical size."""
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
    return 8 + len(raw) + offset
