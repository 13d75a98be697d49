"""DFlash in process (drafter/model/dflash.py, drafter/decode/proposers.py, drafter/train/block_objective.py):
the mini world's zl-mini-dflash decodes losslessly at every width its block allows; the training pass (many
masked blocks at once) computes exactly what the decoding pass does for the same context; the objective labels
only reply tokens inside the sample; the layout round-trips and gates against k2.5-mini with its weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from drafter.data.dataset import Batch
from drafter.decode.speculate import speculative_generate, target_generate
from drafter.methods import dflash
from drafter.model.dflash import BlockContext
from drafter.model.target import load_target
from drafter.train.block_objective import block_acceptance, block_forward, position_weights, sample_anchors
from tests.helpers.steps import run_step

ROOT = Path(__file__).resolve().parents[1]
MINI = ROOT / "miniworld" / "zl-mini-dflash"
K25 = ROOT / "miniworld" / "k2.5-mini"


@pytest.fixture(scope="module")
def pair():
    target = load_target(K25, dtype="float32", progress=False)
    drafter = dflash.load(MINI, torch.float32, target.embedding_weight, target.lm_head_weight)
    target.set_aux_layers(list(drafter.config.target_layer_ids))
    return target, drafter


def _prompt(target, i: int) -> torch.Tensor:
    rec = json.loads((ROOT / "miniworld" / "prompts" / "k2.5-val.jsonl").read_text().splitlines()[i])
    text = target.tokenizer.apply_chat_template(rec["messages"][:1], add_generation_prompt=True, tokenize=False)
    return torch.tensor(target.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("k", [1, 3, 7])
def test_block_speculation_reproduces_the_targets_greedy_output_at_every_width(pair, k):
    target, drafter = pair
    accepted = []
    for i in range(3):
        prompt = _prompt(target, i)
        base = target_generate(target, prompt, 40)
        spec = speculative_generate(target, drafter, prompt, 40, k=k)
        assert spec.tokens == base.tokens  # lossless: the block only proposes, the target decides
        assert all(0 <= n <= k for n in spec.accepted)
        accepted += spec.accepted
    assert sum(accepted) > 0  # a trained drafter: some drafts land
    with pytest.raises(ValueError, match="drafts 1..7"):
        drafter.propose(BlockContext(), 5, drafter.block_size)


def test_the_training_pass_computes_what_the_decoding_pass_does(pair):
    """Many blocks, each masked to its own context and block, in one forward == each block decoded alone."""
    target, drafter = pair
    prompt = _prompt(target, 0)
    out = target.forward(prompt[None])
    t = prompt.shape[0]
    batch = Batch(input_ids=prompt[None], attention_mask=torch.ones(1, t, dtype=torch.bool),
                  loss_mask=torch.ones(1, t, dtype=torch.bool), aux_hidden=out.aux_hidden.float(),
                  last_hidden=out.last_hidden, target_token=out.logits.argmax(-1))  # fmt: skip
    anchors = torch.tensor([[3, t // 2, t - 9]])
    res = block_forward(drafter, batch, anchors)
    blk = drafter.block_size
    for n, a in enumerate(anchors[0].tolist()):
        ctx = BlockContext()
        drafter.extend(ctx, out.aux_hidden[0, :a])
        drafts, _ = drafter.propose(ctx, int(prompt[a]), blk - 1)
        labels = out.logits[0].argmax(-1)[a : a + blk - 1]
        assert res.correct[n].tolist() == (drafts == labels).tolist()
    assert res.valid.all() and torch.isfinite(res.loss)


def test_the_objective_labels_reply_tokens_inside_the_sample_and_decays_by_position():
    w = position_weights(8)
    assert w[0] == 1 and torch.all(w[1:] < w[:-1]) and w[-1] == pytest.approx(torch.exp(torch.tensor(-6 / 7)))
    mask = torch.tensor([[False] * 6 + [True] * 6 + [False] * 4])
    batch = Batch(input_ids=torch.arange(16)[None], attention_mask=torch.tensor([[True] * 12 + [False] * 4]),
                  loss_mask=mask, aux_hidden=torch.zeros(1, 16, 6), last_hidden=torch.zeros(1, 16, 2),
                  target_token=torch.arange(1, 17)[None])  # fmt: skip
    anchors = sample_anchors(batch, 20, torch.Generator().manual_seed(0))
    drawn = [a for a in anchors[0].tolist() if a >= 0]
    assert drawn == list(range(5, 11))  # a + 1 a reply token, a + 1 inside the 12 real positions
    # teacher-forced acceptance: a draft counts only when every one before it did
    correct = torch.tensor([[True, True, False], [True, False, True], [False, True, True]])
    sim, cond = block_acceptance(correct, torch.ones(3, 3, dtype=torch.bool), 3)
    assert sim == pytest.approx(1 + (2 + 1 + 0) / 3) and cond == pytest.approx([2 / 3, 1 / 2, 0.0])


def test_the_layout_round_trips_and_gates_against_k25_mini_with_its_weights(pair, tmp_path):
    target, drafter = pair
    folder = tmp_path / "copy"
    dflash.save(drafter, folder, target.config.num_hidden_layers)
    again = dflash.load(folder, torch.float32, target.embedding_weight, target.lm_head_weight)
    pairs = zip(drafter.state_dict().values(), again.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert json.loads((folder / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    done = run_step("shape_gate", ["--model", str(MINI), "--target", str(K25)], tmp_path, here=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASSED" in done.stdout and "CONFIG-ONLY" not in done.stdout
    bad = tmp_path / "bad"
    shutil.copytree(MINI, bad)
    raw = json.loads((bad / "config.json").read_text())
    raw["dflash_config"]["target_layer_ids"] = [1, 3, 9]
    (bad / "config.json").write_text(json.dumps(raw))
    done = run_step("shape_gate", ["--model", str(bad), "--target", str(K25)], tmp_path, here=True)
    assert done.returncode == 1 and "target layer ids" in done.stdout


def _broken(tmp_path: Path, how: str) -> Path:
    """zl-mini-dflash copied and broken one way: weights of its own it must borrow, NaN weights, a missing tensor,
    a config field of the wrong kind, a block too small to draft."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / how
    shutil.copytree(MINI, folder)
    state = load_file(str(folder / "model.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    if how == "own-embedding":
        state["embed_tokens.weight"] = torch.zeros(raw["vocab_size"], raw["hidden_size"])
    elif how == "nan":
        state["norm.weight"] = torch.full_like(state["norm.weight"], float("nan"))
    elif how == "missing":
        del state["fc.weight"]
    elif how == "ids":
        raw["dflash_config"]["target_layer_ids"] = "x"
    elif how == "block":
        raw["block_size"] = 1
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


@pytest.mark.parametrize(
    ("how", "said"),
    [
        ("own-embedding", "tensors not in a DFlash drafter: embed_tokens.weight"),
        ("missing", "tensor fc.weight is missing"),
        ("ids", "'dflash_config.target_layer_ids' is not a non-empty list"),
        ("block", "'block_size' is 1"),
    ],
)
def test_a_broken_dflash_folder_is_refused_in_one_line_and_registers_nothing(tmp_path, how, said):
    from mlflow import MlflowClient

    from tests.helpers.checks import one_line_exit_2

    folder = _broken(tmp_path, how)
    res = run_step("import_drafter", ["--source", str(folder), "--target", str(K25)], tmp_path, here=True)
    one_line_exit_2(res, said)
    assert MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_registered_models() == []


def test_nan_weights_are_refused_before_a_dflash_drafter_drafts(pair, tmp_path):
    from common.errors import BadInput

    target, _ = pair
    with pytest.raises(BadInput, match="NaN/Inf"):
        dflash.load(_broken(tmp_path, "nan"), torch.float32, target.embedding_weight, target.lm_head_weight)
