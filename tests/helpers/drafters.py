"""Tiny drafters written by the tests themselves, and the real K2 drafter's tensor shapes."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from drafter.model.config import DrafterConfig
from drafter.model.eagle3 import Eagle3Drafter
from drafter.model.mla import MLASpec
from drafter.model.rope import RopeSpec
from drafter.model.vocab import build_vocab_maps

REFERENCE = Path(__file__).resolve().parents[2] / "configs" / "reference"


def tiny_config(**overrides) -> DrafterConfig:
    values = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=96,
        draft_vocab_size=48,
        aux_layer_ids=[0, 2, 3],
        rope_theta=10000.0,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
    )
    values.update(overrides)
    return DrafterConfig(**values)


TINY_MLA = MLASpec(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, q_lora_rank=12)
EAGLE31 = dict(fc_norm=True, norm_before_fc=True, norm_output=True, norm_before_residual=True)
# Every draft layer the project builds: config overrides for tiny_config / tiny_drafter.
FAMILIES = {
    "llama": {},
    "mla": dict(mla=TINY_MLA),
    "mla-no-q-lora": dict(mla=MLASpec(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)),
    "llama-eagle3.1": EAGLE31,
    "mla-eagle3.1": dict(mla=TINY_MLA, **EAGLE31),
    "mla-yarn": dict(
        mla=TINY_MLA,
        rope=RopeSpec("yarn", factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=1.0),
    ),  # fmt: skip
}


def tiny_drafter(seed: int = 0, **overrides) -> Eagle3Drafter:
    cfg = tiny_config(**overrides)
    model = Eagle3Drafter(cfg)
    model.init_weights(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.5)
    counts = torch.rand(cfg.vocab_size, generator=gen)
    d2t, t2d = build_vocab_maps(counts, cfg.draft_vocab_size)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    model.has_embedding = True
    return model


def save_tiny_drafter(folder: Path, target: Path, seed: int = 2) -> Path:
    """A tiny drafter for the tiny target (its vocabulary, aux layers 0-2), saved without embedding."""
    from drafter.formats.checkpoint import save_drafter

    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    drafter = tiny_drafter(seed=seed, vocab_size=vocab, draft_vocab_size=128, aux_layer_ids=[0, 1, 2])
    save_drafter(drafter, folder, include_embedding=False)
    return folder


def k2_drafter_tensors() -> dict[str, tuple[str, list[int]]]:
    """The real AQ-MedAI Kimi-K2 drafter's tensors (configs/reference), without embed_tokens."""
    m = "midlayer."
    return {
        "fc.weight": ("BF16", [7168, 21504]),
        f"{m}input_layernorm.weight": ("BF16", [7168]),
        f"{m}hidden_norm.weight": ("BF16", [7168]),
        f"{m}post_attention_layernorm.weight": ("BF16", [7168]),
        f"{m}self_attn.q_proj.weight": ("BF16", [8192, 14336]),
        f"{m}self_attn.k_proj.weight": ("BF16", [8192, 14336]),
        f"{m}self_attn.v_proj.weight": ("BF16", [8192, 14336]),
        f"{m}self_attn.o_proj.weight": ("BF16", [7168, 8192]),
        f"{m}mlp.gate_proj.weight": ("BF16", [18432, 7168]),
        f"{m}mlp.up_proj.weight": ("BF16", [18432, 7168]),
        f"{m}mlp.down_proj.weight": ("BF16", [7168, 18432]),
        "norm.weight": ("BF16", [7168]),
        "lm_head.weight": ("BF16", [32000, 7168]),
        "d2t": ("I64", [32000]),
        "t2d": ("BOOL", [163840]),
    }


def random_samples(model, lengths: list[int], prompts: list[int], seed: int = 0) -> list:
    """Random samples for `model`: each a prompt (context, never a target) of `prompts[i]` tokens, then the reply."""
    from drafter.data.dataset import Sample

    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    out = []
    for n, p in zip(lengths, prompts, strict=True):
        loss_mask = torch.zeros(n, dtype=torch.bool)
        loss_mask[p:] = True  # the prompt first, then the reply
        out.append(
            Sample(
                input_ids=torch.randint(0, cfg.vocab_size, (n,), generator=g),
                loss_mask=loss_mask,
                aux_hidden=torch.randn(n, 3 * cfg.target_hidden, generator=g),
                last_hidden=torch.randn(n, cfg.hidden_size, generator=g),
                target_token=torch.randint(0, cfg.vocab_size, (n,), generator=g),
            )
        )
    return out
