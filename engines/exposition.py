"""What a serving engine's /metrics says about speculation, read from Prometheus' exposition format.

Both engines the project serves on export cumulative counters: vLLM `vllm:spec_decode_num_drafts`,
`..._num_draft_tokens`, `..._num_accepted_tokens` and `..._num_accepted_tokens_per_pos{position}`, and
`vllm:num_requests_running` for the load; SGLang the same counters under `sglang:` in its newer releases,
and in older ones only `sglang:spec_accept_length`, the mean tokens per verify cycle since the server
started, beside the `sglang:generation_tokens_total` counter (generated tokens / that mean = verify
cycles, so differences between two reads still give an interval's figure). The text is parsed by
prometheus_client's own parser; samples are summed over their labels (engines, data-parallel ranks) and
the model names they carry are kept; given the names the server answers to, samples labelled for another
model are left out (they are not this server's).

A reading is checked before it counts (`implausible`): counts since the server started, and the differences
between two reads, obey what speculation can produce (finite, non-negative, accepted at most drafts x depth,
each position accepting no more than the one before, draft tokens between one and `depth` per draft). An
exporter glitch (-1, a jump of 1e15, NaN, +Inf) fails one of these and is left out, never read as a drop.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, replace

from prometheus_client.parser import text_string_to_metric_families

from serving.drift import Counts

ENGINES = ("vllm", "sglang")
DRAFTS, DRAFT_TOKENS = "spec_decode_num_drafts", "spec_decode_num_draft_tokens"
ACCEPTED = "spec_decode_num_accepted_tokens"
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
RUNNING = {"vllm": "num_requests_running", "sglang": "num_running_reqs"}
MEAN_ACCEPT_LEN, GENERATED = "spec_accept_length", "generation_tokens"


class NotExposition(ValueError):
    """The text is not Prometheus' exposition format, or names no engine the project reads."""


@dataclass(frozen=True)
class Scrape:
    """One read of an engine's counters (cumulative since the server started) and its load."""

    engine: str  # vllm or sglang
    drafts: float | None  # verify cycles that carried drafts
    draft_tokens: float | None
    accepted: float | None  # accepted draft tokens
    per_pos: tuple[float, ...]  # accepted draft tokens at each draft position
    running: float | None  # requests in flight (a gauge)
    models: tuple[str, ...]  # the model_name labels the samples carry
    generated: float | None = None  # SGLang without counters: generated tokens ...
    mean_accept_len: float | None = None  # ... and the mean tokens per verify cycle since start

    @property
    def cycles(self) -> float | None:
        """Verify cycles so far: the drafts counter, or (older SGLang) generated tokens / mean accept_len."""
        if self.drafts is not None:
            return self.drafts
        if self.generated is not None and self.mean_accept_len:
            return self.generated / self.mean_accept_len
        return None

    def missing(self, depth: int = 0) -> list[str]:
        """What a watch needs and this read lacks; given the served depth, per-position counts for each of its
        positions (vLLM always exports them; SGLang where it counts by position)."""
        out = []
        if self.cycles is None:
            out.append(f"{self.engine}:{DRAFTS}")
        if self.drafts is not None and self.accepted is None and not self.per_pos:
            out.append(f"{self.engine}:{ACCEPTED}")
        if self.running is None:
            out.append(f"{self.engine}:{RUNNING[self.engine]}")
        if depth and (self.per_pos or self.engine == "vllm") and len(self.per_pos) != depth:
            out.append(f"{self.engine}:{PER_POS} for {depth} positions (it counts {len(self.per_pos)})")
        return out


def families(text: str) -> list:
    """The metric families of an exposition text, by prometheus_client's parser; NotExposition when it is not one."""
    try:
        return list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise NotExposition(f"not Prometheus' exposition format ({str(exc)[:80]})") from None


def engine_of(parsed: list) -> str:
    """The serving engine whose metrics these are (the first family named for one)."""
    for family in parsed:
        prefix, _, base = family.name.partition(":")
        if prefix in ENGINES and base:
            return prefix
    raise NotExposition("no vllm: or sglang: metrics: not a serving engine's metrics endpoint")


def parse(text: str | list, served: Collection[str] | None = None) -> Scrape:
    """The speculative counters and the load in an exposition text (or its families, parsed once by `families`);
    NotExposition when it is not one. With `served` (the names the server answers to), a sample labelled for
    any other model is left out."""
    parsed = families(text) if isinstance(text, str) else text
    engine = engine_of(parsed)
    totals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    seen: set[tuple[str, tuple]] = set()  # a sample given twice is no exposition (a proxy that doubles lines)
    models: set[str] = set()
    for family in parsed:
        prefix, _, base = family.name.partition(":")
        if prefix != engine or not base:
            continue
        if family.type == "unknown":  # a counter written without its TYPE line keeps its _total suffix
            base = base.removesuffix("_total")
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket", "_sum", "_count")) and family.type != "gauge":
                continue
            key = (sample.name, tuple(sorted(sample.labels.items())))
            if key in seen:
                raise NotExposition(f"{sample.name} is given twice for the same labels")
            seen.add(key)
            model = sample.labels.get("model_name")
            if served is not None and model is not None and model not in served:
                continue  # counted for a model this server does not answer to: not its traffic
            if model is not None:
                models.add(model)
            if base == PER_POS:
                label = sample.labels.get("position", "0")
                if not (label.isascii() and label.isdigit()):
                    raise NotExposition(f"{family.name} has position {label[:20]!r}, not a whole number")
                pos = int(label)
                per_pos[pos] = per_pos.get(pos, 0.0) + float(sample.value)
            else:
                totals[base] = totals.get(base, 0.0) + float(sample.value)
    positions = tuple(per_pos[i] for i in range(len(per_pos))) if set(per_pos) == set(range(len(per_pos))) else ()
    accepted = totals.get(ACCEPTED, sum(positions) if positions else None)
    return Scrape(
        engine=engine,
        drafts=totals.get(DRAFTS),
        draft_tokens=totals.get(DRAFT_TOKENS),
        accepted=accepted,
        per_pos=positions,
        running=totals.get(RUNNING[engine]),
        models=tuple(sorted(models)),
        generated=totals.get(GENERATED),
        mean_accept_len=totals.get(MEAN_ACCEPT_LEN),
    )


def interval_counts(before: Scrape, now: Scrape, depth: int) -> Counts | None:
    """The counts between two reads of one server (serving/drift.Counts); None when a counter went back
    (the server restarted and its counters began again: no interval to speak of)."""
    pairs = [(before.cycles, now.cycles), (before.accepted, now.accepted)]
    pairs += list(zip(before.per_pos, now.per_pos, strict=False))
    if any(a is not None and b is not None and b < a for a, b in pairs) or len(now.per_pos) < len(before.per_pos):
        return None
    if before.cycles is None or now.cycles is None:
        return None
    per_pos = tuple(b - a for a, b in zip(before.per_pos, now.per_pos, strict=False))
    if len(now.per_pos) > len(before.per_pos):  # a position first counted in this interval
        per_pos = tuple(now.per_pos[i] - (before.per_pos[i] if i < len(before.per_pos) else 0.0)
                        for i in range(len(now.per_pos)))  # fmt: skip
    accepted = None if before.accepted is None or now.accepted is None else now.accepted - before.accepted
    if before.drafts is None:  # SGLang's mean: tokens generated minus one per verify cycle were accepted drafts
        gained = (now.generated or 0.0) - (before.generated or 0.0)
        accepted = gained - (now.cycles - before.cycles)
    return Counts(drafts=now.cycles - before.cycles, per_pos=per_pos, accepted=accepted, depth=depth)


def difference(before: Scrape, now: Scrape) -> Scrape:
    """What happened between two reads of one server, field by field (None where either read lacks it)."""

    def minus(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else b - a

    width = min(len(before.per_pos), len(now.per_pos))
    return replace(
        now,
        drafts=minus(before.drafts, now.drafts),
        draft_tokens=minus(before.draft_tokens, now.draft_tokens),
        accepted=minus(before.accepted, now.accepted),
        per_pos=tuple(now.per_pos[i] - before.per_pos[i] for i in range(width)),
        generated=minus(before.generated, now.generated),
    )


def implausible(s: Scrape, depth: int) -> str | None:
    """Why these counts (since the server started, or between two reads) cannot come from speculation at
    `depth` draft tokens per cycle; None when they can. Each reason is a fixed phrase (findings are said
    once per phrase), the figures go in the finding's line."""
    values = [s.drafts, s.draft_tokens, s.accepted, *s.per_pos, s.running, s.generated, s.mean_accept_len]
    if any(v is not None and not math.isfinite(v) for v in values):
        return "a count that is not a finite number"
    if any(v is not None and v < 0 for v in values):
        return "a negative count"
    if any(b > a for a, b in zip(s.per_pos, s.per_pos[1:], strict=False)):
        return "a position accepting more drafts than the one before it"
    drafts = s.drafts
    if drafts is None:
        return None  # SGLang's mean: nothing more to hold it to
    accepted = s.accepted if s.accepted is not None else float(sum(s.per_pos))
    if s.per_pos and s.per_pos[0] > drafts:
        return "more drafts accepted at the first position than drafts"
    if depth and accepted > drafts * depth:
        return f"more accepted draft tokens than drafts x {depth}"
    if s.accepted is not None and s.per_pos and abs(s.accepted - sum(s.per_pos)) > 0.5:
        return "accepted tokens that differ from the sum over positions"
    if s.draft_tokens is not None and not drafts <= s.draft_tokens <= drafts * max(depth, 1):
        return f"draft tokens outside one to {depth} per draft"
    return None


def implausible_interval(c: Counts, depth: int) -> str | None:
    """Why an interval's counts (`interval_counts`) cannot be speculation's at `depth`, by `implausible`'s rules:
    SGLang's older mean gives accepted drafts by difference, which a glitched mean turns negative or past the
    drafts, and which the counters' differences alone do not show."""
    return implausible(Scrape("", c.drafts, None, c.accepted_total, c.per_pos, None, ()), depth)
