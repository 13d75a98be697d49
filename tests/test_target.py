import json
from pathlib import Path

import pytest
import torch

from common.errors import BadInput
from drafter.model.target import load_target


def test_aux_capture_equals_output_hidden_states_at_id_plus_one(tiny_targets):
    flat, _ = tiny_targets
    target = load_target(flat)
    target.set_aux_layers([0, 1, 2])
    ids = torch.randint(3, 300, (1, 12))
    out = target.forward(ids)
    ref = target.model(ids, output_hidden_states=True)
    h = target.config.hidden_size
    for k, layer in enumerate([0, 1, 2]):
        assert torch.equal(out.aux_hidden[..., k * h : (k + 1) * h], ref.hidden_states[layer + 1])
    assert torch.equal(out.last_hidden, ref.hidden_states[-1])  # after the final norm
    assert torch.allclose(out.last_hidden @ target.lm_head_weight.T, out.logits, atol=1e-5)


def test_k25_wrapper_gives_the_same_states_as_the_flat_model(tiny_targets):
    flat, wrapped = tiny_targets
    a, b = load_target(flat), load_target(wrapped)
    assert b.config.weight_prefix == "language_model." and a.config.weight_prefix == ""
    for t in (a, b):
        t.set_aux_layers([0, 2, 3])
    ids = torch.randint(3, 300, (1, 16))
    oa, ob = a.forward(ids), b.forward(ids)
    assert torch.equal(oa.aux_hidden, ob.aux_hidden)
    assert torch.equal(oa.logits, ob.logits)
    assert b.tokenizer is not None


def test_kv_cache_incremental_and_crop(tiny_targets):
    target = load_target(tiny_targets[0])
    target.set_aux_layers([0, 1, 2])
    ids = torch.randint(3, 300, (1, 10))
    full = target.forward(ids)
    cache = target.new_cache()
    first = target.forward(ids[:, :6], past_key_values=cache)
    target.crop_cache(cache, 4)  # as after a rejection: keep 4 positions
    assert cache.get_seq_length() == 4
    rest = target.forward(ids[:, 4:], past_key_values=first.past_key_values)
    assert torch.allclose(rest.logits, full.logits[:, 4:], atol=1e-4)
    assert torch.allclose(rest.aux_hidden, full.aux_hidden[:, 4:], atol=1e-4)


def test_layer_ids_out_of_range(tiny_targets):
    target = load_target(tiny_targets[0])
    with pytest.raises(BadInput, match=r"aux layer ids \[4, 9\] out of range .* 4 layers"):
        target.set_aux_layers([1, 4, 9])


def test_wrapper_with_wrong_prefix_is_refused(tiny_targets, tmp_path):
    import shutil

    _, wrapped = tiny_targets
    bad = tmp_path / "bad"
    shutil.copytree(wrapped, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["text_config"]["num_hidden_layers"] = 5
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInput, match="do not fit the text model: missing"):
        load_target(bad)


def test_unknown_source_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(BadInput, match="not a local folder and not downloadable"):
        load_target("nobody/no-such-model")


def test_a_target_loads_at_its_own_precision_unless_told(tiny_targets, tmp_path):
    """The mini world's K2.5 is stored in bf16 (its vision tower's fp32 stub does not count): it loads in
    bf16, half the memory of fp32; a config's dtype names it outright; --dtype overrides."""
    from common.paths import MINIWORLD
    from drafter.model.target import target_precision

    assert target_precision(MINIWORLD / "k2.5-mini") == "bfloat16"
    assert target_precision(MINIWORLD / "k2-mini") == "bfloat16"  # its config says so
    flat, _ = tiny_targets
    assert target_precision(flat) == "bfloat16" and target_precision(flat, "float32") == "float32"
    assert next(load_target(MINIWORLD / "k2.5-mini", tokenizer=False).model.parameters()).dtype == torch.bfloat16
    assert next(load_target(flat, "float32", tokenizer=False).model.parameters()).dtype == torch.float32
    with pytest.raises(BadInput, match="--dtype must be auto or one of float32, bfloat16, float16, got 'fp8'"):
        target_precision(flat, "fp8")


class _Tie:
    """A target whose next-token logits put two tokens `gap` apart (what a bf16 near-tie looks like)."""

    def __init__(self, dtype, gap):
        self.model = torch.nn.Linear(1, 1).to(dtype)
        self.gap = gap

    def forward(self, ids):
        logits = torch.zeros(1, ids.shape[1], 8)
        logits[0, -1, 3], logits[0, -1, 5] = 10.0, 10.0 - self.gap
        return type("Out", (), {"logits": logits})()


def test_a_parting_at_a_bf16_near_tie_is_rounding_and_any_other_is_a_bug():
    """Greedy speculative decoding may leave the plain decode where two tokens' logits lie within a few
    rounding steps (a verify block rounds otherwise than one token at a time); that is said with its
    gap. A wider gap, a parting in float32, or one output merely stopping early, is a decoding bug."""
    from drafter.decode.evaluation import divergence_gap

    prompt, base, spec = torch.tensor([1, 2]), [7, 3, 4], [7, 5, 4]
    assert divergence_gap(_Tie(torch.bfloat16, 0.05), prompt, base, spec) == pytest.approx(0.05, rel=1e-4)
    assert divergence_gap(_Tie(torch.bfloat16, 0.4), prompt, base, spec) is None  # 10 x 2^-7 x 4 = 0.3125
    assert divergence_gap(_Tie(torch.float32, 1e-6), prompt, base, spec) is None
    assert divergence_gap(_Tie(torch.bfloat16, 0.05), prompt, base, base[:2]) is None


def test_near_ties_on_more_than_a_fifth_of_the_prompts_are_a_bug_not_rounding(monkeypatch):
    """Attack: a decoder that parts everywhere at small gaps is not rounding; past NEAR_TIE_SHARE of the
    prompts the in-process engine refuses to report a figure."""
    from common.errors import InternalError
    from drafter.decode.evaluation import OnlineResult
    from engines import inprocess
    from engines.protocol import Job

    def online(near_ties):
        return OnlineResult(2, [[1]] * 10, 10, 1.0, 10, 1.0, 0.5, 0.5, near_ties=near_ties, tie_gap=0.03)

    job = Job(Path("."), Path("."), [], 2, 8, 0.0, 0, False)
    monkeypatch.setattr(inprocess, "evaluate_online", lambda *a: online(2))
    bf16 = _Tie(torch.bfloat16, 0.0)
    bf16.model.dtype = torch.bfloat16  # as a transformers model says it
    assert inprocess.InProcess(bf16, None).measure(job).online.near_ties == 2
    monkeypatch.setattr(inprocess, "evaluate_online", lambda *a: online(3))
    with pytest.raises(InternalError, match="near-ties on 3 of 10 prompts"):
        inprocess.InProcess(bf16, None).measure(job)
