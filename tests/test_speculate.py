import math

import pytest
import torch

from drafter.decode.speculate import _accept, speculative_generate, target_generate
from drafter.model.eagle3 import DraftCache
from drafter.model.target import load_target
from tests.helpers.drafters import tiny_drafter


class ScriptedDrafter:
    """A drafter double whose proposals come from the real target: always right, always wrong, or
    right with some probability (a real Eagle3Drafter handles the caching it is given)."""

    def __init__(self, real, target, mode: str, p_right: float = 1.0, seed: int = 0):
        self.real, self.target, self.mode, self.p = real, target, mode, p_right
        self.context: list[int] = []
        self.gen = torch.Generator().manual_seed(seed)

    def new_cache(self):
        return self.real.new_cache()

    def extend(self, cache, next_ids, aux):
        if not self.context:
            self.context = [-1]  # placeholder for token 0, unknown to the drafter
        self.context += next_ids.tolist()
        return self.real.extend(cache, next_ids, aux)

    def propose(self, cache, hidden, k, temperature=0.0, generator=None):
        ctx = self._prompt + self.context[len(self._prompt) :]
        out = []
        for _ in range(k):
            nxt = int(self.target.model(torch.tensor([ctx])).logits[0, -1].argmax())
            right = self.mode == "oracle" or (
                self.mode == "noisy" and float(torch.rand((), generator=self.gen)) < self.p
            )
            tok = nxt if right else (nxt + 1) % self.target.config.vocab_size
            out.append(tok)
            ctx = ctx + [tok]
        v = self.target.config.vocab_size
        return torch.tensor(out), torch.nn.functional.one_hot(torch.tensor(out), v).float()

    def start(self, prompt):
        self._prompt = prompt.tolist()
        self.context = []


@pytest.fixture(scope="module")
def target(tiny_targets):
    t = load_target(tiny_targets[0])
    t.set_aux_layers([0, 1, 2])
    return t


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g) for _ in range(n)]


def _drafter(target):
    d = tiny_drafter(seed=7, vocab_size=target.config.vocab_size, draft_vocab_size=128, aux_layer_ids=[0, 1, 2])
    with torch.no_grad():
        d.embed_tokens.weight.copy_(target.embedding_weight)
    return d.eval()


def test_greedy_speculation_reproduces_target_greedy_output(target):
    real = _drafter(target)
    for i, prompt in enumerate(prompts(6)):
        base = target_generate(target, prompt, 24)
        for mode, p in (("real", 0.0), ("noisy", 0.6)):
            drafter = real if mode == "real" else ScriptedDrafter(real, target, "noisy", p, seed=i)
            if mode != "real":
                drafter.start(prompt)
            spec = speculative_generate(target, drafter, prompt, 24, k=3)
            assert spec.tokens == base.tokens, (i, mode)
            assert sum(a + 1 for a in spec.accepted) + 1 >= len(spec.tokens)
        assert spec.target_forwards < base.target_forwards or all(a == 0 for a in spec.accepted)


@pytest.mark.parametrize("mode, expected", [("oracle", 4.0), ("wrong", 1.0)])
def test_perfect_and_hopeless_drafters(target, mode, expected):
    real = _drafter(target)
    lens = []
    for prompt in prompts(2, seed=1):
        d = ScriptedDrafter(real, target, mode)
        d.start(prompt)
        res = speculative_generate(target, d, prompt, 24, k=3)
        lens += [a + 1 for a in res.accepted]
        assert res.tokens == target_generate(target, prompt, 24).tokens
    assert sum(lens) / len(lens) == expected


def test_decoding_stops_in_the_cycle_where_eos_lands(target):
    """EOS arriving as an accepted draft mid-cycle ends decoding there: no cycle runs after it (each
    would add ~1 token per cycle to the count), the output ends at EOS, and the cycle counts whole."""
    real = _drafter(target)
    prompt = prompts(1, seed=4)[0]
    plain = target_generate(target, prompt, 40).tokens
    # an end-of-sequence token that first appears mid-output, not on a cycle boundary (4 tokens a cycle)
    i = next(j for j in range(5, 40) if plain[j] not in plain[:j] and j % 4 != 0)
    eos = plain[i]
    d = ScriptedDrafter(real, target, "oracle")
    d.start(prompt)
    res = speculative_generate(target, d, prompt, 40, k=3, eos_token_id=eos)
    assert res.tokens == plain[: i + 1] == target_generate(target, prompt, 40, eos_token_id=eos).tokens
    assert res.cycles == math.ceil(i / 4) and all(a == 3 for a in res.accepted)
    budget = speculative_generate(target, real, prompt, 10, k=3)  # the token budget stops it too
    assert len(budget.tokens) == 10 and sum(a + 1 for a in budget.accepted[:-1]) < 9


def test_lossless_rejection_sampling_matches_the_target_distribution():
    """Tiny vocabulary, many trials: the first emitted token is distributed as p, not as q."""
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    q = torch.tensor([0.05, 0.1, 0.2, 0.25, 0.4])
    logits = torch.log(p)[None].repeat(2, 1)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.zeros(5)
    naive = torch.zeros(5)
    for _ in range(n):
        d = torch.multinomial(q, 1, generator=gen)
        n_acc, new = _accept(logits, d, q[None], 1.0, gen)
        first = int(d) if n_acc == 1 else new
        counts[first] += 1
        naive[int(d)] += 1  # "always accept" would emit q
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    chi2_naive = float(((naive - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 18.47  # chi-square, 4 dof, p = 0.001
    assert chi2_naive > 1000  # the test has the power to see a wrong rule


def test_sampling_mode_runs_and_keeps_caches_consistent(target):
    real = _drafter(target)
    gen = torch.Generator().manual_seed(0)
    res = speculative_generate(target, real, prompts(1)[0], 20, k=2, temperature=0.8, generator=gen)
    assert len(res.tokens) == 20 and all(0 <= a <= 2 for a in res.accepted)
    assert math.isfinite(res.seconds)


def test_draft_cache_is_left_at_the_verified_length(target):
    real = _drafter(target)
    prompt = prompts(1, seed=3)[0]
    cache = DraftCache()
    out = target.forward(prompt[None])
    real.extend(cache, torch.cat([prompt[1:], out.logits[0, -1:].argmax(-1)]), out.aux_hidden[0])
    assert cache.length == len(prompt)
