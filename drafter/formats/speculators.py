"""The speculators format (vllm-project/speculators; vLLM serves it with `vllm serve <folder>`), to and from
the project's layout (SpecForge's / SGLang's `LlamaForCausalLMEagle3`).

What vLLM 0.32 reads from a speculators config (`transformers_utils/configs/speculators/algos.py`): the
decoder's settings from `transformer_layer_config`, whose `model_type` must be llama or qwen3 (so an MLA
draft layer has no speculators form for vLLM 0.32: refused by name); `draft_vocab_size`,
`target_hidden_size`; `norm_before_residual` with a default of True when the key is missing,
`norm_before_fc`, `fc_norm`, `norm_output` with a default of False (EAGLE-3.1's norms: the project builds
all four, drafter/model/config.py); `eagle_aux_hidden_state_layer_ids` only when present (else the model's
default layers), read as vLLM reads every aux id (the input of layer i: drafter/aux_layers). Every flag
is written out explicitly, since a folder without `norm_before_residual` is served as another network.

Tensors: the same bytes; the decoder layer is `layers.0.` here and `midlayer.` in the project.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.errors import BadInput
from drafter.formats import aux_layers
from drafter.formats.checkpoint import EMBED, checked, copy_tensors, header_problems, read_header
from drafter.model.config import ARCHITECTURE, DrafterConfig, read_json

MODEL_TYPE = "eagle3"
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")  # drafter/model/config.py NORM_FLAGS
PROJECT_LAYER, SPECULATORS_LAYER = "midlayer.", "layers.0."
TOP_LEVEL = ("architectures", "eagle_config", "draft_vocab_size", "target_hidden_size", aux_layers.CONVENTION_KEY)


def is_speculators(folder: str | Path) -> bool:
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and "speculators_config" in raw and "transformer_layer_config" in raw


def speculators_config(cfg: DrafterConfig, verifier: str, verifier_architectures: list[str], k: int) -> dict:
    """The config vLLM builds the project's drafter from, with `verifier` as its target and k proposals."""
    if cfg.mla is not None:
        raise BadInput(
            "an MLA draft layer has no speculators form vLLM 0.32 reads (its eagle3 speculators map only "
            "model_type llama and qwen3): export it for 'vllm' or 'sglang'"
        )
    project = cfg.to_dict()
    eagle = dict(project.get("eagle_config") or {})
    eagle.pop("eagle_aux_hidden_state_layer_ids", None)
    out: dict[str, Any] = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": MODEL_TYPE,
        "transformer_layer_config": {key: v for key, v in project.items() if key not in TOP_LEVEL},
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden,
        **{flag: getattr(cfg, flag) for flag in NORM_FLAGS},
        "eagle_aux_hidden_state_layer_ids": aux_layers.handed_ids(list(cfg.aux_layer_ids), "vllm"),
        aux_layers.CONVENTION_KEY: "vllm",
        "speculators_config": {
            "algorithm": MODEL_TYPE,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(k)}],
            "verifier": {"name_or_path": str(verifier), "architectures": list(verifier_architectures)},
        },
        "torch_dtype": cfg.torch_dtype,
    }
    if eagle != {"use_aux_hidden_state": True}:
        out["drafterops_eagle_config"] = eagle  # other eagle_config keys, kept for the way back
    return out


def to_speculators(src: str | Path, out: str | Path, verifier: str, verifier_architectures: list[str], k: int) -> Path:
    """Write the project's drafter in `src` as a speculators folder in `out` (embed_tokens left out:
    vLLM takes the verifier's)."""
    src, out = Path(src), Path(out)
    cfg, header = checked(src)

    def rename(name: str) -> str | None:
        if name == EMBED:
            return None
        return SPECULATORS_LAYER + name.removeprefix(PROJECT_LAYER) if name.startswith(PROJECT_LAYER) else name

    copy_tensors(src, out, rename, header)
    config = speculators_config(cfg, verifier, verifier_architectures, k)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def project_config(raw: dict[str, Any], where: str) -> DrafterConfig:
    """The project's config for a speculators config, or a refusal naming the key that makes it another network."""
    return DrafterConfig.from_dict(project_fields(raw, where), where)


def project_fields(raw: dict[str, Any], where: str, kind: str = MODEL_TYPE) -> dict[str, Any]:
    """The project's config.json fields for a speculators config of `kind` (eagle3, or peagle: the same decoder
    fields, several layers), as vLLM 0.32 reads them; a refusal naming the key that makes it another network."""
    if raw.get("speculators_model_type") != kind:
        raise BadInput(f"{where}: speculators_model_type is {raw.get('speculators_model_type')!r}; only {kind!r} "
                       f"is read here")  # fmt: skip
    residual = kind == MODEL_TYPE  # vLLM's default when the key is missing: True for eagle3, False for peagle
    flags = {flag: raw.get(flag, residual and flag == "norm_before_residual") for flag in NORM_FLAGS}
    for flag, value in flags.items():
        if not isinstance(value, bool):
            raise BadInput(f"{where}: '{flag}' is {value!r}; it must be true or false")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise BadInput(f"{where}: 'transformer_layer_config' must be the decoder's config (a mapping)")
    if layer.get("model_type", "llama") != "llama":
        raise BadInput(
            f"{where}: transformer_layer_config.model_type is {layer['model_type']!r}; the project reads the llama "
            "draft layer of a speculators folder (vLLM 0.32 also serves qwen3's, with q/k norms the project lacks)"
        )
    handed = raw.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(handed, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in handed):
        raise BadInput(
            f"{where}: no 'eagle_aux_hidden_state_layer_ids': vLLM would feed the target's default layers, which "
            "the folder does not name"
        )
    convention = raw.get(aux_layers.CONVENTION_KEY, "vllm")
    if convention != "vllm":  # vLLM reads every speculators folder its own way, whatever the folder says
        raise BadInput(f"{where}: '{aux_layers.CONVENTION_KEY}' is {convention!r}; vLLM reads these ids as 'vllm'")
    extra = raw.get("drafterops_eagle_config") or {}
    if not isinstance(extra, dict) or extra.get("use_aux_hidden_state", True) is not True:
        raise BadInput(f"{where}: 'drafterops_eagle_config' must be a mapping that keeps use_aux_hidden_state true")
    if "draft_vocab_size" not in raw:
        raise BadInput(f"{where}: missing field 'draft_vocab_size'")
    project = {key: v for key, v in layer.items() if key not in TOP_LEVEL}
    eagle = {"use_aux_hidden_state": True, **extra}
    eagle["eagle_aux_hidden_state_layer_ids"] = aux_layers.project_ids(handed, "vllm")
    project.update(architectures=[ARCHITECTURE], eagle_config=eagle, draft_vocab_size=raw["draft_vocab_size"])
    owned = NORM_FLAGS if kind == MODEL_TYPE else ("norm_before_residual", "norm_before_fc")  # algos.py sets these
    project.update({flag: flags[flag] for flag in owned})  # over the layer's, both ways, as vLLM builds it
    if raw.get("target_hidden_size") is not None:
        project["target_hidden_size"] = raw["target_hidden_size"]
    return project


def from_speculators(src: str | Path, out: str | Path) -> Path:
    """Convert a speculators-format EAGLE-3 folder to the project's layout (the same tensor bytes)."""
    src, out = Path(src), Path(out)
    where = str(src / "config.json")
    cfg = project_config(read_json(src / "config.json"), where)
    header = read_header(src)
    mixed = sorted(n for n in header if n.startswith(PROJECT_LAYER))
    if mixed:
        raise BadInput(f"{src}: tensor '{mixed[0]}' has the project's name inside a speculators folder (layers.0.)")
    other_layers = sorted(
        {n.split(".")[1] for n in header if n.startswith("layers.") and not n.startswith("layers.0.")}
    )
    if other_layers:
        raise BadInput(f"{src}: decoder layers {', '.join(other_layers)} beyond the first: an EAGLE-3 drafter has one")

    def rename(name: str) -> str:
        return PROJECT_LAYER + name.removeprefix(SPECULATORS_LAYER) if name.startswith(SPECULATORS_LAYER) else name

    renamed = {rename(n): info for n, info in header.items()}
    problems = header_problems(renamed, cfg)
    if problems:
        raise BadInput(f"{src}: tensors do not match its config: " + "; ".join(problems))
    copy_tensors(src, out, rename, header)
    cfg.save(out)
    return out


def verifier_of(folder: str | Path) -> str:
    raw = read_json(Path(folder) / "config.json")
    return str(((raw.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path", ""))
