"""The GPU path's training step (a host-made plan, each step scored as it comes, drafter/train/ttt_step.py)
trains what the reference trains: the same loss, gradients and acceptance counts as the forward's
logits scored by drafter/loss.ttt_loss, on padded and packed batches, with a sliding window, for the
Llama and MLA draft layers and TTT 1 to 7."""

import pytest
import torch

from drafter.data.dataset import collate
from drafter.data.packing import collate_packed
from drafter.model.ttt_plan import plan_steps
from drafter.train.loss import loss_positions, pred_mask_from_loss_mask, target_draft_logits, ttt_loss
from drafter.train.ttt_step import ttt_step_loss
from tests.helpers.drafters import FAMILIES, random_samples, tiny_drafter


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _both(model, batch, head_rows, ttt: int, denominators: bool):
    mask = pred_mask_from_loss_mask(batch.loss_mask, batch.segment_ids) & batch.attention_mask
    target = target_draft_logits(batch.last_hidden, head_rows)
    counts = loss_positions(batch.target_token, mask, model.t2d, ttt, batch.segment_ids) if denominators else None
    model.zero_grad()
    steps = model(batch.input_ids, batch.aux_hidden, batch.attention_mask, ttt_length=ttt, pred_mask=mask,
                  position_ids=batch.position_ids, segment_ids=batch.segment_ids)  # fmt: skip
    ref_loss, _, ref_stats = ttt_loss(steps, target, batch.target_token, mask, model.t2d, model.d2t,
                                      denominators=counts, world_size=2 if denominators else 1,
                                      segment_ids=batch.segment_ids)  # fmt: skip
    ref_loss.backward()
    ref = (ref_loss.detach(), _grads(model), ref_stats)
    model.zero_grad()
    plan = plan_steps(mask, ttt, tuple(batch.input_ids.shape), batch.attention_mask, batch.segment_ids)
    loss, stats = ttt_step_loss(model, batch, mask, target, plan, denominators=counts,
                                world_size=2 if denominators else 1)  # fmt: skip
    loss.backward()
    return ref, (loss.detach(), _grads(model), stats)


@pytest.mark.parametrize("ttt", [1, 3, 7])
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize(("window", "family"), [(None, "llama"), (7, "llama"), (None, "mla-eagle3.1")])
def test_the_step_scored_as_it_comes_is_the_reference_loss_gradients_and_counts(ttt, layout, window, family):
    model = tiny_drafter(seed=5, sliding_window=window, **FAMILIES[family])
    samples = random_samples(model, lengths=[40, 9, 17, 6, 12, 25], prompts=[10, 3, 8, 2, 12, 5])
    head_rows = torch.randn(model.config.vocab_size, model.config.hidden_size)[model.t2d]
    batch = collate(samples) if layout == "padded" else collate_packed(samples)
    ref, new = _both(model, batch, head_rows, ttt, denominators=layout == "packed")
    assert torch.allclose(ref[0], new[0], rtol=1e-5, atol=1e-6)
    assert ref[1].keys() == new[1].keys()
    for name, g in ref[1].items():
        worst = (g - new[1][name]).abs().max() / g.abs().max().clamp_min(1e-12)
        assert worst <= 1e-5, (name, float(worst))
    for a, b in zip(ref[2].astuple(), new[2].astuple(), strict=True):
        assert torch.equal(a, b.to(a.device))


def test_every_position_scored_when_nothing_is_masked():
    """A batch with every position trained (the benchmark's case): the plan is plain prefixes, and the
    step still equals the reference."""
    model = tiny_drafter(seed=3)
    samples = random_samples(model, lengths=[30, 30], prompts=[0, 0])
    head_rows = torch.randn(model.config.vocab_size, model.config.hidden_size)[model.t2d]
    batch = collate(samples)
    mask = pred_mask_from_loss_mask(batch.loss_mask) & batch.attention_mask
    plan = plan_steps(mask, 4, tuple(batch.input_ids.shape))
    assert all(isinstance(r, int) for r in plan.needed + plan.scored)
    ref, new = _both(model, batch, head_rows, 4, denominators=False)
    assert torch.allclose(ref[0], new[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["mla-eagle3.1"])
def test_the_compiled_gpu_functions_are_the_cpu_arithmetic(family, monkeypatch):
    """Norms, rotary embeddings, SwiGLU and the fused cross-entropy as the GPU path compiles them
    (drafter/model/compiled.py), forced on here: the same loss, gradients and counts as the reference. The MLA
    layer with EAGLE-3.1's norms has every compiled function but the Llama layer's rotary embedding, whose
    expression is the CPU path's own."""
    import drafter.model.compiled

    monkeypatch.setattr(drafter.model.compiled, "on_device", lambda x: True)
    model = tiny_drafter(seed=5, **FAMILIES[family])
    samples = random_samples(model, lengths=[40, 9, 17, 6, 12, 25], prompts=[10, 3, 8, 2, 12, 5])
    head_rows = torch.randn(model.config.vocab_size, model.config.hidden_size)[model.t2d]
    batch = collate_packed(samples)
    monkeypatch.setattr(drafter.model.compiled, "on_device", lambda x: False)
    ref, _ = _both(model, batch, head_rows, 3, denominators=True)
    monkeypatch.setattr(drafter.model.compiled, "on_device", lambda x: True)
    _, new = _both(model, batch, head_rows, 3, denominators=True)
    assert torch.allclose(ref[0], new[0], rtol=1e-5, atol=1e-6)
    for name, g in ref[1].items():
        worst = (g - new[1][name]).abs().max() / g.abs().max().clamp_min(1e-12)
        assert worst <= 1e-5, (name, float(worst))
    for a, b in zip(ref[2].astuple(), new[2].astuple(), strict=True):
        assert torch.equal(a, b)
