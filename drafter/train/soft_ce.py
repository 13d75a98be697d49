"""Soft cross-entropy against the target's distribution, its gradient worked out in the same pass.

The gradient of -sum_v p_v log softmax(z)_v with respect to z is softmax(z) * sum(p) - p: known as soon as
the loss is. Autograd's version keeps the fp32 log-softmax for backward ([N, V] fp32 per TTT step, 1 GiB
at 8192 positions over a 32k draft vocabulary) and runs a kernel or more per operation. Here the rows go
through one function (compiled into fused kernels on a GPU; in chunks on the CPU), which returns the weighted loss,
the gradient in the logits' own precision and the argmax the acceptance counts read; backward only
scales the stored gradient. The arithmetic is drafter/loss.ttt_loss's: fp32 log-sum-exp over the row.
"""

from __future__ import annotations

import torch

from drafter.model import compiled

CHUNK_ELEMENTS = 1 << 26  # on the CPU one chunk's fp32 logits stay within 256 MiB, whatever the vocabulary


def _chunk(logits: torch.Tensor, p: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(sum_i w_i CE_i, dCE/dlogits * w, argmax) for rows of logits [n, V], target p [n, V], weights w [n]."""
    z = logits.float()
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    mass = p.sum(-1, keepdim=True)
    ce = (lse * mass).squeeze(-1) - (p * z).sum(-1)
    grad = ((z - lse).exp() * mass - p) * w[:, None]
    return (ce * w).sum(), grad.to(logits.dtype), z.argmax(-1)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, p, w):  # noqa: ANN001
        n = logits.shape[0]
        if compiled.on_device(logits):  # one fused pass over every row: nothing wide is materialised
            loss, grad, top = compiled.compiled(_chunk)(logits, p, w)
        else:  # rows in chunks, so that the fp32 intermediates stay bounded
            rows = max(1, CHUNK_ELEMENTS // max(1, logits.shape[-1]))
            loss = logits.new_zeros((), dtype=torch.float32)
            grad = torch.empty_like(logits)
            top = torch.empty(n, dtype=torch.long, device=logits.device)
            for lo in range(0, n, rows):
                hi = min(n, lo + rows)
                part, grad[lo:hi], top[lo:hi] = _chunk(logits[lo:hi], p[lo:hi], w[lo:hi])
                loss = loss + part
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(top)
        return loss, top

    @staticmethod
    def backward(ctx, grad_loss, _grad_top):  # noqa: ANN001
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None


def soft_cross_entropy(
    logits: torch.Tensor, target_p: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum over rows of weight * cross-entropy of softmax(logits) against target_p, each row's argmax).
    logits [N, V] in any precision, target_p [N, V], weight [N]; gradients flow to logits only."""
    return _SoftCrossEntropy.apply(logits, target_p.float(), weight.float())
