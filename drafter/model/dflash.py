"""A DFlash block drafter in plain PyTorch, as z-lab trains it and vLLM's qwen3_dflash serves it.

One pass drafts a whole block: the block is the bonus token followed by mask tokens, at the positions after the
context, and attends non-causally within itself. The context is the target's hidden states of the layers in
`target_layer_ids`, fused by `fc` and normed by `hidden_norm`; every layer projects it to keys and values (its own
k_proj, k_norm and RoPE at the context's positions) and the block's queries attend to them, never passing it
through the layers. The output at block position j predicts the token at that position. Embedding and head are
the target's, borrowed and never saved.

Tensor names are z-lab's (drafter/methods/dflash.expected_tensors), so a state dict is the checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.errors import BadInput
from drafter.model.config import MAX_DRAFT_LAYERS
from drafter.model.eagle3 import Rotary, apply_rope
from drafter.model.lean_ops import RMSNorm, normal_init, swiglu
from drafter.model.rope import RopeSpec, rope_from_config


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    causal: bool
    num_target_layers: int | None
    rope_scaling: dict[str, Any] | None
    rope: RopeSpec = RopeSpec()
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """The target layers it reads, under the name every drafter's config gives them (the project's reading)."""
        return self.target_layer_ids

    @property
    def yarn_attention_factor(self) -> float | None:
        """The YaRN attention factor as z-lab resolves it: the config's own, else 0.1 ln(factor) + 1 (None: no
        YaRN). vLLM after 0.29 started honouring `mscale` here, which moved this checkpoint's from 1.416 to 1."""
        rs = self.rope_scaling or {}
        if rs.get("rope_type", rs.get("type")) != "yarn":
            return None
        if "attention_factor" in rs:
            return float(rs["attention_factor"])
        factor = float(rs.get("factor", 1.0))
        return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0

    @classmethod
    def from_dict(cls, raw: Any, where: str = "config.json") -> DFlashConfig:
        """Every field checked: one line naming the file and the field when one is missing or wrong."""
        if not isinstance(raw, dict):
            raise BadInput(f"{where}: not a JSON object")
        inner = raw.get("dflash_config")
        if not isinstance(inner, dict):
            raise BadInput(f"{where}: 'dflash_config' is missing or not an object")

        def whole(key: str, value: Any, low: int = 1) -> int:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise BadInput(f"{where}: '{key}' is {value!r}, not a whole number >= {low}")
            return value

        ids = inner.get("target_layer_ids")
        if not isinstance(ids, list) or not ids:
            raise BadInput(f"{where}: 'dflash_config.target_layer_ids' is not a non-empty list of layer ids")
        ids = tuple(whole(f"dflash_config.target_layer_ids[{i}]", x, 0) for i, x in enumerate(ids))
        if len(set(ids)) != len(ids):
            raise BadInput(f"{where}: 'dflash_config.target_layer_ids' {list(ids)} names a layer twice")
        block = raw.get("block_size", inner.get("block_size"))
        heads = whole("num_attention_heads", raw.get("num_attention_heads"))
        hidden = whole("hidden_size", raw.get("hidden_size"))
        head_dim = raw.get("head_dim", hidden // heads if hidden % heads == 0 else None)
        causal = inner.get("causal", False)
        if not isinstance(causal, bool):
            raise BadInput(f"{where}: 'dflash_config.causal' is {causal!r}, not true or false")
        rope = raw.get("rope_scaling")
        if rope is not None and not isinstance(rope, dict):
            raise BadInput(f"{where}: 'rope_scaling' is {rope!r}, not an object")
        layers = whole("num_hidden_layers", raw.get("num_hidden_layers"))
        if layers > MAX_DRAFT_LAYERS:
            raise BadInput(f"{where}: 'num_hidden_layers' is {layers}: more than {MAX_DRAFT_LAYERS} is no drafter")
        n_target = raw.get("num_target_layers")
        eps = raw.get("rms_norm_eps", 1e-6)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise BadInput(f"{where}: 'rms_norm_eps' is {eps!r}, not a number between 0 and 1")
        kv = whole("num_key_value_heads", raw.get("num_key_value_heads", heads))
        if heads % kv:
            raise BadInput(f"{where}: 'num_attention_heads' {heads} is not a multiple of 'num_key_value_heads' {kv}")
        act = raw.get("hidden_act", "silu")
        if act != "silu":  # Qwen3's SwiGLU, as z-lab's layers and vLLM's run them
            raise BadInput(f"{where}: 'hidden_act' is {act!r}; a DFlash layer runs 'silu'")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=whole("head_dim", head_dim),
            intermediate_size=whole("intermediate_size", raw.get("intermediate_size")),
            vocab_size=whole("vocab_size", raw.get("vocab_size")),
            block_size=whole("block_size", block, 2),
            mask_token_id=whole("dflash_config.mask_token_id", inner.get("mask_token_id"), 0),
            target_layer_ids=ids,
            causal=causal,
            num_target_layers=None if n_target is None else whole("num_target_layers", n_target),
            rope_scaling=rope,
            # vLLM's default theta for a DFlash layer that names none (set_default_rope_theta)
            rope=rope_from_config({"rope_theta": 1_000_000.0, **raw}, where),
            rms_norm_eps=float(eps),
            max_position_embeddings=whole("max_position_embeddings", raw.get("max_position_embeddings", 4096)),
        )


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)  # [B, n, T, d]

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (per-head normed, rotated) and values of x [B, T, H]: [B, kv_heads, T, d] each."""
        k = self.k_norm(self._heads(self.k_proj(x), self.n_kv)).to(x.dtype)
        return apply_rope(k, cos, sin), self._heads(self.v_proj(x), self.n_kv)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The block's queries over [context keys; the block's own keys]; mask [B or 1, 1, Q, S + Q] (True: may
        attend), None for a single block that sees its whole context."""
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)).to(x.dtype), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        k, v = torch.cat([ctx_k, k], dim=2), torch.cat([ctx_v, v], dim=2)
        rep = self.n_heads // self.n_kv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(c)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, ctx_k, ctx_v, mask) -> torch.Tensor:  # noqa: ANN001
        x = x + self.self_attn(self.input_layernorm(x).to(x.dtype), cos, sin, ctx_k, ctx_v, mask)
        h = self.post_attention_layernorm(x).to(x.dtype)
        return x + self.mlp.down_proj(swiglu(self.mlp.gate_proj(h), self.mlp.up_proj(h)))


@dataclass
class BlockContext:
    """The context keys and values every layer has seen (batch of one), and the next position."""

    keys: list[torch.Tensor] = field(default_factory=list)  # per layer [1, kv_heads, S, d]
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def length(self) -> int:
        return 0 if not self.keys else self.keys[0].shape[2]


class DFlashDrafter(nn.Module):
    """z-lab's DFlash drafter over a borrowed embedding [V, H] and head [V, H] (the target's)."""

    def __init__(self, config: DFlashConfig, embedding: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        c = config
        if embedding.shape != (c.vocab_size, c.hidden_size) or lm_head.shape != (c.vocab_size, c.hidden_size):
            raise ValueError(
                f"the target's embedding {list(embedding.shape)} and head {list(lm_head.shape)} are not "
                f"[{c.vocab_size}, {c.hidden_size}], the drafter's vocabulary and hidden size"
            )
        self.config = c
        self.layers = nn.ModuleList(DFlashLayer(c) for _ in range(c.num_hidden_layers))
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope, c.max_position_embeddings)
        # borrowed, frozen and not part of the checkpoint
        self.register_buffer("embed", embedding.detach(), persistent=False)
        self.register_buffer("head", lm_head.detach(), persistent=False)

    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init for training from scratch: N(0, std), norms at 1 (the borrowed embedding and head are
        buffers, untouched)."""
        normal_init(self, seed, std)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def _angles(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(positions, dtype)
        return (cos, sin) if cos.dim() == 3 else (cos[None], sin[None])

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Every layer's keys and values of the context: aux [B, S, n x H] at positions [B or 1, S]."""
        ctx = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype))).to(self.fc.weight.dtype)
        cos, sin = self._angles(positions, ctx.dtype)
        pairs = [layer.self_attn.keys_values(ctx, cos, sin) for layer in self.layers]
        return [k for k, _ in pairs], [v for _, v in pairs]

    def block_hidden(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        ctx_k: list[torch.Tensor],
        ctx_v: list[torch.Tensor],
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final-normed hidden states of block tokens [B, Q] at positions [B or 1, Q]."""
        x = F.embedding(tokens, self.embed).to(self.fc.weight.dtype)
        cos, sin = self._angles(positions, x.dtype)
        for layer, k, v in zip(self.layers, ctx_k, ctx_v, strict=True):
            x = layer(x, cos, sin, k, v, mask)
        return self.norm(x).to(x.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.head.to(hidden.dtype).T

    # ------------------------------------------------------------------ decoding (batch of one)
    def extend(self, context: BlockContext, aux: torch.Tensor) -> None:
        """Add the target's states of verified tokens (aux [n, n_layers x H]) at the next context positions."""
        start = context.length
        positions = torch.arange(start, start + aux.shape[0], device=aux.device)[None]
        keys, values = self.context_kv(aux[None], positions)
        if not context.keys:
            context.keys, context.values = keys, values
            return
        context.keys = [torch.cat([a, b], dim=2) for a, b in zip(context.keys, keys, strict=True)]
        context.values = [torch.cat([a, b], dim=2) for a, b in zip(context.values, values, strict=True)]

    @torch.no_grad()
    def propose(
        self,
        context: BlockContext,
        bonus: int,
        k: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k drafts in one pass from the block [bonus, mask x k] right after the context (k < block_size).

        Returns the drafts [k] and their distributions [k, V] (for lossless rejection sampling)."""
        if not 1 <= k < self.block_size:
            raise ValueError(f"a DFlash drafter with block size {self.block_size} drafts 1..{self.block_size - 1}")
        tokens = torch.tensor([[bonus] + [self.config.mask_token_id] * k])
        positions = torch.arange(context.length, context.length + k + 1)[None]
        logits = self.logits(self.block_hidden(tokens, positions, context.keys, context.values))[0, 1:].float()
        if temperature <= 0:
            drafts = logits.argmax(-1)
            return drafts, torch.nn.functional.one_hot(drafts, logits.shape[-1]).float()
        q = torch.softmax(logits / temperature, -1)
        return torch.multinomial(q, 1, generator=generator)[:, 0], q
