"""The committed mini world: every artifact matches the build's record and loads through the project's loaders."""

import hashlib
import json
from pathlib import Path

import pytest
import torch

from common.prompt_files import read_prompts
from drafter.formats.checkpoint import load_drafter, read_header
from drafter.model.config import TargetConfig
from drafter.model.target import load_target

MW = Path(__file__).resolve().parents[1] / "miniworld"
RECORD = json.loads((MW / "build_record.json").read_text())


@pytest.mark.parametrize("artifact", ["k2-mini", "k2.5-mini", "aq-mini-eagle3", "prompts"])
def test_artifacts_match_the_build_record(artifact):
    recorded = RECORD["artifacts"][artifact]
    on_disk = {
        str(p.relative_to(MW / artifact)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((MW / artifact).rglob("*"))
        if p.is_file()
    }
    assert on_disk == recorded


def test_committed_size_is_small():
    total = sum(p.stat().st_size for a in RECORD["artifacts"] for p in (MW / a).rglob("*") if p.is_file())
    assert total < 30 * 2**20


def test_targets_load_and_the_k25_one_through_the_wrapper():
    k2, k25 = load_target(MW / "k2-mini"), load_target(MW / "k2.5-mini")
    assert k2.config.weight_prefix == "" and k25.config.weight_prefix == "language_model."
    assert TargetConfig.from_file(MW / "k2.5-mini").raw["architectures"] == ["KimiK25ForConditionalGeneration"]
    ids = torch.tensor([k2.tokenizer("def main():\n    return 0\n")["input_ids"]])
    for t in (k2, k25):
        t.set_aux_layers(RECORD["aux_layer_ids"])
        out = t.forward(ids)
        assert torch.isfinite(out.logits).all()
        # a real language model: held-out loss far below uniform
        loss = torch.nn.functional.cross_entropy(out.logits[0, :-1], ids[0, 1:]).item()
        assert loss < 0.75 * RECORD["figures"]["log_vocab"]
    assert not torch.equal(k2.lm_head_weight, k25.lm_head_weight)  # k2.5 moved on


def test_public_drafter_is_released_like_aq_medai():
    folder = MW / "aq-mini-eagle3"
    assert "embed_tokens.weight" not in read_header(folder)
    card = (folder / "README.md").read_text()
    assert "license: mit" in card and "Training samples:" in card
    target = load_target(MW / "k2-mini")
    drafter = load_drafter(folder, embedding=target.embedding_weight.detach().float())
    assert drafter.config.aux_layer_ids == RECORD["aux_layer_ids"]
    fig = RECORD["figures"]["aq-mini-eagle3"]
    assert fig["sim_accept_len_k2_mini"] > 2.3 and fig["sim_accept_len_k2_mini"] - fig["sim_accept_len_k2.5_mini"] > 0.3


def test_prompt_sets_are_disjoint_and_sized_like_the_seed():
    sets = {name: read_prompts(MW / "prompts" / f"{name}.jsonl") for name in ("k2.5-train", "k2.5-val", "k2.5-test")}
    users = {name: {r["messages"][0]["content"] for r in recs} for name, recs in sets.items()}
    assert not users["k2.5-train"] & users["k2.5-val"] and not users["k2.5-train"] & users["k2.5-test"]
    assert not users["k2.5-val"] & users["k2.5-test"]
    pool = {r["messages"][0]["content"] for r in read_prompts(MW / "prompts" / "k2.5-pool.jsonl")}
    assert len(pool) >= 320 and not pool & (users["k2.5-val"] | users["k2.5-test"] | users["k2.5-train"])
    assert RECORD["figures"]["aq-mini-eagle3"]["train_samples"] >= 20 * len(sets["k2.5-train"])


def test_offline_and_online_acceptance_agree_on_the_mini_world(tmp_path):
    """Teacher-forced sim_accept_len (held-out hidden states) and real decoding's accept_len describe the
    same drafter: on the mini world they agree within 20% (measured: 2-15% across the main job's drafters)."""
    from drafter.data.capture import capture, plan_capture
    from drafter.data.dataset import HiddenStateDataset
    from drafter.decode.evaluation import evaluate_online
    from drafter.train.loop import offline_stats

    target = load_target(MW / "k2.5-mini")
    drafter = load_drafter(MW / "aq-mini-eagle3", embedding=target.embedding_weight.detach().float())
    val = read_prompts(MW / "prompts" / "k2.5-val.jsonl")
    meta = {
        "target": "k2.5-mini",
        "layer_ids": RECORD["aux_layer_ids"],
        "hidden_size": 128,
        "vocab_size": target.config.vocab_size,
    }
    capture(target, plan_capture(target, val, 256), tmp_path / "val", RECORD["aux_layer_ids"], meta, progress=False)
    ds = HiddenStateDataset(tmp_path / "val")
    offline = offline_stats(drafter, ds, list(range(len(ds))), ds.target_head()[drafter.t2d].float(), 2)
    online = evaluate_online(
        target, drafter, read_prompts(MW / "prompts" / "k2.5-test.jsonl", 12), 2, max_new_tokens=48, progress=False
    )
    assert online.mismatches == 0
    assert abs(online.accept_len - offline.sim_accept_len) / offline.sim_accept_len < 0.20, (
        online.accept_len,
        offline.sim_accept_len,
    )
