import json

import pytest

from common.errors import BadInput
from drafter.model.config import DrafterConfig, TargetConfig
from tests.helpers.drafters import REFERENCE


def test_reference_k2_drafter_config_parses_and_round_trips(tmp_path):
    raw = json.loads((REFERENCE / "kimi-k2-eagle3.config.json").read_text())
    cfg = DrafterConfig.from_dict(raw)
    assert cfg.hidden_size == 7168 and cfg.head_dim == 128 and cfg.num_key_value_heads == 64
    assert cfg.aux_layer_ids == [2, 30, 58] and cfg.draft_vocab_size == 32000 and cfg.vocab_size == 163840
    cfg.save(tmp_path)
    again = json.loads((tmp_path / "config.json").read_text())
    # every key survives, unknown ones (model_type, hidden_act, use_cache, ...) included
    assert set(raw) <= set(again)
    for key, value in raw.items():
        assert again[key] == value, key
    assert DrafterConfig.from_file(tmp_path) == cfg


def test_kimi_k25_wrapper_is_unwrapped():
    t = TargetConfig.from_file(REFERENCE / "kimi-k2.5.config.json")
    assert (t.hidden_size, t.num_hidden_layers, t.vocab_size) == (7168, 61, 163840)
    assert t.weight_prefix == "language_model."
    assert t.embedding_name == "language_model.model.embed_tokens.weight"
    assert (t.bos_token_id, t.eos_token_id) == (163584, 163585)


def test_flat_target_config():
    t = TargetConfig.from_dict({"hidden_size": 64, "num_hidden_layers": 4, "vocab_size": 100})
    assert t.weight_prefix == "" and t.embedding_name == "model.embed_tokens.weight"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda r: r.pop("hidden_size"), "missing required field(s) hidden_size"),
        (lambda r: r.pop("eagle_config"), "eagle_aux_hidden_state_layer_ids"),
        (lambda r: r.update(num_key_value_heads="64"), "'num_key_value_heads' must be a positive integer"),
        (lambda r: r.update(draft_vocab_size=200000), "exceeds vocab_size"),
        (lambda r: r["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[2, 30]), "3 layer ids"),
        (lambda r: r.update(architectures=["MedusaModel"]), "unknown drafter architecture 'MedusaModel'"),
        (lambda r: r.update(kv_lora_rank=512), "with MLA keys kv_lora_rank: mixed layout"),
        (
            lambda r: r.update(architectures=["Eagle3DeepseekV3ForCausalLM"]),
            "'kv_lora_rank' must be a positive integer for an MLA",
        ),
        (lambda r: r.update(fc_norm="yes"), "field 'fc_norm' must be true or false"),
    ],
)
def test_bad_drafter_configs(mutate, message):
    raw = json.loads((REFERENCE / "kimi-k2-eagle3.config.json").read_text())
    mutate(raw)
    with pytest.raises(BadInput, match="config.json") as err:
        DrafterConfig.from_dict(raw)
    assert message in str(err.value)


def test_missing_and_non_json_config(tmp_path):
    with pytest.raises(BadInput, match="file not found"):
        DrafterConfig.from_file(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(BadInput, match="not valid JSON"):
        DrafterConfig.from_file(tmp_path)


def test_target_config_without_vocab_inside_text_config():
    with pytest.raises(BadInput, match=r"\(text_config\): missing required field 'vocab_size'"):
        TargetConfig.from_dict({"text_config": {"hidden_size": 8, "num_hidden_layers": 2}})
