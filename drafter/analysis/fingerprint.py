"""Identities of what an evaluation was measured on, so that evidence can be bound to its conditions.

A target's identity is its config, the safetensors headers of its weights (names, shapes, dtypes), and the
sha256 of each weight file: K2.5, K2.6 and K2.7 share one architecture and one set of headers, so only the
weights tell them apart. A hub snapshot names each file by its sha256 already (the cache's blob names), so
a 1T target costs no hashing; a local folder is hashed once per file version in this process.
(A prompt's identity is serving.workload.prompt_key.)
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from common.errors import BadInput


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def target_digest(source: str | Path) -> str:
    """sha256 over the target's config.json and its weights' headers (local folders); hub ids are
    resolved through the local hub cache only when they were downloaded before."""
    from drafter.formats.checkpoint import read_file_header

    folder = Path(source)
    if not folder.is_dir():
        from drafter.model.target import resolve_local

        folder, _ = resolve_local(str(source))
    config = folder / "config.json"
    if not config.is_file():
        raise BadInput(f"{folder}: target has no config.json")
    try:
        cfg = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadInput(f"{config}: not valid JSON") from None
    headers = {}
    for path in sorted(folder.glob("*.safetensors")):
        headers[path.name] = {k: [v.dtype, list(v.shape)] for k, v in read_file_header(path).items()}
    contents = {path.name: file_sha256(path) for path in sorted(folder.glob("*.safetensors"))}
    return _sha({"config": cfg, "weights": headers, "contents": contents})


_HASHED: dict[tuple[str, int, int], str] = {}
_BLOB = re.compile(r"^[0-9a-f]{64}$")


def file_sha256(path: Path) -> str:
    """A weight file's sha256: the hub cache's blob name when the file is one (huggingface_hub names LFS
    blobs by their sha256), else hashed in 8 MiB blocks, once per (file, size, mtime) in this process."""
    real = path.resolve()
    if path.is_symlink() and real.parent.name == "blobs" and _BLOB.match(real.name):
        return real.name
    st = real.stat()
    key = (str(real), st.st_size, st.st_mtime_ns)
    if key not in _HASHED:
        h = hashlib.sha256()
        with real.open("rb") as fh:
            while block := fh.read(8 << 20):
                h.update(block)
        _HASHED[key] = h.hexdigest()
    return _HASHED[key]


def tensor_digest(folder: str | Path) -> str:
    """The weights' identity by value: sha256 over every tensor's name, shape and values at one canonical
    precision (floating point as float32, the rest as int64), in name order, whatever file, shard layout,
    metadata or dtype they were saved with. Lineage is looked up by it, so weights re-saved with other
    metadata, re-imported from a folder, or re-saved losslessly in another precision (bf16 as float32) are
    still the same weights. A lossy change (float32 as bf16, any noise) is another digest: `drafter.analysis.sketch`
    recognises those near-copies."""
    return _sha({name: f"{shape}|{hashlib.sha256(raw).hexdigest()}" for name, shape, raw in _canonical(folder)})


def legacy_tensor_digest(folder: str | Path) -> str:
    """The digest earlier versions logged (each tensor's own dtype and bytes): looked up too, so a store's older
    lineage records are still found."""
    import torch

    per_tensor = {}
    for name, t in tensors(folder):
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        per_tensor[name] = f"{t.dtype}|{list(t.shape)}|{hashlib.sha256(raw).hexdigest()}"
    return _sha(per_tensor)


def tensors(folder: str | Path):
    """(name, tensor) of every tensor in the folder's safetensors files, contiguous."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise BadInput(f"{folder}: no safetensors weights to fingerprint")
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, fh.get_tensor(name).contiguous()


def canonical_values(t: Any) -> Any:
    """A tensor's values at the canonical precision: float32 for floating point, int64 for the rest."""
    import torch

    return t.to(torch.float32) if t.is_floating_point() else t.to(torch.int64)


def _canonical(folder: str | Path):
    for name, t in tensors(folder):
        values = canonical_values(t).reshape(-1)
        yield name, list(t.shape), values.numpy().astype(values.numpy().dtype.newbyteorder("<")).tobytes()
