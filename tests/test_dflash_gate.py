"""DFlash drafters at the shape gate (drafter/methods/dflash.py): z-lab's Kimi-K2.5-DFlash shapes pass against
K2.5 from config and headers; each rule broken one at a time is refused with its reason; malformed configs get
one line (exit 2) and a broken rule exit 1, through the shape_gate step on a folder."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from common.errors import BadInput
from drafter.analysis.compat import Check
from drafter.methods import dflash, method_of
from tests.helpers.steps import run_step

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = json.loads((ROOT / "configs" / "reference" / "kimi-k2.5-dflash.config.json").read_text())
K25 = ROOT / "configs" / "reference" / "kimi-k2.5.config.json"
HIDDEN, VOCAB, LAYERS = 7168, 163840, 61  # Kimi-K2.5's (configs/reference/kimi-k2.5.config.json)


def _rules(raw: dict, header_from: dict | None = None, edit=None) -> dict[str, Check]:
    """Every rule by name for `raw` against K2.5, with a header of the layout's own shapes (from `header_from`'s
    config, edited by `edit`)."""
    cfg = dflash.DFlashConfig.from_dict(raw)
    header = dict(dflash.expected_tensors(dflash.DFlashConfig.from_dict(header_from or raw)))
    if edit:
        edit(header)
    return {r.name: r for r in dflash.rules(cfg, HIDDEN, VOCAB, LAYERS, header)}


def _with(**changes) -> dict:
    raw = copy.deepcopy(REFERENCE)
    for key, value in changes.items():
        if key.startswith("dflash_"):
            raw["dflash_config"][key.removeprefix("dflash_")] = value
        else:
            raw[key] = value
    return raw


def test_the_public_k25_dflash_shapes_pass_against_k25_and_record_what_engines_read_otherwise():
    assert method_of(REFERENCE) is dflash and method_of({"architectures": ["Eagle3LlamaForCausalLM"]}) is None
    cfg = dflash.DFlashConfig.from_dict(REFERENCE)
    assert len(dflash.expected_tensors(cfg)) == 6 * 11 + 3  # 69, as the public conversion counts them
    rules = _rules(REFERENCE)
    assert all(r.ok for r in rules.values()), [r for r in rules.values() if not r.ok]
    assert rules["fc in-features"].actual == str(6 * HIDDEN)
    assert rules["YaRN attention factor"].actual == "1.4159" and rules["layer id convention"].informational
    assert cfg.block_size == 8 and cfg.mask_token_id == 163838 and not cfg.causal


@pytest.mark.parametrize(
    ("rule", "raw", "edit"),
    [
        ("hidden size", _with(hidden_size=4096), None),
        ("vocabulary", _with(vocab_size=32000), None),
        ("mask token", _with(dflash_mask_token_id=VOCAB), None),
        ("target layer ids", _with(dflash_target_layer_ids=[1, 12, 24, 35, 47, 61]), None),
        ("num_target_layers", _with(num_target_layers=60), None),
        ("fc in-features", REFERENCE, lambda h: h.update({"fc.weight": (HIDDEN, 5 * HIDDEN)})),
        ("layers.5.mlp.down_proj.weight", REFERENCE, lambda h: h.pop("layers.5.mlp.down_proj.weight")),
        ("layers.0.self_attn.k_proj.weight", REFERENCE,
         lambda h: h.update({"layers.0.self_attn.k_proj.weight": (64 * 128, HIDDEN)})),
        ("embed_tokens.weight", REFERENCE, lambda h: h.update({"embed_tokens.weight": (VOCAB, HIDDEN)})),
    ],
    ids=["hidden", "vocab", "mask", "layer-id", "num-target-layers", "fc", "missing-tensor", "kv-heads",
         "own-embedding"],
)  # fmt: skip
def test_each_rule_broken_alone_is_refused_with_its_reason(rule, raw, edit):
    rules = _rules(raw, REFERENCE if raw is not REFERENCE else None, edit)
    failed = [name for name, r in rules.items() if r.ok is False]
    assert rule in failed, failed
    if rule == "embed_tokens.weight":
        assert "the target's is borrowed" in rules[rule].expected


BAD = [
    ([1, 2], "not a JSON object"),
    ({k: v for k, v in REFERENCE.items() if k != "dflash_config"}, "'dflash_config' is missing"),
    ({**REFERENCE, "dflash_config": "x"}, "'dflash_config' is missing or not an object"),
    (_with(dflash_target_layer_ids=[]), "'dflash_config.target_layer_ids' is not a non-empty list"),
    (_with(dflash_target_layer_ids="1,2"), "'dflash_config.target_layer_ids' is not a non-empty list"),
    (_with(dflash_target_layer_ids=[1, -2]), "target_layer_ids\\[1\\]' is -2"),
    (_with(dflash_target_layer_ids=[1, 1]), "names a layer twice"),
    (_with(dflash_mask_token_id="x"), "'dflash_config.mask_token_id' is 'x'"),
    (_with(dflash_mask_token_id=None), "'dflash_config.mask_token_id' is None"),
    (_with(block_size=1), "'block_size' is 1"),
    (_with(hidden_size=0), "'hidden_size' is 0"),
    (_with(num_attention_heads=True), "'num_attention_heads' is True"),
    (_with(intermediate_size=None), "'intermediate_size' is None"),
    (_with(dflash_causal="yes"), "'dflash_config.causal' is 'yes'"),
    (_with(rope_scaling=[64]), "'rope_scaling' is \\[64\\]"),
    (_with(num_hidden_layers=10**9), "'num_hidden_layers' is 1000000000: more than 128 is no drafter"),
    (_with(num_key_value_heads=5), "'num_attention_heads' 64 is not a multiple of 'num_key_value_heads' 5"),
    (_with(hidden_act="nonsense"), "'hidden_act' is 'nonsense'; a DFlash layer runs 'silu'"),
]


@pytest.mark.parametrize(("raw", "said"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_each_malformed_config_is_one_line_naming_the_field(raw, said):
    with pytest.raises(BadInput, match=said) as exc:
        dflash.DFlashConfig.from_dict(raw, "d/config.json")
    assert str(exc.value).startswith("d/config.json: ") and "\n" not in str(exc.value)


def test_the_shape_gate_step_gates_a_dflash_folder(tmp_path):
    good, broken, bad = tmp_path / "good", tmp_path / "broken", tmp_path / "bad"
    for folder, raw in ((good, REFERENCE), (broken, _with(dflash_mask_token_id=VOCAB)), (bad, _with(block_size=0))):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(raw))
    ok = run_step("shape_gate", ["--model", str(good), "--target", str(K25)], tmp_path, here=True)
    assert ok.returncode == 0 and "shape_gate: PASSED-CONFIG-ONLY" in ok.stdout, ok.stdout + ok.stderr
    assert "(dflash) vs target" in ok.stdout and "the tensors were not checked" in ok.stdout
    no = run_step("shape_gate", ["--model", str(broken), "--target", str(K25)], tmp_path, here=True)
    assert no.returncode == 1 and "shape_gate: FAILED (mask token)" in no.stdout, no.stdout + no.stderr
    refused = run_step("shape_gate", ["--model", str(bad), "--target", str(K25)], tmp_path, here=True)
    assert (
        refused.returncode == 2
        and refused.stderr.strip() == f"shape_gate: {bad}/config.json: 'block_size' is 0, not a whole number >= 2"
    )
