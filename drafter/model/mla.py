"""The MLA draft layer: DeepSeek-style multi-head latent attention in an EAGLE-3 drafter.

The family TorchSpec trains for Kimi-K2.5 (lightseekorg/kimi-k2.5-eagle3-mla) and vLLM serves as
`Eagle3DeepseekV3ForCausalLM` (vLLM 0.32, `model_executor/models/deepseek_eagle3.py` over
`deepseek_v2.py`'s `DeepseekV2Attention`; SGLang's `deepseek_eagle3` reads the same names). The
config keys and tensor names below are those loaders':

- queries: `q_a_proj` [q_lora_rank, 2h] -> `q_a_layernorm` -> `q_b_proj` [heads x qk_head_dim, q_lora_rank],
  or one `q_proj` [heads x qk_head_dim, 2h] when `q_lora_rank` is null;
- keys and values: `kv_a_proj_with_mqa` [kv_lora_rank + qk_rope_head_dim, 2h] gives the latent and one
  rope key shared by every head; `kv_a_layernorm` -> `kv_b_proj` [heads x (qk_nope + v_head_dim), kv_lora_rank]
  gives each head's no-rope key and its value;
- qk_head_dim = qk_nope_head_dim + qk_rope_head_dim; only the last qk_rope_head_dim dimensions of a
  query and key are rotated, pairwise interleaved (vLLM's `is_neox_style=False`); the softmax scale is
  qk_head_dim ** -0.5; `o_proj` [h, heads x v_head_dim].

The attention computes full per-head keys and values (the "naive" MLA form): the same numbers as the
absorbed form engines use at decode time, and the same interface as the Llama layer's attention, so
training, TTT and decoding are shared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from common.errors import BadInput
from drafter.model import compiled
from drafter.model.lean_ops import RMSNorm
from drafter.model.rope import RopeSpec

ARCHITECTURES = ("Eagle3DeepseekV3ForCausalLM", "Eagle3DeepseekV2ForCausalLM")
# vLLM 0.32 reads a draft of model_type deepseek_v3 as DeepSeek's MTP module (config/speculative.py,
# hf_config_override); kimi_k2, what ModelOpt and TorchSpec write, maps to DeepseekV3Config as it is.
MODEL_TYPE = "kimi_k2"
KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class MLASpec:
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None  # None: one q_proj, no low-rank query

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> MLASpec:
        def positive(key: str, even: bool = False) -> int:
            value = raw.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise BadInput(
                    f"{where}: field '{key}' must be a positive integer for an MLA draft layer, got {value!r}"
                )
            if even and value % 2:
                raise BadInput(f"{where}: field '{key}' must be even (rotary dimensions come in pairs), got {value}")
            return value

        q_lora = raw.get("q_lora_rank")
        return cls(
            kv_lora_rank=positive("kv_lora_rank"),
            qk_nope_head_dim=positive("qk_nope_head_dim"),
            qk_rope_head_dim=positive("qk_rope_head_dim", even=True),
            v_head_dim=positive("v_head_dim"),
            q_lora_rank=None if q_lora is None else positive("q_lora_rank"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in KEYS}

    def tensors(self, heads: int, width_in: int, hidden: int) -> dict[str, tuple[int, ...]]:
        """The attention's tensors (under `self_attn.`) and their shapes."""
        qk, out = heads * self.qk_head_dim, {}
        if self.q_lora_rank is None:
            out["q_proj.weight"] = (qk, width_in)
        else:
            out["q_a_proj.weight"] = (self.q_lora_rank, width_in)
            out["q_a_layernorm.weight"] = (self.q_lora_rank,)
            out["q_b_proj.weight"] = (qk, self.q_lora_rank)
        out["kv_a_proj_with_mqa.weight"] = (self.kv_lora_rank + self.qk_rope_head_dim, width_in)
        out["kv_a_layernorm.weight"] = (self.kv_lora_rank,)
        out["kv_b_proj.weight"] = (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)
        out["o_proj.weight"] = (hidden, heads * self.v_head_dim)
        return out


def softmax_factor(rope: RopeSpec | None) -> float:
    """DeepSeek's YaRN also scales the softmax, by mscale(factor, mscale_all_dim) squared (vLLM's
    `deepseek_yarn`, deepseek_v2.py; the rotary angles and their cos/sin factor are drafter/model/rope.py's yarn)."""
    if rope is None or rope.rope_type != "yarn":
        return 1.0
    m = 0.1 * float(rope.mscale_all_dim or 0.0) * math.log(rope.factor) + 1.0 if rope.factor > 1 else 1.0
    return m * m


def check_rope(rope: RopeSpec, where: str) -> None:
    """An MLA layer's RoPE as vLLM maps it: default, or YaRN (served as deepseek_yarn); anything else it
    serves as DeepSeek's scaling, which the project does not reproduce."""
    if rope.rope_type not in ("default", "yarn") or (rope.rope_type == "yarn" and rope.attention_factor == 1.0):
        raise BadInput(
            f"{where}: rope type {rope.rope_type!r} on an MLA draft layer is not supported (vLLM serves it as "
            "DeepSeek's own scaling); only default RoPE and YaRN"
        )


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J / DeepSeek rotary: dimensions (2i, 2i+1) rotate by angle i. cos/sin as drafter.model.eagle3's
    Rotary gives them ([B or 1, T, d], the d/2 angles twice); x: [B, heads, T, d]."""
    if compiled.on_device(x):
        return compiled.compiled(_rope_interleaved)(x, cos, sin)
    return _rope_interleaved(x, cos, sin)


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    c, s = cos[:, None, :, :half], sin[:, None, :, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)


class MLAAttention(nn.Module):
    """Multi-head latent attention over the draft layer's [embed; hidden] input (2h wide)."""

    def __init__(self, hidden: int, heads: int, spec: MLASpec, eps: float, rope: RopeSpec | None = None) -> None:
        super().__init__()
        self.spec, self.n_heads, self.n_kv = spec, heads, heads
        self.head_dim = spec.qk_head_dim  # the query/key width: the softmax is scaled by it
        self.softmax_scale = spec.qk_head_dim**-0.5 * softmax_factor(rope)
        width_in = 2 * hidden
        if spec.q_lora_rank is None:
            self.q_proj = nn.Linear(width_in, heads * spec.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(width_in, spec.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(spec.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(spec.q_lora_rank, heads * spec.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width_in, spec.kv_lora_rank + spec.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(spec.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(spec.kv_lora_rank, heads * (spec.qk_nope_head_dim + spec.v_head_dim), bias=False)
        self.o_proj = nn.Linear(heads * spec.v_head_dim, hidden, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """(q [B, heads, T, qk], k [B, heads, T, qk], v [B, heads, T, v_head_dim]), rope applied."""
        b, t, _ = x.shape
        sp, h = self.spec, self.n_heads
        q = self.q_proj(x) if sp.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(b, t, h, sp.qk_head_dim).transpose(1, 2)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([sp.kv_lora_rank, sp.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, h, sp.qk_nope_head_dim + sp.v_head_dim)
        k_nope, v = kv.transpose(1, 2).split([sp.qk_nope_head_dim, sp.v_head_dim], dim=-1)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q_nope, q_pe = q.split([sp.qk_nope_head_dim, sp.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rope_interleaved(q_pe, cos, sin)], dim=-1)
        k_pe = apply_rope_interleaved(k_pe[:, None], cos, sin).expand(b, h, t, sp.qk_rope_head_dim)
        return q, torch.cat([k_nope, k_pe], dim=-1), v

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        return x  # every head has its own key and value
