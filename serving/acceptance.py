"""What "accept_len" means, derived in one place from one record: the verify-step histogram.

For each request, h(j) counts the verify steps that accepted exactly j drafts (j = 0..k). Every figure a tool
calls acceptance is a function of these histograms (docs/metrics.md maps each tool's number to these):

- pooled accept_len, per verify step: 1 + sum_j j*H(j) / sum_j H(j), with H the requests' histograms summed.
  vLLM's counters, speculators' acceptance.csv, SGLang's server log and ModelOpt's mean_accept_length. Decode
  speed follows it, so break-even, the rule and the watch use it (`accept_len`).
- per-request mean: each request's own 1 + sum_j j*h(j) / sum_j h(j), averaged without weights. SGLang's
  spec_accept_length averaged, `specforge benchmark`, z-lab's DFlash benchmark, ModelOpt's Average_AL
  (`accept_len_per_request`). The pooled figure is the token-weighted harmonic mean of these: rankings can flip.
- marginal m_i = P(j >= i + 1) and conditional c_i = m_i / m_(i-1) by draft position; pooled = 1 + sum_i m_i.
- acceptance rate: accepted drafts over drafted tokens.
- accept_len at a smaller depth d: 1 + sum_(i<d) m_i, which holds for a chain drafter (its depth-d draft is the
  prefix of its depth-k one) and is marked extrapolated; a block drafter re-plans its block, so only a depth it
  was measured at is given.

Pure: no torch, no MLflow. serving/speculation_profile.py writes and reads ModelOpt's portable form of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHAIN = "chain"  # a depth-d draft is the prefix of the depth-k one (EAGLE, EAGLE-3, a draft model)
BLOCK = "block"  # the whole block is re-planned at each width (DFlash, P-EAGLE's parallel pass)


@dataclass(frozen=True)
class RequestHistogram:
    """One request: steps[j] verify steps accepted exactly j drafts (len k + 1), with its traffic class and its
    context in tokens, prompt plus reply (0: not known)."""

    steps: tuple[int, ...]
    traffic_class: str = ""
    context_tokens: int = 0

    @property
    def verify_steps(self) -> int:
        return sum(self.steps)

    @property
    def accepted(self) -> int:
        return sum(j * n for j, n in enumerate(self.steps))

    @property
    def tokens(self) -> int:
        """Tokens the verify steps yielded: every accepted draft plus each step's own token."""
        return self.accepted + self.verify_steps

    @property
    def accept_len(self) -> float | None:
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else None


def from_trace(accepted: list[int], k: int, traffic_class: str = "", context_tokens: int = 0) -> RequestHistogram:
    """A request's histogram from its decoding trace (drafts accepted per verify step)."""
    steps = [0] * (k + 1)
    for n in accepted:
        if not 0 <= n <= k:
            raise ValueError(f"a verify step accepted {n} drafts at depth {k}")
        steps[n] += 1
    return RequestHistogram(tuple(steps), traffic_class, context_tokens)


@dataclass(frozen=True)
class Histograms:
    """Every request of one measurement at depth k, by a method of `shape` CHAIN or BLOCK."""

    k: int
    requests: tuple[RequestHistogram, ...]
    shape: str = CHAIN

    def __post_init__(self) -> None:
        for r in self.requests:
            if len(r.steps) != self.k + 1 or any(n < 0 for n in r.steps):
                raise ValueError(f"a request's histogram {list(r.steps)} is not k + 1 = {self.k + 1} counts >= 0")

    @property
    def total(self) -> tuple[int, ...]:
        """H(j): the requests' histograms summed."""
        return tuple(sum(r.steps[j] for r in self.requests) for j in range(self.k + 1))

    @property
    def pooled(self) -> RequestHistogram:
        """Every request's steps as one: what the pooled figures are read from."""
        return RequestHistogram(self.total)

    @property
    def verify_steps(self) -> int:
        return self.pooled.verify_steps

    @property
    def accepted(self) -> int:
        return self.pooled.accepted

    @property
    def accept_len(self) -> float:
        """Pooled per verify step: the number decode speed, break-even and the rule use."""
        return self.pooled.accept_len or 1.0

    @property
    def accept_len_per_request(self) -> float:
        """Each request's own accept_len, averaged without weights (requests with no verify step left out)."""
        return per_request_mean(self.per_prompt)

    @property
    def marginal(self) -> list[float]:
        """m_i = P(at least i + 1 drafts accepted in a step), i = 0..k-1."""
        return marginal_rates(self.total)

    @property
    def conditional(self) -> list[float]:
        """c_i = P(draft i accepted | drafts before it accepted) = m_i / m_(i-1) (0 where none reached it)."""
        return conditional_rates(self.marginal)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over drafted tokens (k per verify step)."""
        return self.accepted / (self.k * self.verify_steps) if self.verify_steps and self.k else 0.0

    @property
    def per_prompt(self) -> list[tuple[int, int]]:
        """(tokens, verify steps) per request: what the interval and the evidence's older figures use."""
        return [(r.tokens, r.verify_steps) for r in self.requests]

    def accept_len_by_k(self) -> dict[int, tuple[float, str]]:
        """accept_len at each depth up to k, with how it is known: 'measured', or 'extrapolated' from the
        marginals for a chain method. A block method gives only the depths it was measured at."""
        m = self.marginal
        out = {}
        for d in range(1, self.k + 1):
            measured = d == self.k
            if measured or self.shape == CHAIN:
                out[d] = (1.0 + sum(m[:d]), "measured" if measured else "extrapolated")
        return out

    def by_class(self) -> dict[str, Histograms]:
        names = dict.fromkeys(r.traffic_class for r in self.requests)
        return {n: Histograms(self.k, tuple(r for r in self.requests if r.traffic_class == n), self.shape)
                for n in names}  # fmt: skip

    def metrics(self) -> dict[str, float]:
        """The histogram's figures under the names every run logs them by."""
        out = {
            "accept_len": self.accept_len,
            "accept_len_per_request": self.accept_len_per_request,
            "acceptance_rate": self.acceptance_rate,
            "verify_steps": float(self.verify_steps),
        }
        out |= {f"marginal_pos_{i}": v for i, v in enumerate(self.marginal)}
        return out

    def rows(self) -> list[dict[str, Any]]:
        """One row per request (its class, prompt length, verify steps, both figures, h(0..k)): the run's table."""
        return [{"request": i, "class": r.traffic_class, "context_tokens": r.context_tokens,
                 "verify_steps": r.verify_steps, "accept_len": r.accept_len,
                 **{f"h{j}": n for j, n in enumerate(r.steps)}} for i, r in enumerate(self.requests)]  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "k": self.k,
            "shape": self.shape,
            "requests": [
                {"steps": list(r.steps), "class": r.traffic_class, "context_tokens": r.context_tokens}
                for r in self.requests
            ],  # fmt: skip
        }

    @classmethod
    def from_dict(cls, raw: Any) -> Histograms:
        """A stored histogram, every field checked (ValueError naming the field)."""
        if not isinstance(raw, dict):
            raise ValueError("the histogram is not an object")
        k = raw.get("k")
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 64:
            raise ValueError(f"'k' is {k!r}, not a depth from 1 to 64")
        if raw.get("shape", CHAIN) not in (CHAIN, BLOCK):
            raise ValueError(f"'shape' is {raw.get('shape')!r}, not {CHAIN} or {BLOCK}")
        items = raw.get("requests")
        if not isinstance(items, list):
            raise ValueError("'requests' is not a list")
        requests = []
        for i, item in enumerate(items):
            steps = item.get("steps") if isinstance(item, dict) else None
            if not isinstance(steps, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in steps):
                raise ValueError(f"requests[{i}].steps is not a list of counts")
            context = item.get("context_tokens", 0)
            if not isinstance(context, int) or isinstance(context, bool) or context < 0:
                raise ValueError(f"requests[{i}].context_tokens is {context!r}, not a count")
            requests.append(RequestHistogram(tuple(steps), str(item.get("class", "")), context))
        return cls(k, tuple(requests), raw.get("shape", CHAIN))


def marginal_rates(total: tuple[int, ...] | list[float]) -> list[float]:
    """m_i = P(j >= i + 1) from step counts H(0..k)."""
    steps = sum(total)
    if not steps:
        return [0.0] * (len(total) - 1)
    return [sum(total[i + 1 :]) / steps for i in range(len(total) - 1)]


def conditional_rates(marginal: list[float]) -> list[float]:
    out, before = [], 1.0
    for m in marginal:
        out.append(m / before if before > 0 else 0.0)
        before = m
    return out


def accept_len_from_marginals(marginal: list[float]) -> float:
    """1 + sum_i m_i: the pooled accept_len from marginal rates (the identity a profile's check tests)."""
    return 1.0 + sum(marginal)


def pooled_from_counts(steps: float, accepted_by_position: tuple[float, ...] | list[float]) -> float | None:
    """The pooled accept_len from counters: verify steps and accepted drafts at each position (the i-th count
    is the steps that accepted at least i + 1: the marginal counts an engine's /metrics exposes)."""
    return None if steps <= 0 else 1.0 + sum(accepted_by_position) / steps


def per_request_mean(per_prompt: list[tuple[int, int]]) -> float:
    """Each request's tokens over its verify steps, averaged without weights (requests with no step left out)."""
    own = [t / c for t, c in per_prompt if c > 0]
    return sum(own) / len(own) if own else 1.0


def mix_per_request(parts: list[tuple[float, list[tuple[int, int]]]]) -> float:
    """The per-request mean of a traffic mix: each class's, weighted by its share (as the pooled mix is)."""
    return sum(share * per_request_mean(per) for share, per in parts)


def ranking_flip(a: str, fa: tuple[float, float], b: str, fb: tuple[float, float]) -> str | None:
    """One sentence when the pooled and per-request means (each drafter's (pooled, per_request)) order two
    drafters oppositely; None when they agree. The verdict follows the pooled one, which decode speed follows."""
    pooled, per_request = fa[0] - fb[0], fa[1] - fb[1]
    if pooled * per_request >= 0:
        return None
    (first, f1), (second, f2) = ((a, fa), (b, fb)) if pooled > 0 else ((b, fb), (a, fa))
    return (f"{first} leads on the pooled accept_len ({f1[0]:.3f} against {f2[0]:.3f}) and {second} on the "
            f"per-request mean ({f2[1]:.3f} against {f1[1]:.3f}): decode speed follows the pooled one, so {first} "
            "ranks first")  # fmt: skip
