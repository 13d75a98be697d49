"""The GPU path's TTT attention (flex_attention under a block mask, drafter/model/flex_ttt.py) sees exactly
what the reference lets a query see. flex_attention has no backward on a CPU, so here its forward is held to
the blockwise path (itself held to the eager one, tests/test_packing.py) on the rule's every case, and once
through the drafter's whole TTT forward; its gradients are held to the eager path on a GPU by
`python -m bench.train_gpu --check`. On a CPU each shape compiles on its own: few shapes here."""

import pytest
import torch

from drafter.model.flex_ttt import flex_ttt_attention, ttt_block_mask
from drafter.model.ttt_attention import KeyRule, blockwise_ttt_attention


def _case(rows: str, window, segments: bool, chain: int, qk: int, v: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    b, h, t = 2, 2, 48
    key_ok = torch.ones(b, t, dtype=torch.bool)
    key_ok[1, 40:] = False  # a padded row
    seg = None
    if segments:
        seg = torch.tensor([[0] * 20 + [1] * 28, [0] * 10 + [1] * 30 + [-1] * 8])
    if rows == "prefix":
        pos = torch.arange(t - chain)[None].expand(b, -1)
    else:  # positions per row: what a step computes when prompts are not scored
        pos = torch.stack([torch.arange(5, 45), torch.arange(8, 48)])
    m = pos.shape[1]
    q = torch.randn(b, h, m, qk, generator=g)
    keys, values = torch.randn(b, h, t, qk, generator=g), torch.randn(b, h, t, v, generator=g)
    chain_k = [torch.randn(b, h, m, qk, generator=g) for _ in range(chain)]
    chain_v = [torch.randn(b, h, m, v, generator=g) for _ in range(chain)]
    rule = KeyRule(pos, key_ok, seg, window, offset=chain)
    return q, keys, values, chain_k, chain_v, rule


@pytest.mark.parametrize(
    ("rows", "window", "segments", "chain", "qk", "v"),
    [("positions", 7, True, 3, 16, 16), ("prefix", 9, True, 2, 32, 16)],
    ids=["positions-window-packed-chain", "mla-widths"],
)
def test_flex_attention_sees_what_the_reference_sees(rows, window, segments, chain, qk, v):
    q, keys, values, chain_k, chain_v, rule = _case(rows, window, segments, chain, qk, v)
    stacked_k = torch.stack(chain_k, dim=3) if chain else q.new_zeros(*q.shape[:3], 0, qk)
    stacked_v = torch.stack(chain_v, dim=3) if chain else q.new_zeros(*q.shape[:3], 0, v)
    reference = blockwise_ttt_attention(q, keys, values, stacked_k, stacked_v, rule, 0.3)
    got = flex_ttt_attention(q, keys, values, chain_k, chain_v, rule, 0.3)
    seen = torch.gather(rule.key_ok, 1, rule.query_pos)  # queries at padding see nothing they may use
    assert ((got - reference).abs() * seen[:, None, :, None]).max() <= 1e-5


def test_the_drafters_ttt_forward_under_flex_is_the_reference():
    from drafter.data.dataset import collate
    from drafter.model.eagle3 import Eagle3Drafter
    from drafter.train.loss import pred_mask_from_loss_mask, shifted
    from tests.helpers.drafters import random_samples, tiny_config

    model = Eagle3Drafter(tiny_config(head_dim=16, num_attention_heads=2, num_key_value_heads=2, sliding_window=9))
    model.init_weights(3)
    model.has_embedding = True
    batch = collate(random_samples(model, lengths=[24, 24], prompts=[0, 0]))
    mask = pred_mask_from_loss_mask(batch.loss_mask) & batch.attention_mask
    outs = {}
    for mode in ("blockwise", "flex"):
        model.attention = mode
        with torch.no_grad():
            outs[mode] = model(batch.input_ids, batch.aux_hidden, batch.attention_mask, ttt_length=2, pred_mask=mask)
    for j, (a, b) in enumerate(zip(outs["blockwise"], outs["flex"], strict=True)):
        scored = shifted(mask, j + 1)[:, : a.shape[1]]
        assert ((a - b).abs() * scored[..., None]).max() <= 1e-5, j


def test_the_block_mask_skips_blocks_no_query_may_see():
    """A 1024-token causal step with one earlier step: of the 8 x 16 query-key blocks, the future half
    and the chain's off-diagonal blocks are never visited; wholly visible blocks run without the mask."""
    t = 1024
    rule = KeyRule(torch.arange(t)[None], torch.ones(1, t, dtype=torch.bool), offset=1)
    mask = ttt_block_mask(rule, t, t, 1, dynamic=False)
    partial, full = mask.kv_num_blocks.sum().item(), mask.full_kv_num_blocks.sum().item()
    assert partial + full == 8 * 9 // 2 + 8  # the causal half (diagonal included) and the chain's diagonal
    assert full == 8 * 7 // 2  # below the diagonal: no mask to apply
