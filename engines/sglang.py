"""SGLang as the serving engine (the seed team's): the same measurement through SGLang's own API.

SGLang cannot run on a CPU-only machine, so this path is built from SGLang's documented interface and
everything around the server is tested here (command, request, per-request accounting); the server
itself runs where there is a GPU. Launch: `python -m sglang.launch_server --speculative-algorithm
EAGLE3 --speculative-draft-model-path D --speculative-num-steps k --speculative-eagle-topk 1
--speculative-num-draft-tokens k+1`. Each `/generate` response's `meta_info` carries
`completion_tokens` and `spec_verify_ct` (verify passes). The prefill's first token is no verify
cycle's, so per request tokens = completion_tokens - 1 over cycles = spec_verify_ct, as in-process and
vLLM count it (SGLang's own `completion_tokens / spec_verify_ct` counts that token too). SGLang reads
aux layer ids as the project does (output of layer i): the ids are handed as they are.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from common.errors import InternalError
from engines.measurement import EngineRun, Launch
from engines.server import on_loopback
from engines.vllm import Settings


def server_command(python: Path, model: Path, port: int, s: Settings, drafter: Path | None,
                   method: str | None = None) -> list[str]:  # fmt: skip
    """The server's command. `method`: the draft method (drafter/methods NAME) when the drafter folder is not
    (yet) where it will be served from; else read from the folder."""
    cmd = [
        str(python), "-m", "sglang.launch_server", "--model-path", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", s.dtype,
        "--context-length", str(s.max_model_len), "--random-seed", str(s.seed),
    ]  # fmt: skip
    if drafter is not None:
        cmd += speculative_flags(drafter, s.k, method)
    return cmd


def speculative_flags(drafter: Path, k: int, method: str | None = None) -> list[str]:
    """SGLang's flags for the drafter's method at k drafts a cycle: a chain (EAGLE3) drafts k steps of top-1; a
    block (DFLASH) drafts its k in one pass, so only the verify width, k + 1 with the bonus token, is said."""
    from drafter.methods import method_for, sglang_algorithm

    m = method_for(drafter, method)
    flags = ["--speculative-algorithm", sglang_algorithm(m), "--speculative-draft-model-path", str(drafter)]
    if m.SHAPE == "chain":
        flags += ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1"]
    return flags + ["--speculative-num-draft-tokens", str(k + 1)]


def request_body(prompt: list[int], s: Settings, seed: int) -> dict:
    sampling = {"max_new_tokens": s.max_new_tokens, "temperature": s.temperature, "sampling_seed": seed}
    if s.stop_token_id is not None:
        sampling.update(stop_token_ids=[s.stop_token_id], ignore_eos=True)
    return {"input_ids": prompt, "sampling_params": sampling, "stream": False}


def cycles_of(response: dict) -> tuple[list[int], tuple[int, int]]:
    """(output ids, (tokens from verify cycles, verify cycles)) of one /generate response."""
    meta = response.get("meta_info") or {}
    if "spec_verify_ct" not in meta or "completion_tokens" not in meta:
        raise InternalError("SGLang response has no spec_verify_ct/completion_tokens: is speculation on?")
    verify = int(meta["spec_verify_ct"])
    return list(response.get("output_ids") or []), (max(0, int(meta["completion_tokens"]) - 1), verify)


def generate(base_url: str, prompt: list[int], s: Settings, seed: int) -> tuple[dict, float]:
    body = json.dumps(request_body(prompt, s, seed)).encode()
    req = urllib.request.Request(f"{base_url}/generate", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as r:
        out = json.loads(r.read())
    return out, time.perf_counter() - t0


def sequential(base_url: str, prompts: list[list[int]], s: Settings, spec: bool, progress: Callable | None):
    outputs, per_prompt, tokens, seconds = [], [], 0, 0.0
    for i, prompt in enumerate(prompts):
        out, took = generate(base_url, prompt, s, s.seed + i)
        ids, cyc = cycles_of(out) if spec else (list(out.get("output_ids") or []), (0, 0))
        outputs.append(ids)
        per_prompt.append(cyc)
        tokens, seconds = tokens + len(ids), seconds + took
        if progress:
            progress()
    return outputs, per_prompt, tokens / max(seconds, 1e-9)  # includes the prefill: no streaming here


def measure(
    launch: Launch,
    prompts: list[list[int]],
    s: Settings,
    progress: bool = True,  # noqa: ARG001  (no per-prompt bar: SGLang requests are not streamed)
    check: Callable[[EngineRun], None] | None = None,
) -> EngineRun:
    """As engines.vllm.measure: the speculative server first (`check` sees its half), then the plain one."""
    runs, starts, logs = {}, {}, []
    env = dict(os.environ)
    for name, draft in (("spec", launch.drafter), ("baseline", None))[: 2 if s.baseline else 1]:
        log = launch.workdir / f"sglang-{name}.log"
        logs.append(str(log))
        with on_loopback(
            f"SGLang ({launch.version}, {name})",
            lambda port, draft=draft: server_command(launch.python, launch.target, port, s, draft),
            env,
            log,
            s.start_timeout_s,
        ) as server:
            starts[name] = server.start_seconds
            runs[name] = sequential(server.url, prompts, s, draft is not None, None)
        if draft is not None and check is not None:
            check(_run(launch, s, runs[name], None, starts, logs))
    return _run(launch, s, runs["spec"], runs.get("baseline"), starts, logs)


def _run(launch: Launch, s: Settings, spec, base, starts, logs) -> EngineRun:
    return EngineRun(
        engine="sglang",
        engine_version=launch.version,
        k=s.k,
        per_prompt=spec[1],
        accepted_at=[],
        outputs_spec=spec[0],
        outputs_base=base[0] if base else None,
        tps_baseline=base[2] if base else None,
        tps_spec=spec[2],
        start_seconds=dict(starts),
        aux=launch.aux,
        logs=list(logs),
    )
