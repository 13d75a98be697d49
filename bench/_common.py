"""Small helpers for benchmarks: bytes read by this process, peak RSS, result files."""

from __future__ import annotations

import json
import platform
import resource
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# the drafters the benches train: the mini world's size, and a medium one (a 1 B-class drafter's shapes, scaled)
MINI_DRAFTER = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
                    vocab_size=4096, draft_vocab_size=1024, aux_layer_ids=[0, 1, 2])  # fmt: skip
MEDIUM_DRAFTER = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4,
                      head_dim=64, vocab_size=32000, draft_vocab_size=8192, aux_layer_ids=[0, 1, 2])  # fmt: skip


def bytes_read() -> int:
    """Bytes this process asked the kernel to read (rchar), page-cache hits included."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_results(name: str, rows: list[dict], notes: str = "") -> Path:
    """bench/results/<name>.json and .md (a markdown table of the rows)."""
    RESULTS.mkdir(exist_ok=True)
    meta = {"machine": platform.machine(), "python": platform.python_version(), "notes": notes}
    (RESULTS / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    md = "\n".join(lines) + ("\n\n" + notes if notes else "") + "\n"
    (RESULTS / f"{name}.md").write_text(md)
    return RESULTS / f"{name}.md"
