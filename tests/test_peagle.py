"""P-EAGLE in process and at the gate (drafter/model/peagle.py, drafter/methods/peagle.py,
drafter/train/parallel_objective.py): one pass drafts what vLLM's single parallel pass drafts; a one-layer P-EAGLE
drafts its first token as EAGLE-3 does with the same weights; the training pass computes what decoding does; the
mini world's pe-mini-peagle decodes losslessly and gates against k2.5-mini; every malformed config or header is
one line, exit 2, and registers nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from drafter.decode.speculate import speculative_generate, target_generate
from drafter.methods import peagle
from drafter.model.eagle3 import Eagle3Drafter
from drafter.model.peagle import PEagleConfig, PEagleDrafter
from drafter.train.parallel_objective import Slots, parallel_forward, sample_slots
from tests.helpers.drafters import EAGLE31, tiny_config
from tests.helpers.steps import run_step

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "miniworld" / "pe-mini-peagle"
K25 = ROOT / "miniworld" / "k2.5-mini"


def _tiny(layers: int, **flags) -> PEagleDrafter:
    m = PEagleDrafter(PEagleConfig(tiny_config(**flags), layers, 5))
    m.init_weights(seed=layers, std=0.2)
    with torch.no_grad():
        m.embed_tokens.weight.normal_(generator=torch.Generator().manual_seed(1))
        m.mask_hidden.normal_(generator=torch.Generator().manual_seed(2))
        m.t2d[:48] = True
    return m.eval()


@pytest.mark.parametrize("flags", [{}, EAGLE31], ids=["eagle3", "eagle3.1"])
@pytest.mark.parametrize("layers", [1, 3])
def test_one_pass_over_verified_positions_and_slots_drafts_what_propose_drafts(layers, flags):
    """vLLM runs the verified tokens and the k - 1 mask slots as one causal pass: propose, over the cache, equals it."""
    m = _tiny(layers, **flags)
    ids, aux = torch.randint(0, 96, (9,), generator=torch.Generator().manual_seed(3)), torch.randn(9, 96)
    cache = m.new_cache()
    m.extend(cache, ids[:6], aux[:6])
    last = m.extend(cache, ids[6:], aux[6:])
    drafts, dists = m.propose(cache, last[:, -1:], 4)
    slot_ids, slot_h = m.slot_inputs(3)
    rows = m.run(torch.cat([ids, slot_ids])[None], torch.cat([m.combine(aux), slot_h])[None], torch.arange(12)[None],
                 torch.ones(12, 12, dtype=torch.bool).tril()[None, None])  # fmt: skip
    assert torch.equal(m.draft_to_target(m.logits(rows)[0, 8:].argmax(-1)), drafts)
    assert torch.equal(dists.argmax(-1), drafts) and cache.length == 9  # the slots never join the cache


def test_a_one_layer_p_eagle_drafts_its_first_token_as_eagle3_with_the_same_weights():
    m = _tiny(1)
    e = Eagle3Drafter(m.config)
    e.load_state_dict({k.replace("layers.0.", "midlayer."): v for k, v in m.state_dict().items() if k != "mask_hidden"})
    ids, aux = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(4)), torch.randn(7, 96)
    pc, ec = m.new_cache(), e.new_cache()
    ph, eh = m.extend(pc, ids, aux), e.extend(ec, ids, aux)
    assert torch.allclose(ph, eh, atol=1e-6)
    assert m.propose(pc, ph[:, -1:], 3)[0][0] == e.propose(ec, eh[:, -1:], 1)[0][0]


def test_the_training_pass_computes_what_the_decoding_pass_does():
    """All anchors and their slots in one forward == each anchor's slots drafted over its own prefix."""
    from drafter.data.dataset import Batch

    m = _tiny(2)
    t = 10
    gen = torch.Generator().manual_seed(5)
    ids, aux = torch.randint(3, 96, (1, t), generator=gen), torch.randn(1, t, 96, generator=gen)
    batch = Batch(ids, torch.ones(1, t, dtype=torch.bool), torch.ones(1, t, dtype=torch.bool), aux,
                  torch.randn(1, t, 32, generator=gen), torch.randint(0, 96, (1, t), generator=gen))  # fmt: skip
    slots = Slots(torch.tensor([[2, 2, 2, 5, 5]]), torch.tensor([[1, 2, 3, 1, 2]]))
    out = parallel_forward(m, batch, slots, m.embed_tokens.weight[m.t2d][:, :32])
    nxt = torch.cat([ids[0, 1:], torch.zeros(1, dtype=torch.long)])
    for anchor, depth in ((2, 3), (5, 2)):
        cache = m.new_cache()
        last = m.extend(cache, nxt[: anchor + 1], aux[0, : anchor + 1])
        drafts, _ = m.propose(cache, last[:, -1:], depth + 1)
        label = batch.target_token[0, torch.arange(anchor + 1, anchor + depth + 2).clamp(max=t - 1)]
        row = [anchor] + [t + i for i, a in enumerate(slots.anchor[0].tolist()) if a == anchor]
        assert torch.equal(out.correct[0, row], drafts == label)
    assert out.loss.isfinite()


def test_cod_sampling_keeps_fewer_anchors_each_depth_and_chains_them_from_depth_one():
    ok = torch.ones(2, 40, dtype=torch.bool)
    ok[1, 20:] = False
    slots = sample_slots(ok, torch.Generator().manual_seed(0), depths=4)
    for b in range(2):
        by_depth = [set(slots.anchor[b][(slots.depth[b] == d) & (slots.anchor[b] >= 0)].tolist()) for d in (1, 2, 3)]
        assert len(by_depth[0]) > len(by_depth[1]) > len(by_depth[2]) > 0
        assert by_depth[2] <= by_depth[1] <= by_depth[0]  # a depth-d slot sees its anchor's slots 1 .. d - 1
        assert all(ok[b, a + d] for d, anchors in enumerate(by_depth, 1) for a in anchors)


@pytest.fixture(scope="module")
def pair():
    from drafter.model.target import load_target

    target = load_target(K25, dtype="float32", progress=False)
    drafter = peagle.load(MINI, torch.float32, target.embedding_weight, target.lm_head_weight)
    target.set_aux_layers(list(drafter.config.aux_layer_ids))
    return target, drafter


def test_pe_mini_peagle_speculates_losslessly_and_gates_against_k25_mini(pair):
    from drafter.analysis.compat import passed
    from drafter.methods import folder_method_or_default

    target, drafter = pair
    assert folder_method_or_default(MINI) is peagle
    rec = json.loads((ROOT / "miniworld" / "prompts" / "k2.5-val.jsonl").read_text().splitlines()[0])
    text = target.tokenizer.apply_chat_template(rec["messages"][:1], add_generation_prompt=True, tokenize=False)
    prompt = torch.tensor(target.tokenizer.encode(text, add_special_tokens=False))
    spec = speculative_generate(target, drafter, prompt, 40, k=4)
    assert spec.tokens == target_generate(target, prompt, 40).tokens  # the slots only propose
    assert sum(spec.accepted) > 0 and max(spec.accepted) >= 2  # drafts from the slots land, not only the first
    checks = peagle.fit_checks(MINI, K25)
    assert passed(checks) and {"mask token", "mask_hidden", "layer 0 input width"} <= {c.name for c in checks}


def _other_target(tmp_path: Path) -> Path:
    """k2.5-mini's config at another width and depth (a config-only target: the gate reads configs and headers)."""
    raw = json.loads((K25 / "config.json").read_text())
    raw["text_config"].update(hidden_size=96, num_hidden_layers=4)
    folder = tmp_path / "other-target"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_the_gate_says_where_a_target_differs(tmp_path):
    bad = {c.name: c.actual for c in peagle.fit_checks(MINI, _other_target(tmp_path)) if c.ok is False}
    assert {"hidden size (fc input / 3)", "aux layer ids", "mask_hidden"} <= set(bad)
    assert bad["mask_hidden"] == "[1, 1, 384]"


def _broken(tmp_path: Path, how: str) -> Path:
    from safetensors.torch import load_file, save_file

    folder = tmp_path / how
    shutil.copytree(MINI, folder)
    state = load_file(str(folder / "model.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    edits = {
        "no-mask": lambda: [raw.pop("mask_token_id"), raw.pop("ptd_token_id")],
        "mask-disagree": lambda: raw.update(ptd_token_id=7),
        "mask-beyond": lambda: raw.update(mask_token_id=5000, ptd_token_id=5000),
        "layers": lambda: raw.update(num_hidden_layers=0),
        "layers-text": lambda: raw.update(num_hidden_layers="2"),
        "layers-huge": lambda: raw.update(num_hidden_layers=10**9),
        "window": lambda: raw.update(sliding_window=16, layer_types=["sliding_attention"]),
        "mla": lambda: raw.update(kv_lora_rank=16),
        "speculators": lambda: raw.update(speculators_model_type="peagle"),
        "aux": lambda: raw["eagle_config"].pop("eagle_aux_hidden_state_layer_ids"),
        "mask-hidden": lambda: state.pop("mask_hidden"),
        "mask-hidden-shape": lambda: state.update(mask_hidden=state["mask_hidden"][..., :128]),
        "wide-layer-1": lambda: state.update({"layers.1.self_attn.q_proj.weight": torch.zeros(128, 256,
                                                                                              dtype=torch.bfloat16)}),
        "extra-layer": lambda: state.update({"layers.2.input_layernorm.weight": torch.ones(128, dtype=torch.bfloat16)}),
        "dtype": lambda: state.update({"norm.weight": state["norm.weight"].float()}),
        "torch-dtype": lambda: raw.update(torch_dtype="int8-nonsense"),
    }  # fmt: skip
    edits[how]()
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


BROKEN = [
    ("no-mask", "no mask token (mask_token_id, ptd_token_id, pard_token)"),
    ("mask-disagree", "the mask token fields disagree"),
    ("mask-beyond", "mask token 5000 is not a token of the vocabulary"),
    ("layers", "'num_hidden_layers' must be a whole number in 1..128, got 0"),
    ("layers-text", "'num_hidden_layers' must be a whole number in 1..128, got '2'"),
    ("layers-huge", "'num_hidden_layers' must be a whole number in 1..128, got 1000000000"),
    ("window", "read with full attention only"),
    ("mla", "read with Llama attention (MLA keys kv_lora_rank)"),
    ("speculators", "'transformer_layer_config' must be the decoder's config"),
    ("aux", "missing field 'eagle_config.eagle_aux_hidden_state_layer_ids'"),
    ("mask-hidden", "tensor mask_hidden is missing"),
    ("mask-hidden-shape", "tensor mask_hidden is BF16 [1, 1, 128]"),
    ("wide-layer-1", "tensor layers.1.self_attn.q_proj.weight is BF16 [128, 256]"),
    ("extra-layer", "tensors not in a P-EAGLE drafter of 2 layers: layers.2.input_layernorm.weight"),
    ("dtype", "tensor norm.weight is F32 [128], the config makes it BF16 [128]"),
    ("torch-dtype", "field 'torch_dtype' is 'int8-nonsense', not one of bfloat16, float16, float32"),
]


@pytest.mark.parametrize(("how", "said"), BROKEN, ids=[b[0] for b in BROKEN])
def test_each_broken_p_eagle_folder_is_refused_in_one_line(tmp_path, how, said):
    from common.errors import BadInput

    folder = _broken(tmp_path, how)
    with pytest.raises(BadInput, match=__import__("re").escape(said)):
        peagle.checked_header(folder)


def test_a_broken_p_eagle_folder_registers_nothing_and_the_gate_step_says_no(tmp_path):
    from mlflow import MlflowClient

    from tests.helpers.checks import one_line_exit_2

    res = run_step("import_drafter", ["--source", str(_broken(tmp_path, "no-mask")), "--target", str(K25)], tmp_path,
                   here=True)  # fmt: skip
    one_line_exit_2(res, "no mask token")
    assert MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_registered_models() == []
    ok = run_step("shape_gate", ["--model", str(MINI), "--target", str(K25)], tmp_path, here=True)
    assert ok.returncode == 0, ok.stderr[-2000:]
    no = run_step("shape_gate", ["--model", str(MINI), "--target", str(_other_target(tmp_path))], tmp_path, here=True)
    assert no.returncode == 1, no.stderr[-2000:]


def test_speculators_p_eagle_layout_reads_as_the_same_drafter(tmp_path):
    """speculators' P-EAGLE folder (its decoder under transformer_layer_config, aux ids in vLLM's reading, the mask
    token at the top level, the same tensors): the same config, the gate passes, the same drafts; no mask token is
    refused as vLLM would fail on it."""
    from common.errors import BadInput
    from drafter.analysis.compat import passed
    from drafter.methods import folder_method_or_default

    ours = json.loads((MINI / "config.json").read_text())
    layer = {k: ours[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size",
                                  "num_hidden_layers", "torch_dtype")}  # fmt: skip
    raw = {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
           "transformer_layer_config": {**layer, "model_type": "llama", "hidden_act": "silu"},
           "draft_vocab_size": ours["draft_vocab_size"], "norm_before_residual": False, "mask_token_id": 0,
           "eagle_aux_hidden_state_layer_ids": [i + 1 for i in peagle.folder_config(MINI).aux_layer_ids],
           "speculators_config": {"algorithm": "peagle", "proposal_methods": [{"speculative_tokens": 4}]}}  # fmt: skip
    folder = tmp_path / "spec"
    folder.mkdir()
    shutil.copyfile(MINI / "model.safetensors", folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(raw))
    assert folder_method_or_default(folder) is peagle
    a, b = peagle.folder_config(MINI), peagle.folder_config(folder)
    assert (b.aux_layer_ids, b.num_hidden_layers, b.mask_token_id) == (a.aux_layer_ids, 2, 0)
    assert peagle.expected_tensors(a) == peagle.expected_tensors(b) and passed(peagle.fit_checks(folder, K25))
    raw["transformer_layer_config"] |= {"norm_before_residual": True, "norm_before_fc": True}  # vLLM: the top's
    (folder / "config.json").write_text(json.dumps(raw))
    base = peagle.folder_config(folder).base
    assert (base.norm_before_residual, base.norm_before_fc) == (False, False)  # update_peagle sets both
    del raw["mask_token_id"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(BadInput, match="no mask token"):
        peagle.folder_config(folder)


def test_the_gate_fails_what_import_and_load_refuse(tmp_path):
    """A later layer saved at another dtype, or a stray `midlayer.` copy shadowing layer 0: the gate's layout row
    fails, as checked_header (import, load) does, instead of passing a folder nothing can load."""
    from safetensors.torch import load_file, save_file

    from drafter.analysis.compat import passed

    for how in ("dtype", "shadow"):
        folder = tmp_path / how
        shutil.copytree(MINI, folder)
        state = load_file(str(folder / "model.safetensors"))
        if how == "dtype":
            state["layers.1.mlp.down_proj.weight"] = state["layers.1.mlp.down_proj.weight"].float()
        else:
            state["midlayer.input_layernorm.weight"] = state["layers.0.input_layernorm.weight"].clone()
            state["layers.0.input_layernorm.weight"] = state["layers.0.input_layernorm.weight"][:64].clone()
        save_file(state, str(folder / "model.safetensors"))
        checks = peagle.fit_checks(folder, K25)
        assert not passed(checks) and any(c.name == "layout" and c.ok is False for c in checks), how


def test_a_config_whose_architectures_is_not_a_list_is_one_line(tmp_path):
    from common.errors import BadInput
    from drafter.methods import folder_method

    for value in (5, True, "PEagleDraftModel"):
        (tmp_path / "config.json").write_text(json.dumps({"architectures": value}))
        with pytest.raises(BadInput, match="field 'architectures' is .*, not a list of names"):
            folder_method(tmp_path)


def test_held_out_statistics_in_chunks_of_anchors_are_the_whole_pass(monkeypatch):
    """parallel_stats scores a sample's anchors a chunk at a time (memory): the same figures as all at once."""
    from drafter.data.dataset import Sample
    from drafter.train import parallel_objective as po

    gen = torch.Generator().manual_seed(6)

    class Samples(list):  # what parallel_stats reads of a dataset: samples and the target's head
        def target_head(self) -> torch.Tensor:
            return torch.randn(96, 32, generator=torch.Generator().manual_seed(7))

    data = Samples(
        Sample(torch.randint(3, 96, (t,), generator=gen), torch.ones(t, dtype=torch.bool),
               torch.randn(t, 96, generator=gen), torch.randn(t, 32, generator=gen),
               torch.randint(0, 96, (t,), generator=gen))
        for t in (12, 13)
    )  # fmt: skip
    m = _tiny(2)
    for x in data:  # labels: the drafter's own first drafts, so that the figures are not all zero
        t = len(x)
        nxt = torch.cat([x.input_ids[1:], torch.zeros(1, dtype=torch.long)])
        rows = m.run(nxt[None], m.combine(x.aux_hidden)[None], torch.arange(t)[None],
                     torch.ones(t, t, dtype=torch.bool).tril()[None, None])  # fmt: skip
        x.target_token[1:] = m.draft_to_target(m.logits(rows)[0, :-1].argmax(-1))
    whole = po.parallel_stats(m, data, [0, 1], 4)
    assert whole[0] > 1.5 and 0 < whole[1][1] < 1  # the first drafts land, the slots' partly
    monkeypatch.setattr(po, "ANCHORS_AT_ONCE", 5)
    chunked = po.parallel_stats(m, data, [0, 1], 4)
    assert chunked[0] == pytest.approx(whole[0]) and chunked[1] == pytest.approx(whole[1])
