"""Small helpers for benchmarks: bytes read by this process, peak RSS, result files."""

from __future__ import annotations

import datetime
import json
import platform
import resource
import shlex
import subprocess
import sys
from pathlib import Path

from bench.report import RESULTS, ROOT, section, write_page

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


def provenance() -> dict:
    """When, on which commit and by which command a figure was measured: the line docs/measurements/ cites.

    A tree with uncommitted changes (a figure is usually measured before its change is committed) is marked
    "+changes": the figure belongs to the next commit that touches its result file."""
    main = sys.modules["__main__"]
    module = getattr(getattr(main, "__spec__", None), "name", None)
    if not module:  # run as a file: bench/gate.py -> bench.gate
        script = Path(sys.argv[0]).resolve()
        module = (
            ".".join(script.relative_to(ROOT).with_suffix("").parts) if script.is_relative_to(ROOT) else script.stem
        )
    command = " ".join(["python -m", module, *map(shlex.quote, sys.argv[1:])])

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short=7", "HEAD") or "unknown"
    if git("status", "--porcelain", "--", ".", ":(exclude)bench/results", ":(exclude)docs"):
        commit += "+changes"
    measured = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return {"measured": measured, "commit": commit, "command": command}


def write_results(name: str, rows: list[dict], notes: str = "") -> str:
    """bench/results/<name>.json (the rows, with when, where and how they were measured), and
    docs/measurements/benchmarks.md generated again, so a figure is written down once. Returns the result's
    section of that page, for the bench to print."""
    RESULTS.mkdir(exist_ok=True)
    meta = {**provenance(), "machine": platform.machine(), "python": platform.python_version(), "notes": notes}
    result = {"meta": meta, "rows": rows}
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    write_page()
    return section(name, result)
