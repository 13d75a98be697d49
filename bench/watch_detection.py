"""How fast the production watch detects a drop, and how often it cries wolf, on replayed served traffic.

The traffic: the mini world's public drafter (`aq-mini-eagle3`, where its production starts) decoding the
pinned workload's prompts on k2.5-mini at depth 3 through the in-process engine (the reference vLLM's
served figures are held to: the same greedy tokens, the same counts), each verify cycle's accepted drafts
kept. An interval replays whole prompts, drawn with replacement, until it holds a given number of verify
cycles, and turns them into the counters an engine exports (drafts, accepted at each position): a
stationary stream with the prompts' own correlation. A drop of x is injected from a chosen interval on by
thinning: each accepted draft survives with probability 1 - x, the chain cut at the first that does not
(conditional acceptance at every position times 1 - x), drawn exactly with hypergeometric and binomial
draws.

The watch's own code decides (serving/drift.py: the baseline window, the CUSUMs, the threshold for one
false alarm per 10^6 intervals): per drop size (2%, 5%, 10%) the detection delay in intervals and in verify
cycles over many replays, and the false alarms over a long replay with no drop.

    python -m bench.watch_detection [--cycles 2000] [--replays 40] [--quiet 20000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from bench._common import write_results
from serving import drift

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "bench" / "results" / "watch_trace.json"
K = 3
TOLERANCE, FALSE_ALARM_INTERVALS = 0.02, 1e6


def record_trace(limit: int) -> dict:
    """Accepted drafts per verify cycle, per prompt, decoding the pinned workload in-process."""
    from common.paths import MINIWORLD
    from common.prompt_files import read_prompts
    from drafter.checkpoint import load_drafter
    from drafter.evaluation import evaluate_online
    from drafter.target import load_target

    target = load_target(MINIWORLD / "k2.5-mini", dtype="float32", progress=False)
    drafter = load_drafter(MINIWORLD / "aq-mini-eagle3", embedding=target.embedding_weight.detach().float()).eval()
    records = []
    for cls in ("code", "docs", "repl", "long"):
        records += read_prompts(MINIWORLD / "prompts" / f"workload-{cls}.jsonl")[:limit]
    result = evaluate_online(target, drafter, records, K, max_new_tokens=64)
    return {"drafter": "aq-mini-eagle3", "target": "k2.5-mini", "k": K, "prompts": len(records),
            "accept_len": result.accept_len, "accepted": result.accepted}  # fmt: skip


def prompt_table(trace: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per prompt: its verify cycles, and its cycles accepting at least i + 1 drafts for each position i."""
    cycles = np.array([len(a) for a in trace["accepted"]], dtype=np.int64)
    reach = np.array([[sum(1 for n in a if n > i) for i in range(K)] for a in trace["accepted"]], dtype=np.int64)
    return cycles, reach


def interval(rng: np.random.Generator, cycles: np.ndarray, reach: np.ndarray, n: int, drop: float) -> drift.Counts:
    """One interval of at least `n` verify cycles, whole prompts drawn with replacement, thinned by `drop`."""
    picked, total = [], 0
    while total < n:
        batch = rng.integers(0, len(cycles), size=64)
        for i in batch:
            picked.append(i)
            total += int(cycles[i])
            if total >= n:
                break
    drafts = int(cycles[picked].sum())
    reached = reach[picked].sum(axis=0)  # cycles whose original chain reached past position i
    if drop <= 0:
        return drift.Counts(float(drafts), tuple(float(x) for x in reached), depth=K)
    accepted, survivors, pool = [], 0, drafts
    for i in range(K):
        # of the survivors so far (pool of them), how many originally accepted position i; each survives 1 - drop
        eligible = int(reached[i]) if i == 0 else int(rng.hypergeometric(int(reached[i]), pool - int(reached[i]),
                                                                          survivors))  # fmt: skip
        survivors = int(rng.binomial(eligible, 1 - drop))
        pool = int(reached[i])
        accepted.append(float(survivors))
    return drift.Counts(float(drafts), tuple(accepted), depth=K)


def settle(rng, cycles, reach, n) -> tuple[drift.Baseline, int]:
    window = drift.BaselineWindow(TOLERANCE)
    for count in range(1, 100000):
        ready = window.add(interval(rng, cycles, reach, n, 0.0))
        if ready:
            return ready, count
    raise RuntimeError("no baseline")


def delays(cycles, reach, n: int, drop: float, replays: int, seed: int) -> list[int | None]:
    out = []
    for r in range(replays):
        rng = np.random.default_rng(seed + r)
        baseline, _ = settle(rng, cycles, reach, n)
        monitor = drift.DropMonitor(baseline, TOLERANCE, FALSE_ALARM_INTERVALS)
        for _ in range(20):  # the drop comes some intervals after the baseline
            monitor.update(interval(rng, cycles, reach, n, 0.0))
        hit = None
        for t in range(1, 5001):
            if monitor.update(interval(rng, cycles, reach, n, drop)):
                hit = t
                break
        out.append(hit)
    return out


def false_alarms(cycles, reach, n: int, intervals: int, seed: int) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    baseline, _ = settle(rng, cycles, reach, n)
    monitor = drift.DropMonitor(baseline, TOLERANCE, FALSE_ALARM_INTERVALS)
    alarms = sum(1 for _ in range(intervals) if monitor.update(interval(rng, cycles, reach, n, 0.0)))
    return alarms, int(monitor.cycles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", default="500,2000", help="verify cycles per interval (comma-separated)")
    parser.add_argument("--replays", type=int, default=40)
    parser.add_argument("--quiet", type=int, default=20000, help="intervals replayed with no drop")
    parser.add_argument("--prompts", type=int, default=12, help="prompts per traffic class in the trace")
    args = parser.parse_args()
    if not TRACE.is_file():
        TRACE.write_text(json.dumps(record_trace(args.prompts)) + "\n")
    trace = json.loads(TRACE.read_text())
    cycles, reach = prompt_table(trace)
    p = reach.sum(axis=0) / np.concatenate([[cycles.sum()], reach.sum(axis=0)[:-1]])
    rows = []
    t0 = time.perf_counter()
    for n in (int(x) for x in args.cycles.split(",")):
        rng = np.random.default_rng(7)
        _, settle_intervals = settle(rng, cycles, reach, n)
        for drop in (0.02, 0.05, 0.10):
            found = delays(cycles, reach, n, drop, args.replays, seed=1000 * n + int(drop * 100))
            hit = sorted(d for d in found if d is not None)
            rows.append({
                "cycles per interval": n, "drop": f"{drop:.0%}", "detected": f"{len(hit)}/{len(found)}",
                "median delay (intervals)": statistics.median(hit) if hit else "-",
                "95th percentile (intervals)": hit[min(len(hit) - 1, int(0.95 * len(hit)))] if hit else "-",
                "median delay (verify cycles)": int(statistics.median(hit) * n) if hit else "-",
                "baseline after (intervals)": settle_intervals, "false alarms": "",
            })  # fmt: skip
        alarms, watched = false_alarms(cycles, reach, n, args.quiet, seed=n)
        rows.append({
            "cycles per interval": n, "drop": "none", "detected": "", "median delay (intervals)": "",
            "95th percentile (intervals)": "", "median delay (verify cycles)": "",
            "baseline after (intervals)": settle_intervals,
            "false alarms": f"{alarms} in {args.quiet} intervals ({watched} verify cycles)",
        })  # fmt: skip
    notes = (
        f"Trace: {trace['drafter']} on {trace['target']}, k={K}, {trace['prompts']} prompts of the pinned workload "
        f"({int(cycles.sum())} verify cycles, accept_len {trace['accept_len']:.3f}; conditional acceptance by "
        f"position {', '.join(f'{x:.3f}' for x in p)}). Test: serving/drift.py, tolerance {TOLERANCE:.0%}, one false "
        f"alarm per {FALSE_ALARM_INTERVALS:.0e} intervals stated (threshold "
        f"{drift.threshold(FALSE_ALARM_INTERVALS, K + 1):.2f}); the drop starts 20 intervals after the baseline; "
        f"{args.replays} replays per drop; {time.perf_counter() - t0:.0f} s."
    )
    print(write_results("watch_detection", rows, notes).read_text())


if __name__ == "__main__":
    main()
