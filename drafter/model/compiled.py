"""Functions compiled once per process, for the GPU path.

On a GPU each small operation of a norm, a rotary embedding or SwiGLU is a kernel of its own that reads
and writes the whole activation; compiled, each is one fused kernel forward and one backward, and
autograd keeps what the compiler's partitioner chooses to keep: the inputs, with the rest recomputed in
backward, as drafter/model/lean_ops.py does by hand on the CPU. Shapes are dynamic from the first call, so
every length, step and row count shares one compilation (per dtype), and Optuna's trials in one process
reuse it. The CPU path runs the same functions uncompiled (`on_device` says which applies).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

RECOMPILE_LIMIT = 64  # variants per function (dtypes, constants): far more than a run meets


@functools.cache
def compiled(fn: Callable) -> Callable:
    """`fn` compiled with dynamic shapes (one compilation per process and function)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, dynamic=True)


def on_device(x: torch.Tensor) -> bool:
    """Whether `x` takes the compiled GPU path (tests force it on the CPU to check it there)."""
    return x.is_cuda
