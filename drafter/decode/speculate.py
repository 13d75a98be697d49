"""Speculative decoding with a drafter (an EAGLE-3 chain or a DFlash block) and a transformers target (batch of one).

Each cycle: the drafter proposes k tokens from the target's aux states (drafter/decode/proposers.py), the
target verifies them in one forward with its KV cache, the accepted prefix plus one token from the target
(the correction, or the bonus token when all k were accepted) is kept, both caches are cropped, and the cycle repeats.
Greedy mode reproduces the target's greedy output token for token; sampling mode uses the standard
lossless rule (accept d with probability min(1, p(d)/q(d)), else sample from max(0, p - q)).

Decoding stops after the cycle in which the end-of-sequence token lands, wherever it lands (an
accepted draft, the correction or the bonus token), or the token budget is reached: no cycle runs
after it, and the output is cut at EOS. Each cycle that ran is counted whole, as serving engines count
it (vLLM: 1 + accepted / drafts; SGLang: tokens / verify count), so accept_len = mean over verify
cycles of (accepted drafts + 1). The prefill's first token is no cycle's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from drafter.decode.proposers import proposer_for
from drafter.model.dflash import DFlashDrafter
from drafter.model.eagle3 import Eagle3Drafter
from drafter.model.target import Target


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify cycle (0..k)
    seconds: float = 0.0
    prefill_seconds: float = 0.0  # the prompt's forward and the first token: no cycle's work
    target_forwards: int = 0
    verify_seconds: float = 0.0
    draft_seconds: float = 0.0

    @property
    def cycles(self) -> int:
        return len(self.accepted)


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    return int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator))


@torch.no_grad()
def target_generate(
    target: Target,
    prompt: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
) -> DecodeResult:
    """Plain decoding, one target forward per token: the baseline speculation must beat."""
    start = time.perf_counter()
    cache = target.new_cache()
    out = target.forward(prompt[None], past_key_values=cache)
    tokens = [_pick(out.logits[0, -1], temperature, generator)]
    prefill = time.perf_counter() - start
    forwards = 1
    while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
        out = target.forward(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values)
        tokens.append(_pick(out.logits[0, -1], temperature, generator))
        forwards += 1
    return DecodeResult(tokens, seconds=time.perf_counter() - start, prefill_seconds=prefill, target_forwards=forwards)


@torch.no_grad()
def speculative_generate(
    target: Target,
    drafter: Eagle3Drafter | DFlashDrafter,
    prompt: torch.Tensor,
    max_new_tokens: int,
    k: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    eos_token_id: int | None = None,
) -> DecodeResult:
    """Speculative decoding; the target must have its aux layers set to the drafter's ids."""
    start = time.perf_counter()
    cache = target.new_cache()
    out = target.forward(prompt[None], past_key_values=cache)
    n_ctx = prompt.shape[0]
    nxt = _pick(out.logits[0, -1], temperature, generator)
    tokens = [nxt]
    proposer = proposer_for(drafter)
    proposer.begin(prompt, nxt, out.aux_hidden[0])
    result = DecodeResult(tokens, target_forwards=1, prefill_seconds=time.perf_counter() - start)
    while len(tokens) < max_new_tokens and tokens[-1] != eos_token_id:
        t0 = time.perf_counter()
        drafts, q = proposer.propose(k, temperature, generator)
        t1 = time.perf_counter()
        verify = target.forward(torch.cat([torch.tensor([nxt]), drafts])[None], past_key_values=out.past_key_values)
        result.verify_seconds += time.perf_counter() - t1
        result.draft_seconds += t1 - t0
        result.target_forwards += 1
        logits = verify.logits[0]  # row i predicts the token after position n_ctx + i
        n, new = _accept(logits, drafts, q, temperature, generator)
        result.accepted.append(n)
        emitted = [*drafts[:n].tolist(), new]
        kept = _until_stop(emitted, eos_token_id, max_new_tokens - len(tokens))
        tokens += kept
        if len(kept) < len(emitted) or kept[-1] == eos_token_id:
            break
        # keep the target's states for nxt and the accepted drafts; drop the rejected ones
        target.crop_cache(verify.past_key_values, n_ctx + 1 + n)
        out = verify
        proposer.advance(emitted, verify.aux_hidden[0, : n + 1])
        n_ctx += 1 + n
        nxt = new
    result.tokens = tokens
    result.seconds = time.perf_counter() - start
    return result


def _until_stop(emitted: list[int], eos_token_id: int | None, room: int) -> list[int]:
    """The part of one cycle's tokens that reaches the output: up to and including EOS, within room
    (the rest is dropped, and decoding stops)."""
    if eos_token_id is not None and eos_token_id in emitted:
        emitted = emitted[: emitted.index(eos_token_id) + 1]
    return emitted[: max(room, 0)]


def _accept(
    logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[int, int]:
    """(drafts accepted, the target's own next token) for one verify cycle."""
    k = drafts.shape[0]
    if temperature <= 0:
        greedy = logits.argmax(-1)
        n = 0
        while n < k and int(drafts[n]) == int(greedy[n]):
            n += 1
        return n, int(greedy[n])
    p = torch.softmax(logits.float() / temperature, -1)
    for i in range(k):
        d = int(drafts[i])
        ratio = float(p[i, d] / q[i, d].clamp(min=1e-20))
        if float(torch.rand((), generator=generator)) < min(1.0, ratio):
            continue
        residual = (p[i] - q[i]).clamp(min=0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i]
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return k, int(torch.multinomial(p[k], 1, generator=generator))
