"""RMSNorm and SwiGLU that keep only their inputs for backward and recompute the rest.

Autograd keeps every intermediate of the plain expressions: RMSNorm in fp32 holds its fp32 copy of
the input, the normalised value and its cast (seven hidden-size fp32 tensors per position across the
drafter's norms), SwiGLU holds gate, up, silu(gate) and their product. At the real K2 drafter's
width (hidden 7168, intermediate 18432) that is 6 GiB of a 4096-token TTT-7 sample. These functions
save their inputs (and RMSNorm's fp32 reciprocal norm, one number per position) and recompute the
rest in backward: the same arithmetic, in the same precisions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from drafter.model import compiled


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (bf16 and fp16 widen, fp64 stays)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps: float):  # noqa: ANN001
        xf = _wide(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        x, weight, rstd = ctx.saved_tensors
        normed = (_wide(x) * rstd).to(x.dtype)
        grad_weight = (grad * normed).reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        g = _wide((grad * weight).to(x.dtype))
        xhat = _wide(x) * rstd
        grad_x = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


def _plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = _wide(x)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), the normalisation in fp32, the result in x's dtype times the weight
    (on a GPU one compiled kernel each way, drafter/model/compiled.py)."""
    if compiled.on_device(x):
        return compiled.compiled(_plain_rms_norm)(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):  # noqa: ANN001
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(_wide(gate))
        silu = _wide(gate) * sig
        grad_up = (_wide(grad) * silu).to(up.dtype)
        grad_gate = (_wide(grad) * _wide(up) * sig * (1 + _wide(gate) * (1 - sig))).to(gate.dtype)
        return grad_gate, grad_up


def _plain_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, keeping only gate and up for backward (on a GPU one compiled kernel each way)."""
    if compiled.on_device(gate):
        return compiled.compiled(_plain_swiglu)(gate, up)
    return _SwiGLU.apply(gate, up)


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in float32 for bf16 stability."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # keeps x and one fp32 number per position for backward


def normal_init(model: nn.Module, seed: int = 0, std: float = 0.02, keep: tuple[str, ...] = ()) -> None:
    """Random init for training from scratch, one seeded draw per parameter in order: N(0, std), every RMSNorm's
    weight at 1, the parameters named in `keep` (a borrowed embedding) left as they are."""
    gen = torch.Generator().manual_seed(seed)
    norms = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, RMSNorm)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in keep:
                continue
            if name in norms:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
