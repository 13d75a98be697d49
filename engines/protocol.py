"""The one interface every place that measures a drafter goes through, whichever engine decodes: the
project's own decoder in this process, a vLLM server or an SGLang server. `evaluate` (and anything else
that measures acceptance) reads the engine's name once (steps/evaluate.py: `serving_engine`) and never
branches on it again: each engine checks it can run before any decoding, measures a `Job`, and reports a
`Measurement` whose figures carry the same names whoever measured them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from serving.profile import Profile


@dataclass(frozen=True)
class Job:
    """What to measure: a drafter folder on a target, the prompt records (every traffic class, in order), and
    the decoding settings (draft depth, reply length, temperature, seed)."""

    folder: Path
    target: Path
    records: list[dict[str, Any]]
    k: int
    max_new_tokens: int
    temperature: float
    seed: int
    progress: bool = True


class Measurement(Protocol):
    """What an engine reports: per-prompt verify cycles (what accept_len and its interval are computed
    from), acceptance by position, the engine that measured it, and whether the project itself handed the
    engine the drafter's files (`attested`; False for a user's endpoint)."""

    engine: str
    engine_version: str
    aux: dict | None
    endpoint: str
    attested: bool
    display: str  # how a version page names the engine
    title_suffix: str  # what a figure's title adds to name the engine ("" for the project's own decoder)
    accepted: list[list[int]] | None  # drafts accepted per cycle, per prompt (None: only counters)
    histograms: list[tuple[int, ...]] | None  # per prompt, verify steps that accepted exactly j drafts (None: unknown)
    outputs: list[list[int]]  # the token ids decoded per prompt (what a lossless engine must reproduce)

    @property
    def per_prompt(self) -> list[tuple[int, int]]: ...

    @property
    def acc_pos(self) -> list[float]: ...

    @property
    def accept_len(self) -> float: ...

    def metrics(self, profile: Profile) -> dict[str, float]:
        """Every figure this measurement gives, projected onto the deployment `profile`; the names are the
        same whichever engine measured it (accept_len, accept_len_ci_low/high, projected_tps, ...)."""
        ...

    def artifacts(self) -> dict[str, Any]:
        """What the run should keep besides metrics: tags, JSON files and log paths."""
        ...

    def warnings(self, profile: Profile) -> list[str]:
        """What a user should know about the measurement itself (prompts cut, a stale host profile)."""
        ...


class Engine(Protocol):
    name: str

    def check_reachable(self) -> None:
        """Bad input before any decoding (the in-process reference takes minutes) when the engine cannot
        run: no interpreter with the engine installed, or an endpoint that is not a speculative server."""
        ...

    def measure(self, job: Job, reference: Measurement | None = None) -> Measurement:
        """Decode the job's prompts with and without the drafter. `reference`: the project's own decoding of
        the same job, which a served measurement must agree with."""
        ...
