"""Shape compatibility of a drafter with a target, from safetensors headers and configs alone.

Each rule is a named check with the expected value, the actual one and a verdict (True, False, or
None for "not checked" when what it needs is unavailable, e.g. target weights given by config only).
One check per tensor (shape and dtype together), so a mutated tensor fails its own check and no other.

The gate's verdict (`verdict`): `failed` when any check fails; `passed` only when every required check
was made and passed; `passed-config-only` when nothing failed but a required check could not be made
(a config-only target, a header-only drafter). Informational checks (rope, undeclared ids) never
decide. A check that was not made is never a pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from common.errors import BadInput
from drafter.formats.checkpoint import CONFIG_DTYPES, DTYPES, EMBED, TensorInfo, expected_tensors, parse_header_bytes
from drafter.model.config import NORM_FLAGS, DrafterConfig, TargetConfig
from drafter.model.rope import rope_from_config
from drafter.model.vocab import validate_vocab_maps


@dataclass
class Check:
    name: str
    expected: str
    actual: str
    ok: bool | None  # None: not checked
    note: str = ""
    informational: bool = False  # reported, never decides the verdict

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "not checked"}[self.ok]


@dataclass
class DrafterFacts:
    config: DrafterConfig
    header: dict[str, TensorInfo]
    read_tensor: Callable[[str], torch.Tensor] | None = None  # small tensors (d2t, t2d) only
    source: str = ""


@dataclass
class TargetFacts:
    config: TargetConfig
    embedding: TensorInfo | None  # the target's input embedding, if its weights' headers are known
    weights_known: bool
    source: str = ""


def fmt_shape(info: TensorInfo | None) -> str:
    return "MISSING" if info is None else f"{list(info.shape)} {info.dtype}"


def _rows(shape: tuple[int, ...], dtype: str) -> str:
    return f"{list(shape)} {dtype}"


def check_compat(d: DrafterFacts, t: TargetFacts) -> list[Check]:
    cfg, tc, header = d.config, t.config, d.header
    checks: list[Check] = []
    add = checks.append
    # ---- config against the target
    add(
        Check(
            "hidden size (fc input / 3)",
            str(tc.hidden_size),
            str(cfg.target_hidden),
            cfg.target_hidden == tc.hidden_size,
            "target_hidden_size" if cfg.target_hidden_size else "drafter hidden_size = target hidden size",
        )
    )
    add(Check("vocab_size", str(tc.vocab_size), str(cfg.vocab_size), cfg.vocab_size == tc.vocab_size))
    bad_ids = [i for i in cfg.aux_layer_ids if not 0 <= i < tc.num_hidden_layers]
    add(
        Check(
            "aux layer ids",
            f"each < {tc.num_hidden_layers} target layers",
            str(cfg.aux_layer_ids),
            not bad_ids,
            "outputs of these decoder layers (SGLang: hidden_states[id + 1])",
        )
    )
    # ---- every tensor: shape and dtype implied by the config and the target
    expected = expected_tensors(cfg)
    expected["fc.weight"] = (expected["fc.weight"][0], (cfg.hidden_size, 3 * tc.hidden_size))
    for name in [n for n in expected if n.startswith("fc_norm.")]:
        expected[name] = (expected[name][0], (tc.hidden_size,))
    if "input_norm.weight" in expected:
        expected["input_norm.weight"] = (expected["input_norm.weight"][0], (3 * tc.hidden_size,))
    add(family_check(cfg))
    expected["t2d"] = ("BOOL", (tc.vocab_size,))
    expected[EMBED] = (expected[EMBED][0], (tc.vocab_size, cfg.hidden_size))
    for name, (dtype, shape) in expected.items():
        info = header.get(name)
        if name == EMBED:
            continue
        ok = info is not None and info.shape == shape and info.dtype == dtype
        add(Check(name, _rows(shape, dtype), fmt_shape(info), ok))
    unexpected = sorted(set(header) - set(expected))
    add(
        Check(
            "no unexpected tensors",
            "none",
            ", ".join(unexpected) or "none",
            not unexpected,
            "a loader would drop or mis-assign them",
        )
    )
    # ---- the vocab maps' content (small: read them when the tensors are local)
    d2t_ok = header.get("d2t") is not None and header["d2t"].shape == (cfg.draft_vocab_size,)
    t2d_ok = header.get("t2d") is not None and header["t2d"].shape == (tc.vocab_size,)
    if d2t_ok and t2d_ok and d.read_tensor is not None:
        try:
            validate_vocab_maps(d.read_tensor("d2t"), d.read_tensor("t2d"), cfg.draft_vocab_size, tc.vocab_size)
            add(
                Check(
                    "d2t/t2d consistent",
                    f"t2d has {cfg.draft_vocab_size} true; i + d2t[i] = i-th true id",
                    "consistent",
                    True,
                )
            )
        except BadInput as exc:
            add(Check("d2t/t2d consistent", "i + d2t[i] = i-th true id of t2d", str(exc).split(": ", 1)[-1], False))
    else:
        why = "shapes wrong" if not (d2t_ok and t2d_ok) else "tensor data not available (header-only source)"
        add(Check("d2t/t2d consistent", "i + d2t[i] = i-th true id of t2d", why, None))
    # ---- embedding: the drafter's own, or the target's that serving engines hand it
    e_dtype, e_shape = expected[EMBED]
    if EMBED in header:
        info = header[EMBED]
        add(
            Check(
                "embed_tokens",
                _rows(e_shape, e_dtype),
                fmt_shape(info),
                info.shape == e_shape,
                "present in the drafter (dropped on export)",
            )
        )
    elif t.embedding is not None:
        add(
            Check(
                "embed_tokens (from target)",
                _rows(e_shape, e_dtype),
                f"{list(t.embedding.shape)} {t.embedding.dtype}",
                t.embedding.shape == e_shape and t.embedding.dtype == e_dtype,
                f"absent in the drafter; target's {tc.embedding_name}",
            )
        )
    elif t.weights_known:
        add(
            Check(
                "embed_tokens (from target)",
                _rows(e_shape, e_dtype),
                "MISSING",
                False,
                f"absent in the drafter, and the target's weights hold no {tc.embedding_name}",
            )
        )
    else:
        add(
            Check(
                "embed_tokens (from target)",
                f"{list(e_shape)}",
                "target weights not available",
                None,
                "absent in the drafter; the target's embedding shape is unknown (config-only target)",
            )
        )
    # ---- ids and rope
    for key in ("bos_token_id", "eos_token_id"):
        mine, theirs = getattr(cfg, key), getattr(tc, key)
        if mine is None or theirs is None:
            add(Check(key, str(theirs), str(mine), None, "not declared on one side", informational=True))
        else:
            add(Check(key, str(theirs), str(mine), mine == theirs))
    try:
        target_rope = rope_from_config(tc.text_config).theta
    except BadInput:
        target_rope = "unreadable"
    rope = cfg.rope
    add(
        Check(
            "rope_theta",
            f"drafter's own ({rope.theta:g}, {rope.rope_type})",
            f"target {target_rope}",
            None,
            "reported: the drafter's RoPE is its own and need not equal the target's",
            informational=True,
        )
    )
    dtype_ok = CONFIG_DTYPES.get(cfg.torch_dtype) is not None
    add(Check("torch_dtype", "bfloat16/float16/float32", cfg.torch_dtype, dtype_ok))
    return checks


def family_check(cfg: DrafterConfig) -> Check:
    """Which draft layer the header was read as, and so which tensors the checks below hold it to."""
    flags = [k for k in NORM_FLAGS if getattr(cfg, k)]
    norms = f"; EAGLE-3.1 norms: {', '.join(flags)}" if flags else ""
    if cfg.mla is None:
        what = (
            f"Llama attention: q_proj/k_proj/v_proj/o_proj for {cfg.num_attention_heads} query and "
            f"{cfg.num_key_value_heads} kv heads of {cfg.head_dim}"
        )
    else:
        sp = cfg.mla
        q = "q_proj" if sp.q_lora_rank is None else f"q_a_proj (rank {sp.q_lora_rank}), q_a_layernorm, q_b_proj"
        what = (
            f"MLA: {q}; kv_a_proj_with_mqa (latent {sp.kv_lora_rank} + rope {sp.qk_rope_head_dim}), "
            f"kv_a_layernorm, kv_b_proj (nope {sp.qk_nope_head_dim} + v {sp.v_head_dim} per head), o_proj; "
            f"{cfg.num_attention_heads} heads"
        )
    return Check("draft layer family", cfg.family, what + norms, None, "the tensors checked follow from it",
                 informational=True)  # fmt: skip


def passed(checks: list[Check]) -> bool:
    """Nothing failed (the drafter may still be unproven where a check could not be made)."""
    return all(c.ok is not False for c in checks)


def require_passed(checks: list[Check], refusal: str) -> None:
    """Bad input (`refusal: what differs`, one line) unless nothing failed."""
    if not passed(checks):
        bad = "; ".join(f"{c.name}: expected {c.expected}, got {c.actual}" for c in checks if c.ok is False)
        raise BadInput(f"{refusal}: {bad}")


def verdict(checks: list[Check]) -> str:
    """`failed`, `passed-config-only` (nothing failed, a required check not made) or `passed`."""
    if not passed(checks):
        return "failed"
    if any(c.ok is None and not c.informational for c in checks):
        return "passed-config-only"
    return "passed"


def compare_drafters(a: dict[str, TensorInfo], b: dict[str, TensorInfo]) -> list[tuple[str, str, str, str]]:
    """The seed's side-by-side table: tensor, A, B, YES / NO / MISSING."""
    rows = []
    for name in sorted(set(a) | set(b)):
        ia, ib = a.get(name), b.get(name)
        if ia is None or ib is None:
            verdict = "MISSING"
        else:
            verdict = "YES" if (ia.shape, ia.dtype) == (ib.shape, ib.dtype) else "NO"
        rows.append((name, fmt_shape(ia), fmt_shape(ib), verdict))
    return rows


# ------------------------------------------------------------------------------------------ sources
def local_tensor_reader(folder: Path, header: dict[str, TensorInfo]) -> Callable[[str], torch.Tensor]:
    """Read one (small) tensor by its offsets: a positional read, no memory map of the file."""

    def read(name: str) -> torch.Tensor:
        info = header[name]
        path = Path(folder) / info.file
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            entry = parse_header_bytes(fh.read(n), path.stat().st_size, str(path))[name]
        fd = os.open(path, os.O_RDONLY)
        try:
            begin, end = entry["data_offsets"]
            raw = os.pread(fd, end - begin, 8 + n + begin)
        finally:
            os.close(fd)
        return torch.frombuffer(bytearray(raw), dtype=DTYPES[info.dtype][0]).view(*info.shape)

    return read


def _hub_file(repo: str, filename: str, revision: str | None) -> Path:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(hf_hub_download(repo, filename, revision=revision))
    except (EntryNotFoundError, LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise BadInput(f"{repo}: cannot fetch {filename} from the hub ({exc.__class__.__name__})") from None


def drafter_facts(source: str | Path, revision: str | None = None) -> DrafterFacts:
    """A local drafter folder (headers + the small vocab tensors) or a hub id (headers only)."""
    from drafter.formats.checkpoint import read_header, read_hub_header
    from drafter.formats.layouts import view

    path = Path(source)
    if path.exists():
        if not path.is_dir():
            raise BadInput(f"{path}: not a drafter folder")
        seen = view(path)  # any layout public drafters ship in, read as the project's (drafter/formats/layouts.py)
        if seen.layout == "project":
            return DrafterFacts(seen.config, seen.header, local_tensor_reader(path, seen.header), str(path))
        own = read_header(path)
        reader = local_tensor_reader(path, own)

        def read(name: str) -> torch.Tensor:
            return seen.derived[name] if name in seen.derived else reader(seen.source_names[name])

        return DrafterFacts(seen.config, seen.header, read, f"{path} ({seen.layout} layout)")
    repo, _, rev = str(source).removeprefix("hf://").partition("@")
    rev = revision or rev or None
    cfg = DrafterConfig.from_file(_hub_file(repo, "config.json", rev))
    try:
        header = read_hub_header(repo, rev)
    except Exception as exc:  # huggingface_hub raises several types for a missing or unreachable repo
        raise BadInput(f"{repo}: cannot read safetensors metadata from the hub ({exc.__class__.__name__})") from None
    return DrafterFacts(cfg, header, None, f"hf://{repo}@{rev or 'main'}")


def target_facts(source: str | Path, revision: str | None = None) -> TargetFacts:
    """A target folder (config, plus the embedding's header when weights are there) or a hub id."""
    from drafter.formats.checkpoint import read_hub_header, tensor_header

    path = Path(source)
    if path.exists():
        cfg = TargetConfig.from_file(path)
        has_weights = any(path.glob("*.safetensors"))
        emb = tensor_header(path, cfg.embedding_name) if has_weights else None
        return TargetFacts(cfg, emb, has_weights, str(path))
    repo, _, rev = str(source).removeprefix("hf://").partition("@")
    rev = revision or rev or None
    cfg = TargetConfig.from_file(_hub_file(repo, "config.json", rev))
    try:
        header = read_hub_header(repo, rev)
    except Exception:  # a config-only view is still useful: the embedding check says "not checked"
        return TargetFacts(cfg, None, False, f"hf://{repo}")
    return TargetFacts(cfg, header.get(cfg.embedding_name), True, f"hf://{repo}")
