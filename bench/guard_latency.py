"""How fast the guard undoes a move by hand: a live `mlflow server` with the guard's webhook installed,
one imported drafter, and production set by hand N times; each time, the seconds until the guard has
taken the unsanctioned alias off again (webhook delivery, signature check, registry read, revert).

    python -m bench.guard_latency [--moves 20]

A figure, not a timed test: tests/test_guard.py checks that every move is reverted, this measures how fast.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlflow

from bench._common import write_results
from drafter.formats.checkpoint import save_drafter
from tests.helpers.drafters import tiny_drafter
from tests.helpers.guard import guarded_server, wait_for
from tests.helpers.steps import run_module
from tests.helpers.targets import write_tiny_targets

NAME = "k25-tiny-eagle3"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--moves", type=int, default=20)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        _, wrapped = write_tiny_targets(tmp / "targets")
        vocab = json.loads((wrapped / "config.json").read_text())["text_config"]["vocab_size"]
        drafter = tiny_drafter(seed=1, vocab_size=vocab, draft_vocab_size=128, aux_layer_ids=[0, 1, 2])
        save_drafter(drafter, tmp / "d1", include_embedding=False)
        with guarded_server(tmp) as guarded:
            source = ["--source", str(tmp / "d1"), "--target", str(wrapped)]
            res = run_module("steps.import_drafter", source, tmp, guarded.env, timeout=600)
            if res.returncode != 0:
                sys.exit(res.stderr[-2000:])
            c = mlflow.MlflowClient(guarded.url)
            latencies = []
            for _ in range(args.moves):
                t0 = time.perf_counter()
                c.set_registered_model_alias(NAME, "production", "1")
                if not wait_for(lambda: "production" not in c.get_registered_model(NAME).aliases):
                    sys.exit("a move by hand was not reverted within 30 s")
                latencies.append(time.perf_counter() - t0)
    first = latencies[0]
    latencies.sort()
    row = {
        "moves": len(latencies),
        "first_s": round(first, 2),
        "median_s": round(statistics.median(latencies), 2),
        "p90_s": round(latencies[int(0.9 * (len(latencies) - 1))], 2),
        "worst_s": round(latencies[-1], 2),
    }
    print(
        write_results(
            "guard_latency", [row], "Seconds from a move by hand to the guard's revert (polled every 0.25 s)."
        )
    )
    print(row)


if __name__ == "__main__":
    main()
