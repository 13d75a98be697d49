"""A deployment's traffic: classes of prompts with their shares, pinned by digest.

A profile declares the prompts its evidence must be measured on, either one pinned set
(`eval_prompts` + `eval_prompts_sha256`) or a workload of traffic classes (name, prompts file, sha256,
share). Only an evaluation on exactly those prompts speaks for the deployment: a prompt file the
evaluator chose (easy prompts, copies of one, the training set) speaks for nothing. The mix is the
share-weighted figure over classes; its interval comes from resampling prompts within each class.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import BadInput

CLASS_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
SINGLE = "all"  # the one class of a profile that pins a single evaluation set


@dataclass(frozen=True)
class TrafficClass:
    name: str
    prompts: Path  # resolved against the profile's folder
    sha256: str
    share: float

    def identity(self) -> dict[str, Any]:
        """What evidence binds (the file's location may differ between machines; its digest may not)."""
        return {"name": self.name, "sha256": self.sha256, "share": self.share}

    def records(self) -> list[dict[str, Any]]:
        """The pinned prompts, after checking the file is the one pinned."""
        from common.prompt_files import file_digest, read_prompts

        if not self.prompts.is_file():
            raise BadInput(f"{self.prompts}: prompts file of traffic class '{self.name}' not found")
        actual = file_digest(self.prompts)
        if actual != self.sha256:
            raise BadInput(
                f"{self.prompts}: sha256 {actual[:16]}... does not match the pinned {self.sha256[:16]}... "
                f"(traffic class '{self.name}')"
            )
        records = read_prompts(self.prompts)
        keys = [prompt_key(r) for r in records]
        if len(set(keys)) != len(keys):
            raise BadInput(
                f"{self.prompts}: {len(keys) - len(set(keys))} prompts repeat (traffic class '{self.name}'); "
                "a copy of a prompt is not another prompt"
            )
        return records

    def keys(self) -> list[str]:
        return [prompt_key(r) for r in self.records()]


def parse_workload(raw: dict[str, Any], where: Path) -> tuple[TrafficClass, ...]:
    """The profile's pinned prompts as classes; () when it pins none. Every field is checked."""
    base = where.parent
    if "workload" in raw and "eval_prompts" in raw:
        raise BadInput(f"{where}: give either 'workload' or 'eval_prompts', not both")
    if "eval_prompts" in raw:
        sha = raw.get("eval_prompts_sha256")
        return (_class({"name": SINGLE, "prompts": raw["eval_prompts"], "sha256": sha, "share": 1}, base, where),)
    if "eval_prompts_sha256" in raw:
        raise BadInput(f"{where}: 'eval_prompts_sha256' without 'eval_prompts'")
    if "workload" not in raw:
        return ()
    items = raw["workload"]
    if not isinstance(items, list) or not items:
        raise BadInput(f"{where}: 'workload' must be a non-empty list of traffic classes")
    classes = tuple(_class(item, base, where) for item in items)
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise BadInput(f"{where}: workload class names repeat ({', '.join(names)})")
    total = sum(c.share for c in classes)
    if abs(total - 1.0) > 1e-6:
        raise BadInput(f"{where}: workload shares sum to {total:g}, not 1")
    # normalised, so that the mix of classes that each accept nothing is 1.000, never a rounding above it
    return tuple(replace(c, share=c.share / total) for c in classes)


def _class(item: Any, base: Path, where: Path) -> TrafficClass:
    if not isinstance(item, dict):
        raise BadInput(f"{where}: a workload class must be a mapping (name, prompts, sha256, share)")
    unknown = sorted(set(item) - {"name", "prompts", "sha256", "share", "description"})
    if unknown:
        raise BadInput(f"{where}: unknown workload field(s) {', '.join(unknown)}")
    name = item.get("name")
    if not isinstance(name, str) or not CLASS_NAME.fullmatch(name):
        raise BadInput(f"{where}: workload class name {name!r} must match {CLASS_NAME.pattern}")
    prompts, sha, share = item.get("prompts"), item.get("sha256"), item.get("share")
    if not isinstance(prompts, str) or not prompts:
        raise BadInput(f"{where}: class '{name}' needs 'prompts' (a path relative to the profile)")
    if not isinstance(sha, str) or not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise BadInput(f"{where}: class '{name}' needs 'sha256' (64 hex digits) of its prompts file")
    if isinstance(share, bool) or not isinstance(share, int | float) or not math.isfinite(share) or not 0 < share <= 1:
        raise BadInput(f"{where}: class '{name}' share must be a number in (0, 1], got {share!r}")
    return TrafficClass(name, (base / prompts).resolve(), sha, float(share))


def prompt_key(record: dict[str, Any]) -> str:
    """A prompt's identity as it is sent: a conversation up to its last user turn (the recorded reply is
    dropped, as evaluation drops it), or the text. A training conversation built on the same prompt has
    the same key, which is what contamination is checked by."""
    if "messages" in record:
        msgs = list(record["messages"])
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        body: Any = [[m["role"], m["content"]] for m in msgs]
    else:
        body = record["text"]
    return hashlib.sha256(json.dumps(body, ensure_ascii=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------------- figures
def pooled(per_prompt: list[tuple[int, int]]) -> float:
    """Tokens over cycles, pooled across prompts (as serving engines count accept_len)."""
    return sum(t for t, _ in per_prompt) / max(1, sum(c for _, c in per_prompt))


def mix_accept_len(parts: list[tuple[float, list[tuple[int, int]]]]) -> float:
    """Share-weighted accept_len of (share, per-prompt counts) classes: projected tok/s is linear in
    accept_len at one cycle cost, so this is the mix's projected tok/s over 1000 / cycle_ms. Summed as the excess
    over one token a cycle, so a mix of classes that accept nothing is exactly 1, whatever the shares round to."""
    return 1.0 + sum(share * (pooled(per) - 1.0) for share, per in parts)


def mix_ci(
    parts: list[tuple[float, list[tuple[int, int]]]], iters: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float]:
    """Interval of the mix from resampling prompts within each class (stratified: every resample keeps
    each class's share and prompt count). The bootstrap's spread, corrected for small classes
    (sqrt(n / (n - 1))), times Student's t with (smallest class - 1) degrees of freedom: a plain percentile
    interval covers a known mix only ~92-93% of the time at 24 prompts a class (tests/test_workload.py
    simulates it), this one 94-96% from 12 to 40."""
    from scipy.stats import t as student

    rng = np.random.default_rng(seed)
    total, center, smallest = np.zeros(iters), 0.0, None  # the excess over 1 token a cycle, as mix_accept_len
    for share, per in parts:
        arr = np.asarray([p for p in per if p[1]], dtype=np.float64).reshape(-1, 2)
        n = len(arr)
        if n == 0:  # no cycles: read as 1 token a cycle, no excess
            continue
        value = arr[:, 0].sum() / arr[:, 1].sum()
        center += share * (value - 1.0)
        if n == 1:
            total += share * (value - 1.0)
            continue
        pick = rng.integers(0, n, size=(iters, n))
        spread = math.sqrt(n / (n - 1)) * (arr[pick, 0].sum(1) / arr[pick, 1].sum(1) - value)
        total += share * (value - 1.0 + spread)
        smallest = n if smallest is None else min(smallest, n)
    if smallest is None:
        return 1.0 + center, 1.0 + center
    half = float(student.ppf(0.5 + level / 2, smallest - 1)) * float(total.std(ddof=1))
    return 1.0 + center - half, 1.0 + center + half


@dataclass(frozen=True)
class ClassFigure:
    """One traffic class's measured acceptance and what it projects to on a deployment."""

    name: str
    share: float
    prompts: int
    accept_len: float
    ci_low: float
    ci_high: float
    speedup: float  # projected tok/s over plain decoding at the deployment's cycle cost

    @classmethod
    def of(cls, name: str, share: float, per: list[tuple[int, int]], break_even: float) -> ClassFigure:
        lo, hi = mix_ci([(1.0, per)])
        L = pooled(per)
        return cls(name, share, len(per), L, lo, hi, L / break_even)


def class_figures(
    parts: list[tuple[str, float, list[tuple[int, int]]]], break_even: float
) -> tuple[list[ClassFigure], ClassFigure]:
    """Every class's figure and the mix's (named 'mix', share 1)."""
    figures = [ClassFigure.of(name, share, per, break_even) for name, share, per in parts]
    shares = [(share, per) for _, share, per in parts]
    L = mix_accept_len(shares)
    lo, hi = mix_ci(shares)
    n = sum(len(per) for _, _, per in parts)
    return figures, ClassFigure("mix", 1.0, n, L, lo, hi, L / break_even)


def acceptance_by_position(accepted: list[list[int]], k: int) -> list[float]:
    """Conditional acceptance at draft position i: P(accepted > i | accepted >= i), over every cycle of
    every prompt given (drafts accepted per cycle, per prompt)."""
    flat = [n for a in accepted for n in a]
    out = []
    for i in range(k):
        reached = sum(1 for n in flat if n >= i)
        out.append(sum(1 for n in flat if n > i) / reached if reached else 0.0)
    return out


# ------------------------------------------------------------------------------- context length
CONTEXT_EDGES = (512, 2048, 8192)  # tokens of prompt plus reply: <512, 512-2k, 2k-8k, >=8k


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def context_buckets(edges: tuple[int, ...] = CONTEXT_EDGES) -> list[str]:
    """The buckets' names, as metric names and profiles spell them: lt512, 512-2k, 2k-8k, ge8k."""
    inner = [f"{_tokens(a)}-{_tokens(b)}" for a, b in zip(edges, edges[1:], strict=False)]
    return [f"lt{_tokens(edges[0])}", *inner, f"ge{_tokens(edges[-1])}"]


def context_bucket(tokens: int, edges: tuple[int, ...] = CONTEXT_EDGES) -> str:
    """The bucket of a conversation of `tokens` tokens (its prompt plus the reply decoded)."""
    names = context_buckets(edges)
    return names[sum(tokens >= e for e in edges)]


def context_figures(per_prompt: list[tuple[int, int]], contexts: list[int], break_even: float) -> list[ClassFigure]:
    """accept_len per context bucket, pooled over the prompts whose conversation falls in it (every
    class together: acceptance falls with length whatever the traffic); `share` is the bucket's share of
    the prompts. Buckets no prompt reaches are left out."""
    if len(contexts) != len(per_prompt):
        raise ValueError(f"{len(contexts)} context lengths for {len(per_prompt)} prompts")
    groups: dict[str, list[tuple[int, int]]] = {}
    for counts, n in zip(per_prompt, contexts, strict=True):
        groups.setdefault(context_bucket(n), []).append(counts)
    total = max(1, len(per_prompt))
    return [
        ClassFigure.of(name, len(groups[name]) / total, groups[name], break_even)
        for name in context_buckets()
        if name in groups
    ]


def bootstrap_ci(per_prompt: list[tuple[int, int]], iters: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the pooled accept_len, resampling prompts (cycles within a prompt are not
    independent): the traffic mix's interval with one class, so every figure uses one method."""
    return mix_ci([(1.0, per_prompt)], iters, seed)
