"""DFlash (block diffusion) drafters: z-lab's layout read and gated against a target from config and headers.

A DFlash drafter drafts a whole block in one pass: the bonus token then B - 1 mask tokens, attending
non-causally within the block, the target's hidden states of `target_layer_ids` fused by `fc` and injected into
every layer's keys and values. It has no embedding and no head of its own (the target's are borrowed), so it
must share the target's hidden size and vocabulary. z-lab reads layer id i as `hidden_states[i + 1]` (the
output of decoder layer i), and resolves YaRN's attention factor as 0.1 ln(factor) + 1 where the config names
none: both are recorded, so that an engine that reads either otherwise is caught rather than trusted.

The gate's Check rows (drafter/analysis/compat.py); no MLflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from common.errors import BadInput
from drafter.analysis.compat import Check

NAME = "dflash"
LAYER_TENSORS = (  # 11 per layer, Qwen3-style
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
)  # fmt: skip
LAYER_ID_CONVENTION = "hidden_states[id + 1]: the output of decoder layer id (z-lab's reading)"


def detect(raw: dict[str, Any]) -> bool:
    """A config in z-lab's or speculators' DFlash layout."""
    archs = raw.get("architectures") or []
    return "dflash_config" in raw or any("DFlash" in str(a) for a in archs if isinstance(a, str))


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
        n_target = raw.get("num_target_layers")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=whole("num_hidden_layers", raw.get("num_hidden_layers")),
            num_attention_heads=heads,
            num_key_value_heads=whole("num_key_value_heads", raw.get("num_key_value_heads", heads)),
            head_dim=whole("head_dim", head_dim),
            intermediate_size=whole("intermediate_size", raw.get("intermediate_size")),
            vocab_size=whole("vocab_size", raw.get("vocab_size")),
            block_size=whole("block_size", block, 2),
            mask_token_id=whole("dflash_config.mask_token_id", inner.get("mask_token_id"), 0),
            target_layer_ids=ids,
            causal=causal,
            num_target_layers=None if n_target is None else whole("num_target_layers", n_target),
            rope_scaling=rope,
        )


def expected_tensors(c: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the layout holds and its shape: 11 per layer, `fc`, `hidden_norm` and `norm`."""
    h, inter = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = dict(zip(LAYER_TENSORS, ((q, h), (kv, h), (kv, h), (h, q), (c.head_dim,), (c.head_dim,),
                                         (inter, h), (inter, h), (h, inter), (h,), (h,)), strict=True))  # fmt: skip
    out = {f"layers.{i}.{name}": shape for i in range(c.num_hidden_layers) for name, shape in per_layer.items()}
    out |= {"fc.weight": (h, len(c.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    return out


def rules(c: DFlashConfig, target_hidden: int, target_vocab: int, target_layers: int,
          header: dict[str, tuple[int, ...]] | None) -> list[Check]:  # fmt: skip
    """The gate's rules, each refused with its reason: the drafter borrows the target's embedding and head, so
    hidden size and vocabulary are the target's; `fc` fuses len(target_layer_ids) target states; the mask token
    is a token of the vocabulary; every layer id is a layer of the target. With the weights' header, every
    tensor of the layout at its shape (None: header not known, the gate then passes on the config only)."""
    fused = len(c.target_layer_ids) * target_hidden
    fc_in = header["fc.weight"][1] if header and "fc.weight" in header and len(header["fc.weight"]) == 2 else None
    out = [
        Check("hidden size", str(target_hidden), str(c.hidden_size), c.hidden_size == target_hidden),
        Check("vocabulary", str(target_vocab), str(c.vocab_size), c.vocab_size == target_vocab),
        Check("fc in-features", f"{len(c.target_layer_ids)} x {target_hidden} = {fused}",
             "header not known" if header is None else str(fc_in), None if header is None else fc_in == fused),
        Check("mask token", f"< {target_vocab}", str(c.mask_token_id), c.mask_token_id < target_vocab),
        Check("target layer ids", f"each < {target_layers}", str(list(c.target_layer_ids)),
             all(i < target_layers for i in c.target_layer_ids)),
    ]  # fmt: skip
    if c.num_target_layers is not None:
        out.append(Check("num_target_layers", str(target_layers), str(c.num_target_layers),
                        c.num_target_layers == target_layers))  # fmt: skip
    if header is not None:
        want = expected_tensors(c)
        for name, shape in want.items():
            got = header.get(name)
            out.append(Check(name, str(list(shape)), "MISSING" if got is None else str(list(got)), got == shape))
        for name in sorted(set(header) - set(want)):
            borrowed = name.startswith(("embed_tokens", "lm_head"))
            out.append(Check(name, "not in a DFlash drafter" + (" (the target's is borrowed)" if borrowed else ""),
                            str(list(header[name])), False))  # fmt: skip
    out.append(Check("layer id convention", LAYER_ID_CONVENTION, "recorded", True, informational=True))
    factor = c.yarn_attention_factor
    out.append(Check("YaRN attention factor", "written explicitly on export", "no YaRN" if factor is None
                    else f"{factor:.4f}", True, informational=True))  # fmt: skip
    return out
