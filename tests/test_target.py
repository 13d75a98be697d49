import json

import pytest
import torch

from common.errors import BadInput
from drafter.target import load_target


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
