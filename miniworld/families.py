"""The mini world's K2.5-era public drafters: one per family the project reads, each trained for
k2.5-mini (as the public K2.5 drafters were) with a recipe of its own, and shipped in its exporter's
layout (drafter/formats/layouts.py):

- ls-mini-eagle3-mla: an MLA draft layer (TorchSpec's, lightseekorg/kimi-k2.5-eagle3-mla);
- nv-mini-eagle3: ModelOpt's export layout (nvidia/Kimi-K2.5-Thinking-Eagle3);
- rh-mini-eagle3: the speculators format with EAGLE-3.1's norms (RedHatAI's drafters).

Their data is k2.5-mini's own conversation pool (prompts/k2.5-pool.jsonl, written by k2.5-mini) and
its fine-tuning set; the recipes differ in size, data and steps so that the drafters differ measurably.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from drafter.model.mla import MLASpec

CARD = """---
license: mit
base_model: k2.5-mini
tags: [eagle3, speculative-decoding, drafterops-miniworld, {family}]
---
# {name}

An EAGLE-3 draft model for **k2.5-mini**, the mini world's stand-in for {public}.
Built by `python -m miniworld.build --stage families` (drafterops), in {layout}'s layout.

- Target: k2.5-mini (DeepSeek-V3 architecture, {layers} layers, hidden {hidden})
- Draft layer: {layer}
- Auxiliary hidden-state layers: {aux}
- Training samples: {samples} conversations ({tokens} tokens), {steps} steps
- Simulated accept_len on k2.5-mini held-out data (3 draft steps, bonus token included): {sim:.2f}

## License
MIT
"""


@dataclass(frozen=True)
class Recipe:
    name: str
    public: str  # the public drafter it stands in for
    layout: str  # drafter/formats/layouts.py
    steps: int
    pool: int  # conversations of the k2.5 pool it trains on (plus k2.5-train)
    intermediate: int
    lr: float
    mla: MLASpec | None = None
    norms: dict[str, bool] = field(default_factory=dict)
    whole_vocab: bool = False  # draft over the target's whole vocabulary
    seed: int = 0

    def layer(self) -> str:
        kind = "MLA" if self.mla is not None else "Llama attention"
        flags = [k for k, v in self.norms.items() if v]
        return kind + (f" with EAGLE-3.1 norms ({', '.join(flags)})" if flags else "")


RECIPES = (
    Recipe(
        "ls-mini-eagle3-mla",
        "lightseekorg/kimi-k2.5-eagle3-mla (TorchSpec)",
        "torchspec",
        steps=800,
        pool=400,
        intermediate=256,
        lr=3e-3,
        # the target's own MLA widths (miniworld/k2.5-mini/config.json), as the public MLA drafter takes K2.5's
        mla=MLASpec(kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=64),
        seed=11,
    ),
    Recipe(
        "nv-mini-eagle3",
        "nvidia/Kimi-K2.5-Thinking-Eagle3 (ModelOpt)",
        "modelopt",
        steps=400,
        pool=160,
        intermediate=128,
        lr=3e-3,
        # as nvidia's: an MLA layer (DeepSeek-V3 architecture) with a head over the whole vocabulary (no d2t)
        mla=MLASpec(kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, q_lora_rank=None),
        whole_vocab=True,
        seed=12,
    ),
    Recipe(
        "rh-mini-eagle3",
        "RedHatAI's speculators drafters",
        "speculators",
        steps=600,
        pool=320,
        intermediate=256,
        lr=3e-3,
        norms={"fc_norm": True, "norm_output": True, "norm_before_residual": True},
        seed=13,
    ),
)


def drafter_config(recipe: Recipe, target: Path, aux: list[int], draft_vocab: int):
    from drafter.model.config import DrafterConfig, TargetConfig

    tc = TargetConfig.from_file(target)
    return DrafterConfig(
        hidden_size=tc.hidden_size,
        intermediate_size=recipe.intermediate,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=tc.hidden_size // 4,
        vocab_size=tc.vocab_size,
        draft_vocab_size=draft_vocab,
        aux_layer_ids=list(aux),
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        bos_token_id=tc.bos_token_id,
        eos_token_id=tc.eos_token_id,
        torch_dtype="bfloat16",
        mla=recipe.mla,
        **recipe.norms,
    )


def build_families(
    out: Path, capture_set: Callable[[Path, list[dict], Path], Path], aux: list[int], seed: int = 0, quick: bool = False
) -> dict[str, Any]:
    """Every recipe over an earlier full build in `out` (`capture_set`: the build's capture of a target's
    states for conversations); returns {name: figures}."""
    prompts = out / "prompts"
    pool = _records(prompts / "k2.5-pool.jsonl")
    train_set = _records(prompts / "k2.5-train.jsonl")
    draft_vocab = json.loads((out / "aq-mini-eagle3" / "config.json").read_text())["draft_vocab_size"]
    figures = {}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        val = capture_set(out / "k2.5-mini", _records(prompts / "k2.5-val.jsonl"), tmp / "val")
        for recipe in RECIPES:
            records = pool[: recipe.pool] + train_set
            if quick:
                records, recipe = records[:16], Recipe(**{**recipe.__dict__, "steps": 10})
            data = capture_set(out / "k2.5-mini", records, tmp / recipe.name)
            figures[recipe.name] = build_family(recipe, out, data, val, aux, draft_vocab, seed)
    return figures


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def build_family(
    recipe: Recipe, out: Path, train_data: Path, val_data: Path, aux: list[int], draft_vocab: int, seed: int
) -> dict[str, Any]:
    """Train one family drafter and write it in its layout under out/<name>; returns its figures."""
    from drafter.data.dataset import HiddenStateDataset
    from drafter.formats.layouts import write_layout
    from drafter.train.loop import TrainConfig, offline_stats, scratch_drafter, train

    ds = HiddenStateDataset(train_data)
    vocab = json.loads((out / "k2.5-mini" / "config.json").read_text())["text_config"]["vocab_size"]
    cfg = drafter_config(recipe, out / "k2.5-mini", aux, vocab if recipe.whole_vocab else draft_vocab)
    drafter = scratch_drafter(cfg, ds, list(range(len(ds))), seed=seed + recipe.seed)
    tcfg = TrainConfig(
        max_steps=recipe.steps,
        batch_size=8,
        max_len=256,
        peak_lr=recipe.lr,
        warmup_ratio=0.03,
        ttt_length=3,
        val_fraction=0.05,
        val_every=max(100, recipe.steps // 3),
        seed=seed + recipe.seed,
    )
    result = train(drafter, ds, tcfg)
    val = HiddenStateDataset(val_data)
    stats = offline_stats(result.model, val, list(range(len(val))), val.target_head()[result.model.t2d].float(), 3)
    folder = out / recipe.name
    shutil.rmtree(folder, ignore_errors=True)
    write_layout(result.model, folder, recipe.layout)
    figures = {
        "layout": recipe.layout,
        "family": cfg.family,
        "train_samples": len(ds),
        "train_tokens": ds.index["num_tokens"],
        "steps": recipe.steps,
        "sim_accept_len_k2.5_mini": stats.sim_accept_len,
        "acc_pos_k2.5_mini": stats.conditional_acceptance,
        "train_seconds": result.seconds,
    }
    (folder / "README.md").write_text(
        CARD.format(
            name=recipe.name,
            family=cfg.family,
            public=recipe.public,
            layout=recipe.layout,
            layers=json.loads((out / "k2.5-mini" / "config.json").read_text())["text_config"]["num_hidden_layers"],
            hidden=cfg.hidden_size,
            layer=recipe.layer(),
            aux=aux,
            samples=len(ds),
            tokens=ds.index["num_tokens"],
            steps=recipe.steps,
            sim=stats.sim_accept_len,
        )
    )
    return figures
