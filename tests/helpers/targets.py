"""Tiny targets made by the tests (no downloads): a flat DeepSeek-V3 and the same weights saved
Kimi-K2.5-style, with a tokenizer trained on a few lines."""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
    "Speculative decoding drafts tokens and the target verifies them in one pass.",
    "import os\nimport sys\nprint(os.path.join('a', 'b'))\n",
    "Hidden states flow from the target to the drafter through three auxiliary layers.",
] * 4


def write_tiny_targets(root: Path) -> tuple[Path, Path]:
    """(flat, wrapped) folders under `root`."""
    from transformers import DeepseekV3ForCausalLM

    from miniworld.models import deepseek_config, save_k25_style, train_tokenizer

    tok = train_tokenizer(CORPUS, vocab_size=300)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(deepseek_config(len(tok), hidden_size=32, layers=4)).eval()
    with torch.no_grad():  # a random LM predicts near-uniformly; a sharper head gives drafters something to learn
        model.lm_head.weight.mul_(40.0)
    model = model.to(torch.bfloat16)  # stored as real targets are (the drafter shares its bf16 embedding)
    flat = root / "k2-tiny"
    model.save_pretrained(flat)
    tok.save_pretrained(flat)
    wrapped = save_k25_style(model, root / "k25-tiny", tok)
    return flat, wrapped


def same_shapes_other_weights(target: Path, out: Path, seed: int = 1, scale: float = 1.0) -> Path:
    """A copy of `target` with the same config and headers and other weights (the next release of a model,
    say): the shape gate cannot tell them apart, only the weights' digest and measured acceptance can. Each
    tensor gets noise of `scale` times its own spread (1: another model; 0.1: a fine-tune of the same)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(target, out)
    g = torch.Generator().manual_seed(seed)
    for path in sorted(out.glob("*.safetensors")):
        tensors = load_file(path)
        for name, t in tensors.items():
            if t.is_floating_point() and "norm" not in name:
                spread = t.float().std().clamp(min=1e-3) * scale
                noise = torch.randn(t.shape, generator=g).to(t.dtype) * spread.to(t.dtype)
                tensors[name] = (t + noise).contiguous()
        save_file(tensors, path, metadata={"format": "pt"})
    return out
