"""Drafter folders in the SGLang/vLLM layout: config.json + model.safetensors (or shards + index).

Headers are parsed here (8-byte length + JSON) rather than through a loader, so that a gate can check
a 2.4 GB checkpoint by reading a few KB, and so that every kind of corruption gets a message naming
the file. Tensor data is read with `safetensors` (memory-mapped), never with pickle.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.errors import BadInput
from drafter.formats import aux_layers
from drafter.model.config import DrafterConfig, read_json
from drafter.model.eagle3 import Eagle3Drafter, Rotary
from drafter.model.vocab import validate_vocab_maps

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EMBED = "embed_tokens.weight"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "BF16": (torch.bfloat16, 2),
    "F16": (torch.float16, 2),
    "F32": (torch.float32, 4),
    "F64": (torch.float64, 8),
    "I64": (torch.int64, 8),
    "I32": (torch.int32, 4),
    "I16": (torch.int16, 2),
    "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1),
    "BOOL": (torch.bool, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
}
TORCH_TO_ST = {v[0]: k for k, v in DTYPES.items()}
CONFIG_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors name: BF16, I64, BOOL, ...
    shape: tuple[int, ...]
    file: str  # file name inside the folder

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype][1]


def parse_header_bytes(raw: bytes, file_size: int, where: str) -> dict[str, dict]:
    """Validate a safetensors header (the JSON part) against the file size; return its tensor entries."""
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(f"{where}: safetensors header is not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(header, dict):
        raise BadInput(f"{where}: safetensors header is not a JSON object")
    data_size = file_size - 8 - len(raw)
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise BadInput(f"{where}: tensor '{name}' has a malformed header entry")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise BadInput(f"{where}: tensor '{name}' has unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise BadInput(f"{where}: tensor '{name}' has an invalid shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise BadInput(f"{where}: tensor '{name}' has invalid data_offsets {offsets!r}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_size:
            raise BadInput(
                f"{where}: tensor '{name}' data [{begin}, {end}) lies outside the file's {data_size} data bytes"
                " (truncated or corrupt file)"
            )
        if end - begin != math.prod(shape) * DTYPES[dtype][1]:
            raise BadInput(
                f"{where}: tensor '{name}' occupies {end - begin} bytes, its shape needs "
                f"{math.prod(shape) * DTYPES[dtype][1]}"
            )
        tensors[name] = entry
    _check_layout(tensors, data_size, where)
    return tensors


def _check_layout(tensors: dict[str, dict], data_size: int, where: str) -> None:
    """safetensors' own rule: tensors tile the data area exactly, in order, without overlap or gap
    (the library refuses any other file, so a header-only reader must too)."""
    at = 0
    for name, entry in sorted(tensors.items(), key=lambda kv: tuple(kv[1]["data_offsets"])):
        begin, end = entry["data_offsets"]
        if begin != at:
            kind = "overlaps the previous tensor" if begin < at else f"leaves a gap of {begin - at} bytes before it"
            raise BadInput(f"{where}: tensor '{name}' at [{begin}, {end}) {kind} (corrupt or crafted header)")
        at = end
    if at != data_size:
        raise BadInput(f"{where}: {data_size - at} bytes after the last tensor belong to none (corrupt file)")


def read_file_header(path: Path) -> dict[str, TensorInfo]:
    """Header of one safetensors file; reads 8 + header-length bytes, never tensor data."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}: file not found")
    size = path.stat().st_size
    with path.open("rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise BadInput(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise BadInput(f"{path}: safetensors header length {n} is larger than the file ({size} bytes)")
        raw = fh.read(n)
    entries = parse_header_bytes(raw, size, str(path))
    return {k: TensorInfo(v["dtype"], tuple(v["shape"]), path.name) for k, v in entries.items()}


def weight_files(folder: Path) -> list[str]:
    """The safetensors files of a drafter folder: the index's shards, or the single file."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise BadInput(f"{index}: missing or empty 'weight_map'")
        return sorted(set(weight_map.values()))
    if (folder / SINGLE_FILE).is_file():
        return [SINGLE_FILE]
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    if found:
        return found
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in {".bin", ".pt", ".pth"}) if folder.is_dir() else []
    if pickles:
        raise BadInput(f"{folder}: only pickle-based weights ({', '.join(pickles)}); safetensors required")
    raise BadInput(f"{folder}: no safetensors weights ({SINGLE_FILE} or {INDEX_FILE})")


def read_header(folder: str | Path) -> dict[str, TensorInfo]:
    """{tensor name: TensorInfo} for a drafter folder, from headers alone (sharded or not)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"{folder}: not a folder")
    out: dict[str, TensorInfo] = {}
    index = folder / INDEX_FILE
    weight_map = read_json(index).get("weight_map", {}) if index.is_file() else None
    for name in weight_files(folder):
        for tensor, info in read_file_header(folder / name).items():
            if tensor in out:
                raise BadInput(f"{folder}: tensor '{tensor}' appears in both {out[tensor].file} and {name}")
            if weight_map is not None and weight_map.get(tensor) != name:
                raise BadInput(
                    f"{index}: tensor '{tensor}' found in {name} but the index says {weight_map.get(tensor)!r}"
                )
            out[tensor] = info
    if weight_map is not None:
        absent = sorted(set(weight_map) - set(out))
        if absent:
            raise BadInput(f"{index}: tensors listed but absent from the shards: {', '.join(absent[:5])}")
    return out


def expected_tensors(cfg: DrafterConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """What a drafter with this config must hold: {name: (safetensors dtype, shape)}."""
    w = CONFIG_DTYPES.get(cfg.torch_dtype, "BF16")
    h, ht, i = cfg.hidden_size, cfg.target_hidden, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    m = "midlayer."
    if cfg.mla is None:
        attention = {
            "q_proj.weight": (q, 2 * h),
            "k_proj.weight": (kv, 2 * h),
            "v_proj.weight": (kv, 2 * h),
            "o_proj.weight": (h, q),
        }
    else:
        attention = cfg.mla.tensors(cfg.num_attention_heads, 2 * h, h)
    norms = {f"fc_norm.{n}.weight": (w, (ht,)) for n in range(3)} if cfg.fc_norm else {}
    if cfg.norm_before_fc:
        norms["input_norm.weight"] = (w, (3 * ht,))
    return {
        "fc.weight": (w, (h, 3 * ht)),
        **norms,
        f"{m}input_layernorm.weight": (w, (h,)),
        f"{m}hidden_norm.weight": (w, (h,)),
        f"{m}post_attention_layernorm.weight": (w, (h,)),
        **{f"{m}self_attn.{name}": (w, shape) for name, shape in attention.items()},
        f"{m}mlp.gate_proj.weight": (w, (i, h)),
        f"{m}mlp.up_proj.weight": (w, (i, h)),
        f"{m}mlp.down_proj.weight": (w, (h, i)),
        "norm.weight": (w, (h,)),
        "lm_head.weight": (w, (cfg.draft_vocab_size, h)),
        "d2t": ("I64", (cfg.draft_vocab_size,)),
        "t2d": ("BOOL", (cfg.vocab_size,)),
        EMBED: (w, (cfg.vocab_size, h)),
    }


def header_problems(header: dict[str, TensorInfo], cfg: DrafterConfig) -> list[str]:
    """Every way the tensors disagree with the config (embed_tokens may be absent)."""
    expected = expected_tensors(cfg)
    problems = []
    missing = sorted(n for n in expected if n not in header and n != EMBED)
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    unexpected = sorted(n for n in header if n not in expected)
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    for name, (dtype, shape) in expected.items():
        info = header.get(name)
        if info is None:
            continue
        if info.shape != shape:
            problems.append(f"{name}: shape {list(info.shape)}, config implies {list(shape)}")
        if info.dtype != dtype:
            problems.append(f"{name}: dtype {info.dtype}, expected {dtype}")
    return problems


def load_config(folder: str | Path) -> DrafterConfig:
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"{folder}: not a drafter folder")
    return DrafterConfig.from_file(folder / "config.json")


def load_drafter(
    folder: str | Path,
    dtype: torch.dtype = torch.float32,
    embedding: torch.Tensor | None = None,
) -> Eagle3Drafter:
    """Strict load: every tensor must be present with the config's shape and dtype, finite, and the
    vocab maps consistent. embed_tokens may be absent; pass the target's `embedding` then (otherwise
    the model's `has_embedding` is False and it cannot draft until one is set)."""
    folder = Path(folder)
    cfg = load_config(folder)
    header = read_header(folder)
    problems = header_problems(header, cfg)
    if problems:
        raise BadInput(f"{folder}: checkpoint does not match its config: " + "; ".join(problems))
    with torch.device("meta"):  # no random weights first: at real width that was a second, fp32 copy (9.5 GB)
        model = Eagle3Drafter(cfg)
    state = finite_state(folder, header, dtype)
    validate_vocab_maps(state["d2t"], state["t2d"], cfg.draft_vocab_size, cfg.vocab_size, where=str(folder))
    has_embedding = EMBED in state
    if not has_embedding and embedding is not None:
        if tuple(embedding.shape) != (cfg.vocab_size, cfg.hidden_size):
            raise BadInput(
                f"target embedding has shape {list(embedding.shape)}, drafter needs "
                f"[{cfg.vocab_size}, {cfg.hidden_size}]"
            )
        state[EMBED] = embedding.to(dtype)
        has_embedding = True
    if not has_embedding:
        state[EMBED] = torch.zeros(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = Rotary(cfg.rope_dim, cfg.rope, cfg.max_position_embeddings)  # not in the file: computed
    model.has_embedding = has_embedding
    return model


def finite_state(folder: Path, header: dict[str, TensorInfo], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of a checked folder, floating ones at `dtype`; bad input naming the tensor with NaN or Inf."""
    state = {}
    for fname in sorted({info.file for info in header.values()}):
        with safe_open(str(folder / fname), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = fh.get_tensor(name)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    bad = int((~torch.isfinite(tensor)).sum())
                    raise BadInput(f"{folder / fname}: tensor '{name}' has {bad} NaN/Inf values")
                state[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state


def state_for_saving(model: Eagle3Drafter, include_embedding: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in model.state_dict().items():
        if name == EMBED and not (include_embedding and getattr(model, "has_embedding", True)):
            continue
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        out[name] = tensor.detach().contiguous().cpu()
    return out


def save_drafter(
    model: Eagle3Drafter,
    folder: str | Path,
    include_embedding: bool = True,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write config.json + safetensors in the config's dtype; shard when a shard limit is given."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    dtype = DTYPES[CONFIG_DTYPES.get(cfg.torch_dtype, "BF16")][0]
    state = state_for_saving(model, include_embedding, dtype)
    write_tensors(state, folder, max_shard_bytes)
    cfg.save(folder)
    return folder


def write_tensors(state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int | None) -> None:
    """One file, or shards of at most max_shard_bytes plus an index, as transformers writes them."""
    for stale in [folder / SINGLE_FILE, folder / INDEX_FILE, *folder.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(state, str(folder / SINGLE_FILE), metadata=meta)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def export_drafter(
    src: str | Path, out: str | Path, engine: str = "sglang", handed_ids: list[int] | None = None
) -> Path:
    """Serving layout: the same tensors without embed_tokens (SGLang/vLLM take the target's), and a
    config in `engine`'s reading of the aux layer ids (drafter/formats/aux_layers.py) with the keys engines
    need (model_type, num_hidden_layers, ...). `handed_ids` overrides the translation (a test of what
    an untranslated folder does).

    Works shard by shard, so memory stays at one shard."""
    src, out = Path(src), Path(out)
    cfg, header = checked(src)
    copy_tensors(src, out, lambda name: None if name == EMBED else name, header)
    config = cfg.to_dict()
    handed = aux_layers.handed_ids(list(cfg.aux_layer_ids), engine) if handed_ids is None else list(handed_ids)
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = handed
    if aux_layers.convention(engine).offset:
        config[aux_layers.CONVENTION_KEY] = engine
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def checked(src: Path) -> tuple[DrafterConfig, dict[str, TensorInfo]]:
    """A drafter folder's config and tensor headers, or bad input naming every way they disagree."""
    cfg = load_config(src)
    header = read_header(src)
    problems = header_problems(header, cfg)
    if problems:
        raise BadInput(f"{src}: checkpoint does not match its config: " + "; ".join(problems))
    return cfg, header


def copy_tensors(
    src: Path, out: Path, rename: Callable[[str], str | None], header: dict[str, TensorInfo] | None = None
) -> dict[str, str]:
    """Every tensor of `src` under `rename(name)` (None: left out), shard by shard (memory stays at one
    shard), the same bytes; the index rewritten when `src` is sharded. Returns {new name: file}."""
    src, out = Path(src), Path(out)
    header = read_header(src) if header is None else header
    out.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    sizes: dict[str, int] = {}
    for fname in sorted({info.file for info in header.values()}):
        with safe_open(str(src / fname), framework="pt") as fh:
            shard = {}
            for name in fh.keys():  # noqa: SIM118
                new = rename(name)
                if new is not None:
                    shard[new] = fh.get_tensor(name)
                    sizes[new] = header[name].nbytes
        if shard:
            save_file(shard, str(out / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in shard})
    if (src / INDEX_FILE).is_file():
        (out / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}, indent=2) + "\n"
        )
    return weight_map


def read_hub_header(repo_id: str, revision: str | None = None) -> dict[str, TensorInfo]:
    """Tensor headers of a hub repository through huggingface_hub's safetensors metadata (HTTP range
    reads of each file's header): never the weights."""
    from huggingface_hub import get_safetensors_metadata

    meta = get_safetensors_metadata(repo_id, revision=revision)
    out: dict[str, TensorInfo] = {}
    for fname, fmeta in meta.files_metadata.items():
        for name, t in fmeta.tensors.items():
            out[name] = TensorInfo(t.dtype, tuple(t.shape), fname)
    return out


def tensor_header(folder: str | Path, name: str) -> TensorInfo | None:
    """One tensor's header from a model folder, reading only the shard the index names for it."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        shard = read_json(index).get("weight_map", {}).get(name)
        return read_file_header(folder / shard).get(name) if shard else None
    files = [p.name for p in folder.glob("*.safetensors")]
    for fname in sorted(files):
        info = read_file_header(folder / fname).get(name)
        if info is not None:
            return info
    return None
