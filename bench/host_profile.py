"""Measure this host's deployment profile on the mini world (k2.5-mini + aq-mini-eagle3) and write
configs/profiles/host.yaml: plain decode speed, verify-forward cost, draft-step cost.

    python -m bench.host_profile [--draft_steps 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from drafter.checkpoint import load_drafter
from drafter.evaluation import evaluate_online
from drafter.prompts import read_prompts
from drafter.target import load_target

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
    res = evaluate_online(target, drafter, records, args.draft_steps, max_new_tokens=64)
    m = res.metrics(__import__("drafter.cost", fromlist=["Profile"]).Profile("host", 1, 1, 0, args.draft_steps))
    profile = {
        "name": "host",
        "description": (
            f"This machine, measured by `python -m bench.host_profile` on the mini world (k2.5-mini, "
            f"{args.prompts} prompts, 64 new tokens): plain greedy decoding speed and the measured cost "
            "of one verify forward and one draft step."
        ),
        "baseline_tps": round(res.host_tps_baseline, 2),
        "verify_ms": round(m["host_verify_ms"], 3),
        "draft_step_ms": round(m["host_draft_step_ms"], 3),
        "draft_steps": args.draft_steps,
    }
    (ROOT / "configs" / "profiles" / "host.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    print(yaml.safe_dump(profile, sort_keys=False))
    print(f"accept_len {res.accept_len:.3f}, host speedup {m['host_speedup']:.2f}x")


if __name__ == "__main__":
    main()
