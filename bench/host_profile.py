"""Measure this host's deployment profile on the mini world (k2.5-mini + aq-mini-eagle3) and write
configs/profiles/host.yaml: plain decode speed and what a whole speculative cycle costs.

A cycle is more than a verify forward plus k draft steps: the drafter's extend over the accepted
tokens, the acceptance test and the cache crops cost too. So the profile is measured as the seed's
30 ms was, as whole cycles (decode time / verify cycles, prefill excluded), and split into
draft_step_ms (timed) and verify_ms (everything else), so that projected tok/s = accept_len / cycle
agrees with what `evaluate` measures on this host.

    python -m bench.host_profile [--draft_steps 3]
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
import yaml

from common.prompt_files import file_digest, read_prompts
from drafter.decode.evaluation import evaluate_online
from drafter.formats.checkpoint import load_drafter
from drafter.model.target import load_target
from serving.profile import Profile

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--draft_steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=10)
    args = p.parse_args()
    mw = ROOT / "miniworld"
    target = load_target(mw / "k2.5-mini")
    drafter = load_drafter(mw / "aq-mini-eagle3", embedding=target.embedding_weight.detach().float())
    records = read_prompts(mw / "prompts" / "k2.5-val.jsonl", args.prompts)
    res = evaluate_online(target, drafter, records, args.draft_steps, max_new_tokens=64, progress=False)
    m = res.metrics(Profile("host", 1, 1, 0, args.draft_steps))
    cycle_ms = res.host_cycle_ms
    draft_step_ms = m["host_draft_step_ms"]
    profile = {
        "name": "host",
        "description": (
            f"This machine, measured by `python -m bench.host_profile` on the mini world (k2.5-mini, "
            f"{args.prompts} prompts, 64 new tokens): plain greedy decode speed (prefill excluded) and "
            f"whole speculative cycles of {cycle_ms:.2f} ms at {args.draft_steps} draft steps, split into "
            "draft steps (timed) and the rest of the cycle (verify_ms)."
        ),
        "baseline_tps": round(res.host_tps_baseline, 2),
        "verify_ms": round(cycle_ms - args.draft_steps * draft_step_ms, 3),
        "draft_step_ms": round(draft_step_ms, 3),
        "draft_steps": args.draft_steps,
        # evidence for this profile is measured on exactly these prompts (the mini world's held-out test set)
        "eval_prompts": "../../miniworld/prompts/k2.5-test.jsonl",
        "eval_prompts_sha256": file_digest(mw / "prompts" / "k2.5-test.jsonl"),
        "measured": {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "torch": str(torch.__version__),
            "threads": torch.get_num_threads(),
        },
    }
    (ROOT / "configs" / "profiles" / "host.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    print(yaml.safe_dump(profile, sort_keys=False))
    print(
        f"accept_len {res.accept_len:.3f}; measured {res.host_tps_spec:.1f} tok/s speculative vs "
        f"{res.host_tps_baseline:.1f} plain ({m['host_speedup']:.2f}x); verify forward alone "
        f"{m['host_verify_ms']:.2f} ms of a {cycle_ms:.2f} ms cycle"
    )


if __name__ == "__main__":
    main()
