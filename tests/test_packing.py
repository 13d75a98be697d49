"""Packed rows give the padded batch's loss, gradients and acceptance counts on the same samples."""

import pytest
import torch

from drafter.data.dataset import collate
from drafter.data.packing import collate_packed, first_fit_decreasing
from drafter.train.loss import loss_positions, pred_mask_from_loss_mask, target_draft_logits, ttt_loss
from tests.helpers.drafters import FAMILIES, random_samples, tiny_drafter


def _loss_and_grads(model, batch, head_rows, ttt: int):
    model.zero_grad()
    mask = pred_mask_from_loss_mask(batch.loss_mask, batch.segment_ids) & batch.attention_mask
    steps = model(
        batch.input_ids, batch.aux_hidden, batch.attention_mask, ttt_length=ttt, pred_mask=mask,
        position_ids=batch.position_ids, segment_ids=batch.segment_ids,
    )  # fmt: skip
    counts = loss_positions(batch.target_token, mask, model.t2d, ttt, batch.segment_ids)
    loss, _, stats = ttt_loss(
        steps, target_draft_logits(batch.last_hidden, head_rows), batch.target_token, mask, model.t2d, model.d2t,
        denominators=counts, segment_ids=batch.segment_ids,
    )  # fmt: skip
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, stats, counts


@pytest.mark.parametrize("ttt", [1, 3])
def test_packed_rows_give_the_padded_batchs_loss_gradients_and_counts(ttt):
    torch.manual_seed(0)
    model = tiny_drafter(seed=5)
    # a long-tailed mix: one long conversation and several short ones that share its row width
    samples = random_samples(model, lengths=[40, 9, 17, 6, 12, 25], prompts=[10, 3, 8, 2, 12, 5])
    head_rows = torch.randn(model.config.vocab_size, model.config.hidden_size)[model.t2d]
    padded, packed = collate(samples), collate_packed(samples)
    assert packed.input_ids.shape[0] < padded.input_ids.shape[0]  # fewer rows: less work
    assert packed.num_tokens == padded.num_tokens
    a, b = _loss_and_grads(model, padded, head_rows, ttt), _loss_and_grads(model, packed, head_rows, ttt)
    assert torch.equal(a[3], b[3])  # the same loss positions per step
    assert torch.allclose(a[0], b[0], atol=1e-5, rtol=1e-5)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.allclose(a[1][name], b[1][name], atol=1e-5, rtol=1e-4), name
    for x, y in zip(a[2].astuple(), b[2].astuple(), strict=True):
        assert torch.equal(x, y)


def test_a_sample_never_sees_its_row_neighbour():
    """Changing the first sample of a row changes nothing the second sample's logits depend on, and
    the second sample's positions restart at 0."""
    model = tiny_drafter(seed=1)
    samples = random_samples(model, lengths=[20, 8, 10], prompts=[0, 0, 0])
    packed = collate_packed(samples)
    assert packed.segment_ids.tolist()[1] == [1] * 8 + [2] * 10 + [-1] * 2  # 8 + 10 share a row of 20
    assert packed.position_ids[1, 8:18].tolist() == list(range(10))
    other = random_samples(model, lengths=[20, 8, 10], prompts=[0, 0, 0], seed=9)
    changed = collate_packed([samples[0], other[1], samples[2]])  # the row's first sample replaced
    run = lambda b: model(b.input_ids, b.aux_hidden, b.attention_mask, ttt_length=3,  # noqa: E731
                          position_ids=b.position_ids, segment_ids=b.segment_ids)  # fmt: skip
    out, out2 = run(packed), run(changed)
    second = packed.segment_ids == 2
    for j in range(3):
        assert torch.allclose(out[j][second], out2[j][second], atol=1e-6), j
        assert not torch.allclose(out[j][packed.segment_ids == 1], out2[j][packed.segment_ids == 1])


def test_first_fit_decreasing_never_overfills_and_keeps_every_sample():
    lengths = [30, 2, 17, 13, 30, 1, 8, 22]
    rows = first_fit_decreasing(lengths, 30)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 30 for r in rows)
    assert len(rows) == 5  # 30 | 30 | 22+8 | 17+13 | 2+1


def _under(model, batch, head_rows, ttt: int, attention: str, bf16: bool):
    model.attention = attention
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return _loss_and_grads(model, batch, head_rows, ttt)


# the largest relative differences seen (bench-free: tests/test_packing.py prints none): fp32 ~4e-7,
# bf16 ~1e-2 of a tensor's largest gradient (bf16 keeps 8 bits of mantissa: 2^-7 = 7.8e-3 per rounding)
TOLERANCE = {False: 1e-5, True: 3e-2}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize(("window", "family"), [(None, "llama"), (7, "llama"), (None, "mla-eagle3.1")])
def test_blockwise_attention_gives_the_eager_loss_and_gradients(bf16, layout, window, family, monkeypatch):
    """The linear-memory path (query blocks merged by log-sum-exp, scores recomputed in backward) is
    the eager path's arithmetic: the same loss, the same gradient for every parameter, on padded and
    packed batches, with and without a sliding window, for the Llama and the MLA draft layer (values
    narrower than keys) with the EAGLE-3.1 norms. Blocks of 16 queries force many blocks."""
    import drafter.model.ttt_attention as ttt_attention

    monkeypatch.setattr(ttt_attention, "BLOCK_ELEMENTS", 1)  # the smallest blocks: 16 queries each
    model = tiny_drafter(seed=5, sliding_window=window, **FAMILIES[family])
    samples = random_samples(model, lengths=[40, 9, 17, 6, 12, 25], prompts=[10, 3, 8, 2, 12, 5])
    head_rows = torch.randn(model.config.vocab_size, model.config.hidden_size)[model.t2d]
    batch = collate(samples) if layout == "padded" else collate_packed(samples)
    eager = _under(model, batch, head_rows, 4, "eager", bf16)
    blockwise = _under(model, batch, head_rows, 4, "blockwise", bf16)
    tol = TOLERANCE[bf16]
    assert abs(eager[0].item() - blockwise[0].item()) <= tol * abs(eager[0].item())
    assert eager[1].keys() == blockwise[1].keys()
    for name, g in eager[1].items():
        worst = (g - blockwise[1][name]).abs().max() / g.abs().max().clamp_min(1e-12)
        assert worst <= tol, (name, float(worst))


def test_a_window_hides_what_lies_beyond_it():
    """With a sliding window of w, a position's step-0 output does not change when a token more than
    w - 1 positions back changes, and does when one inside the window changes."""
    model = tiny_drafter(seed=2, sliding_window=4)
    s = random_samples(model, lengths=[20], prompts=[0])[0]
    ids, aux = s.input_ids[None], s.aux_hidden[None]
    far, near = aux.clone(), aux.clone()
    far[0, 5] += 3.0  # 15 - 5 >= 4: outside position 15's window
    near[0, 13] += 3.0
    base = model(ids, aux, ttt_length=1)[0][0, 15]
    assert torch.allclose(model(ids, far, ttt_length=1)[0][0, 15], base, atol=1e-6)
    assert not torch.allclose(model(ids, near, ttt_length=1)[0][0, 15], base, atol=1e-6)


def test_a_query_that_may_see_no_key_averages_as_the_eager_softmax_does():
    """Attack: a row whose every step-0 key is masked (padding everywhere it may look) and no chain key.
    The eager softmax spreads it evenly over the masked keys; one log-sum-exp (top + log total) rounds to
    the mask value and summed the values instead. Output and gradients equal the plain formula."""
    from drafter.model.ttt_attention import KeyRule, blockwise_ttt_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g, requires_grad=True) for _ in range(3))
    empty = torch.zeros(1, 2, 6, 0, 4)
    key_ok = torch.tensor([[False, False, True, True, True, True]])  # rows 0 and 1 may see no key
    rule = KeyRule(torch.arange(6)[None], key_ok)
    out = blockwise_ttt_attention(q, k, v, empty, empty, rule, 0.5)
    allowed = (torch.arange(6)[None] <= torch.arange(6)[:, None]) & key_ok
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~allowed, torch.finfo(torch.float32).min)
    expected = torch.softmax(scores, -1) @ v
    assert torch.allclose(out, expected, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(expected.square().sum(), (q, k, v)), strict=True):
        assert torch.allclose(got, want, atol=1e-5)
