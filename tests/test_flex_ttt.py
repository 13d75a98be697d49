"""The GPU path's TTT attention (flex_attention under a block mask, drafter/model/flex_ttt.py) sees exactly
what the reference lets a query see. flex_attention has no backward on a CPU, so here its forward is
held to the blockwise and eager paths on every scored position; its gradients are held to them on a
GPU by `python -m bench.train_gpu`."""

import pytest
import torch

from drafter.data.dataset import collate
from drafter.data.packing import collate_packed
from drafter.model.mla import MLASpec
from drafter.model.ttt_attention import KeyRule
from drafter.train.loss import pred_mask_from_loss_mask, shifted
from tests.helpers.drafters import EAGLE31, tiny_drafter
from tests.test_packing import _samples

# torch's CPU code generator needs key widths of 16 or more: the tiny MLA layer a little wider
MLA16 = dict(mla=MLASpec(kv_lora_rank=16, qk_nope_head_dim=12, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=12))


def _forward(model, batch, attention: str, ttt: int):
    model.attention = attention
    mask = pred_mask_from_loss_mask(batch.loss_mask, batch.segment_ids) & batch.attention_mask
    with torch.no_grad():
        steps = model(batch.input_ids, batch.aux_hidden, batch.attention_mask, ttt_length=ttt, pred_mask=mask,
                      position_ids=batch.position_ids, segment_ids=batch.segment_ids)  # fmt: skip
    return steps, mask


@pytest.mark.parametrize(
    ("family", "window", "layouts"),
    [({}, None, ("padded", "packed")), ({}, 7, ("padded", "packed")), ({**MLA16, **EAGLE31}, 5, ("packed",))],
    ids=["llama", "llama-window", "mla-eagle3.1-window"],
)
def test_flex_attention_gives_the_reference_logits_on_every_scored_position(family, window, layouts):
    model = tiny_drafter(seed=5, sliding_window=window, **family)
    samples = _samples(model, lengths=[40, 9, 17, 6, 12, 25], prompts=[10, 3, 8, 2, 12, 5])
    for layout in layouts:
        batch = collate(samples) if layout == "padded" else collate_packed(samples)
        reference, mask = _forward(model, batch, "eager", 4)
        flex, _ = _forward(model, batch, "flex", 4)
        for j, (a, b) in enumerate(zip(reference, flex, strict=True)):
            scored = shifted(mask, j + 1, batch.segment_ids)[:, : a.shape[1]]
            assert scored.any()
            assert ((a - b).abs() * scored[..., None]).max() <= 1e-5, (layout, j)


def test_the_block_mask_skips_blocks_no_query_may_see():
    """A 1024-token causal step with one earlier step: of the 8 x 16 query-key blocks, the future half
    and the chain's off-diagonal blocks are never visited; wholly visible blocks run without the mask."""
    from drafter.model.flex_ttt import ttt_block_mask

    t = 1024
    rule = KeyRule(torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool), offset=1)
    mask = ttt_block_mask(rule, t, t, 1)
    partial, full = mask.kv_num_blocks.sum().item(), mask.full_kv_num_blocks.sum().item()
    assert partial + full == 8 * 9 // 2 + 8  # the causal half (diagonal included) and the chain's diagonal
    assert full == 8 * 7 // 2  # below the diagonal: no mask to apply
