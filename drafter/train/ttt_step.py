"""One TTT training step's loss and acceptance counts, each step scored as the unroll produces it.

drafter/loss.ttt_loss scores every step's logits at once, after the forward, so all of them live
together with their fp32 log-softmax. Here drafter/model.ttt_states hands over each step's carried
states as soon as the step is done; the draft head turns them into logits and drafter/soft_ce scores
them at once, so a step's logits never outlive it. Nothing reads a number back to the host: the loss
and the counts stay on the device until whoever logs them asks (drafter/train/loop.py, once per logging
interval). The arithmetic is ttt_loss's, position for position (tests/test_ttt_step.py): the GPU path
trains what the CPU path trains.
"""

from __future__ import annotations

import torch

from drafter.data.dataset import Batch
from drafter.model.eagle3 import Eagle3Drafter
from drafter.model.ttt_plan import PackedPlan, Plan, StepPlan
from drafter.train.loss import StepStats, loss_positions, shifted
from drafter.train.soft_ce import soft_cross_entropy


def ttt_step_loss(
    model: Eagle3Drafter,
    batch: Batch,
    pred_mask: torch.Tensor,
    target_logits_d: torch.Tensor,
    plan: Plan,
    decay: float = 0.8,
    denominators: torch.Tensor | None = None,
    world_size: int = 1,
    noise_std: float = 0.0,
) -> tuple[torch.Tensor, StepStats]:
    """(loss, counts) of one TTT unroll over `batch`, as ttt_loss gives them for the forward's logits:
    soft cross-entropy per step weighted decay**j over the positions the drafter could propose, each
    step divided by its loss positions (`denominators`, summed over ranks, times `world_size`; this
    batch's own when None). `plan` is drafter/ttt_plan.plan_steps of the same `pred_mask`."""
    steps = len(plan.rows[0].needed if isinstance(plan, PackedPlan) else plan.needed)
    if denominators is None:
        denominators = loss_positions(batch.target_token, pred_mask, model.t2d, steps, batch.segment_ids)
    coef = decay ** torch.arange(steps, device=pred_mask.device, dtype=torch.float32)  # made on the device: no copy
    coef = coef * world_size / denominators.float().clamp(min=1.0)
    target_p = torch.softmax(target_logits_d, dim=-1, dtype=torch.float32)
    counted_all = pred_mask.bool()
    valid_all = counted_all & model.t2d[batch.target_token.long()]
    if isinstance(plan, PackedPlan):
        parts = [(slice(r, r + 1), n, p) for r, (n, p) in enumerate(zip(plan.lengths, plan.rows, strict=True))]
    else:
        parts = [(slice(None), batch.input_ids.shape[1], plan)]
    loss, counts = None, []
    for rows, n, row_plan in parts:
        cut = lambda x, rows=rows, n=n: None if x is None else x[rows, :n]  # noqa: E731
        row_loss, row_counts = _rows(
            model, cut, batch, row_plan, cut(target_p), cut(counted_all), cut(valid_all), coef, noise_std
        )
        loss = row_loss if loss is None else loss + row_loss
        counts.append(row_counts)
    return loss, StepStats(*(torch.stack([c[i] for c in counts]).sum(0) for i in range(4)))


def _rows(model, cut, batch: Batch, plan: StepPlan, target_p, counted_all, valid_all, coef, noise_std):  # noqa: ANN001
    """One row group's (loss, (correct, total, chain_correct, chain_total)) over its steps."""
    segments = cut(batch.segment_ids)
    target = cut(batch.target_token).long()
    b, t = target.shape
    alive = torch.ones(b, t, dtype=torch.bool, device=target.device)  # the chain still correct
    loss, per_step = None, []
    unroll = model.ttt_states(cut(batch.input_ids), cut(batch.aux_hidden), plan, cut(batch.attention_mask),
                              noise_std, cut(batch.position_ids), segments)  # fmt: skip
    for j, (states, at) in enumerate(unroll):
        shift = j + 1
        counted = shifted(counted_all, shift, segments)
        valid = shifted(valid_all, shift, segments)
        logits = model.logits(states)
        hit = torch.zeros(b, t, dtype=torch.bool, device=target.device)
        if at is None or isinstance(at, int):  # the prefix 0..m-1: plain slices
            m = min(logits.shape[1], t - shift)  # later positions have nothing to predict
            if m > 0:
                w = valid[:, :m].float() * coef[j]
                p = target_p[:, shift : shift + m]
                part, top = soft_cross_entropy(logits[:, :m].flatten(0, 1), p.flatten(0, 1), w.flatten())
                top = top.view(b, m)
                hit[:, :m] = (top + model.d2t[top]) == target[:, shift : shift + m]
            else:
                part = logits.sum() * 0.0
        else:  # positions per row
            ahead = (at + shift).clamp(max=t - 1)
            w = torch.gather(valid, 1, at).float() * coef[j]
            p = torch.gather(target_p, 1, ahead[..., None].expand(-1, -1, target_p.shape[-1]))
            part, top = soft_cross_entropy(logits.flatten(0, 1), p.flatten(0, 1), w.flatten())
            top = top.view(at.shape)
            hit = hit.scatter(1, at, (top + model.d2t[top]) == torch.gather(target, 1, ahead))
        hit &= valid
        considered = alive & counted
        alive = considered & hit
        per_step.append(torch.stack([hit.sum(), counted.sum(), alive.sum(), considered.sum()]))
        loss = part if loss is None else loss + part
    counts = torch.stack(per_step).double()  # [steps, 4]
    return loss, (counts[:, 0], counts[:, 1], counts[:, 2], counts[:, 3])
