"""An evaluation as asked, and the same evaluation checked: every value read and held to the profile before
anything is loaded, so that bad input is one line naming the parameter and nothing is measured.

`Asked` holds the entry point's parameters in their own words (MLproject strings, `auto` and `none` for "not
given"), the way the run shows them; `check` turns them into a typed `Request`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from common.errors import BadInput
from common.prompt_files import file_digest, read_prompts
from common.values import MAX_CONCURRENCY, MAX_ROUNDS, integer, none_if_empty, number
from registry.ledger.deployment import trust_for
from registry.ledger.evidence import record as ev_record
from registry.ledger.signing import load_key
from registry.ledger.trust import EVALUATOR
from reports.workload import MeasuredClass
from serving.profile import BOUNDS, Profile, load_profile
from serving.workload import prompt_key


@dataclass(frozen=True)
class Asked:
    """The evaluate entry point's parameters as given (steps/evaluate.py declares them, with their defaults)."""

    model: str
    target: str
    dtype: str
    data: str
    prompts: str
    traffic_class: str
    profile: str
    draft_steps: str
    temperature: str
    max_new_tokens: str
    limit: str
    seed: str
    engine: str
    endpoint: str
    engine_python: str
    concurrency: str
    rounds: str
    reference: str
    agreement_tolerance: str
    agreement_prompts: str
    handed_aux_ids: str
    drafter_format: str
    progress: bool


class EngineSettings(NamedTuple):
    """A serving engine's settings, each checked (finite, in range)."""

    concurrency: int
    rounds: int
    tolerance: float  # engine vs in-process accept_len, relative
    agreement: float  # share of prompts whose engine and in-process cycles must be identical
    handed: list[int] | None  # aux ids handed as they are (None: translated)


@dataclass(frozen=True)
class Request:
    """An evaluation as asked, every argument checked: what to measure, on which prompts, under which
    profile, and on which engine."""

    asked: Asked
    profile: Profile  # as named: evidence is bound to it
    deployment: Profile  # at the measured depth: the operating points the depth sentences read
    binding: Profile  # the operating point with the highest break-even: the figures are projected on it
    k: int
    temperature: float
    max_new: int
    limit: int
    seed: int
    data: str | None
    classes: list[MeasuredClass]
    scope: str
    engine: str
    endpoint: str | None
    served: EngineSettings | None  # for a serving engine
    precision: str = "auto"  # the target's and the drafter's, in-process and served (resolved once it fits)

    @property
    def records(self) -> list[dict] | None:
        return [r for c in self.classes for r in c.records] or None

    @property
    def reference(self) -> bool:
        """The project's decoder runs too: as the engine, or as the reference a served figure must agree with."""
        return self.asked.reference == "in-process" or self.engine == "in-process"


def check(asked: Asked) -> Request:
    """The arguments checked against the profile: bad input before anything is loaded."""
    from drafter.model.target import check_precision  # torch: loaded once the cheap checks passed

    profile = load_profile(asked.profile)
    k = integer(asked.draft_steps, "draft_steps", 1, BOUNDS["draft_steps"]) if none_if_empty(asked.draft_steps) else (
        profile.draft_steps
    )  # fmt: skip
    temperature = (
        number(asked.temperature, "temperature", 0) if none_if_empty(asked.temperature) else profile.eval_temperature
    )
    max_new = (
        integer(asked.max_new_tokens, "max_new_tokens", 1)
        if none_if_empty(asked.max_new_tokens)
        else profile.eval_max_new_tokens
    )
    limit, seed = integer(asked.limit, "limit"), integer(asked.seed, "seed", 0, 2**32 - 1)
    deployment = profile.with_draft_steps(k)
    data = none_if_empty(asked.data)
    classes, scope = prompt_classes(asked, profile, limit)
    require_evaluator_key(profile)
    if not data and not classes:
        raise BadInput("give --prompts (online) and/or --data (offline)")
    engine, endpoint = asked.engine, none_if_empty(asked.endpoint)
    if endpoint and engine == "in-process":
        raise BadInput("--endpoint needs --engine vllm or --engine sglang")
    if not classes and engine != "in-process":
        raise BadInput(f"--engine {engine} measures on prompts: give --prompts")
    served = engine_settings(asked) if engine != "in-process" else None  # first: the reference takes minutes
    return Request(
        asked, profile, deployment, deployment.binding(), k, temperature, max_new, limit, seed, data, classes, scope,
        engine, endpoint, served, check_precision(asked.dtype),
    )  # fmt: skip


def require_evaluator_key(profile: Profile) -> None:
    """An evaluation signs evidence: a key no trust list names as an evaluator (a promoter's, say) is refused
    before anything is measured, since its record would count for nothing."""
    key, trust = load_key(), trust_for(profile)
    if trust.name(EVALUATOR, key.id) is None:
        raise BadInput(f"{key.origin}: signing key {key.id} is not a trusted evaluator ({trust.origin}): "
                       "its evidence would count for nothing")  # fmt: skip


def engine_settings(asked: Asked) -> EngineSettings:
    """The serving-engine settings, each checked (finite, in range)."""
    concurrency = integer(asked.concurrency, "concurrency", 1, MAX_CONCURRENCY)
    rounds = integer(asked.rounds, "rounds", 1, MAX_ROUNDS)
    tolerance = number(asked.agreement_tolerance, "agreement_tolerance", 0, 1, "a number in [0, 1)")
    if tolerance == 1:
        raise BadInput(f"--agreement_tolerance must be a number in [0, 1), got {asked.agreement_tolerance!r}")
    agreement = number(asked.agreement_prompts, "agreement_prompts", 0, 1, "a share in [0, 1]")
    handed = None
    if none_if_empty(asked.handed_aux_ids):
        try:
            handed = [int(x) for x in asked.handed_aux_ids.split(",")]
        except ValueError:
            raise BadInput(f"--handed_aux_ids must be comma-separated integers, got {asked.handed_aux_ids!r}") from None
    return EngineSettings(concurrency, rounds, tolerance, agreement, handed)


def prompt_classes(asked: Asked, profile: Profile, limit: int) -> tuple[list[MeasuredClass], str]:
    """(classes to decode, scope): the profile's pinned workload by default; one class of it with
    --class; a file of the user's with --prompts (measured, never evidence)."""
    chosen, name = none_if_empty(asked.prompts), none_if_empty(asked.traffic_class)
    if asked.prompts in ("none", ""):
        return [], "none"
    if chosen and name:
        raise BadInput("give --class (one of the profile's traffic classes) or --prompts (a file), not both")
    if chosen:
        path = Path(chosen)
        records = read_prompts(path, limit or None)
        repeats = len(records) - len({prompt_key(r) for r in records})
        if repeats:
            print(f"evaluate: warning: {path}: {repeats} prompts repeat; copies are not independent prompts")
        print(f"evaluate: {path.name} is not a prompt set {profile.name} pins: measured, but not evidence for it")
        return [MeasuredClass("prompts", 1.0, path, file_digest(path), records)], f"prompts:{path.name}"
    pinned = [profile.traffic_class(name)] if name else list(profile.workload)
    if not pinned:
        raise BadInput(
            f"profile {profile.name} pins no evaluation prompts (eval_prompts or workload); give --prompts FILE "
            "(measured, but never evidence for it)"
        )
    out = []
    for c in pinned:
        records = c.records()  # checks the file against its pinned digest
        if limit and limit < len(records):
            print(f"evaluate: warning: --limit {limit} decodes part of class {c.name}: not evidence for {profile.name}")
            records = records[:limit]
        out.append(MeasuredClass(c.name, 1.0 if name else c.share, c.prompts, c.sha256, records))
    return out, (f"class:{name}" if name else ev_record.WORKLOAD)
