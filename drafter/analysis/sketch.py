"""A compact sketch of a drafter's weights, so that a near-copy (a little noise, a lossy re-save) is
recognised as the weights it was copied from without keeping those weights.

Per floating-point tensor, every value (as float32) is added, with a fixed pseudo-random sign, into one of
BUCKETS fixed pseudo-random buckets (a CountSketch: a sparse random projection). The signs and buckets come
from a counter-based generator seeded by the tensor's name and shape (numpy's PCG64 raw stream, which numpy
keeps stable), so anyone computes the same sketch of the same weights. For two drafters with the same tensor
names and shapes, the squared differences of their sketches, summed, estimate the squared L2 distance of
their weights (unbiased; about sqrt(2 / BUCKETS) relative spread per tensor), and the sketch keeps each
tensor's exact squared norm: `relative_distance` is ||a - b|| / ||a||, over all floating-point tensors.

Within NEAR (1% of the weights' norm) two drafters are taken as one network: bf16 rounding of a float32
drafter moves it by about 0.3%, noise of 1e-6 on one tensor by about 1e-7; the fast tier's 8-step
fine-tune moved its init by 4.3% (docs/promotion.md). Integer tensors (d2t, t2d) enter only through the shapes digest.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from drafter.analysis.fingerprint import canonical_values, tensors

BUCKETS = 32
NEAR = 0.01
CHUNK = 1 << 22  # values per block: memory stays flat for a 1B-parameter drafter


@dataclass(frozen=True)
class Sketch:
    shapes: str  # sha256 of every tensor's name and shape: only sketches with the same shapes compare
    buckets: dict[str, list[float]]  # floating-point tensor -> BUCKETS signed sums
    norm2: dict[str, float]  # floating-point tensor -> its squared L2 norm

    def to_json(self) -> dict:
        return {"shapes": self.shapes, "buckets": self.buckets, "norm2": self.norm2}

    @classmethod
    def from_json(cls, raw: object) -> Sketch | None:
        """A sketch from a record, or None when it is not one (a forged or older record)."""
        try:
            buckets = {str(k): [float(x) for x in v] for k, v in raw["buckets"].items()}  # type: ignore[index]
            norm2 = {str(k): float(v) for k, v in raw["norm2"].items()}  # type: ignore[index]
            ok = set(buckets) == set(norm2) and all(len(v) == BUCKETS for v in buckets.values())
            finite = all(math.isfinite(x) for v in buckets.values() for x in v) and all(
                math.isfinite(x) and x >= 0 for x in norm2.values()
            )
            return cls(str(raw["shapes"]), buckets, norm2) if ok and finite else None  # type: ignore[index]
        except (KeyError, TypeError, ValueError, AttributeError):
            return None


def weights_sketch(folder: str | Path) -> Sketch:
    """The sketch of the weights in `folder` (every safetensors file)."""
    shapes, buckets, norm2 = {}, {}, {}
    for name, t in tensors(folder):
        shapes[name] = list(t.shape)
        if not t.is_floating_point():
            continue
        values = canonical_values(t).reshape(-1).numpy().astype(np.float64)
        rng = np.random.PCG64(int.from_bytes(hashlib.sha256(f"{name}|{list(t.shape)}".encode()).digest()[:8], "little"))
        sums = np.zeros(BUCKETS)
        for start in range(0, values.size, CHUNK):
            block = values[start : start + CHUNK]
            raw = rng.random_raw(block.size)
            signs = np.where(raw >> np.uint64(63), -1.0, 1.0)
            np.add.at(sums, (raw % np.uint64(BUCKETS)).astype(np.int64), signs * block)
        buckets[name] = [float(x) for x in sums]
        norm2[name] = float(np.dot(values, values))
    digest = hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()
    return Sketch(digest, buckets, norm2)


def relative_distance(a: Sketch, b: Sketch) -> float:
    """Estimated ||a - b|| / ||a|| over the floating-point tensors (inf when their shapes differ)."""
    if a.shapes != b.shapes or set(a.buckets) != set(b.buckets):
        return math.inf
    diff2 = sum(sum((x - y) ** 2 for x, y in zip(a.buckets[n], b.buckets[n], strict=True)) for n in a.buckets)
    norm2 = sum(a.norm2.values())
    return math.sqrt(diff2 / norm2) if norm2 > 0 else (0.0 if diff2 == 0 else math.inf)
