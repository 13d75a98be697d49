"""TTT loss and acceptance metrics for EAGLE-3 training and offline evaluation.

Targets come from the target model: its logits restricted to the draft vocabulary (softmax over the
t2d rows), and its full-vocab argmax. Step j at drafter position t is scored against the target at
position t+j+1; `pred_mask[p]` says whether the target's prediction at p is a training target.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def pred_mask_from_loss_mask(loss_mask: torch.Tensor, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """loss_mask[p] marks assistant token p; the prediction made at p-1 is what is trained (never
    across two packed samples)."""
    return shifted(loss_mask.bool(), 1, segment_ids)


def shifted(mask: torch.Tensor, shift: int, segment_ids: torch.Tensor | None = None) -> torch.Tensor:
    """out[..., t] = mask[..., t + shift] where t + shift lies in the same sample as t (else False):
    what TTT step shift-1 at position t is scored on."""
    t = mask.shape[-1]
    out = torch.zeros_like(mask, dtype=torch.bool)
    if shift < t:
        out[..., : t - shift] = mask[..., shift:]
        if segment_ids is not None:
            out[..., : t - shift] &= segment_ids[..., shift:] == segment_ids[..., : t - shift]
    return out


@dataclass
class StepStats:
    """Counts per TTT step, summable across batches."""

    correct: torch.Tensor  # [L] positions where the draft argmax equals the target argmax
    total: torch.Tensor  # [L] valid positions
    chain_correct: torch.Tensor  # [L] positions where steps 0..j are all correct
    chain_total: torch.Tensor  # [L] positions where steps 0..j-1 are all correct (and j valid)

    def __add__(self, other: StepStats) -> StepStats:
        return StepStats(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def astuple(self) -> tuple[torch.Tensor, ...]:
        return (self.correct, self.total, self.chain_correct, self.chain_total)

    @property
    def accuracy(self) -> list[float]:
        """Unconditional per-step accuracy (teacher forced)."""
        return (self.correct / self.total.clamp(min=1)).tolist()

    @property
    def conditional_acceptance(self) -> list[float]:
        """acc_pos_<i>: P(step i correct | steps < i correct)."""
        return (self.chain_correct / self.chain_total.clamp(min=1)).tolist()

    @property
    def sim_accept_len(self) -> float:
        """1 + sum_i prod_{j<=i} acc_j: expected tokens per verify cycle, bonus token included."""
        return simulated_accept_len(self.conditional_acceptance)


def simulated_accept_len(cond_acc: list[float]) -> float:
    total, prod = 1.0, 1.0
    for a in cond_acc:
        prod *= a
        total += prod
    return total


def target_draft_logits(last_hidden: torch.Tensor, head_rows: torch.Tensor) -> torch.Tensor:
    """Target logits over the draft vocabulary: last_hidden @ lm_head[t2d].T, in fp32; on a GPU in the
    states' own half precision (a bf16 matmul accumulates in fp32, as the target's own head does), which
    the loss widens when it takes the softmax."""
    if last_hidden.is_cuda and last_hidden.dtype in (torch.bfloat16, torch.float16):
        return last_hidden @ head_rows.to(last_hidden.dtype).T
    return last_hidden.float() @ head_rows.float().T


def ttt_loss(
    step_logits: list[torch.Tensor],
    target_logits_d: torch.Tensor,
    target_token: torch.Tensor,
    pred_mask: torch.Tensor,
    t2d: torch.Tensor,
    d2t: torch.Tensor,
    decay: float = 0.8,
    denominators: torch.Tensor | None = None,
    world_size: int = 1,
    segment_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor], StepStats]:
    """Soft cross-entropy per step, weighted decay**j. Positions whose target token lies outside the
    draft vocabulary carry no loss (the drafter cannot propose it) but count as rejections in the
    acceptance counts, as they are online.

    Under data parallelism each rank passes `denominators` (the loss positions per step summed over
    all ranks, `loss_positions` + all_reduce) and `world_size`: the gradients DeepSpeed averages
    over ranks then equal those of one rank holding the whole global batch.

    step_logits[j]: [B, T, Vd]; target_logits_d: [B, T, Vd]; target_token: [B, T] target ids;
    pred_mask: [B, T] bool; segment_ids: [B, T] for packed rows (a step is never scored across two
    samples). Returns (loss, per-step losses, counts).
    """
    b, t = target_token.shape
    counted_all = pred_mask.bool()  # every position the target verifies
    valid_all = counted_all & t2d[target_token.long()]  # ... of which the drafter could propose
    target_probs = torch.softmax(target_logits_d.float(), dim=-1)
    n_steps = len(step_logits)
    loss = target_logits_d.new_zeros((), dtype=torch.float32)
    step_losses = []
    correct, total, chain_correct, chain_total = (torch.zeros(n_steps, dtype=torch.float64) for _ in range(4))
    alive = torch.ones(b, t, dtype=torch.bool, device=target_token.device)  # chain still correct
    for j, logits in enumerate(step_logits):
        shift = j + 1
        n = min(t - shift, logits.shape[1])  # a step's logits may stop before T: nothing after is scored
        counted = shifted(counted_all, shift, segment_ids)  # a position past short logits counts as a miss
        valid = shifted(valid_all, shift, segment_ids)
        valid[:, max(n, 0) :] = False
        logp = F.log_softmax(logits.float(), dim=-1)
        if n > 0:
            ce = -(target_probs[:, shift : shift + n] * logp[:, :n]).sum(-1)  # [B, n]
            m = valid[:, :n].float()
            if denominators is None:
                step_loss = (ce * m).sum() / m.sum().clamp(min=1.0)
            else:
                step_loss = (ce * m).sum() * world_size / denominators[j].clamp(min=1.0)
        else:
            step_loss = logp.sum() * 0.0
        step_losses.append(step_loss)
        loss = loss + (decay**j) * step_loss
        with torch.no_grad():
            hit = torch.zeros(b, t, dtype=torch.bool, device=target_token.device)
            if n > 0:
                draft = logp[:, :n].argmax(-1)  # float32: faster than a bf16 argmax, the same order
                hit[:, :n] = (draft + d2t[draft]) == target_token[:, shift : shift + n].long()
            hit &= valid
            correct[j] = hit.sum()
            total[j] = counted.sum()
            considered = alive & counted
            chain_total[j] = considered.sum()
            alive = considered & hit
            chain_correct[j] = alive.sum()
    return loss, step_losses, StepStats(correct, total, chain_correct, chain_total)


def loss_positions(
    target_token: torch.Tensor,
    pred_mask: torch.Tensor,
    t2d: torch.Tensor,
    n_steps: int,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """[n_steps] positions that carry loss at each TTT step (what ttt_loss divides by)."""
    valid_all = pred_mask.bool() & t2d[target_token.long()]
    return torch.stack([shifted(valid_all, j + 1, segment_ids).sum() for j in range(n_steps)]).float()
