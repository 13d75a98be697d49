import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.synthetic import READER, write_random_dataset
from common.errors import BadInput
from common.prompt_files import read_prompts
from drafter.data.capture import capture, plan_capture
from drafter.data.dataset import (
    HiddenStateDataset,
    SpecForgeDataset,
    iterate_batches,
    split_indices,
)
from drafter.data.prompts import tokenize_record
from drafter.model.target import load_target
from tests.helpers.prompts import PROMPTS

ROOT = Path(__file__).resolve().parents[1]


def meta_for(target, layers):
    return {
        "target": "t",
        "layer_ids": layers,
        "hidden_size": target.config.hidden_size,
        "vocab_size": target.config.vocab_size,
    }


def test_chat_loss_mask_covers_assistant_tokens_only(tiny_targets):
    tok = load_target(tiny_targets[0]).tokenizer
    t = tokenize_record(tok, PROMPTS[0], 512)
    text_masked = tok.decode([i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if m])
    text_unmasked = tok.decode([i for i, m in zip(t.input_ids, t.loss_mask, strict=True) if not m])
    assert text_masked.startswith("def add(a, b)") and "<|im_end|>" in text_masked
    assert "add two numbers" in text_unmasked and "<|im_start|>assistant\n" in text_unmasked
    assert tok.decode(t.input_ids) == tok.apply_chat_template(PROMPTS[0]["messages"], tokenize=False)
    assert all(tokenize_record(tok, PROMPTS[1], 512).loss_mask)


def test_capture_writes_the_target_states(tiny_targets, tmp_path):
    target = load_target(tiny_targets[0])
    plan = plan_capture(target, PROMPTS, 64)
    index = capture(
        target, plan, tmp_path / "ds", [0, 1, 2], meta_for(target, [0, 1, 2]), shard_tokens=50, progress=False
    )
    ds = HiddenStateDataset(tmp_path / "ds")
    assert len(ds) == len(PROMPTS) == index["num_samples"] and len(index["shards"]) > 1
    s = ds[2]
    out = target.forward(s.input_ids[None])
    assert torch.equal(s.aux_hidden, out.aux_hidden[0].to(torch.bfloat16))
    assert torch.equal(s.last_hidden, out.last_hidden[0].to(torch.bfloat16))
    assert torch.equal(s.target_token, out.logits[0].argmax(-1))
    assert torch.equal(ds.target_head(), target.lm_head_weight.to(torch.bfloat16))


def test_resume_after_interruption_gives_an_identical_dataset(tiny_targets, tmp_path):
    target = load_target(tiny_targets[0])
    plan = plan_capture(target, PROMPTS, 64)
    meta = meta_for(target, [0, 1, 2])
    capture(target, plan, tmp_path / "whole", [0, 1, 2], meta, shard_tokens=40, progress=False)

    class Crash(Exception):
        pass

    def die_at_7(n):
        if n == 7:
            # a half-written shard left behind, as a kill during save would
            (tmp_path / "cut" / "shard-99999.safetensors.tmp").write_bytes(b"partial")
            raise Crash

    with pytest.raises(Crash):
        capture(target, plan, tmp_path / "cut", [0, 1, 2], meta, shard_tokens=40, progress=False, on_sample=die_at_7)
    assert not (tmp_path / "cut" / "index.json").exists()
    with pytest.raises(BadInput, match="capture unfinished"):
        HiddenStateDataset(tmp_path / "cut")
    index = capture(target, plan, tmp_path / "cut", [0, 1, 2], meta, shard_tokens=40, progress=False)
    whole = json.loads((tmp_path / "whole" / "index.json").read_text())
    assert index["digest"] == whole["digest"]
    assert [s["sha256"] for s in index["shards"]] == [s["sha256"] for s in whole["shards"]]
    assert not list((tmp_path / "cut").glob("*.tmp"))


def test_refuses_to_mix_datasets_and_corrupt_shards(tiny_targets, tmp_path):
    target = load_target(tiny_targets[0])
    plan = plan_capture(target, PROMPTS[:3], 64)
    capture(target, plan, tmp_path / "ds", [0, 1, 2], meta_for(target, [0, 1, 2]), progress=False)
    before = sorted(p.name for p in (tmp_path / "ds").iterdir())
    with pytest.raises(BadInput, match="already holds a different dataset"):
        capture(target, plan, tmp_path / "ds", [0, 1, 3], meta_for(target, [0, 1, 3]), progress=False)
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == before
    shard = tmp_path / "ds" / "shard-00000.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(BadInput, match="shard-00000.safetensors: sha256 does not match"):
        HiddenStateDataset(tmp_path / "ds")[0]


@pytest.mark.parametrize(
    "content, message",
    [
        ("", "no prompts"),
        ('{"text": "ok"}\nnot json\n', r":2: not valid JSON"),
        ('{"text": "ok"}\n{"messages": [{"role": "user"}]}\n', r":2: messages\[0\] needs string"),
        ("[1, 2]\n", r":1: expected a JSON object"),
    ],
)
def test_bad_prompt_files(tmp_path, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(BadInput, match=message):
        read_prompts(path)
    with pytest.raises(BadInput, match="prompts file not found"):
        read_prompts(tmp_path / "missing.jsonl")


def test_split_and_batches_are_deterministic(tiny_targets, tmp_path):
    target = load_target(tiny_targets[0])
    capture(
        target,
        plan_capture(target, PROMPTS, 64),
        tmp_path / "ds",
        [0, 1, 2],
        meta_for(target, [0, 1, 2]),
        shard_tokens=30,
        progress=False,
    )
    ds = HiddenStateDataset(tmp_path / "ds")
    train, val = split_indices(len(ds), 0.25, seed=1)
    assert len(val) == 3 and not set(train) & set(val) and sorted(train + val) == list(range(len(ds)))
    a = [b.input_ids for b in iterate_batches(ds, train, 4, seed=3, epoch=1)]
    b = [b.input_ids for b in iterate_batches(ds, train, 4, seed=3, epoch=1)]
    c = [b.input_ids for b in iterate_batches(ds, train, 4, seed=3, epoch=2)]
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_specforge_files_round_trip_into_the_same_batches(tiny_targets, tmp_path):
    target = load_target(tiny_targets[0])
    capture(
        target,
        plan_capture(target, PROMPTS, 64),
        tmp_path / "ds",
        [0, 1, 2],
        meta_for(target, [0, 1, 2]),
        progress=False,
    )
    ds = HiddenStateDataset(tmp_path / "ds")
    sf = tmp_path / "specforge" / "rows_0-5000"
    sf.mkdir(parents=True)
    for i in range(len(ds)):
        s = ds[i]
        torch.save(
            {
                "input_ids": s.input_ids,
                "loss_mask": s.loss_mask.long(),
                "hidden_state": s.last_hidden[None],
                "aux_hidden_state": s.aux_hidden[None],
            },
            sf / f"data_{i}.ckpt",
        )
    spec = SpecForgeDataset(tmp_path / "specforge", target_head=ds.target_head(), layer_ids=[0, 1, 2])
    idx = list(range(len(ds)))
    for x, y in zip(iterate_batches(ds, idx, 5, seed=0), iterate_batches(spec, idx, 5, seed=0), strict=True):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
        assert torch.equal(x.aux_hidden, y.aux_hidden) and torch.equal(x.last_hidden, y.last_hidden)
        # the argmax recomputed from bf16 states matches the captured full-precision one almost everywhere
        assert (x.target_token == y.target_token).float().mean() > 0.9


def test_pickle_payloads_in_specforge_files_are_refused(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "data_0.ckpt").write_bytes(pickle.dumps({"input_ids": Evil()}))
    spec = SpecForgeDataset(tmp_path, target_head=torch.zeros(10, 4), layer_ids=[0, 1, 2])
    with pytest.raises(BadInput, match="not a readable SpecForge sample"):
        spec[0]


def test_reader_memory_does_not_grow_with_dataset_size(tmp_path):
    write_random_dataset(tmp_path / "x1", 16)  # ~8 MiB
    write_random_dataset(tmp_path / "x10", 160)  # ~84 MiB
    rss = {}
    for name in ("x1", "x10"):
        out = subprocess.run(
            [sys.executable, "-c", READER, str(tmp_path / name)], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.split()
        rss[name] = int(out[2])
    assert rss["x10"] / rss["x1"] < 1.1, rss


def test_a_writer_deletes_nothing_it_did_not_write(tmp_path):
    """An output folder holding someone's `notes.tmp` or a `shard-00000.safetensors` that no record of ours names is
    refused (nothing in it deleted); in a folder whose record says a capture of ours is under way, the writer
    discards only its own half-written shard."""
    import pytest

    from common.errors import BadInput
    from drafter.data.dataset import PARTIAL, DatasetWriter

    for name in ("notes.tmp", "shard-00000.safetensors"):
        out = tmp_path / name.replace(".", "-")
        out.mkdir()
        (out / name).write_text("someone else's")
        with pytest.raises(BadInput, match="is not a drafterops dataset"):
            DatasetWriter(out, {"target": "t"})
        assert (out / name).read_text() == "someone else's"
    ours = tmp_path / "ours"
    DatasetWriter(ours, {"target": "t"})  # records itself (index.partial.json) before any shard
    (ours / "shard-00000.safetensors.tmp").write_text("half-written")
    DatasetWriter(ours, {"target": "t"})
    assert (ours / PARTIAL).is_file() and not (ours / "shard-00000.safetensors.tmp").exists()
