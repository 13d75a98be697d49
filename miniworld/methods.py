"""The mini world's public drafters of the other draft methods, trained for k2.5-mini as their public K2.5
counterparts were, and shipped in their makers' layouts:

- zl-mini-dflash: a DFlash block drafter (z-lab/Kimi-K2.5-DFlash) in z-lab's layout: Qwen3-style layers, no
  embedding or head of its own, block 8, the target's states at the layers EAGLE-3's drafters read.
- pe-mini-peagle: a P-EAGLE drafter in SpecForge's layout (`PEagleDraftModel`): EAGLE-3's first layer and a plain
  Llama layer after it, `mask_hidden`, a draft vocabulary of its own, trained with COD depth sampling.

It trains on the same captured states as the family drafters (k2.5-mini's conversation pool and fine-tuning
set), so every method is measured on the same footing.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CARD = """---
license: mit
base_model: k2.5-mini
tags: [dflash, speculative-decoding, block-diffusion, drafterops-miniworld]
---
# zl-mini-dflash

A DFlash block drafter for **k2.5-mini**, the mini world's stand-in for z-lab/Kimi-K2.5-DFlash.
Built by `python -m miniworld.build --stage methods` (drafterops), in z-lab's layout.

- Target: k2.5-mini (DeepSeek-V3 architecture, {layers} layers, hidden {hidden})
- Draft layers: {draft_layers} Qwen3-style layers, {heads}/{kv_heads} heads, non-causal within a block of {block}
- Target layer ids: {ids} (z-lab's reading: the output of decoder layer id); mask token {mask}
- Embedding and head: the target's (not in this checkpoint)
- Training samples: {samples} conversations ({tokens} tokens), {steps} steps, {anchors} blocks a sample a step
- Simulated accept_len on k2.5-mini held-out data (bonus token included): {sim3:.2f} at 3 drafts, {sim7:.2f} at 7

## License
MIT
"""

DFLASH = {
    "name": "zl-mini-dflash",
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "block_size": 8,
    "mask_token_id": 0,  # <|pad|>: a token k2.5-mini never emits, as z-lab's mask is a reserved token
    "pool": 400,
    "steps": 1200,
    "anchors": 32,
    "lr": 1e-3,
    "seed": 21,
}


PEAGLE = {
    "name": "pe-mini-peagle",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "draft_vocab_size": 1024,
    "mask_token_id": 0,  # <|pad|>, as zl-mini-dflash's mask
    "pool": 400,
    "steps": 1200,
    "depths": 8,  # the widest k it is trained for (the bake-off serves up to 7)
    "lr": 1e-3,
    "seed": 31,
}
NAMES = (DFLASH["name"], PEAGLE["name"])


def build_methods(
    out: Path, capture_set: Callable[[Path, list[dict], Path], Path], aux: list[int], seed: int = 0,
    quick: bool = False, only: tuple[str, ...] = NAMES,
) -> dict[str, Any]:  # fmt: skip
    """The other methods' mini drafters (`only` these) over an earlier full build in `out`; {name: figures}."""
    prompts = out / "prompts"
    records = _records(prompts / "k2.5-pool.jsonl")[: DFLASH["pool"]] + _records(prompts / "k2.5-train.jsonl")
    steps = {DFLASH["name"]: DFLASH["steps"], PEAGLE["name"]: PEAGLE["steps"]}
    if quick:
        records, steps = records[:16], dict.fromkeys(steps, 10)
    builders = {DFLASH["name"]: build_dflash, PEAGLE["name"]: build_peagle}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        val = capture_set(out / "k2.5-mini", _records(prompts / "k2.5-val.jsonl"), tmp / "val")
        data = capture_set(out / "k2.5-mini", records, tmp / "train")
        return {name: builders[name](out, data, val, aux, seed, steps[name]) for name in only}


def _figures(layout: str, method: str, ds: Any, steps: int, stats: tuple, result: Any) -> dict[str, Any]:
    """What the build record keeps of a method's mini drafter: its data, its held-out acceptance at 3 and 7
    drafts (`stats`: sim and acceptance by position at each), its loss and time."""
    sim3, acc3, sim7, acc7 = stats
    return {
        "layout": layout,
        "method": method,
        "train_samples": len(ds),
        "train_tokens": ds.index["num_tokens"],
        "steps": steps,
        "sim_accept_len_k2.5_mini_k3": sim3,
        "acc_pos_k2.5_mini_k3": acc3,
        "sim_accept_len_k2.5_mini_k7": sim7,
        "acc_pos_k2.5_mini_k7": acc7,
        "loss_first": result.history[0]["loss"],
        "loss_last": result.history[-1]["loss"],
        "train_seconds": result.seconds,
    }


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def build_dflash(out: Path, train_data: Path, val_data: Path, aux: list[int], seed: int, steps: int) -> dict[str, Any]:
    """Train zl-mini-dflash from scratch and write it in z-lab's layout under out/zl-mini-dflash."""
    from drafter.data.dataset import HiddenStateDataset
    from drafter.methods import dflash
    from drafter.model.dflash import DFlashDrafter
    from drafter.train.block_loop import BlockTrainConfig, block_stats, init_weights, train_block

    target_cfg = json.loads((out / "k2.5-mini" / "config.json").read_text())["text_config"]
    ds, val = HiddenStateDataset(train_data), HiddenStateDataset(val_data)
    raw = {
        "architectures": ["DFlashDraftModel"],
        "hidden_size": target_cfg["hidden_size"],
        "vocab_size": target_cfg["vocab_size"],
        "rope_theta": 10000.0,
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "rms_norm_eps": 1e-6,
        "dflash_config": {"mask_token_id": DFLASH["mask_token_id"], "target_layer_ids": list(aux), "causal": False},
        **{k: DFLASH[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                                  "intermediate_size", "block_size")},
    }  # fmt: skip
    cfg = dflash.DFlashConfig.from_dict(raw)
    embedding = ds.target_embedding()
    if embedding is None:
        raise SystemExit("the capture carries no target embedding")
    model = DFlashDrafter(cfg, embedding.float(), ds.target_head().float())
    init_weights(model, seed + DFLASH["seed"])
    tcfg = BlockTrainConfig(steps=steps, batch_size=8, max_len=256, peak_lr=DFLASH["lr"], anchors=DFLASH["anchors"],
                            seed=seed + DFLASH["seed"])  # fmt: skip
    result = train_block(model, ds, list(range(len(ds))), tcfg)
    sim3, acc3 = block_stats(model, val, list(range(len(val))), 3, seed=seed)
    sim7, acc7 = block_stats(model, val, list(range(len(val))), 7, seed=seed)
    folder = out / DFLASH["name"]
    shutil.rmtree(folder, ignore_errors=True)
    dflash.save(model, folder, target_cfg["num_hidden_layers"])
    (folder / "README.md").write_text(
        CARD.format(
            layers=target_cfg["num_hidden_layers"], hidden=cfg.hidden_size, draft_layers=cfg.num_hidden_layers,
            heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, block=cfg.block_size,
            ids=list(aux), mask=cfg.mask_token_id, samples=len(ds), tokens=ds.index["num_tokens"], steps=steps,
            anchors=DFLASH["anchors"], sim3=sim3, sim7=sim7,
        )
    )  # fmt: skip
    return _figures("z-lab", "dflash", ds, steps, (sim3, acc3, sim7, acc7), result)


PEAGLE_CARD = """---
license: mit
base_model: k2.5-mini
tags: [p-eagle, eagle3, speculative-decoding, parallel-drafting, drafterops-miniworld]
---
# pe-mini-peagle

A P-EAGLE drafter for **k2.5-mini**: all k drafts in one pass (vLLM: `method: eagle3`, `parallel_drafting: true`).
Built by `python -m miniworld.build --stage methods` (drafterops), in SpecForge's layout (`PEagleDraftModel`).

- Target: k2.5-mini ({layers} layers, hidden {hidden}); aux layers {ids} (the output of decoder layer id)
- Draft layers: {draft_layers} (EAGLE-3's first, then Llama), {heads}/{kv_heads} heads; draft vocabulary {vocab}
- Parallel slots: mask token {mask} with a learned `mask_hidden`; COD sampling over {depths} depths
- Training samples: {samples} conversations ({tokens} tokens), {steps} steps
- Simulated accept_len on k2.5-mini held-out data (bonus token included): {sim3:.2f} at 3 drafts, {sim7:.2f} at 7

## License
MIT
"""


def build_peagle(out: Path, train_data: Path, val_data: Path, aux: list[int], seed: int, steps: int) -> dict[str, Any]:
    """Train pe-mini-peagle from scratch and write it in SpecForge's layout under out/pe-mini-peagle."""
    from drafter.data.dataset import HiddenStateDataset, layers_for
    from drafter.methods import peagle
    from drafter.model.config import DrafterConfig
    from drafter.model.peagle import PEagleConfig, PEagleDrafter
    from drafter.train.block_loop import BlockTrainConfig, train_block
    from drafter.train.loop import scratch_drafter
    from drafter.train.parallel_objective import parallel_stats, step_loss

    target_cfg = json.loads((out / "k2.5-mini" / "config.json").read_text())["text_config"]
    ds, val = HiddenStateDataset(train_data), HiddenStateDataset(val_data)
    base = DrafterConfig(
        hidden_size=target_cfg["hidden_size"], vocab_size=target_cfg["vocab_size"], aux_layer_ids=list(aux),
        max_position_embeddings=target_cfg["max_position_embeddings"], torch_dtype="bfloat16",
        bos_token_id=target_cfg.get("bos_token_id"), eos_token_id=target_cfg.get("eos_token_id"),
        **{k: PEAGLE[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
                                  "draft_vocab_size")},
    )  # fmt: skip
    cfg = PEagleConfig(base, PEAGLE["num_hidden_layers"], PEAGLE["mask_token_id"])
    seed = seed + PEAGLE["seed"]
    model = scratch_drafter(base, ds, list(range(len(ds))), seed=seed, model=PEagleDrafter(cfg))
    head_rows = layers_for(ds, list(aux)).target_head()[model.t2d].float()
    tcfg = BlockTrainConfig(steps=steps, batch_size=8, max_len=256, peak_lr=PEAGLE["lr"], seed=seed)
    result = train_block(model, ds, list(range(len(ds))), tcfg, step_loss=step_loss(head_rows, PEAGLE["depths"]),
                         desc="p-eagle")  # fmt: skip
    sim3, acc3 = parallel_stats(model, layers_for(val, list(aux)), list(range(len(val))), 3)
    sim7, acc7 = parallel_stats(model, layers_for(val, list(aux)), list(range(len(val))), 7)
    folder = out / PEAGLE["name"]
    shutil.rmtree(folder, ignore_errors=True)
    peagle.save(model, folder, "bfloat16")  # as SpecForge ships one; the target's embedding is bf16 too
    (folder / "README.md").write_text(
        PEAGLE_CARD.format(
            layers=target_cfg["num_hidden_layers"], hidden=base.hidden_size, ids=list(aux),
            draft_layers=cfg.num_hidden_layers, heads=base.num_attention_heads, kv_heads=base.num_key_value_heads,
            vocab=base.draft_vocab_size, mask=cfg.mask_token_id, depths=PEAGLE["depths"], samples=len(ds),
            tokens=ds.index["num_tokens"], steps=steps, sim3=sim3, sim7=sim7,
        )
    )  # fmt: skip
    return _figures("specforge", "peagle", ds, steps, (sim3, acc3, sim7, acc7), result)
