"""RMSNorm and SwiGLU that keep only their inputs: the plain expressions' values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from drafter.model.lean_ops import rms_norm, swiglu


def _plain_rms_norm(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_gradients_are_exact_in_double():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, generator=g, requires_grad=True)
    up = torch.randn(3, 5, 8, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: rms_norm(a, b, 1e-6), (x, w))
    assert torch.autograd.gradcheck(swiglu, (x, up))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_equal_the_plain_expressions(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 16, 32, generator=g).to(dtype)
    w = torch.randn(32, generator=g)  # fp32 weights, as under autocast
    up = torch.randn(4, 16, 32, generator=g).to(dtype)
    grad = torch.randn(4, 16, 32, generator=g)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for lean, plain, args in (
        (lambda a, b: rms_norm(a, b, 1e-6), lambda a, b: _plain_rms_norm(a, b, 1e-6), (x, w)),
        (swiglu, lambda a, b: F.silu(a) * b, (x, up)),
    ):
        ins_a = [t.clone().requires_grad_() for t in args]
        ins_b = [t.clone().requires_grad_() for t in args]
        out_a, out_b = lean(*ins_a), plain(*ins_b)
        assert out_a.dtype == out_b.dtype
        assert torch.allclose(out_a.float(), out_b.float(), **tol)
        out_a.backward(grad.to(out_a.dtype))
        out_b.backward(grad.to(out_b.dtype))
        for a, b in zip(ins_a, ins_b, strict=True):
            assert torch.allclose(a.grad.float(), b.grad.float(), **tol)
