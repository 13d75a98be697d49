"""What one draft step reads, per family, from the config the gate holds to the headers."""

from __future__ import annotations

import math

from common.paths import MINIWORLD, ROOT
from drafter.analysis.step_cost import folder_step_cost, main, step_cost
from drafter.formats.checkpoint import read_header
from drafter.formats.layouts import to_project, view
from drafter.model.config import DrafterConfig


def test_a_llama_draft_step_reads_its_layer_norms_and_head_and_fc_once_a_cycle():
    """aq-mini-eagle3 by hand: q/k/v/o, the SwiGLU, four norms and the draft-vocabulary head a step; fc a cycle;
    the embedding (a row lookup) and the vocabulary maps never."""
    cfg = view(MINIWORLD / "aq-mini-eagle3").config
    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads * cfg.head_dim, (
        cfg.num_key_value_heads * cfg.head_dim)  # fmt: skip
    layer = q * 2 * h + 2 * kv * 2 * h + h * q + 3 * h * i + 3 * h
    assert step_cost(cfg).per_step == layer + h + cfg.draft_vocab_size * h
    assert step_cost(cfg).per_cycle == h * 3 * cfg.target_hidden


def test_each_family_is_counted_from_the_layout_it_ships_in_as_from_its_project_form(tmp_path):
    """MLA's low-rank projections, a whole-vocabulary head and the EAGLE-3.1 norms all count, and a drafter
    read in its own layout costs what its project form's tensors hold (headers summed)."""
    costs = {}
    for name in ("aq-mini-eagle3", "ls-mini-eagle3-mla", "nv-mini-eagle3", "rh-mini-eagle3"):
        folder = MINIWORLD / name
        costs[name] = folder_step_cost(folder)
        project = folder if view(folder).layout == "project" else to_project(folder, tmp_path / name)
        header = read_header(project)
        counted = sum(math.prod(info.shape) for tensor, info in header.items()
                      if tensor not in ("d2t", "t2d", "embed_tokens.weight"))  # fmt: skip
        assert counted == costs[name].per_step + costs[name].per_cycle, name
    assert costs["nv-mini-eagle3"].per_step > 1.7 * costs["aq-mini-eagle3"].per_step  # its head is the whole vocab
    assert costs["ls-mini-eagle3-mla"].per_step < costs["aq-mini-eagle3"].per_step  # low-rank q and kv
    assert costs["rh-mini-eagle3"].per_cycle > costs["aq-mini-eagle3"].per_cycle  # fc_norm: three norms a cycle


def test_the_public_k25_mla_drafter_reads_more_a_step_than_the_k2_drafter(capsys):
    """The reference configs: lightseekorg's MLA drafter reads about 1.6x the K2 drafter's parameters a step."""
    k2 = step_cost(DrafterConfig.from_file(ROOT / "configs/reference/kimi-k2-eagle3.config.json"))
    mla = step_cost(DrafterConfig.from_file(ROOT / "configs/reference/kimi-k2.5-eagle3-mla.config.json"))
    assert 1.5 < mla.per_step / k2.per_step < 1.8
    main([str(MINIWORLD / "aq-mini-eagle3")])
    assert "344576 parameters a draft step" in capsys.readouterr().out
