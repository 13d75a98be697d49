"""Eagle3Drafter: the EAGLE-3 draft head with SGLang/SpecForge parameter names.

One decoder layer ("midlayer") reads concat(input_layernorm(embed(token)), hidden_norm(hidden)),
where `hidden` is fc(three target aux states) at the first step and the drafter's own pre-norm output
afterwards. Training unrolls `ttt_length` steps (test-time training); decoding proposes k tokens from
a KV cache. Both share one attention rule, so what is trained is what is served:

- drafter position t holds (token x[t+1], target features at t) at RoPE position t;
- step j at position t stands at sequence position t + j and sees the step-0 keys of positions <= t
  plus its own chain's keys of steps 1..j (the "diagonal" of the TTT mask).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from drafter.model import compiled
from drafter.model.config import DrafterConfig
from drafter.model.flex_ttt import flex_ttt_attention
from drafter.model.lean_ops import RMSNorm, normal_init, swiglu
from drafter.model.mla import MLAAttention
from drafter.model.rope import RopeSpec
from drafter.model.ttt_attention import KeyRule, blockwise_ttt_attention
from drafter.model.ttt_plan import PackedPlan, Plan, Rows, StepPlan, count, plan_steps

# blockwise: memory linear in length (drafter/model/ttt_attention.py), the CPU path; flex: fused kernels
# (drafter/model/flex_ttt.py), the GPU path; auto: flex on CUDA, blockwise elsewhere; eager: the reference
ATTENTION = ("auto", "blockwise", "flex", "eager")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """RoPE angles for arbitrary (not necessarily contiguous) positions, with the config's scaling
    (drafter/model/rope.py: default, linear, llama3, yarn)."""

    def __init__(self, head_dim: int, rope: RopeSpec, max_position_embeddings: int) -> None:
        super().__init__()
        inv, self.scaling = rope.frequencies(head_dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.float()[..., None] * self.inv_freq  # [..., T, d/2]
        emb = torch.cat((angles, angles), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, d]; cos/sin: [B or 1, T, d] (on a GPU one compiled kernel, drafter/model/compiled.py)."""
    return compiled.compiled(_rope)(x, cos, sin) if compiled.on_device(x) else _rope(x, cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig, in_features: int | None = None) -> None:
        """`in_features`: 2 x hidden (the embedding and the state side by side) unless said (a later layer)."""
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        w = 2 * h if in_features is None else in_features
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(w, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(w, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(w, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # under autocast q is bf16: keep it so (no fp32 detour)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """GQA: repeat kv heads to match query heads."""
        rep = self.n_heads // self.n_kv
        return x if rep == 1 else x.repeat_interleave(rep, dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))  # keeps gate and up for backward


class MidLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = (
            Attention(cfg)
            if cfg.mla is None
            else MLAAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.mla, cfg.rms_norm_eps, cfg.rope)
        )
        self.norm_before_residual = cfg.norm_before_residual
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, attn_out: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Residual + MLP, as SGLang's Eagle-3 layer: the residual stream starts at `hidden`
        (at hidden_norm(hidden) with EAGLE-3.1's norm_before_residual, as vLLM reads it)."""
        residual = self.hidden_norm(hidden).to(hidden.dtype) if self.norm_before_residual else hidden
        x = residual + self.self_attn.o_proj(attn_out)
        return x + self.mlp(self.post_attention_layernorm(x))


def _take(x: torch.Tensor, rows: Rows, dim: int) -> torch.Tensor:
    """x at positions `rows` along `dim` (1 for [B, T, ...], 2 for [B, h, T, d])."""
    if isinstance(rows, int):
        return x if rows == x.shape[dim] else x.narrow(dim, 0, rows)
    shape = list(rows.shape) if dim == 1 else [rows.shape[0], 1, rows.shape[1]]
    index = rows.view(*shape, *([1] * (x.dim() - len(shape)))).expand(
        *x.shape[:dim], rows.shape[1], *x.shape[dim + 1 :]
    )
    return torch.gather(x, dim, index)


def _put(full: torch.Tensor, part: torch.Tensor, rows: Rows, dim: int) -> torch.Tensor:
    """`full` with `part` written at positions `rows` along `dim` (a new tensor; autograd-safe)."""
    if isinstance(rows, int):
        rest = full.shape[dim] - rows
        return part if rest == 0 else torch.cat([part, full.narrow(dim, rows, rest)], dim=dim)
    shape = list(rows.shape) if dim == 1 else [rows.shape[0], 1, rows.shape[1]]
    index = rows.view(*shape, *([1] * (part.dim() - len(shape)))).expand_as(part)
    return full.scatter(dim, index, part)


def _earlier(steps: list[tuple[torch.Tensor, Rows]], rows: Rows, like: torch.Tensor) -> list[torch.Tensor]:
    """Each earlier step's keys (or values) at this step's positions, [B, h, M, width] each. A step's
    positions lie within every earlier step's (a step runs where it or a later step is scored), so where
    both are prefixes this is a view; else the earlier ones are laid out over all T positions (`like`'s
    shape) and gathered."""
    out = []
    for x, at in steps:
        if isinstance(at, int) and isinstance(rows, int):
            out.append(x.narrow(2, 0, rows))
        else:
            out.append(_take(_put(x.new_zeros(*like.shape[:3], x.shape[-1]), x, at, dim=2), rows, dim=2))
    return out


def _chain(earlier: list[torch.Tensor], q: torch.Tensor, width: int) -> torch.Tensor:
    """The earlier steps' keys (or values, `width` wide) at this step's positions side by side,
    [B, h, M, J, width] (J may be 0)."""
    if not earlier:
        return q.new_zeros(*q.shape[:3], 0, width)
    return torch.stack(earlier, dim=3)


@dataclass
class DraftCache:
    """Step-0 keys/values of the positions the drafter has seen, for decoding (batch of one)."""

    keys: torch.Tensor | None = None  # [1, kv_heads, S, d]
    values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def crop(self, length: int) -> None:
        if self.keys is not None:
            self.keys = self.keys[:, :, :length]
            self.values = self.values[:, :, :length]


class Eagle3Drafter(nn.Module):
    """EAGLE-3 drafter. Parameter and buffer names match SGLang's `LlamaForCausalLMEagle3` files."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's
        self.fc = nn.Linear(3 * cfg.target_hidden, cfg.hidden_size, bias=False)
        if cfg.norm_before_fc:  # EAGLE-3.1 (drafter/model/config.py NORM_FLAGS): one norm over the three states
            self.input_norm = RMSNorm(3 * cfg.target_hidden, cfg.rms_norm_eps)
        if cfg.fc_norm:  # one norm per aux state
            self.fc_norm = nn.ModuleList(RMSNorm(cfg.target_hidden, cfg.rms_norm_eps) for _ in range(3))
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = Rotary(cfg.rope_dim, cfg.rope, cfg.max_position_embeddings)
        self.has_embedding = False  # True once embed_tokens holds the target's embedding
        self.attention = "auto"  # one of ATTENTION; "eager": the reference, the whole probability matrix per step

    # ------------------------------------------------------------------ helpers
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Random init for training from scratch (never used when loading a checkpoint); the embedding is the
        target's, attached after."""
        normal_init(self, seed, std, keep=("embed_tokens.weight",))

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's three aux states [..., 3 x target hidden] into the drafter's width, as vLLM's
        `combine_hidden_states`: the EAGLE-3.1 norms (if declared), then fc."""
        x = aux_hidden.to(self.fc.weight.dtype)
        if self.config.norm_before_fc:
            x = self.input_norm(x)
        if self.config.fc_norm:
            x = torch.cat([norm(part) for norm, part in zip(self.fc_norm, x.chunk(3, dim=-1), strict=True)], dim=-1)
        return self.fc(x)

    def carry(self, x: torch.Tensor) -> torch.Tensor:
        """What the next draft step reads of the layer's output: the pre-norm state, or (EAGLE-3.1's
        norm_output) the final norm's output."""
        return self.norm(x).to(x.dtype) if self.config.norm_output else x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits of a carried state (already normed under norm_output)."""
        return self.lm_head(hidden if self.config.norm_output else self.norm(hidden))

    # ------------------------------------------------------------------ training (TTT)
    def forward(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        ttt_length: int = 1,
        noise_std: float = 0.0,
        pred_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        plan: Plan | None = None,
    ) -> list[torch.Tensor]:
        """Unrolled TTT forward; returns draft-vocab logits [B, T, Vd] for each step.

        input_ids[b, t] is token t of the sample, aux_hidden[b, t] the target's aux features at t.
        Step j at position t embeds token t+j+1 (teacher forced) and predicts the target's
        distribution at position t+j+1; padding (attention_mask 0) is never attended to.

        With `pred_mask` (the positions whose prediction is trained, as ttt_loss reads them), a step
        computes only what the loss or a later step reads: step j's logits where step j is scored,
        its attention and MLP where step j or a later one is (a prompt position is never scored, so
        only step 0's keys and values cover it). The logits elsewhere are 0 and carry no gradient, or
        are left off: a step's logits may be shorter than T when no later position is scored. A
        `plan` made on the host from the same masks (drafter/model/ttt_plan.py) spares the GPU path the waits.

        Packed rows (drafter/data/packing.py) pass `position_ids` (restarting per sample) and `segment_ids`:
        a position attends only to its own sample, and no step is scored across two samples.
        """
        b, t = input_ids.shape
        plan = plan_steps(pred_mask, ttt_length, (b, t), attention_mask, segment_ids) if plan is None else plan
        if isinstance(plan, PackedPlan):
            return self._each_row(input_ids, aux_hidden, attention_mask, noise_std, position_ids, segment_ids, plan)
        outs = []
        for states, at in self.ttt_states(input_ids, aux_hidden, plan, attention_mask, noise_std, position_ids,
                                          segment_ids):  # fmt: skip
            logits = self.logits(states)
            if at is None or isinstance(at, int):  # scored positions all lie in 0..at-1: no zero tail to build
                outs.append(logits)
            else:
                outs.append(_put(logits.new_zeros(b, t, logits.shape[-1]), logits, at, dim=1))
        return outs

    def ttt_states(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        plan: StepPlan,
        attention_mask: torch.Tensor | None = None,
        noise_std: float = 0.0,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
    ) -> Iterator[tuple[torch.Tensor, Rows | None]]:
        """The TTT unroll one step at a time: for each step, the carried states its logits are read from
        ([B, n, H], at the plan's scored positions) and those positions (None: all T). A caller that
        scores each step as it comes (drafter/train/ttt_step.py) never holds every step's logits at once."""
        b, t = input_ids.shape
        dtype = self.fc.weight.dtype
        if noise_std > 0:
            aux_hidden = aux_hidden + noise_std * torch.randn_like(aux_hidden)
        hidden = self.combine(aux_hidden)
        device = input_ids.device
        pos = torch.arange(t, device=device)[None].expand(b, t) if position_ids is None else position_ids
        key_ok = torch.ones(b, t, dtype=torch.bool, device=device) if attention_mask is None else attention_mask.bool()
        mode = self.attention if self.attention != "auto" else ("flex" if input_ids.is_cuda else "blockwise")
        allowed0 = None
        if mode == "eager":  # the whole [B, Tq, Tk] mask: the reference path only
            causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=device))
            allowed0 = causal[None] & key_ok[:, None, :]
            if segment_ids is not None:
                allowed0 = allowed0 & (segment_ids[:, :, None] == segment_ids[:, None, :])
        attn = self.midlayer.self_attn
        scale = getattr(attn, "softmax_scale", 1.0 / math.sqrt(attn.head_dim))
        keys0 = values0 = None
        diag_k: list[tuple[torch.Tensor, Rows]] = []  # each earlier step's keys at its own positions
        diag_v: list[tuple[torch.Tensor, Rows]] = []
        for j, rows in enumerate(plan.needed):  # rows: the positions this step computes (M == T: all)
            ids = F.pad(input_ids[:, j + 1 :], (0, j + 1), value=0)
            if j == 0:  # keys and values of every position: every later query attends to them
                x = self.midlayer.attn_input(self.embed_tokens(ids).to(dtype), hidden)
                cos, sin = self.rotary(pos, dtype)
                q, k, v = attn.qkv(x, cos, sin)
                keys0, values0 = attn.expand_kv(k), attn.expand_kv(v)
                q = _take(q, rows, dim=2)
            else:
                x = self.midlayer.attn_input(
                    self.embed_tokens(_take(ids, rows, dim=1)).to(dtype), _take(hidden, rows, dim=1)
                )
                cos, sin = self.rotary(_take(pos, rows, dim=1) + j, dtype)
                q, k, v = attn.qkv(x, cos, sin)
            chain_k, chain_v = _earlier(diag_k, rows, keys0), _earlier(diag_v, rows, values0)
            if j > 0:
                diag_k.append((attn.expand_kv(k), rows))
                diag_v.append((attn.expand_kv(v), rows))
                chain_k.append(diag_k[-1][0])
                chain_v.append(diag_v[-1][0])
            if mode == "eager":
                out = self._eager_attention(q, keys0, values0, chain_k, chain_v, rows, allowed0, j, scale)
            else:
                at = torch.arange(rows, device=device)[None].expand(b, rows) if isinstance(rows, int) else rows
                rule = KeyRule(at, key_ok, segment_ids, self.config.sliding_window, offset=j)
                if mode == "flex":  # the chain as a list: the kernel's keys are made in one copy
                    out = flex_ttt_attention(q, keys0, values0, chain_k, chain_v, rule, scale)
                else:
                    chain_k, chain_v = _chain(chain_k, q, keys0.shape[-1]), _chain(chain_v, q, values0.shape[-1])
                    out = blockwise_ttt_attention(q, keys0, values0, chain_k, chain_v, rule, scale)
            out = out.transpose(1, 2).reshape(b, count(rows), -1)
            hidden = _put(hidden, self.carry(self.midlayer.finish(out, _take(hidden, rows, dim=1))), rows, dim=1)
            at = plan.scored[j]
            yield (hidden if at is None else _take(hidden, at, dim=1)), at

    def _eager_attention(self, q, keys0, values0, chain_k, chain_v, rows, allowed0, j, scale) -> torch.Tensor:  # noqa: ANN001
        """The reference path: every step's whole probability matrix [B, h, M, T + j], kept for backward
        (chain_k, chain_v: the earlier steps' keys and values at this step's positions)."""
        t = keys0.shape[2]
        allowed = _take(allowed0, rows, dim=1)
        window = self.config.sliding_window
        if window is not None:  # the query of step j at position t stands at t + j
            qpos = torch.arange(rows, device=q.device) if isinstance(rows, int) else rows
            allowed = allowed & ((qpos[..., :, None] + j - torch.arange(t, device=q.device)) < window)
        scores = torch.matmul(q, keys0.transpose(-1, -2)) * scale  # [B, h, M, T]
        scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
        diag = [(q * dk).sum(-1, keepdim=True) * scale for dk in chain_k]  # [B, h, M, 1]
        probs = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1, dtype=torch.float32).to(q.dtype)
        out = torch.matmul(probs[..., :t], values0)
        for i, dv in enumerate(chain_v):
            out = out + probs[..., t + i : t + i + 1] * dv
        return out

    def _each_row(self, input_ids, aux_hidden, attention_mask, noise_std, position_ids, segment_ids,
                  plan: PackedPlan) -> list[torch.Tensor]:  # fmt: skip
        """Packed rows one at a time, each cut to its content: the positions a step computes are then
        exactly its own (rows of a batch are never padded to the busiest row's count, and trailing pad
        positions cost nothing). Logits come back as [B, T, Vd], zero where nothing is scored."""
        t = input_ids.shape[1]
        per_row = []
        for r, (n, row_plan) in enumerate(zip(plan.lengths, plan.rows, strict=True)):
            cut = lambda x, r=r, n=n: None if x is None else x[r : r + 1, :n]  # noqa: E731
            row = (cut(input_ids), cut(aux_hidden), cut(attention_mask))
            per_row.append(self.forward(*row, noise_std=noise_std, position_ids=cut(position_ids),
                                        segment_ids=cut(segment_ids), plan=row_plan))  # fmt: skip
        steps = len(plan.rows[0].needed)
        return [torch.cat([F.pad(rows[j], (0, 0, 0, t - rows[j].shape[1])) for rows in per_row]) for j in range(steps)]

    # ------------------------------------------------------------------ decoding
    def _step(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cache: DraftCache,
        extra_k: list[torch.Tensor],
        extra_v: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer pass for new positions (batch of one); returns (new hidden, k, v)."""
        dtype = self.fc.weight.dtype
        attn = self.midlayer.self_attn
        x = self.midlayer.attn_input(self.embed_tokens(token_ids).to(dtype), hidden)
        cos, sin = self.rotary(positions[None], dtype)
        q, k, v = attn.qkv(x, cos, sin)
        past_k = [cache.keys] if cache.keys is not None else []
        past_v = [cache.values] if cache.values is not None else []
        keys = torch.cat([*past_k, *extra_k, k], dim=2)
        values = torch.cat([*past_v, *extra_v, v], dim=2)
        n_new, n_keys = q.shape[2], keys.shape[2]
        # causal over everything before, including the new block itself
        mask = torch.ones(n_new, n_keys, dtype=torch.bool, device=q.device).tril(n_keys - n_new)
        if self.config.sliding_window is not None:  # key i sits at position i: the cache, then the chain
            mask = mask & (positions[:, None] - torch.arange(n_keys, device=q.device) < self.config.sliding_window)
        out = F.scaled_dot_product_attention(
            q,
            attn.expand_kv(keys),
            attn.expand_kv(values),
            attn_mask=mask[None, None],
            scale=getattr(attn, "softmax_scale", None),
        )
        out = out.transpose(1, 2).reshape(1, n_new, -1)
        return self.carry(self.midlayer.finish(out, hidden)), k, v

    def new_cache(self) -> DraftCache:
        """An empty cache of this drafter's verified positions (decoding starts one a sequence)."""
        return DraftCache()

    def draft_of(
        self, logits: torch.Tensor, temperature: float, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the target-vocab draft, its distribution over the target vocabulary) of one row of draft-vocab logits:
        sampled at a temperature, else the argmax (a one-hot distribution, for lossless rejection sampling)."""
        if temperature > 0:
            probs_d = torch.softmax(logits / temperature, dim=-1)
            draft = torch.multinomial(probs_d, 1, generator=generator)[0]
        else:
            probs_d = F.one_hot(logits.argmax(), logits.shape[-1]).float()
            draft = logits.argmax()
        full = torch.zeros(self.config.vocab_size, dtype=torch.float32, device=logits.device)
        full[self.t2d] = probs_d  # draft ids are the true entries of t2d, in order
        return self.draft_to_target(draft), full

    @torch.no_grad()
    def extend(self, cache: DraftCache, next_ids: torch.Tensor, aux_hidden: torch.Tensor) -> torch.Tensor:
        """Add positions to the cache: next_ids[i] is the token after the one aux_hidden[i] belongs to.

        Returns the drafter's pre-norm hidden state at the new positions [1, n, H].
        """
        start = cache.length
        positions = torch.arange(start, start + next_ids.shape[-1], device=next_ids.device)
        hidden = self.combine(aux_hidden.reshape(1, -1, self.fc.in_features))
        out, k, v = self._step(next_ids.reshape(1, -1), hidden, positions, cache, [], [])
        cache.keys = k if cache.keys is None else torch.cat([cache.keys, k], dim=2)
        cache.values = v if cache.values is None else torch.cat([cache.values, v], dim=2)
        return out

    @torch.no_grad()
    def propose(
        self,
        cache: DraftCache,
        last_hidden: torch.Tensor,
        k: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Propose k target-vocab tokens after the cache's last position.

        last_hidden is `extend`'s output at the last position ([1, 1, H]). Returns the token ids [k]
        and the draft distributions over the target vocab [k, V] (for lossless rejection sampling).
        Draft keys never enter the cache: the next `extend` rewrites those positions with target
        features.
        """
        tokens, dists = [], []
        hidden = last_hidden[:, -1:]
        extra_k: list[torch.Tensor] = []
        extra_v: list[torch.Tensor] = []
        base = cache.length - 1
        for j in range(k):
            token, full = self.draft_of(self.logits(hidden)[0, -1].float(), temperature, generator)
            tokens.append(token)
            dists.append(full)
            if j == k - 1:
                break
            positions = torch.tensor([base + j + 1], device=token.device)
            hidden, kk, vv = self._step(token.view(1, 1), hidden, positions, cache, extra_k, extra_v)
            extra_k.append(kk)
            extra_v.append(vv)
        return torch.stack(tokens), torch.stack(dists)
