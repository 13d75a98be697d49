"""Header-only read of a checkpoint with the real Kimi-K2 drafter's shapes (~2.4 GB, sparse on disk),
side by side with a full `safetensors.torch.load_file`. Goal: < 1 MiB read, < 50 ms.
bytes_read: read() syscalls for the header (/proc/self/io rchar); tensor bytes for the full load
(mmap'd, so rchar cannot see them).

    python -m bench.header_read
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from bench._common import bytes_read, write_results
from bench.sparse import write_sparse_safetensors
from drafter.formats.checkpoint import EMBED, expected_tensors, read_header
from drafter.model.config import DrafterConfig

REFERENCE = Path(__file__).resolve().parents[1] / "configs" / "reference" / "kimi-k2-eagle3.config.json"


def measure(fn, repeats: int) -> tuple[float, int]:
    times, reads = [], []
    for _ in range(repeats):
        before, start = bytes_read(), time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        reads.append(bytes_read() - before)
    return statistics.median(times), max(reads)


def main() -> None:
    from safetensors.torch import load_file

    cfg = DrafterConfig.from_file(REFERENCE)
    tensors = {k: v for k, v in expected_tensors(cfg).items() if k != EMBED}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        size = write_sparse_safetensors(folder / "model.safetensors", tensors)
        cfg.save(folder)
        header_s, header_b = measure(lambda: read_header(folder), 20)

        def full_load() -> int:
            # what loading into a model costs: every tensor materialised (mmap pages touched, copied)
            return sum(t.clone().nbytes for t in load_file(str(folder / "model.safetensors")).values())

        full_s, _ = measure(full_load, 1)
        full_b = full_load()
    rows = [
        {
            "method": "drafter.formats.checkpoint.read_header",
            "time": f"{header_s * 1000:.2f} ms",
            "bytes_read": header_b,
            "file_bytes": size,
        },
        {
            "method": "safetensors.torch.load_file (tensors materialised)",
            "time": f"{full_s * 1000:.0f} ms",
            "bytes_read": full_b,
            "file_bytes": size,
        },
    ]
    notes = (
        f"K2 drafter shapes from configs/reference ({size / 1e9:.2f} GB logical). Header read is "
        f"{full_s / header_s:.0f}x faster and reads {full_b / max(header_b, 1):.0f}x fewer bytes."
    )
    print(write_results("header_read", rows, notes))


if __name__ == "__main__":
    main()
