"""The whole shape gate (drafter headers + its d2t/t2d + the K2.5 config and embedding header) on a
sparse file with the real K2 drafter's shapes, against loading that drafter.
Goal: < 100 ms and < 1 MiB read.

    python -m bench.gate
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from bench._common import bytes_read, write_results
from bench.header_read import REFERENCE
from bench.sparse import k2_vocab_maps, write_sparse_safetensors
from drafter.checkpoint import EMBED, expected_tensors
from drafter.compat import check_compat, drafter_facts, passed, target_facts
from drafter.config import DrafterConfig


def main() -> None:
    from safetensors.torch import load_file

    cfg = DrafterConfig.from_file(REFERENCE)
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        drafter = tmp / "drafter"
        drafter.mkdir()
        cfg.save(drafter)
        size = write_sparse_safetensors(
            drafter / "model.safetensors",
            {k: v for k, v in expected_tensors(cfg).items() if k != EMBED},
            data=k2_vocab_maps(),
        )
        target = tmp / "target"
        target.mkdir()
        (target / "config.json").write_text((REFERENCE.parent / "kimi-k2.5.config.json").read_text())
        shard = "model-00001-of-00064.safetensors"
        write_sparse_safetensors(target / shard, {"language_model.model.embed_tokens.weight": ("BF16", [163840, 7168])})
        (target / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"language_model.model.embed_tokens.weight": shard}})
        )
        times, reads = [], []
        for _ in range(10):
            b0, t0 = bytes_read(), time.perf_counter()
            ok = passed(check_compat(drafter_facts(drafter), target_facts(target)))
            times.append(time.perf_counter() - t0)
            reads.append(bytes_read() - b0)
        t0 = time.perf_counter()
        loaded = sum(t.clone().nbytes for t in load_file(str(drafter / "model.safetensors")).values())
        load_s = time.perf_counter() - t0
    gate_s = sorted(times)[len(times) // 2]
    rows = [
        {
            "method": "shape gate (drafter_facts + target_facts + check_compat)",
            "time": f"{gate_s * 1000:.1f} ms",
            "bytes_read": max(reads),
            "verdict": "passed" if ok else "failed",
        },
        {
            "method": "load the drafter (safetensors.torch.load_file, materialised)",
            "time": f"{load_s * 1000:.0f} ms",
            "bytes_read": loaded,
            "verdict": "-",
        },
    ]
    notes = (
        f"Drafter file {size / 1e9:.2f} GB logical (K2 shapes). The gate reads {max(reads) / 2**20:.2f} MiB "
        f"(headers + d2t/t2d) and is {load_s / gate_s:.0f}x faster than loading the drafter."
    )
    print(write_results("gate", rows, notes).read_text())


if __name__ == "__main__":
    main()
