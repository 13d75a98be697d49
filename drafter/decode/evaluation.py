"""Acceptance measured two ways, and what it means for a deployment.

Offline: teacher-forced acceptance per draft position on a held-out hidden-state dataset
(acc_pos_<i>, sim_accept_len = 1 + sum_i prod_{j<=i} acc_j). Online: real speculative decoding
against the target on held-out prompts (accept_len with a bootstrap interval over prompts, the
per-position acceptance of the decoding trace, and this host's measured speedup).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from common.errors import BadInput
from drafter.decode.speculate import speculative_generate, target_generate
from drafter.model.eagle3 import Eagle3Drafter
from drafter.model.target import Target
from serving.cost import break_even_accept_len, fit_conditional_acceptance, projected_tps
from serving.profile import Profile
from serving.workload import acceptance_by_position, bootstrap_ci, pooled


@dataclass
class OnlineResult:
    """A decoding trace over prompts, each stopped after the cycle where EOS landed. accept_len is
    pooled over verify cycles: sum of (accepted drafts + 1) / cycles, as serving engines count it."""

    k: int
    accepted: list[list[int]]  # per prompt, drafts accepted per verify cycle
    baseline_tokens: int
    baseline_seconds: float  # decode only (prefill excluded), the steady state a profile models
    spec_tokens: int
    spec_seconds: float  # decode only, likewise
    verify_seconds: float
    draft_seconds: float
    mismatches: int = 0  # greedy outputs that differed from the target's own (must be 0)
    near_ties: int = 0  # in bf16/fp16: outputs that left the target's own at a near-tie its rounding decides
    tie_gap: float = 0.0  # the widest logit gap between the two tokens where an output left at a near-tie
    truncated: int = 0
    outputs: list[list[int]] = field(default_factory=list)  # the target's own decoding, per prompt
    cycles: int = field(init=False)

    def __post_init__(self) -> None:
        self.cycles = sum(len(a) for a in self.accepted)

    @property
    def num_prompts(self) -> int:
        return len(self.accepted)

    @property
    def accept_len(self) -> float:
        return pooled(self.per_prompt)

    @property
    def per_prompt(self) -> list[tuple[int, int]]:
        """(tokens the verify cycles yielded, cycles) per prompt: all that accept_len and its CI need."""
        return [(sum(n + 1 for n in a), len(a)) for a in self.accepted]

    def accept_len_ci(self, iters: int = 2000, seed: int = 0) -> tuple[float, float]:
        return bootstrap_ci(self.per_prompt, iters, seed)

    @property
    def acc_pos(self) -> list[float]:
        return acceptance_by_position(self.accepted, self.k)

    @property
    def host_tps_baseline(self) -> float:
        return self.baseline_tokens / max(self.baseline_seconds, 1e-9)

    @property
    def host_tps_spec(self) -> float:
        return self.spec_tokens / max(self.spec_seconds, 1e-9)

    @property
    def host_cycle_ms(self) -> float:
        """The whole measured cycle (drafting, verify, acceptance, cache crops, drafter extend)."""
        return 1000 * self.spec_seconds / max(1, self.cycles)

    def metrics(self, profile: Profile, host: Profile | None = None) -> dict[str, float]:
        lo, hi = self.accept_len_ci()
        L = self.accept_len
        tps = projected_tps(L, profile)
        out = {
            "accept_len": L,
            "accept_len_ci_low": lo,
            "accept_len_ci_high": hi,
            **{f"acc_pos_{i}": a for i, a in enumerate(self.acc_pos)},
            "cond_acc": fit_conditional_acceptance(L, self.k),
            "break_even_accept_len": break_even_accept_len(profile),
            "projected_tps": tps,
            "projected_speedup": tps / profile.baseline_tps,
            "host_tps_baseline": self.host_tps_baseline,
            "host_tps_spec": self.host_tps_spec,
            "host_speedup": self.host_tps_spec / max(self.host_tps_baseline, 1e-9),
            "host_cycle_ms": self.host_cycle_ms,
            "host_verify_ms": 1000 * self.verify_seconds / max(1, self.cycles),
            "host_draft_step_ms": 1000 * self.draft_seconds / max(1, self.cycles * self.k),
            "num_prompts": float(self.num_prompts),
        }
        if host is not None:  # this host's profile projects what was just measured: do they agree?
            # compared as speed-ups (the cost model's cycle/plain-step ratio): a busier or quieter
            # machine moves plain and speculative tok/s together and says nothing about the model
            projected = projected_tps(L, host.with_draft_steps(self.k))
            out["host_tps_projected"] = projected * self.host_tps_baseline / host.baseline_tps
            out["host_speedup_projected"] = projected / host.baseline_tps
            out["host_projection_error"] = out["host_speedup_projected"] / max(out["host_speedup"], 1e-9) - 1
            out["host_baseline_drift"] = self.host_tps_baseline / host.baseline_tps - 1
        return out


def prompt_ids(tokenizer: Any, record: dict[str, Any], max_len: int) -> tuple[torch.Tensor, bool]:
    """The prompt a user would send: a conversation up to its last user turn (the recorded reply is
    dropped), with the generation prompt; plain text as is. Cut from the left when too long."""
    if "messages" in record:
        msgs = list(record["messages"])
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs:
            raise BadInput("a prompt conversation has no user turn")
        text = (
            tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            if getattr(tokenizer, "chat_template", None)
            else "".join(f"{m['role']}: {m['content']}\n" for m in msgs)
        )
    else:
        text = record["text"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cut = len(ids) > max_len
    return torch.tensor(ids[-max_len:] if cut else ids), cut


@torch.no_grad()
def evaluate_online(
    target: Target,
    drafter: Eagle3Drafter,
    records: list[dict[str, Any]],
    k: int,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
) -> OnlineResult:
    """Speculative decoding on each prompt, timed against the target decoding alone."""
    if target.tokenizer is None:
        raise BadInput(f"{target.folder}: target has no tokenizer; online evaluation needs one")
    target.set_aux_layers(list(drafter.config.aux_layer_ids))
    ctx = int(getattr(target.model.config, "max_position_embeddings", 4096))
    prompts, truncated = encode_prompts(target.tokenizer, records, ctx, max_new_tokens, k)
    eos = stop_token(target.tokenizer)
    accepted, mismatches, outputs, near_ties, tie_gap = [], 0, [], 0, 0.0
    base_tok = spec_tok = 0
    base_s = spec_s = verify_s = draft_s = 0.0
    for i, ids in enumerate(tqdm(prompts, desc="evaluate", unit="prompt", disable=not progress)):
        g1 = torch.Generator().manual_seed(seed + i)
        g2 = torch.Generator().manual_seed(seed + i)
        base = target_generate(target, ids, max_new_tokens, temperature, g1, eos)
        spec = speculative_generate(target, drafter, ids, max_new_tokens, k, temperature, g2, eos)
        if temperature <= 0 and spec.tokens != base.tokens:
            gap = divergence_gap(target, ids, base.tokens, spec.tokens)
            if gap is None:
                mismatches += 1
            else:
                near_ties, tie_gap = near_ties + 1, max(tie_gap, gap)
        accepted.append(spec.accepted)
        outputs.append(base.tokens)
        # decode-only throughput: the first token comes from the prefill, not from a cycle
        base_tok, base_s = base_tok + len(base.tokens) - 1, base_s + base.seconds - base.prefill_seconds
        spec_tok, spec_s = spec_tok + len(spec.tokens) - 1, spec_s + spec.seconds - spec.prefill_seconds
        verify_s, draft_s = verify_s + spec.verify_seconds, draft_s + spec.draft_seconds
    return OnlineResult(
        k, accepted, base_tok, base_s, spec_tok, spec_s, verify_s, draft_s, mismatches, truncated=truncated,
        outputs=outputs, near_ties=near_ties, tie_gap=tie_gap,
    )  # fmt: skip


TIE_ULPS = 4  # a near-tie: the two tokens' logits within this many rounding steps of the logit's precision
NEAR_TIE_SHARE = 0.2  # at most this share of prompts may part at near-ties; more is a bug, not rounding


@torch.no_grad()
def divergence_gap(target: Target, prompt: torch.Tensor, base: list[int], spec: list[int]) -> float | None:
    """Where speculative and plain greedy decoding part, the logit gap between the two tokens they chose,
    recomputed in one forward over the common prefix; when it is within TIE_ULPS rounding steps of the
    target's precision (bf16: 2^-7 relative), a near-tie that rounding in another block shape decides (a
    verify block and one token at a time round differently), so the gap; else None (a decoding bug). In
    float32 and wider any parting is a bug."""
    dtype = next(target.model.parameters()).dtype
    if dtype.itemsize >= 4:
        return None
    n = min(len(base), len(spec))
    at = next((i for i in range(n) if base[i] != spec[i]), n)
    if at == n:
        return None  # one output stops where the other goes on: not a choice between two tokens
    ids = torch.cat([prompt.reshape(-1), torch.tensor(base[:at], dtype=torch.long)])[None]
    logits = target.forward(ids).logits[0, -1].float()
    a, b = logits[base[at]], logits[spec[at]]
    gap = float((a - b).abs())
    step = torch.finfo(dtype).eps * max(1.0, float(torch.maximum(a.abs(), b.abs())))
    return gap if gap <= TIE_ULPS * step else None


def stop_token(tokenizer: Any) -> int | None:
    """Where a chat reply ends: <|im_end|> when the vocabulary has it, else the tokenizer's EOS."""
    if "<|im_end|>" in tokenizer.get_vocab():
        return tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer.eos_token_id


def target_tokenizer(target: str | Path) -> tuple[Any, int]:
    """The target's tokenizer and context length (what prompts are encoded and cut with), or bad input."""
    from transformers import AutoTokenizer

    from drafter.model.config import TargetConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as exc:
        raise BadInput(f"{target}: no tokenizer to encode the prompts ({str(exc).splitlines()[0][:120]})") from None
    return tokenizer, int(TargetConfig.from_file(target).text_config.get("max_position_embeddings", 4096))


def encode_prompts(
    tokenizer: Any, records: list[dict[str, Any]], context: int, max_new_tokens: int, k: int
) -> tuple[list[torch.Tensor], int]:
    """The prompts as token ids (what every engine is sent), cut from the left to leave room for the
    reply and a verify block; with the number that were cut."""
    limit = max(8, context - max_new_tokens - k - 2)
    out, cut = [], 0
    for rec in records:
        ids, was_cut = prompt_ids(tokenizer, rec, limit)
        out.append(ids)
        cut += was_cut
    return out, cut


def context_lengths(
    target: str | Path, records: list[dict[str, Any]], max_new_tokens: int, k: int, outputs: list[list[int]]
) -> list[int] | None:
    """Each conversation's length as decoded: its prompt's tokens as every engine is sent them, plus the
    reply's; None when the engine returned no reply per prompt (a user's endpoint without token ids)."""
    if len(outputs) != len(records):
        return None
    tokenizer, context = target_tokenizer(target)
    prompts, _ = encode_prompts(tokenizer, records, context, max_new_tokens, k)
    return [len(p) + len(o) for p, o in zip(prompts, outputs, strict=True)]
