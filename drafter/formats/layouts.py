"""The layouts public EAGLE-3 drafters ship in, read into the project's and written back out.

The project's layout is SpecForge's and SGLang's (`midlayer.` names, `d2t` and `t2d`, config.json as
drafter/model/config.py reads it, for the Llama and the MLA draft layer alike). The others differ in names and
config keys, never in the numbers, so reading one is a rename plus a config translation, then checked
tensor by tensor against the config it yields (drafter/checkpoint.header_problems). Where each comes from:

- `speculators` (vllm-project/speculators, `models/eagle3/config.py`; vLLM 0.32's
  `transformers_utils/configs/speculators/algos.py`): drafter/formats/speculators.py.
- `modelopt` (NVIDIA/Model-Optimizer, `torch/export/plugins/hf_spec_export.py` and `hf_spec_configs.py`,
  2026-08): `layers.0.` names, no `t2d` (the draft vocabulary is `d2t`'s, or the whole vocabulary when
  there is no `d2t`), no `embed_tokens`; config `LlamaForCausalLMEagle3`/`llama` or, for an MLA layer,
  `Eagle3DeepseekV2ForCausalLM`/`kimi_k2` without `draft_vocab_size`; aux ids and ModelOpt's own switches
  in `eagle_config` (`use_input_layernorm_in_first_layer`, `use_last_layernorm`, `use_mtp_layernorm`,
  `parallel_draft_step`, ...), each of which must be the plain EAGLE-3 network's value.
- `torchspec` (lightseekorg/TorchSpec, `tools/convert_to_hf.py` and `configs/draft_models/
  kimi_k25_eagle3_mla.json`): an MLA layer as `Eagle3DeepseekV2ForCausalLM` (`DeepSeekForCausalLMEagle3`
  before 2026-04) / `kimi_k2`, `_torchspec_version` in the config, `layers.0.` (or native `midlayer.`)
  names with `embed_tokens`, `d2t` and `t2d`; EAGLE-3.1's `fc_norm`/`norm_output` at the top level.

Aux ids in all of them are the 0-based output of layer i, the project's reading (drafter/aux_layers).
TorchSpec's `--vllm` export adds 1 to them for kimi_k2 and says so nowhere in the folder: such a folder
reads one layer off, which only the served acceptance shows.

`detect` decides the layout from the config and the tensor names together; a folder whose names belong to
none, to two layouts or to two draft-layer families is refused with one line naming them, never guessed.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.errors import BadInput
from drafter.formats.checkpoint import (
    EMBED,
    INDEX_FILE,
    TORCH_TO_ST,
    TensorInfo,
    copy_tensors,
    header_problems,
    read_header,
    save_drafter,
)
from drafter.formats.speculators import from_speculators, is_speculators, project_config, to_speculators
from drafter.model import mla
from drafter.model.config import ARCHITECTURE, DrafterConfig, read_json
from drafter.model.eagle3 import Eagle3Drafter

LAYOUTS = ("project", "speculators", "modelopt", "torchspec")
PROJECT, ENGINE = "midlayer.", "layers.0."
KIMI = "kimi_k2"  # the model_type ModelOpt and TorchSpec give an MLA drafter for Kimi
TORCHSPEC_KEY = "_torchspec_version"
MAPS_FILE = "(built on reading)"  # where a view's t2d (and d2t) come from when a layout leaves them out
TORCHSPEC_ARCHITECTURES = (*mla.ARCHITECTURES, "DeepSeekForCausalLMEagle3")
# ModelOpt's eagle_config switches and the value each has in the plain EAGLE-3 network (hf_spec_configs.py);
# another value builds another network, refused by name.
MODELOPT_EAGLE = {
    "use_aux_hidden_state": True,
    "use_input_layernorm_in_first_layer": True,
    "use_last_layernorm": True,
    "use_mtp_layernorm": False,
    "next_layer_regular": True,
    "parallel_draft_step": 1,
    "parallel_draft_heads_num_layers": None,  # read only when parallel_draft_step > 1
}
LLAMA_ONLY = ("self_attn.k_proj.", "self_attn.v_proj.")
MLA_ONLY = ("self_attn.kv_a_proj_with_mqa.", "self_attn.kv_b_proj.", "self_attn.q_a_proj.")


def detect(folder: str | Path) -> str:
    """The layout of a drafter folder, from its config and tensor names; refuses mixed names."""
    folder = Path(folder)
    if is_speculators(folder):
        return "speculators"
    raw = read_json(folder / "config.json")
    names = list(read_header(folder))
    check_names(folder, names)
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if TORCHSPEC_KEY in raw or (raw.get("architectures") or [None])[0] == "DeepSeekForCausalLMEagle3":
        return "torchspec"
    if any(k in eagle for k in ("use_mtp_layernorm", "parallel_draft_step", "use_last_layernorm")):
        return "modelopt"
    if any(n.startswith(ENGINE) for n in names):
        raise BadInput(
            f"{folder}: tensors named '{ENGINE}*' but a config of no layout that uses them (speculators, "
            f"ModelOpt, TorchSpec): unknown layout"
        )
    return "project"


def family_of(raw: dict, layout: str) -> str:
    """ "llama" or "mla" as a layout's config declares it (for the provenance tags; the reader checks it)."""
    if layout == "speculators":
        return "llama"
    arch = (raw.get("architectures") or [None])[0]
    return "mla" if arch in TORCHSPEC_ARCHITECTURES else "llama"


def check_names(folder: Path, names: list[str]) -> None:
    """Refuse tensor names of two layouts or two draft-layer families in one folder."""
    project = sorted(n for n in names if n.startswith(PROJECT))
    engine = sorted(n for n in names if n.startswith(ENGINE))
    if project and engine:
        raise BadInput(f"{folder}: mixed layout: tensors named both '{project[0]}' and '{engine[0]}'")
    llama = sorted(n for n in names if any(part in n for part in LLAMA_ONLY))
    latent = sorted(n for n in names if any(part in n for part in MLA_ONLY))
    if llama and latent:
        raise BadInput(f"{folder}: tensors of two draft-layer families: Llama's '{llama[0]}' and MLA's '{latent[0]}'")
    deeper = sorted({n.split(".")[1] for n in names if n.startswith("layers.") and not n.startswith(ENGINE)})
    if deeper:
        raise BadInput(f"{folder}: decoder layers {', '.join(deeper)} beyond the first: an EAGLE-3 drafter has one")


@dataclass
class ProjectView:
    """A folder in any layout as the project reads it, from headers alone: what the gate checks."""

    layout: str
    config: DrafterConfig
    header: dict[str, TensorInfo]  # project names -> the tensor's header in the folder (or MAPS_FILE)
    source_names: dict[str, str]  # project name -> its name in the folder
    derived: dict[str, torch.Tensor]  # built on reading (t2d, and d2t for a whole-vocabulary head)


def view(folder: str | Path) -> ProjectView:
    """The project's reading of a drafter folder in any layout; refuses what fits none."""
    folder = Path(folder)
    layout = detect(folder)
    header = read_header(folder)
    where = str(folder / "config.json")
    raw = read_json(folder / "config.json")
    if layout == "project":
        cfg = DrafterConfig.from_dict(raw, where)
    elif layout == "speculators":
        cfg = project_config(raw, where)
    else:
        cfg = (_modelopt_config if layout == "modelopt" else _torchspec_config)(raw, header, where)
    derived = _vocab_maps(folder, header, cfg) if layout in ("modelopt", "torchspec") and "t2d" not in header else {}
    names = {_project_name(n): n for n in header}
    renamed = {p: header[n] for p, n in names.items()}
    renamed.update({n: TensorInfo(TORCH_TO_ST[t.dtype], tuple(t.shape), MAPS_FILE) for n, t in derived.items()})
    return ProjectView(layout, cfg, renamed, names, derived)


def to_project(folder: str | Path, out: str | Path) -> Path:
    """A drafter folder in any layout as the project's, in `out` (the same tensor bytes; `t2d` built from
    `d2t` where the layout leaves it out). Nothing is written when the folder is refused."""
    folder, out = Path(folder), Path(out)
    seen = view(folder)
    if seen.layout == "speculators":
        return from_speculators(folder, out)
    if seen.layout == "project":
        raise BadInput(f"{folder}: already in the project's layout")
    problems = header_problems(seen.header, seen.config)
    if problems:
        raise BadInput(f"{folder}: {seen.layout} layout does not match its config: " + "; ".join(problems))
    weight_map = copy_tensors(folder, out, _project_name)
    if seen.derived:  # one more shard, every file named as transformers names shards, under a new index
        files = sorted(set(weight_map.values()))
        n = len(files) + 1
        shard = {f: f"model-{i:05d}-of-{n:05d}.safetensors" for i, f in enumerate(files, start=1)}
        for old_name, new_name in shard.items():
            (out / old_name).rename(out / new_name)
        last = f"model-{n:05d}-of-{n:05d}.safetensors"
        save_file(seen.derived, str(out / last), metadata={"format": "pt"})
        weight_map = {name: shard[f] for name, f in weight_map.items()} | dict.fromkeys(seen.derived, last)
        total = sum(info.nbytes for info in seen.header.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    seen.config.save(out)
    return out


def _project_name(name: str) -> str:
    return PROJECT + name.removeprefix(ENGINE) if name.startswith(ENGINE) else name


def _vocab_maps(folder: Path, header: dict, cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    """`t2d` (and `d2t` for a whole-vocabulary head) from what ModelOpt writes: target id = i + d2t[i]."""
    if "d2t" in header:
        with safe_open(str(folder / header["d2t"].file), framework="pt") as fh:
            d2t = fh.get_tensor("d2t")
        targets = torch.arange(d2t.numel()) + d2t
        if targets.min() < 0 or targets.max() >= cfg.vocab_size:
            raise BadInput(f"{folder}: d2t maps draft ids outside the vocabulary of {cfg.vocab_size}")
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[targets] = True
        return {"t2d": t2d}
    if cfg.draft_vocab_size != cfg.vocab_size:
        raise BadInput(f"{folder}: no d2t, yet a draft vocabulary of {cfg.draft_vocab_size} of {cfg.vocab_size}")
    return {"d2t": torch.zeros(cfg.vocab_size, dtype=torch.long), "t2d": torch.ones(cfg.vocab_size, dtype=torch.bool)}


def _draft_vocab(raw: dict, header: dict, where: str) -> int:
    if raw.get("draft_vocab_size") is not None:
        return raw["draft_vocab_size"]
    head = header.get("lm_head.weight")
    if head is None:
        raise BadInput(f"{where}: no 'draft_vocab_size' and no lm_head.weight to read it from")
    return head.shape[0]


def _common(raw: dict, header: dict, where: str, family: str) -> dict[str, Any]:
    """The project's config keys for a ModelOpt or TorchSpec config of either family."""
    project = dict(raw)
    for key in (TORCHSPEC_KEY, "use_cache", "auto_map"):
        project.pop(key, None)
    project["draft_vocab_size"] = _draft_vocab(raw, header, where)
    if family == "mla":
        project.update(architectures=[mla.ARCHITECTURES[0]], model_type=mla.MODEL_TYPE)
    else:
        project.update(architectures=[ARCHITECTURE], model_type="llama")
    return project


def _family(raw: dict, where: str, layout: str, archs: tuple[str, ...]) -> str:
    arch = (raw.get("architectures") or [None])[0]
    if arch in archs:
        if raw.get("model_type", KIMI) not in (KIMI, "deepseek_v3", "deepseek_v2"):
            raise BadInput(f"{where}: {layout} MLA drafter with model_type {raw['model_type']!r} (expected {KIMI!r})")
        return "mla"
    if arch == ARCHITECTURE and layout == "modelopt":
        return "llama"
    raise BadInput(f"{where}: {layout} layout with architecture {arch!r}, which it does not write: unknown layout")


def _modelopt_config(raw: dict, header: dict, where: str) -> DrafterConfig:
    family = _family(raw, where, "modelopt", mla.ARCHITECTURES)
    eagle = dict(raw.get("eagle_config") or {})
    unknown = sorted(set(eagle) - set(MODELOPT_EAGLE) - {"eagle_aux_hidden_state_layer_ids"})
    if unknown:
        raise BadInput(f"{where}: eagle_config keys ModelOpt's plain EAGLE-3 does not write: {', '.join(unknown)}")
    for key, plain in MODELOPT_EAGLE.items():
        if plain is not None and key in eagle and eagle[key] != plain:
            raise BadInput(
                f"{where}: eagle_config.{key} is {eagle[key]!r}; the EAGLE-3 network the engines serve has {plain!r}"
            )
    project = _common(raw, header, where, family)
    project["eagle_config"] = {
        "eagle_aux_hidden_state_layer_ids": eagle.get("eagle_aux_hidden_state_layer_ids"),
        "use_aux_hidden_state": True,
    }
    return DrafterConfig.from_dict(project, where)


def _torchspec_config(raw: dict, header: dict, where: str) -> DrafterConfig:
    _family(raw, where, "torchspec", TORCHSPEC_ARCHITECTURES)
    project = _common(raw, header, where, "mla")
    eagle = dict(raw.get("eagle_config") or {})
    if "eagle_aux_hidden_state_layer_ids" not in eagle and "eagle_aux_hidden_state_layer_ids" in raw:
        eagle["eagle_aux_hidden_state_layer_ids"] = raw["eagle_aux_hidden_state_layer_ids"]
        project.pop("eagle_aux_hidden_state_layer_ids")
    for key in [k for k in eagle if k in MODELOPT_EAGLE and eagle[k] == MODELOPT_EAGLE[k]]:
        if key != "use_aux_hidden_state":
            eagle.pop(key)
    project["eagle_config"] = eagle
    return DrafterConfig.from_dict(project, where)


# ------------------------------------------------------------------------------------------ writing
def write_layout(model: Eagle3Drafter, folder: str | Path, layout: str, verifier: str = "k2.5-mini") -> Path:
    """Save `model` as `layout`'s exporter writes it (the mini world ships its family drafters so)."""
    folder = Path(folder)
    if layout not in LAYOUTS:
        raise BadInput(f"unknown layout {layout!r} (known: {', '.join(LAYOUTS)})")
    if layout == "project":
        return save_drafter(model, folder, include_embedding=False)
    with tempfile.TemporaryDirectory() as tmp:
        project = save_drafter(model, Path(tmp) / "project", include_embedding=layout == "torchspec")
        if layout == "speculators":
            return to_speculators(project, folder, verifier, ["KimiK25ForConditionalGeneration"], 3)
        cfg = model.config
        config = cfg.to_dict()
        whole_vocab = cfg.draft_vocab_size == cfg.vocab_size

        def rename(name: str) -> str | None:
            if layout == "modelopt" and (name in ("t2d", EMBED) or (name == "d2t" and whole_vocab)):
                return None
            return ENGINE + name.removeprefix(PROJECT) if name.startswith(PROJECT) else name

        copy_tensors(project, folder, rename)
        eagle = {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True}
        if cfg.mla is not None:
            config.update(architectures=["Eagle3DeepseekV2ForCausalLM"], model_type=KIMI)
        if layout == "modelopt":
            eagle.update({k: v for k, v in MODELOPT_EAGLE.items() if v is not None})
            if cfg.mla is not None:
                config.pop("draft_vocab_size")
            config["use_cache"] = True
        else:
            config[TORCHSPEC_KEY] = "0.2.0"
        config["eagle_config"] = eagle
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        return folder
