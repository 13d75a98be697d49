"""Every layout public drafters ship in reads back as the drafter that was written, and a folder that fits
no layout, or two, is refused by name with nothing written."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from common.errors import BadInput
from drafter.formats.checkpoint import load_drafter, read_header
from drafter.formats.layouts import detect, to_project, write_layout
from tests.helpers.drafters import FAMILIES, tiny_drafter

CASES = [
    ("modelopt", "llama"),
    ("modelopt", "mla"),
    ("modelopt", "whole-vocab-mla"),
    ("torchspec", "mla-eagle3.1"),
    ("speculators", "llama-eagle3.1"),
]


def _drafter(family: str):
    if family == "whole-vocab-mla":
        return tiny_drafter(seed=4, draft_vocab_size=96, **FAMILIES["mla"])
    return tiny_drafter(seed=4, **FAMILIES[family])


@pytest.mark.parametrize(("layout", "family"), CASES)
def test_each_layout_reads_back_as_the_drafter_written(tmp_path, layout, family):
    model = _drafter(family).to(torch.bfloat16)
    folder = write_layout(model, tmp_path / layout, layout)
    assert detect(folder) == layout
    names = set(read_header(folder))
    if layout != "speculators":  # the exporters' own names
        assert any(n.startswith("layers.0.") for n in names) and not any(n.startswith("midlayer.") for n in names)
    if layout == "modelopt":
        assert "t2d" not in names and "embed_tokens.weight" not in names
        assert ("d2t" in names) is (model.config.draft_vocab_size < model.config.vocab_size)
    back = load_drafter(to_project(folder, tmp_path / "project"), dtype=torch.bfloat16)
    assert back.config.to_dict() == model.config.to_dict()
    theirs = back.state_dict()
    for name, tensor in model.state_dict().items():
        if name != "embed_tokens.weight":
            assert torch.equal(tensor, theirs[name]), name


def _modelopt(tmp_path, family="llama"):
    return write_layout(_drafter(family), tmp_path / "nv", "modelopt")


def _edit_config(folder, change):
    raw = json.loads((folder / "config.json").read_text())
    change(raw)
    (folder / "config.json").write_text(json.dumps(raw))


def _rename(folder, change):
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    save_file(change(tensors), str(path))


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda f: _edit_config(f, lambda r: r["eagle_config"].update(use_mtp_layernorm=True)),
         "eagle_config.use_mtp_layernorm is True"),
        (lambda f: _edit_config(f, lambda r: r["eagle_config"].update(mystery_switch=1)),
         "eagle_config keys ModelOpt's plain EAGLE-3 does not write: mystery_switch"),
        (lambda f: _rename(f, lambda t: {**t, "midlayer.extra.weight": torch.ones(2)}),
         "mixed layout: tensors named both"),
        (lambda f: _rename(f, lambda t: {**t, "layers.0.self_attn.kv_b_proj.weight": torch.ones(2, 2)}),
         "tensors of two draft-layer families"),
        (lambda f: _rename(f, lambda t: {**t, "layers.1.mlp.up_proj.weight": torch.ones(2)}),
         "decoder layers 1 beyond the first"),
        (lambda f: _rename(f, lambda t: {**t, "medusa_head.0.weight": torch.ones(2)}),
         "unexpected tensors: medusa_head.0.weight"),
        (lambda f: _edit_config(f, lambda r: r.pop("eagle_config")),
         "unknown layout"),
    ],
)  # fmt: skip
def test_what_fits_no_layout_is_refused_by_name_and_nothing_is_written(tmp_path, mutate, words):
    folder = _modelopt(tmp_path)
    mutate(folder)
    with pytest.raises(BadInput) as err:
        to_project(folder, tmp_path / "out")
    assert words in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
