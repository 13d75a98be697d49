"""PEagleDrafter: a P-EAGLE (parallel EAGLE) drafter in plain PyTorch, as SpecForge trains it and vLLM's
`llama_eagle3` serves it with `parallel_drafting`.

Layer 0 is EAGLE-3's layer (the token's embedding and the fused target states side by side, 2 x hidden wide);
the layers after it are plain Llama layers. One pass drafts all k tokens: the first from the last verified
position, as EAGLE-3 drafts its first; the other k - 1 from slots after it, each the mask token's embedding
with a learned `mask_hidden` standing in for the target states nobody has yet, causal by depth. Nothing a draft
emits feeds another, so a cycle costs one drafter pass whatever k is.

Tensor names are SpecForge's (`layers.i.`, `mask_hidden` [1, 1, 3 x target hidden]), so a state dict is the
checkpoint (drafter/methods/peagle.py reads and writes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.errors import BadInput
from drafter.model import mla
from drafter.model.config import ARCHITECTURE, MAX_DRAFT_LAYERS, DrafterConfig
from drafter.model.eagle3 import MLP, Attention, DraftCache, Eagle3Drafter, MidLayer
from drafter.model.lean_ops import RMSNorm

ARCHITECTURES = ("PEagleDraftModel", "PeagleLlamaForCausalLM")  # SpecForge's, and vLLM's other name for it
# (an exported folder for vLLM is under EAGLE-3's name, with `mask_token_id`: drafter/methods/peagle.export_for)
MASK_KEYS = ("mask_token_id", "ptd_token_id", "pard_token")  # vLLM reads the slots' token from any of them


@dataclass(frozen=True)
class PEagleConfig:
    """EAGLE-3's fields (`base`), the number of layers and the token that fills the parallel slots."""

    base: DrafterConfig
    num_hidden_layers: int
    mask_token_id: int

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.base.aux_layer_ids

    @classmethod
    def from_dict(cls, raw: Any, where: str = "config.json") -> PEagleConfig:
        """Every field checked: EAGLE-3's as drafter/model/config.py reads them, the layer count and one mask
        token (bad input naming the field otherwise)."""
        if not isinstance(raw, dict):
            raise BadInput(f"{where}: not a JSON object")
        layers = raw.get("num_hidden_layers")
        if not isinstance(layers, int) or isinstance(layers, bool) or not 1 <= layers <= MAX_DRAFT_LAYERS:
            raise BadInput(f"{where}: field 'num_hidden_layers' must be a whole number in 1..{MAX_DRAFT_LAYERS}, "
                           f"got {layers!r}")  # fmt: skip
        given = {k: raw[k] for k in MASK_KEYS if raw.get(k) is not None}
        if not given:
            raise BadInput(f"{where}: no mask token ({', '.join(MASK_KEYS)}): vLLM fills the parallel slots with it")
        for key, value in given.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise BadInput(f"{where}: field '{key}' must be a token id >= 0, got {value!r}")
        if len(set(given.values())) > 1:
            raise BadInput(f"{where}: the mask token fields disagree ({given}): which token fills the slots?")
        mask = next(iter(given.values()))
        from drafter.formats.checkpoint import CONFIG_DTYPES

        if raw.get("torch_dtype", "bfloat16") not in CONFIG_DTYPES:
            raise BadInput(f"{where}: field 'torch_dtype' is {raw.get('torch_dtype')!r}, not one of "
                           f"{', '.join(CONFIG_DTYPES)}")  # fmt: skip
        if raw.get("layer_types") or raw.get("sliding_window"):
            raise BadInput(f"{where}: field 'layer_types'/'sliding_window': a P-EAGLE drafter is read with full "
                           "attention only")  # fmt: skip
        mla_keys = sorted(k for k in mla.KEYS if k in raw)
        if mla_keys:
            raise BadInput(f"{where}: a P-EAGLE drafter is read with Llama attention (MLA keys {', '.join(mla_keys)})")
        eagle = {k: v for k, v in raw.items() if k not in (*MASK_KEYS, "parallel_drafting", "sliding_window")}
        eagle.update(architectures=[ARCHITECTURE], num_hidden_layers=1)
        base = DrafterConfig.from_dict(eagle, where)
        if mask >= base.vocab_size:
            raise BadInput(f"{where}: mask token {mask} is not a token of the vocabulary ({base.vocab_size})")
        return cls(base, layers, mask)

    def to_dict(self, architecture: str = ARCHITECTURES[0]) -> dict[str, Any]:
        """config.json in SpecForge's layout, with the mask token under every name vLLM reads."""
        out = self.base.to_dict()
        out.update(architectures=[architecture], num_hidden_layers=self.num_hidden_layers)
        out.update({k: self.mask_token_id for k in ("mask_token_id", "ptd_token_id")})
        return out


class PlainLayer(nn.Module):
    """Layers 1 .. n - 1: a Llama decoder layer over the drafter's own width."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, in_features=cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def finish(self, attn_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.o_proj(attn_out)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class LayerCaches:
    """The verified positions' keys and values, one DraftCache a layer (batch of one)."""

    layers: list[DraftCache] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0


class PEagleDrafter(Eagle3Drafter):
    """P-EAGLE drafter: EAGLE-3's embedding, fc, norms, head and vocabulary maps, n layers and `mask_hidden`."""

    def __init__(self, config: PEagleConfig) -> None:
        super().__init__(config.base)
        del self.midlayer  # layer 0 is layers.0 here, as SpecForge and vLLM name it
        cfg = config.base
        self.parallel = config
        self.layers = nn.ModuleList([MidLayer(cfg), *(PlainLayer(cfg) for _ in range(config.num_hidden_layers - 1))])
        self.mask_hidden = nn.Parameter(torch.zeros(1, 1, 3 * cfg.target_hidden))

    def new_cache(self) -> LayerCaches:
        return LayerCaches([DraftCache() for _ in self.layers])

    def slot_inputs(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [n], fused states [n, H]) of n parallel slots: the mask token and fc(mask_hidden)."""
        ids = torch.full((n,), self.parallel.mask_token_id, dtype=torch.long, device=self.fc.weight.device)
        return ids, self.combine(self.mask_hidden.reshape(1, -1)).expand(n, -1)

    def run(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        caches: LayerCaches | None = None,
        commit: bool = False,
    ) -> torch.Tensor:
        """Every layer over new rows [B, N] (token ids, fused states [B, N, H], RoPE positions [B, N]); `mask`
        [B, 1, N, keys] says which keys each row sees: the caches' (decoding, batch of one) then the rows'
        own. Returns the carried state [B, N, H]; with `commit`, the rows' keys join the caches."""
        dtype = self.fc.weight.dtype
        cos, sin = self.rotary(positions, dtype)
        embeds = self.embed_tokens(token_ids).to(dtype)
        x = hidden
        for i, layer in enumerate(self.layers):
            inp = layer.attn_input(embeds, hidden) if i == 0 else layer.input_layernorm(x)
            attn = layer.self_attn
            q, k, v = attn.qkv(inp, cos, sin)
            keys, values = k, v
            if caches is not None and caches.layers[i].keys is not None:
                keys = torch.cat([caches.layers[i].keys, k], dim=2)
                values = torch.cat([caches.layers[i].values, v], dim=2)
            out = F.scaled_dot_product_attention(q, attn.expand_kv(keys), attn.expand_kv(values), attn_mask=mask)
            out = out.transpose(1, 2).reshape(*token_ids.shape, -1)
            x = layer.finish(out, hidden if i == 0 else x)
            if commit and caches is not None:
                caches.layers[i].keys, caches.layers[i].values = keys, values
        return self.carry(x)

    @torch.no_grad()
    def extend(self, cache: LayerCaches, next_ids: torch.Tensor, aux_hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """Verified positions join the caches (next_ids[i] is the token after aux_hidden[i]'s); returns the
        carried state there [1, n, H]."""
        n, start = next_ids.shape[-1], cache.length
        positions = torch.arange(start, start + n, device=next_ids.device)[None]
        hidden = self.combine(aux_hidden.reshape(1, -1, self.fc.in_features))
        mask = torch.ones(n, start + n, dtype=torch.bool, device=next_ids.device).tril(start)[None, None]
        return self.run(next_ids.reshape(1, -1), hidden, positions, mask, cache, commit=True)

    @torch.no_grad()
    def propose(  # type: ignore[override]
        self,
        cache: LayerCaches,
        last_hidden: torch.Tensor,
        k: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k target-vocab drafts in one pass: the first from the last verified position, the others from k - 1
        mask slots after it (never written to the caches). Returns token ids [k] and their distributions
        over the target vocabulary [k, V]."""
        states = [last_hidden[:, -1:]]
        if k > 1:
            base = cache.length - 1
            ids, hidden = self.slot_inputs(k - 1)
            positions = torch.arange(base + 1, base + k, device=ids.device)[None]
            mask = torch.ones(k - 1, cache.length + k - 1, dtype=torch.bool, device=ids.device).tril(cache.length)
            states.append(self.run(ids[None], hidden[None], positions, mask[None, None], cache))
        logits = self.logits(torch.cat(states, dim=1))[0].float()
        drafts = [self.draft_of(row, temperature, generator) for row in logits]
        return torch.stack([t for t, _ in drafts]), torch.stack([d for _, d in drafts])
