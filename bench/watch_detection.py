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

Glitched streams: the same replays turned into the cumulative counters an engine exports and read through
the watch's own reading rules (pipeline/readings.py), with one exporter glitch every `--glitch_every`
intervals in turn: num_drafts read as -1, a jump of 1e15, NaN, +Inf, the per-position family missing. The
actions on a long replay with no drop (one action an interval at most, every monitor restarted after it, as
the watch acts), and the 5% drop's delay beside the same replays' delay without glitches.

    python -m bench.watch_detection [--cycles 2000] [--replays 40] [--quiet 20000] [--glitch_every 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from bench._common import write_results
from engines.endpoint import Reading
from engines.exposition import Scrape
from pipeline.readings import Watched, take
from serving import drift

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "bench" / "results" / "watch_trace.json"
K = 3
TOLERANCE, FALSE_ALARM_INTERVALS = 0.02, 1e6
CAP = 5000  # intervals a drop is watched for at most
SERVED = "drafterops-0000000000000000"
GLITCHES = ("-1", "1e15 jump", "NaN", "+Inf", "missing family")


def record_trace(limit: int) -> dict:
    """Accepted drafts per verify cycle, per prompt, decoding the pinned workload in-process."""
    from common.paths import MINIWORLD
    from common.prompt_files import read_prompts
    from drafter.decode.evaluation import evaluate_online
    from drafter.formats.checkpoint import load_drafter
    from drafter.model.target import load_target

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


def stream(rng: np.random.Generator, cycles: np.ndarray, reach: np.ndarray, n: int, count: int, drop: float):
    """`count` intervals of about `n` verify cycles each (whole prompts drawn with replacement, each interval
    closed by the prompt that reaches n), thinned by `drop`: [(drafts, accepted per position)]."""
    mean = float(cycles.mean())
    draws = rng.integers(0, len(cycles), size=int(count * n / mean * 1.3) + 64)
    ends = np.cumsum(cycles[draws])
    which = (ends - cycles[draws]) // n  # the interval a prompt starts in
    keep = which < count
    which, draws = which[keep], draws[keep]
    drafts = np.bincount(which, weights=cycles[draws], minlength=count)
    reached = np.stack([np.bincount(which, weights=reach[draws, i], minlength=count) for i in range(K)], axis=1)
    drafts, reached = drafts.astype(np.int64), reached.astype(np.int64)
    if drop <= 0:
        return drafts, reached.astype(float)
    accepted = np.zeros_like(reached, dtype=float)
    survivors = np.zeros(count, dtype=np.int64)
    for i in range(K):  # of position i - 1's survivors, those whose chain reached i, each surviving 1 - drop
        if i == 0:
            eligible = reached[:, 0]
        else:
            eligible = rng.hypergeometric(reached[:, i], reached[:, i - 1] - reached[:, i], survivors)
        survivors = rng.binomial(eligible, 1 - drop)
        accepted[:, i] = survivors
    return drafts, accepted


def counts(drafts, accepted, t: int) -> drift.Counts:
    return drift.Counts(float(drafts[t]), tuple(float(x) for x in accepted[t]), depth=K)


def settle(rng, cycles, reach, n) -> tuple[drift.Baseline, int]:
    window = drift.BaselineWindow(TOLERANCE)
    while True:
        d, a = stream(rng, cycles, reach, n, 1000, 0.0)
        for t in range(len(d)):
            ready = window.add(counts(d, a, t))
            if ready:
                return ready, window.intervals
        if window.intervals > 200_000:
            raise RuntimeError("no baseline in 200000 intervals")


def delays(cycles, reach, n: int, drop: float, replays: int, seed: int, baseline: drift.Baseline):
    """Intervals from the drop's start to its detection, per replay (None: not within the cap)."""
    out = []
    for r in range(replays):
        rng = np.random.default_rng(seed + r)
        monitor = drift.DropMonitor(baseline, TOLERANCE, FALSE_ALARM_INTERVALS)
        d, a = stream(rng, cycles, reach, n, 20, 0.0)
        for t in range(20):  # the drop comes some intervals after the baseline
            monitor.update(counts(d, a, t))
        d, a = stream(rng, cycles, reach, n, CAP, drop)
        out.append(next((t + 1 for t in range(CAP) if monitor.update(counts(d, a, t))), None))
    return out


def false_alarms(cycles, reach, n: int, intervals: int, seed: int, baseline: drift.Baseline) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    monitor = drift.DropMonitor(baseline, TOLERANCE, FALSE_ALARM_INTERVALS)
    d, a = stream(rng, cycles, reach, n, intervals, 0.0)
    alarms = sum(1 for t in range(intervals) if monitor.update(counts(d, a, t)))
    return alarms, int(monitor.cycles)


class Exporter:
    """A replay's intervals as the cumulative counters one engine exports, read through the watch's rules, one
    glitch every `every` intervals (kinds in turn); what the watch counts for each interval (None: nothing)."""

    def __init__(self, every: int) -> None:
        self.every, self.drafts, self.per_pos, self.t, self.glitches = every, 0.0, [0.0] * K, 0, 0
        self.w = Watched("replay")

    def read(self, drafts: float, accepted) -> drift.Counts | None:
        self.t += 1
        self.drafts += drafts
        self.per_pos = [x + float(a) for x, a in zip(self.per_pos, accepted, strict=True)]
        scrape = Scrape("vllm", self.drafts, self.drafts * K, float(sum(self.per_pos)), tuple(self.per_pos), 2.0, ())
        if self.every and self.t % self.every == self.every // 2:
            scrape = self.glitch(scrape, GLITCHES[self.glitches % len(GLITCHES)])
            self.glitches += 1
        return take(self.w, Reading(scrape, (SERVED,), "0.32.0"), SERVED, K).counts

    @staticmethod
    def glitch(s: Scrape, kind: str) -> Scrape:
        from dataclasses import replace

        if kind == "missing family":
            return replace(s, per_pos=())
        value = {"-1": -1.0, "1e15 jump": s.drafts + 1e15, "NaN": float("nan"), "+Inf": float("inf")}[kind]
        return replace(s, drafts=value)


def watched_actions(monitor: drift.DropMonitor, got: drift.Counts | None) -> bool:
    """One interval as the watch acts on it: at most one action, every monitor started again after it."""
    if got is None or not monitor.update(got):
        return False
    monitor.restart()
    return True


def glitched_delays(cycles, reach, n: int, drop: float, replays: int, seed: int, baseline: drift.Baseline,
                    every: int) -> list:  # fmt: skip
    """`delays` on the same replays (the same seeds), read through the watch's rules with glitches."""
    out = []
    for r in range(replays):
        rng = np.random.default_rng(seed + r)
        monitor, exporter = drift.DropMonitor(baseline, TOLERANCE, FALSE_ALARM_INTERVALS), Exporter(every)
        d, a = stream(rng, cycles, reach, n, 20, 0.0)
        for t in range(20):
            watched_actions(monitor, exporter.read(d[t], a[t]))
        d, a = stream(rng, cycles, reach, n, CAP, drop)
        out.append(next((t + 1 for t in range(CAP) if watched_actions(monitor, exporter.read(d[t], a[t]))), None))
    return out


def glitched_actions(cycles, reach, n: int, intervals: int, seed: int, baseline: drift.Baseline,
                     every: int) -> tuple[int, int, int]:  # fmt: skip
    """Actions on a replay with no drop read through the watch's rules with glitches; glitches, intervals lost."""
    rng = np.random.default_rng(seed)
    monitor, exporter = drift.DropMonitor(baseline, TOLERANCE, FALSE_ALARM_INTERVALS), Exporter(every)
    d, a = stream(rng, cycles, reach, n, intervals, 0.0)
    actions = lost = 0
    for t in range(intervals):
        got = exporter.read(d[t], a[t])
        lost += got is None
        actions += watched_actions(monitor, got)
    return actions, exporter.glitches, lost


def median(found: list) -> float | str:
    hit = [d for d in found if d is not None]
    return statistics.median(hit) if hit else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", default="500,2000", help="verify cycles per interval (comma-separated)")
    parser.add_argument("--replays", type=int, default=40)
    parser.add_argument("--quiet", type=int, default=20000, help="intervals replayed with no drop")
    parser.add_argument("--prompts", type=int, default=12, help="prompts per traffic class in the trace")
    parser.add_argument("--glitch_every", type=int, default=500, help="intervals between exporter glitches")
    args = parser.parse_args()
    if not TRACE.is_file():
        TRACE.write_text(json.dumps(record_trace(args.prompts)) + "\n")
    trace = json.loads(TRACE.read_text())
    cycles, reach = prompt_table(trace)
    p = reach.sum(axis=0) / np.concatenate([[cycles.sum()], reach.sum(axis=0)[:-1]])
    rows = []
    t0 = time.perf_counter()
    for n in (int(x) for x in args.cycles.split(",")):
        baseline, settle_intervals = settle(np.random.default_rng(7), cycles, reach, n)
        for drop in (0.02, 0.05, 0.10):
            found = delays(cycles, reach, n, drop, args.replays, 1000 * n + int(drop * 100), baseline)
            hit = sorted(d for d in found if d is not None)
            rows.append({
                "cycles per interval": n, "drop": f"{drop:.0%}", "detected": f"{len(hit)}/{len(found)}",
                "median delay (intervals)": statistics.median(hit) if hit else "-",
                "95th percentile (intervals)": hit[min(len(hit) - 1, int(0.95 * len(hit)))] if hit else "-",
                "median delay (verify cycles)": int(statistics.median(hit) * n) if hit else "-",
                "baseline after (intervals)": settle_intervals,
                "overdispersion": ", ".join(f"{x:.1f}" for x in baseline.dispersion), "false alarms": "",
            })  # fmt: skip
        plain = delays(cycles, reach, n, 0.05, args.replays, 1000 * n + 5, baseline)
        glitched = glitched_delays(cycles, reach, n, 0.05, args.replays, 1000 * n + 5, baseline, args.glitch_every)
        actions, glitches, lost = glitched_actions(cycles, reach, n, args.quiet, n, baseline, args.glitch_every)
        rows.append({
            "cycles per interval": n, "drop": "5%, glitched", "detected": f"{sum(x is not None for x in glitched)}/"
            f"{len(glitched)}", "median delay (intervals)": median(glitched), "95th percentile (intervals)": "",
            "median delay (verify cycles)": f"{median(glitched) / median(plain):.3f}x the same replays unglitched "
            f"({median(plain)})", "baseline after (intervals)": settle_intervals, "overdispersion": "",
            "false alarms": f"{actions} actions in {args.quiet} glitched intervals ({glitches} glitches, {lost} "
            "intervals left out)",
        })  # fmt: skip
        alarms, watched = false_alarms(cycles, reach, n, args.quiet, n, baseline)
        rows.append({
            "cycles per interval": n, "drop": "none", "detected": "", "median delay (intervals)": "",
            "95th percentile (intervals)": "", "median delay (verify cycles)": "",
            "baseline after (intervals)": settle_intervals,
            "overdispersion": ", ".join(f"{x:.1f}" for x in baseline.dispersion),
            "false alarms": f"{alarms} in {args.quiet} intervals ({watched} verify cycles)",
        })  # fmt: skip
    notes = (
        f"Trace: {trace['drafter']} on {trace['target']}, k={K}, {trace['prompts']} prompts of the pinned workload "
        f"({int(cycles.sum())} verify cycles, accept_len {trace['accept_len']:.3f}; conditional acceptance by "
        f"position {', '.join(f'{x:.3f}' for x in p)}). Test: serving/drift.py, tolerance {TOLERANCE:.0%}, one false "
        f"alarm per {FALSE_ALARM_INTERVALS:.0e} intervals stated (threshold "
        f"{drift.threshold(FALSE_ALARM_INTERVALS, K + 1):.2f}); the drop starts 20 intervals after the baseline, "
        f"watched {CAP} intervals at most; one baseline per traffic rate; {args.replays} replays per drop; glitched "
        f"rows: one glitch every {args.glitch_every} intervals ({', '.join(GLITCHES)} in turn) read through "
        "pipeline/readings.py, one action an interval at most and the monitors restarted after it; "
        f"{time.perf_counter() - t0:.0f} s."
    )
    print(write_results("watch_detection", rows, notes))


if __name__ == "__main__":
    main()
