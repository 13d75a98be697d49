"""Capture throughput on a small transformers target, and peak RSS of a full reader pass over
datasets of 1x and 10x the size (goal: ratio <= 1.1).

    python -m bench.data_io
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench._common import write_results
from bench.synthetic import READER, write_random_dataset


def capture_throughput(tmp: Path) -> dict:
    from transformers import DeepseekV3ForCausalLM

    from drafter.data.capture import capture, plan_capture
    from drafter.model.target import load_target
    from miniworld.models import deepseek_config, train_tokenizer

    texts = [Path(torch.__file__).read_text()[i * 2000 : (i + 1) * 2000] for i in range(64)]
    tok = train_tokenizer(texts, vocab_size=2048)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(deepseek_config(len(tok), hidden_size=256, layers=6))
    model.save_pretrained(tmp / "target")
    tok.save_pretrained(tmp / "target")
    target = load_target(tmp / "target")
    plan = plan_capture(target, [{"text": t} for t in texts], 512)
    meta = {"target": "bench", "layer_ids": [1, 3, 4], "hidden_size": 256, "vocab_size": len(tok)}
    start = time.perf_counter()
    index = capture(target, plan, tmp / "captured", [1, 3, 4], meta, progress=False)
    sec = time.perf_counter() - start
    return {
        "what": "capture (DeepSeek-V3 target, hidden 256, 6 layers, 64 x <=512 tokens)",
        "figure": f"{index['num_tokens'] / sec:.0f} tokens/s",
        "detail": f"{index['num_tokens']} tokens, {sec:.1f} s",
    }


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        rows.append(capture_throughput(tmp))
        rss = {}
        for name, n in (("1x", 24), ("10x", 240)):
            size = write_random_dataset(tmp / name, n, t=512, h=512, vocab=1000, shard_tokens=16384)
            out = subprocess.run(
                [sys.executable, "-c", READER, str(tmp / name)],
                capture_output=True,
                text=True,
                check=True,
                cwd=Path(__file__).resolve().parents[1],
            ).stdout.split()
            tokens, sec, kib = int(out[0]), float(out[1]), int(out[2])
            rss[name] = kib
            rows.append(
                {
                    "what": f"reader full pass, {name} dataset ({size / 2**20:.0f} MiB on disk)",
                    "figure": f"peak RSS {kib / 1024:.0f} MiB",
                    "detail": f"{tokens} tokens, {tokens / sec:.0f} tokens/s",
                }
            )
        rows.append(
            {"what": "peak RSS ratio 10x / 1x", "figure": f"{rss['10x'] / rss['1x']:.3f}", "detail": "goal <= 1.1"}
        )
    print(write_results("data_io", rows))


if __name__ == "__main__":
    main()
