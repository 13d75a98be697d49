"""The memory plan against the measured peak: for drafters that fit this host, plan each run the way
`finetune` does (from the config, before any data is read), then train two real DeepSpeed steps in
the same fresh process and read its peak RSS. Then the plan for the real K2 drafter on this host.

    python -m bench.memory_plan
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._common import MEDIUM_DRAFTER, MINI_DRAFTER, write_results
from bench.synthetic import write_random_dataset

ROOT = Path(__file__).resolve().parents[1]

RUN = """
import json, resource, sys
import deepspeed, torch  # what finetune holds when it plans
from drafter.model.config import DrafterConfig
from drafter.data.dataset import HiddenStateDataset
from drafter.analysis.memory_plan import plan
from drafter.train.loop import TrainConfig, load_ds_config, scratch_drafter, train
spec = json.loads(sys.argv[2])
if "mla" in spec["drafter"]:  # the MLA draft layer's widths (drafter/model/mla.py)
    from drafter.model.mla import MLASpec
    spec["drafter"]["mla"] = MLASpec(**spec["drafter"]["mla"])
cfg = DrafterConfig(**spec["drafter"])
tc = TrainConfig(**spec["train"])
ds_cfg = load_ds_config(tc.ds_config, tc, tc.max_steps)
p = plan(cfg, stage=ds_cfg["zero_optimization"]["stage"], bf16=ds_cfg["bf16"]["enabled"], world=1,
         micro_batch=tc.batch_size, max_len=tc.max_len, ttt_length=tc.ttt_length, attention=spec["attention"])
ds = HiddenStateDataset(sys.argv[1])
model = scratch_drafter(cfg, ds, list(range(len(ds))))
model.attention = spec["attention"]
train(model, ds, tc, progress=False)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"plan": p.to_json(), "peak": peak}))
"""

# (drafter, micro-batch, attention paths): the long medium run measures both paths side by side
CONFIGS = {
    "mini (hidden 128, Vd 1024), 8 x 256": (MINI_DRAFTER, dict(batch_size=8, max_len=256), ("blockwise",)),
    "medium (hidden 1024, Vd 8192), 4 x 512": (MEDIUM_DRAFTER, dict(batch_size=4, max_len=512), ("blockwise",)),
    "medium (hidden 1024, Vd 8192), 1 x 2048": (
        MEDIUM_DRAFTER, dict(batch_size=1, max_len=2048), ("blockwise", "eager"),
    ),
    "medium MLA + EAGLE-3.1 norms (hidden 1024, Vd 8192), 1 x 2048": (
        {**MEDIUM_DRAFTER, "mla": dict(kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                                       q_lora_rank=384), "fc_norm": True, "norm_output": True},
        dict(batch_size=1, max_len=2048), ("blockwise",),
    ),
    "large (hidden 2048, Vd 16000), 2 x 1024": (
        dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
             vocab_size=64000, draft_vocab_size=16000, aux_layer_ids=[0, 1, 2]),
        dict(batch_size=2, max_len=1024), ("blockwise",),
    ),
}  # fmt: skip


def measure(folder: Path, drafter: dict, train: dict, attention: str) -> dict:
    run = {**train, "max_steps": 2, "ttt_length": 3, "val_every": 10**6, "val_fraction": 0.0, "ds_config": "zero0"}
    spec = {"attention": attention, "drafter": drafter, "train": run}
    out = subprocess.run(
        [sys.executable, "-c", RUN, str(folder), json.dumps(spec)], capture_output=True, text=True, cwd=ROOT
    )
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def k2_verdict() -> str:
    """`finetune`'s own check for the real K2 drafter's config on this host: its one line."""
    from common.errors import BadInput
    from drafter.model.config import DrafterConfig
    from drafter.train.loop import TrainConfig, load_ds_config
    from tuning.memory import check

    cfg = DrafterConfig.from_file(ROOT / "configs" / "reference" / "kimi-k2-eagle3.config.json")
    tc = TrainConfig(batch_size=1, max_len=2048, ttt_length=7)
    lines = []
    for name in ("zero0", "zero2"):
        try:
            p = check(cfg, tc, [load_ds_config(name, tc, 1)], 1, None)
            lines.append(f"{name}: fits ({p.describe()})")
        except BadInput as exc:
            lines.append(f"{name}: exit 2, {exc}")
    return " / ".join(lines)


def k2_activations() -> str:
    """The plan's activations for the real K2 drafter, one sample, TTT 7, bf16, eager against blockwise."""
    from drafter.analysis.memory_plan import GIB, activation_bytes
    from drafter.model.config import DrafterConfig

    cfg = DrafterConfig.from_file(ROOT / "configs" / "reference" / "kimi-k2-eagle3.config.json")
    parts = []
    for t in (512, 2048, 4096):
        eager, block = (activation_bytes(cfg, 1, t, 7, True, a) / GIB for a in ("eager", "blockwise"))
        parts.append(f"{t} tokens {eager:.1f} -> {block:.1f} GiB")
    return "; ".join(parts)


GPU_BYTES, GPU_RUNTIME = 96 * 10**9, 2 * 1024**3  # an RTX PRO 6000 (96 GB); CUDA context and allocator, assumed


def k2_cluster() -> str:
    """What the real K2 drafter's fine-tuning fits on 8 x 96 GB (bf16, TTT 7, one rank per GPU): per ZeRO
    stage, one 4096-token sample's needs, the most 4096-token samples per GPU and the longest one sample."""
    from drafter.analysis.memory_plan import GIB, plan
    from drafter.model.config import DrafterConfig

    cfg = DrafterConfig.from_file(ROOT / "configs" / "reference" / "kimi-k2-eagle3.config.json")

    def at(stage: int, batch: int, length: int):
        return plan(cfg, stage=stage, bf16=True, world=8, micro_batch=batch, max_len=length, ttt_length=7,
                    runtime=GPU_RUNTIME, limit_bytes=GPU_BYTES)  # fmt: skip

    parts = []
    for stage in (1, 2, 3):
        one = at(stage, 1, 4096)
        batch = max((b for b in range(1, 33) if at(stage, b, 4096).fits), default=0)
        longest = max((n for n in range(1024, 65537, 1024) if at(stage, 1, n).fits), default=0)
        parts.append(
            f"ZeRO-{stage}: 1 x 4096 needs {one.per_rank / GIB:.1f} GiB per GPU (model states "
            f"{one.model_states / GIB:.1f}, activations {one.activations / GIB:.1f}); fits {batch} x 4096 per GPU "
            f"({8 * batch} per step), or one sample of up to {longest} tokens"
        )
    return "; ".join(parts)


def main() -> None:
    only = sys.argv[1] if len(sys.argv) > 1 else ""  # a part of a label: measure those rows alone
    rows = []
    gib = 1024**3
    with tempfile.TemporaryDirectory() as tmp_:
        for label, (drafter, train, paths) in CONFIGS.items():
            if only not in label:
                continue
            h, v, t = drafter["hidden_size"], drafter["vocab_size"], train["max_len"]
            folder = Path(tmp_) / f"ds-{h}-{t}"
            write_random_dataset(folder, 2 * train["batch_size"], t=t, h=h, vocab=v, shard_tokens=4 * t)
            for attention in paths:
                r = measure(folder, drafter, train, attention)
                p, peak = r["plan"], r["peak"]
                rows.append(
                    {
                        "config": label,
                        "attention": attention,
                        "planned per rank": f"{p['per_rank'] / gib:.2f} GiB",
                        "states / activations / runtime": f"{p['model_states'] / gib:.2f} / "
                        f"{p['activations'] / gib:.2f} / {p['runtime'] / gib:.2f} GiB",
                        "measured peak RSS": f"{peak / gib:.2f} GiB",
                        "plan / measured": f"{p['per_rank'] / peak:.2f}",
                    }
                )
                print(rows[-1], flush=True)
    notes = (
        "ZeRO-0 fp32, TTT 3, every position trained, two DeepSpeed steps after the plan in one fresh process "
        "(python -m bench.memory_plan). The real K2 drafter's activations in the plan (configs/reference, one "
        f"sample, TTT 7, bf16, eager -> blockwise attention): {k2_activations()}. Its fit on this host "
        f"(1 x 2048 tokens, TTT 7): {k2_verdict()}. On 8 x 96 GB (one rank per GPU, 2 GiB runtime assumed, "
        f"the plan's 15% margin): {k2_cluster()}"
    )
    name = "memory_plan" if not only else "memory_plan-" + "-".join(only.lower().split())
    print(write_results(name, rows, notes))


if __name__ == "__main__":
    main()
