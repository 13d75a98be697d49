"""How repeatable is a served speed-up on this host, and does the prompt set move the concurrency-4 figure?

One plain and one speculative vLLM server (the mini world's target, a drafter at depth k), both up for the
whole run, timed side by side for `--rounds` rounds. Each round times three conditions on both servers:
concurrency 4 on evaluate's 40 pinned test prompts, concurrency 4 on calibrate's 16 validation prompts,
and batch 1 on the 16; each two ways: each server on the whole prompt set in turn (the order alternating
by round; the timing before chunking), and chunk by chunk (engines/interleave, as calibrate and evaluate
now time). Per round, condition and way: the served decode speed-up (per-request decode tok/s, prefill
left out), the speculative server's cycle ms and accept_len from its counters, and the break-even the
round implies (accept_len / speed-up). The spread over rounds is how far apart two honest measurements of
the same thing land here, which bounds how close any prediction can be shown to be. `--idle N` keeps N
more speculative servers (other depths) up and idle, as calibrate does; `--same` times two identical
plain servers (an A/A test: every deviation of the "speed-up" from 1 is measurement noise). The chunked
timing runs twice: without and with the Pacer's wait for the previous server's engine spin to end.

    python -m bench.served_repeatability [--drafter miniworld/aq-mini-eagle3] [--rounds 8] [--idle 0]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from bench._common import write_results
from common.paths import MINIWORLD

PROMPTS = MINIWORLD / "prompts"
ROOT = Path(__file__).resolve().parents[1]
CONDITIONS = (("c4 test40", 4, "k2.5-test.jsonl", 40), ("c4 val16", 4, "k2.5-val.jsonl", 16),
              ("c1 val16", 1, "k2.5-val.jsonl", 16))  # fmt: skip
METHODS = ("whole set", "chunked, unpaced", "chunked, paced")


def encoded(target: Path, name: str, limit: int, max_new: int):
    from common.prompt_files import read_prompts
    from drafter.decode.evaluation import encode_prompts, stop_token, target_tokenizer
    from engines.vllm import Settings

    tokenizer, context = target_tokenizer(str(target))
    ids, _ = encode_prompts(tokenizer, read_prompts(PROMPTS / name, limit), context, max_new, 64)
    s = Settings(k=1, max_new_tokens=max_new, stop_token_id=stop_token(tokenizer), max_model_len=context)
    return [p.tolist() for p in ids], s


def measure(drafter: Path, target: Path, k: int, rounds: int, idle: int, max_new: int, same: bool) -> list[dict]:
    from engines import calibration, environment, export, vllm
    from engines.server import on_loopback

    python = environment.find_python("vllm", None)
    version = environment.engine_version(python)
    workdir = Path(tempfile.mkdtemp(prefix="drafterops-repeat-"))
    extra = [d for d in range(1, 9) if d != k][:idle]
    exported = export.write(drafter, workdir / "drafter-vllm", "vllm", max([k, *extra]), target)
    prompts = {name: encoded(target, file, n, max_new) for name, _, file, n in CONDITIONS}
    s = replace(next(iter(prompts.values()))[1], k=k)
    env = vllm.server_env("cpu" in version)
    rows = []
    with ExitStack() as stack:
        urls = {}
        for name, depth in [("plain", 0), ("spec", 0 if same else k), *[(f"idle k{d}", d) for d in extra]]:
            print(f"starting {name}", flush=True)
            server = stack.enter_context(on_loopback(
                f"vLLM ({version}, {name})",
                lambda port, d=depth: vllm.server_command(python, Path(exported.target), port, replace(s, k=max(d, 1)),
                                                          exported.folder if d else None),
                env, workdir / f"vllm-{name}.log", s.start_timeout_s,
            ))  # fmt: skip
            urls[name] = server.url
        spec = {"plain": False, "spec": not same}
        for r in range(rounds):
            for cond, conc, _, _ in CONDITIONS:
                ids = prompts[cond][0]
                for method in METHODS:
                    if method == "whole set":  # each server on the whole prompt set in turn (before chunking)
                        t = {}
                        for name in ("plain", "spec") if r % 2 == 0 else ("spec", "plain"):
                            t[name] = calibration.time_requests(urls[name], ids, s, conc, spec=spec[name])
                    else:  # engines/interleave, as calibrate and evaluate time: every server on each chunk in turn
                        t = chunked(urls, ids, s, conc, same, r, paced=method == "chunked, paced")
                    speedup = t["spec"].tps / t["plain"].tps
                    rows.append({
                        "round": r + 1, "condition": cond, "method": method, "plain_tps": round(t["plain"].tps, 2),
                        "spec_tps": round(t["spec"].tps, 2), "speedup": round(speedup, 4),
                        "cycle_ms": round(t["spec"].cycle_ms, 3) if not same else "",
                        "accept_len": round(t["spec"].accept_len, 4) if not same else "",
                        "implied_break_even": round(t["spec"].accept_len / speedup, 4) if not same else "",
                    })  # fmt: skip
                    print(rows[-1], flush=True)
    return rows


def chunked(urls, ids, s, conc, same, r, paced):
    """One round of engines/calibration.in_rounds on the pair (plain as depth 0, the other as 1), with or
    without the wait for the previous server's spin."""
    from engines import calibration, interleave

    quiet = interleave.QUIET_S if paced else 0.0
    pair = {0: urls["plain"], 1: urls["spec"]}
    both = calibration.in_rounds(pair, ids, s, [conc], None, 1, start=r, quiet_s=quiet, spec={0: False, 1: not same})
    return {"plain": both[0][conc], "spec": both[1][conc]}


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for cond, *_ in CONDITIONS:
        for method in METHODS:
            sel = [r for r in rows if r["condition"] == cond and r["method"] == method]
            for key in ("plain_tps", "speedup", "implied_break_even")[
                : 2 if not sel or sel[0]["cycle_ms"] == "" else 3
            ]:
                values = [r[key] for r in sel]
                mean = statistics.fmean(values)
                sd = statistics.stdev(values) if len(values) > 1 else 0.0
                out.append({"condition": cond, "method": method, "figure": key, "rounds": len(values),
                            "mean": round(mean, 4), "sd": round(sd, 4), "cv": f"{100 * sd / mean:.1f}%",
                            "min": min(values), "max": max(values)})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default=str(MINIWORLD / "aq-mini-eagle3"))
    ap.add_argument("--target", default=str(MINIWORLD / "k2.5-mini"))
    ap.add_argument("--draft_steps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--idle", type=int, default=0)
    ap.add_argument("--max_new_tokens", type=int, default=64)
    ap.add_argument("--same", action="store_true", help="two plain servers (an A/A test: the speed-up is 1)")
    a = ap.parse_args()
    rows = measure(Path(a.drafter), Path(a.target), a.draft_steps, a.rounds, a.idle, a.max_new_tokens, a.same)
    name = "served_repeatability" + ("_same" if a.same else "") + (f"_idle{a.idle}" if a.idle else "")
    command = f"python -m bench.served_repeatability --rounds {a.rounds} --idle {a.idle}" + (
        " --same" if a.same else ""
    )
    drafter = (
        Path(a.drafter).resolve().relative_to(ROOT) if Path(a.drafter).resolve().is_relative_to(ROOT) else a.drafter
    )
    notes = f"`{command}` (drafter {drafter}, k={a.draft_steps}, {a.max_new_tokens} tokens). Per round:\n\n" + table(
        rows
    )
    print(write_results(name, summary(rows), notes))


def table(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    return "\n".join(lines + ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows])


if __name__ == "__main__":
    main()
