import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from bench._common import bytes_read
from common.errors import BadInput
from drafter.formats.checkpoint import (
    EMBED,
    INDEX_FILE,
    export_drafter,
    load_drafter,
    read_header,
    save_drafter,
)
from drafter.model.config import DrafterConfig
from tests.helpers.drafters import FAMILIES, k2_drafter_tensors, tiny_config, tiny_drafter


def assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("shard", [None, 20_000])
def test_round_trip_identical_tensors_and_config(tmp_path, shard):
    model = tiny_drafter().to(torch.bfloat16)
    save_drafter(model, tmp_path / "d", max_shard_bytes=shard)
    if shard:
        assert (tmp_path / "d" / INDEX_FILE).is_file()
        assert len({i.file for i in read_header(tmp_path / "d").values()}) > 1
    loaded = load_drafter(tmp_path / "d", dtype=torch.bfloat16)
    assert_same_state(model, loaded)
    assert loaded.config == model.config
    assert loaded.has_embedding


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_every_family_round_trips_with_the_engines_names(tmp_path, family):
    """An MLA layer and the EAGLE-3.1 norms are saved under the names vLLM's loaders read (drafter/model/mla.py),
    with the config keys that say which layer it is, and load back identical."""
    model = tiny_drafter(**FAMILIES[family]).to(torch.bfloat16)
    save_drafter(model, tmp_path / "d")
    names = set(read_header(tmp_path / "d"))
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    if model.config.mla is not None:
        assert raw["architectures"] == ["Eagle3DeepseekV3ForCausalLM"] and raw["model_type"] == "kimi_k2"
        assert {"midlayer.self_attn.kv_a_proj_with_mqa.weight", "midlayer.self_attn.kv_b_proj.weight"} <= names
        assert "midlayer.self_attn.k_proj.weight" not in names and "head_dim" not in raw
    if model.config.fc_norm:
        assert {"fc_norm.0.weight", "fc_norm.2.weight", "input_norm.weight"} <= names
        assert raw["fc_norm"] is raw["norm_output"] is raw["norm_before_residual"] is True
    loaded = load_drafter(tmp_path / "d", dtype=torch.bfloat16)
    assert_same_state(model, loaded)
    assert loaded.config.to_dict() == model.config.to_dict() and loaded.config.rope == model.config.rope


def test_checkpoint_with_aq_medai_key_names_loads_and_runs(tmp_path):
    """Written by hand with the released file's exact names (no embed_tokens), not by our saver."""
    cfg = tiny_config()
    h, i, q, kv = 32, 64, 32, 16
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[::2] = True
    d2t = torch.arange(0, 96, 2) - torch.arange(48)
    tensors = {
        "fc.weight": r(h, 3 * h),
        "midlayer.hidden_norm.weight": r(h) + 1,
        "midlayer.input_layernorm.weight": r(h) + 1,
        "midlayer.post_attention_layernorm.weight": r(h) + 1,
        "midlayer.self_attn.q_proj.weight": r(q, 2 * h),
        "midlayer.self_attn.k_proj.weight": r(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": r(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": r(h, q),
        "midlayer.mlp.gate_proj.weight": r(i, h),
        "midlayer.mlp.up_proj.weight": r(i, h),
        "midlayer.mlp.down_proj.weight": r(h, i),
        "norm.weight": r(h) + 1,
        "lm_head.weight": r(48, h),
        "d2t": d2t,
        "t2d": t2d,
    }
    folder = tmp_path / "aq"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    cfg.save(folder)
    embedding = torch.randn(96, 32, generator=g)
    model = load_drafter(folder, embedding=embedding)
    assert torch.equal(model.fc.weight, tensors["fc.weight"].float())
    logits = model(torch.randint(0, 96, (2, 7)), torch.randn(2, 7, 96), ttt_length=3)
    assert len(logits) == 3 and logits[0].shape == (2, 7, 48) and torch.isfinite(logits[2]).all()
    # without an embedding the drafter loads but says it has none
    assert load_drafter(folder).has_embedding is False


def test_strict_load_names_every_offender(tmp_path):
    model = tiny_drafter()
    save_drafter(model, tmp_path / "d")
    path = tmp_path / "d" / "model.safetensors"
    state = {k: v for k, v in load_drafter(tmp_path / "d").state_dict().items()}
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()}
    del state["norm.weight"], state["midlayer.mlp.up_proj.weight"]
    state["midlayer.extra.weight"] = torch.zeros(3, dtype=torch.bfloat16)
    state["fc.weight"] = torch.zeros(32, 95, dtype=torch.bfloat16)
    state["lm_head.weight"] = state["lm_head.weight"].float()
    save_file(state, str(path))
    with pytest.raises(BadInput) as err:
        load_drafter(tmp_path / "d")
    msg = str(err.value)
    for needle in (
        "midlayer.mlp.up_proj.weight",
        "norm.weight",
        "midlayer.extra.weight",
        "fc.weight: shape [32, 95]",
        "lm_head.weight: dtype F32",
    ):
        assert needle in msg


def test_nan_weights_are_reported(tmp_path):
    model = tiny_drafter()
    with torch.no_grad():
        model.midlayer.mlp.down_proj.weight[3, 4] = float("nan")
    save_drafter(model, tmp_path / "d")
    with pytest.raises(BadInput, match=r"'midlayer.mlp.down_proj.weight' has 1 NaN/Inf"):
        load_drafter(tmp_path / "d")


def test_inconsistent_vocab_maps_are_refused(tmp_path):
    model = tiny_drafter()
    model.d2t[5] += 1
    save_drafter(model, tmp_path / "d")
    with pytest.raises(BadInput, match="d2t and t2d disagree at draft id 5"):
        load_drafter(tmp_path / "d")


def test_export_drops_embedding_and_keeps_the_rest(tmp_path):
    model = tiny_drafter()
    save_drafter(model, tmp_path / "d", max_shard_bytes=10_000)
    export_drafter(tmp_path / "d", tmp_path / "serve")
    src, out = read_header(tmp_path / "d"), read_header(tmp_path / "serve")
    assert EMBED in src and EMBED not in out
    assert {k: (v.dtype, v.shape) for k, v in src.items() if k != EMBED} == {
        k: (v.dtype, v.shape) for k, v in out.items()
    }
    original = load_drafter(tmp_path / "d")
    served = load_drafter(tmp_path / "serve", embedding=original.embed_tokens.weight.detach())
    assert_same_state(served, original)


def test_header_read_of_real_k2_shapes_reads_no_data(k2_sparse_drafter):
    size = (k2_sparse_drafter / "model.safetensors").stat().st_size
    assert size > 2_000_000_000  # ~2.4 GB logical
    before = bytes_read()
    header = read_header(k2_sparse_drafter)
    assert bytes_read() - before < 1_000_000  # the header (a few kB), not the 2.4 GB of data behind it
    assert {k: list(v.shape) for k, v in header.items()} == {k: s for k, (_, s) in k2_drafter_tensors().items()}
    # and the strict checks agree with the real config
    from drafter.formats.checkpoint import header_problems

    assert header_problems(header, DrafterConfig.from_file(k2_sparse_drafter)) == []


# ---------------------------------------------------------------- corrupt files
def _write(tmp_path, payload: bytes):
    folder = tmp_path / "bad"
    folder.mkdir(exist_ok=True)
    tiny_config().save(folder)
    (folder / "model.safetensors").write_bytes(payload)
    return folder


def _valid_bytes(tmp_path) -> bytes:
    save_drafter(tiny_drafter(), tmp_path / "ok")
    return (tmp_path / "ok" / "model.safetensors").read_bytes()


def test_truncated_file(tmp_path):
    data = _valid_bytes(tmp_path)
    with pytest.raises(BadInput, match="outside the file's .* data bytes"):
        read_header(_write(tmp_path, data[: len(data) // 2]))
    with pytest.raises(BadInput, match="truncated safetensors file"):
        read_header(_write(tmp_path, data[:5]))


def test_header_length_larger_than_file(tmp_path):
    with pytest.raises(BadInput, match="header length 4096 is larger than the file"):
        read_header(_write(tmp_path, struct.pack("<Q", 4096) + b"{}"))


def test_header_not_json(tmp_path):
    with pytest.raises(BadInput, match="header is not valid JSON"):
        read_header(_write(tmp_path, struct.pack("<Q", 8) + b"{garbage" + b"\0" * 16))


def _with_header(header: dict, data: bytes = b"\0" * 64) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def test_offsets_outside_data(tmp_path):
    payload = _with_header({"fc.weight": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [32, 64 + 32]}})
    with pytest.raises(BadInput, match="'fc.weight' data \\[32, 96\\) lies outside"):
        read_header(_write(tmp_path, payload))


def test_unknown_dtype(tmp_path):
    payload = _with_header({"fc.weight": {"dtype": "Q4", "shape": [4], "data_offsets": [0, 2]}})
    with pytest.raises(BadInput, match="unknown dtype 'Q4'"):
        read_header(_write(tmp_path, payload))


def test_folder_without_weights_and_pickles(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    with pytest.raises(BadInput, match="no safetensors weights"):
        read_header(folder)
    (folder / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(BadInput, match="only pickle-based weights"):
        read_header(folder)
