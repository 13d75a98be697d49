"""DFlash (block diffusion) drafters: z-lab's layout read and gated against a target from config and headers.

A DFlash drafter drafts a whole block in one pass: the bonus token then B - 1 mask tokens, attending
non-causally within the block, the target's hidden states of `target_layer_ids` fused by `fc` and injected into
every layer's keys and values. It has no embedding and no head of its own (the target's are borrowed), so it
must share the target's hidden size and vocabulary. z-lab reads layer id i as `hidden_states[i + 1]` (the
output of decoder layer i), and resolves YaRN's attention factor as 0.1 ln(factor) + 1 where the config names
none: both are recorded, so that an engine that reads either otherwise is caught rather than trusted.

The gate's Check rows (drafter/analysis/compat.py); no MLflow.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from common.errors import BadInput
from drafter.analysis.compat import Check
from drafter.model.dflash import DFlashConfig

NAME = "dflash"
LABEL = "DFlash"  # as a user writes it
VLLM_METHOD = "dflash"  # vLLM's speculative_config method (vllm/v1/spec_decode/dflash.py)
SGLANG_ALGORITHM = "DFLASH"  # --speculative-algorithm (SGLang PR #16818)
CONFIG = DFlashConfig  # what read_config returns (drafter.methods.config_method)
SHAPE = "block"  # one drafter pass a cycle drafts the whole block
LAYOUT = "z-lab"  # the folder as z-lab ships it, which vLLM loads as it is
LAYER_TENSORS = (  # 11 per layer, Qwen3-style
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
)  # fmt: skip
LAYER_ID_CONVENTION = "hidden_states[id + 1]: the output of decoder layer id (z-lab's reading)"


def drafter_passes(k: int) -> int:  # noqa: ARG001 (every width is one pass)
    """Drafter forward passes in one cycle at k drafts: one, whatever k (the verify is k + 1 wide)."""
    return 1


def pass_parameters(c: DFlashConfig) -> tuple[int, int]:
    """(parameters one drafting pass reads, parameters read once a cycle): the layers, the final norm and the
    borrowed head over the whole vocabulary a pass; `fc` and `hidden_norm` with the context states (the embedding
    is a row lookup)."""
    tensors = expected_tensors(c)
    per_cycle = sum(math.prod(s) for n, s in tensors.items() if n.startswith(("fc.", "hidden_norm.")))
    return sum(math.prod(s) for s in tensors.values()) - per_cycle + c.vocab_size * c.hidden_size, per_cycle


def detect(raw: dict[str, Any]) -> bool:
    """A config in z-lab's or speculators' DFlash layout."""
    archs = raw.get("architectures") if isinstance(raw.get("architectures"), list) else []
    return "dflash_config" in raw or any("DFlash" in str(a) for a in archs if isinstance(a, str))


def read_config(raw: Any, where: str = "config.json") -> DFlashConfig:
    """The method table's config reader (every field checked)."""
    return DFlashConfig.from_dict(raw, where)


def folder_config(folder: str | Path) -> DFlashConfig:
    """A folder's config.json, read and checked."""
    where = Path(folder) / "config.json"
    return read_config(json.loads(where.read_text()), str(where))


def _require_width(c: DFlashConfig, k: int, what: str) -> None:
    if not 1 <= k < c.block_size:
        raise BadInput(f"{what} {k}: a DFlash drafter with block size {c.block_size} drafts 1..{c.block_size - 1}")


def expected_tensors(c: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the layout holds and its shape: 11 per layer, `fc`, `hidden_norm` and `norm`."""
    h, inter = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    per_layer = dict(zip(LAYER_TENSORS, ((q, h), (kv, h), (kv, h), (h, q), (c.head_dim,), (c.head_dim,),
                                         (inter, h), (inter, h), (h, inter), (h,), (h,)), strict=True))  # fmt: skip
    out = {f"layers.{i}.{name}": shape for i in range(c.num_hidden_layers) for name, shape in per_layer.items()}
    out |= {"fc.weight": (h, len(c.target_layer_ids) * h), "hidden_norm.weight": (h,), "norm.weight": (h,)}
    return out


def rules(c: DFlashConfig, target_hidden: int, target_vocab: int, target_layers: int,
          header: dict[str, tuple[int, ...]] | None) -> list[Check]:  # fmt: skip
    """The gate's rules, each refused with its reason: the drafter borrows the target's embedding and head, so
    hidden size and vocabulary are the target's; `fc` fuses len(target_layer_ids) target states; the mask token
    is a token of the vocabulary; every layer id is a layer of the target. With the weights' header, every
    tensor of the layout at its shape (None: header not known, the gate then passes on the config only)."""
    fused = len(c.target_layer_ids) * target_hidden
    fc_in = header["fc.weight"][1] if header and "fc.weight" in header and len(header["fc.weight"]) == 2 else None
    out = [
        Check("hidden size", str(target_hidden), str(c.hidden_size), c.hidden_size == target_hidden),
        Check("vocabulary", str(target_vocab), str(c.vocab_size), c.vocab_size == target_vocab),
        Check("fc in-features", f"{len(c.target_layer_ids)} x {target_hidden} = {fused}",
             "header not known" if header is None else str(fc_in), None if header is None else fc_in == fused),
        Check("mask token", f"< {target_vocab}", str(c.mask_token_id), c.mask_token_id < target_vocab),
        Check("target layer ids", f"each < {target_layers}", str(list(c.target_layer_ids)),
             all(i < target_layers for i in c.target_layer_ids)),
    ]  # fmt: skip
    if c.num_target_layers is not None:
        out.append(Check("num_target_layers", str(target_layers), str(c.num_target_layers),
                        c.num_target_layers == target_layers))  # fmt: skip
    if header is not None:
        want = expected_tensors(c)
        for name, shape in want.items():
            got = header.get(name)
            out.append(Check(name, str(list(shape)), "MISSING" if got is None else str(list(got)), got == shape))
        for name in sorted(set(header) - set(want)):
            borrowed = name.startswith(("embed_tokens", "lm_head"))
            out.append(Check(name, "not in a DFlash drafter" + (" (the target's is borrowed)" if borrowed else ""),
                            str(list(header[name])), False))  # fmt: skip
    out.append(Check("layer id convention", LAYER_ID_CONVENTION, "recorded", True, informational=True))
    factor = c.yarn_attention_factor
    out.append(Check("YaRN attention factor", "written explicitly on export", "no YaRN" if factor is None
                    else f"{factor:.4f}", True, informational=True))  # fmt: skip
    return out


def config_dict(c: DFlashConfig, num_target_layers: int, torch_dtype: str = "float32") -> dict[str, Any]:
    """config.json in z-lab's layout (vLLM's `DFlashDraftModel`), the resolved YaRN factor written explicitly."""
    out: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope.theta,
        "tie_word_embeddings": False,
        "block_size": c.block_size,
        "num_target_layers": num_target_layers,
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": list(c.target_layer_ids),
            "causal": c.causal,
        },
        "torch_dtype": torch_dtype,
    }
    if c.rope_scaling:
        out["rope_scaling"] = {**c.rope_scaling, "attention_factor": c.yarn_attention_factor}
    return out


def save(model: Any, folder: Path, num_target_layers: int | None = None, dtype: str = "float32") -> None:
    """A DFlash drafter (drafter/model/dflash.py) as z-lab ships one: config.json and model.safetensors, with no
    embedding or head (the target's are borrowed)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    state = {k: v.detach().to(torch_dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    layers = model.config.num_target_layers if num_target_layers is None else num_target_layers
    (folder / "config.json").write_text(json.dumps(config_dict(model.config, layers, dtype), indent=2))


def reads(folder: Path) -> tuple[list[int], int]:
    """(the target layers it reads, the target hidden size it expects), from its config alone (make_data)."""
    return config_reads(folder_config(folder))


def config_reads(c: DFlashConfig) -> tuple[list[int], int]:
    return list(c.target_layer_ids), int(c.hidden_size)


def check_scratch(c: DFlashConfig, dataset: Any) -> None:
    """The gate's rules for the config against the dataset's target (there are no weights yet), and the dataset
    holds the target's embedding and head at the drafter's [vocab, hidden]: it borrows both."""
    from drafter.analysis.compat import require_passed, target_facts

    target = str((getattr(dataset, "index", None) or {}).get("target", ""))
    if target:
        t = target_facts(target).config
        require_passed(rules(c, t.hidden_size, t.vocab_size, t.num_hidden_layers, None),
                       f"this DFlash config does not fit the dataset's target {target}")  # fmt: skip
    embedding, head = dataset.target_embedding(), dataset.target_head()  # no head: bad input naming the file
    want = (c.vocab_size, c.hidden_size)
    if embedding is None or tuple(embedding.shape) != want or tuple(head.shape) != want:
        got = "no embedding" if embedding is None else f"embedding {list(embedding.shape)}, head {list(head.shape)}"
        raise BadInput(f"{getattr(dataset, 'folder', 'the dataset')}: a DFlash drafter borrows the target's "
                       f"embedding and head at {list(want)}; the dataset carries {got}")  # fmt: skip


def scratch(c: DFlashConfig, dataset: Any, train_indices: list[int], seed: int = 0) -> Any:  # noqa: ARG001
    """A DFlash drafter of this config with random weights (N(0, 0.02), norms at 1, as Qwen3 starts) over the
    dataset's target embedding and head (finetune --init scratch --arch <a DFlash config>)."""
    from drafter.model.dflash import DFlashDrafter

    check_scratch(c, dataset)
    model = DFlashDrafter(c, dataset.target_embedding().float(), dataset.target_head().float())
    model.init_weights(seed)
    return model


def fit_checks(folder: Path, target: str | Path) -> list[Check]:
    """The gate's rules against the target, from the config and the weights' header (when the folder has
    weights; without them the tensors are not checked and the verdict says so)."""
    from drafter.analysis.compat import target_facts
    from drafter.formats.checkpoint import read_header

    folder = Path(folder)
    cfg = folder_config(folder)
    has_weights = any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file()
    header = {n: tuple(i.shape) for n, i in read_header(folder).items()} if has_weights else None
    t = target_facts(target).config
    return rules(cfg, t.hidden_size, t.vocab_size, t.num_hidden_layers, header)


def check_width(folder: Path, k: int, what: str) -> None:
    """k drafts fit in one block (the bonus token takes its first position)."""
    _require_width(folder_config(folder), k, what)


def offline_stats(model: Any, dataset: Any, k: int) -> tuple[float, list[float]]:
    """Teacher-forced (sim_accept_len, conditional acceptance by position) of the blocks of a held-out dataset."""
    return held_out(model, dataset, list(range(len(dataset))), k)


def checked_header(folder: str | Path) -> dict[str, Any]:
    """The weights' header, every tensor of the layout at its config's shape and nothing else (an embedding or head
    of its own included: the target's are borrowed): bad input naming the tensor otherwise. No weights are read."""
    return _checked(folder)[1]


def _checked(folder: str | Path) -> tuple[DFlashConfig, dict[str, Any]]:
    """(config, header), the header held to the config's layout (checked_header)."""
    from drafter.formats.checkpoint import read_header

    folder = Path(folder)
    c = folder_config(folder)
    header = read_header(folder)
    want = expected_tensors(c)
    for name, shape in want.items():
        got = header.get(name)
        if got is None or tuple(got.shape) != shape:
            raise BadInput(f"{folder}: tensor {name} is {'missing' if got is None else list(got.shape)}, "
                           f"the config makes it {list(shape)}")  # fmt: skip
    extra = sorted(set(header) - set(want))
    if extra:
        raise BadInput(f"{folder}: tensors not in a DFlash drafter: {', '.join(extra[:5])}")
    return c, header


def load(folder: str | Path, dtype: Any, embedding: Any, lm_head: Any) -> Any:
    """A DFlash drafter from its folder over the target's embedding and head; every tensor is checked against
    the layout's contract before it is loaded (one line naming the tensor otherwise)."""
    import torch
    from safetensors import safe_open

    from drafter.model.dflash import DFlashDrafter
    from drafter.model.eagle3 import Rotary

    folder = Path(folder)
    c, header = _checked(folder)
    want = expected_tensors(c)
    if tuple(embedding.shape) != (c.vocab_size, c.hidden_size) or tuple(lm_head.shape) != (c.vocab_size, c.hidden_size):
        raise BadInput(f"{folder}: the target's embedding {list(embedding.shape)} and head {list(lm_head.shape)} are "
                       f"not [{c.vocab_size}, {c.hidden_size}], the drafter's vocabulary and hidden size")  # fmt: skip
    model = DFlashDrafter(c, embedding.detach().to(dtype), lm_head.detach().to(dtype)).to(dtype)
    model.rotary = Rotary(c.head_dim, c.rope, c.max_position_embeddings)  # angles in float32 at any dtype
    params = model.state_dict()
    with torch.no_grad():
        for fname in {info.file for info in header.values()}:
            with safe_open(str(folder / fname), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118
                    if name in want:
                        tensor = fh.get_tensor(name)
                        if not torch.isfinite(tensor).all():
                            raise BadInput(f"{folder / fname}: tensor '{name}' has NaN/Inf values")
                        params[name].copy_(tensor.to(dtype))
    return model.eval()


ENGINE_READS = "dflash_config.target_layer_ids: the output of layer i (vLLM adds 1 to reach its own reading)"


def export_for(src: Path, out: Path, engine: str, k: int) -> dict[str, Any]:
    """The folder `engine` loads, in `out`, and the record of which target layers it feeds. vLLM (`method: dflash`)
    and SGLang (`DFLASH`) read z-lab's folder as it is, so the config is rewritten only to make what engines
    resolve differently explicit: the YaRN attention factor the drafter was trained with. Returns the aux-layer
    record."""
    import shutil

    if engine not in ("vllm", "sglang"):
        raise BadInput(f"{src}: a DFlash drafter is exported for vllm and sglang ({engine} has no DFlash reader)")
    c = folder_config(src)
    _require_width(c, k, "--k")
    raw = json.loads((src / "config.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    for name in sorted(p.name for p in src.iterdir() if p.suffix == ".safetensors" or p.name.endswith(".index.json")):
        shutil.copyfile(src / name, out / name)
    if c.yarn_attention_factor is not None:
        raw["rope_scaling"] = {**raw["rope_scaling"], "attention_factor": c.yarn_attention_factor}
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    ids = list(c.target_layer_ids)
    return {"engine": engine, "project_ids": ids, "handed_ids": ids, "engine_reads_id_as": ENGINE_READS,
            "target_layer_outputs_fed": ids, "matches_training": True}  # fmt: skip


def held_out(model: Any, dataset: Any, indices: list[int], k: int) -> tuple[float, list[float]]:
    """Teacher-forced (sim_accept_len, acceptance by position) of `indices` at k drafts (finetune's validation)."""
    from drafter.train.block_loop import block_stats

    return block_stats(model, dataset, indices, k)


def train(model: Any, dataset: Any, cfg: Any, **kw: Any) -> Any:
    """A finetune run on DeepSpeed's engine (drafter/train/one_pass.py) with DFlash's objective: anchored blocks,
    position-decayed cross-entropy."""
    from drafter.data.dataset import layers_for
    from drafter.train.block_loop import BlockTrainConfig, dflash_loss
    from drafter.train.one_pass import train_one_pass

    return train_one_pass(model, layers_for(dataset, list(model.config.target_layer_ids)), cfg,
                          dflash_loss(BlockTrainConfig()), held_out, **kw)  # fmt: skip


def owns(model: Any) -> bool:
    """Whether `model` is this method's network (a finetune trial trains it with this method's objective)."""
    from drafter.model.dflash import DFlashDrafter

    return isinstance(model, DFlashDrafter)
