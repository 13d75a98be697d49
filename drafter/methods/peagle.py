"""P-EAGLE (parallel EAGLE) drafters: SpecForge's layout read, and gated against a target as an EAGLE-3 drafter
plus what P-EAGLE adds: `mask_hidden` [1, 1, 3 x target hidden], layers after the first over the drafter's own
width, and the mask token that fills the parallel slots.

A P-EAGLE drafter is an EAGLE-3 drafter that drafts all k tokens in one pass (drafter/model/peagle.py). vLLM serves
it as `{"method": "eagle3", "parallel_drafting": true}` and reads the slots' token from `mask_token_id`,
`ptd_token_id` or `pard_token`; SGLang has not merged it (PR #27498), so it is refused there by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.errors import BadInput
from drafter.analysis.compat import Check
from drafter.model.peagle import ARCHITECTURES, PEagleConfig

NAME = "peagle"
LABEL = "P-EAGLE"  # as a user writes it
VLLM_METHOD = "eagle3"  # with parallel_drafting (vLLM PR #32887)
VLLM_FLAGS = {"parallel_drafting": True}  # beside `method` in --speculative-config
SGLANG_ALGORITHM = None
SGLANG_REFUSAL = "SGLang has not merged P-EAGLE (sglang PR #27498 is open): serve it with vLLM (parallel_drafting)"
CONFIG = PEagleConfig  # what read_config returns (drafter.methods.config_method)
SHAPE = "block"  # one drafter pass a cycle drafts all k (k rows, causal by depth)
LAYOUT = "specforge"
EAGLE_LAYER = ("layers.0.", "midlayer.")  # layer 0 under SpecForge's name, and under EAGLE-3's
# vLLM 0.32 renames a drafter's architecture to Eagle3<arch> under `method: eagle3` unless it starts or ends with
# Eagle3 (transformers_utils/configs/eagle.py): `PEagleDraftModel` becomes the unknown `Eagle3PEagleDraftModel`.
# Its own EAGLE-3 name loads the same network (llama_eagle3, several layers, `mask_hidden` under parallel drafting).
VLLM_ARCHITECTURE = "LlamaForCausalLMEagle3"
METHOD_KEY = "drafterops_draft_method"  # written into an exported folder, whose architecture no longer says P-EAGLE


def drafter_passes(k: int) -> int:  # noqa: ARG001 (every width is one pass)
    """Drafter forward passes in one cycle at k drafts: one (the first draft and k - 1 slots, side by side)."""
    return 1


def detect(raw: dict[str, Any]) -> bool:
    """A config in SpecForge's P-EAGLE layout, speculators' (which names its type) or exported for vLLM (METHOD_KEY)."""
    archs = raw.get("architectures") if isinstance(raw.get("architectures"), list) else []
    named = raw.get("speculators_model_type") == "peagle" or raw.get(METHOD_KEY) == NAME
    return named or any(a in ARCHITECTURES for a in archs)


def read_config(raw: Any, where: str = "config.json") -> PEagleConfig:
    """The method table's config reader (every field checked): SpecForge's layout, or speculators' (its decoder's
    fields under `transformer_layer_config`, the aux ids in vLLM's reading, `mask_token_id` at the top level:
    the same tensors under the same names), read as vLLM 0.32 reads it (`update_peagle`)."""
    if isinstance(raw, dict) and raw.get("speculators_model_type") == "peagle":
        from drafter.formats.speculators import project_fields

        fields = project_fields(raw, where, "peagle")
        layer = raw["transformer_layer_config"]
        fields.update(architectures=[ARCHITECTURES[0]], num_hidden_layers=layer.get("num_hidden_layers"),
                      mask_token_id=raw.get("mask_token_id"))  # fmt: skip
        raw = fields
    return PEagleConfig.from_dict(raw, where)


def folder_config(folder: str | Path) -> PEagleConfig:
    where = Path(folder) / "config.json"
    try:
        raw = json.loads(where.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadInput(f"{where}: not a readable JSON config ({type(exc).__name__})") from None
    return read_config(raw, str(where))


def expected_tensors(c: PEagleConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{name: (safetensors dtype, shape)} of the layout: EAGLE-3's tensors with layer 0 as `layers.0.`, the later
    layers over the drafter's width, and `mask_hidden`. The embedding is optional (the target's is borrowed)."""
    from drafter.formats.checkpoint import CONFIG_DTYPES
    from drafter.formats.checkpoint import expected_tensors as eagle3_tensors

    b = c.base
    w = CONFIG_DTYPES.get(b.torch_dtype, "BF16")
    out = {name.replace(EAGLE_LAYER[1], EAGLE_LAYER[0]): spec for name, spec in eagle3_tensors(b).items()}
    h, i = b.hidden_size, b.intermediate_size
    q, kv = b.num_attention_heads * b.head_dim, b.num_key_value_heads * b.head_dim
    plain = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h),
             "mlp.down_proj.weight": (h, i)}  # fmt: skip
    for n in range(1, c.num_hidden_layers):
        out.update({f"layers.{n}.{name}": (w, shape) for name, shape in plain.items()})
    out["mask_hidden"] = (w, (1, 1, 3 * b.target_hidden))
    return out


def checked_header(folder: str | Path) -> dict[str, Any]:
    """The weights' header, every tensor of the layout at its config's shape and dtype and nothing else: bad input
    naming the tensor otherwise. No weights are read."""
    return _checked(folder)[1]


def _checked(folder: str | Path) -> tuple[PEagleConfig, dict[str, Any]]:
    """(config, header), the header held to the config's layout (bad input naming the tensor otherwise)."""
    from drafter.formats.checkpoint import read_header

    folder = Path(folder)
    c, header = folder_config(folder), read_header(folder)
    problem = layout_problem(c, header)
    if problem:
        raise BadInput(f"{folder}: {problem}")
    return c, header


def layout_problem(c: PEagleConfig, header: dict[str, Any]) -> str:
    """What first keeps `header` from the config's layout (every tensor at its shape and dtype, the embedding
    optional, nothing else); "" when nothing does."""
    from drafter.formats.checkpoint import EMBED

    want = expected_tensors(c)
    for name, (dtype, shape) in want.items():
        got = header.get(name)
        if got is None and name == EMBED:
            continue
        if got is None or got.shape != shape or got.dtype != dtype:
            found = "missing" if got is None else f"{got.dtype} {list(got.shape)}"
            return f"tensor {name} is {found}, the config makes it {dtype} {list(shape)}"
    extra = sorted(set(header) - set(want))
    if extra:
        return f"tensors not in a P-EAGLE drafter of {c.num_hidden_layers} layers: {', '.join(extra[:5])}"
    return ""


def pass_parameters(c: PEagleConfig) -> tuple[int, int]:
    """(parameters one drafting pass reads, parameters read once a cycle): every layer, the final norm and the
    draft head a pass; `fc` and its norms with the target's states (the embedding is a row lookup)."""
    import math

    tensors = expected_tensors(c)
    skip = ("embed_tokens.", "d2t", "t2d")
    per_cycle = sum(math.prod(s) for n, (_, s) in tensors.items() if n.startswith(("fc.", "fc_norm.", "input_norm.")))
    total = sum(math.prod(s) for n, (_, s) in tensors.items() if not n.startswith(skip))
    return total - per_cycle, per_cycle


def reads(folder: Path) -> tuple[list[int], int]:
    """(the target layers it reads, the target hidden size it expects), from its config alone (make_data)."""
    return config_reads(folder_config(folder))


def config_reads(c: PEagleConfig) -> tuple[list[int], int]:
    return list(c.aux_layer_ids), int(c.base.target_hidden)


def check_scratch(c: PEagleConfig, dataset: Any) -> None:
    """What EAGLE-3's scratch drafter needs of the dataset (its layers, vocabulary and the target's embedding)."""
    from drafter.train.loop import check_fit

    check_fit(c.base, dataset)  # layers, width and vocabulary: the dataset's target's
    if c.mask_token_id >= c.base.vocab_size:
        raise BadInput(f"P-EAGLE mask_token_id {c.mask_token_id} is not a token of the {c.base.vocab_size}-token "
                       "vocabulary")  # fmt: skip
    embedding = dataset.target_embedding()
    if embedding is None or tuple(embedding.shape) != (c.base.vocab_size, c.base.hidden_size):
        got, want = "none" if embedding is None else list(embedding.shape), [c.base.vocab_size, c.base.hidden_size]
        raise BadInput(f"{getattr(dataset, 'folder', 'the dataset')}: a P-EAGLE drafter from scratch reads the "
                       f"target's embedding at {want}; the dataset carries {got}")  # fmt: skip


def scratch(c: PEagleConfig, dataset: Any, train_indices: list[int], seed: int = 0) -> Any:
    """A P-EAGLE drafter of this config with random weights, its draft vocabulary from the training data's token
    counts and the target's embedding, as an EAGLE-3 drafter from scratch (finetune --init scratch)."""
    from drafter.model.peagle import PEagleDrafter
    from drafter.train.loop import scratch_drafter

    return scratch_drafter(c.base, dataset, train_indices, seed, model=PEagleDrafter(c))


def fit_checks(folder: Path, target: str | Path) -> list[Check]:
    """The EAGLE-3 gate (drafter/analysis/compat.check_compat) on layer 0 and what it shares with EAGLE-3, then
    P-EAGLE's own rows: the mask token is a token of the target's vocabulary, `mask_hidden` holds three target
    states, layer 0 reads 2 x hidden and every later layer is at its shape."""
    from drafter.analysis.compat import DrafterFacts, check_compat, local_tensor_reader, target_facts
    from drafter.formats.checkpoint import read_header

    folder = Path(folder)
    c = folder_config(folder)
    header = read_header(folder)
    t = target_facts(target)
    later = ("layers.", "mask_hidden")  # what P-EAGLE adds to EAGLE-3's tensors (layer 0 is EAGLE-3's)
    extras = {n for n in expected_tensors(c) if n.startswith(later) and not n.startswith(EAGLE_LAYER[0])}
    eagle_view = {(EAGLE_LAYER[1] + n[len(EAGLE_LAYER[0]) :] if n.startswith(EAGLE_LAYER[0]) else n): info
                  for n, info in header.items() if n not in extras}  # fmt: skip
    reader = local_tensor_reader(folder, header)
    checks = check_compat(DrafterFacts(c.base, eagle_view, reader, str(folder)), t)
    tv, th = t.config.vocab_size, t.config.hidden_size
    want = expected_tensors(c)
    q0 = header.get("layers.0.self_attn.q_proj.weight")
    width = q0.shape[1] if q0 is not None and len(q0.shape) == 2 else None
    checks += [
        Check("mask token", f"< {tv}", str(c.mask_token_id), c.mask_token_id < tv,
              "fills the k - 1 parallel slots (mask_token_id / ptd_token_id)"),
        Check("mask_hidden", f"[1, 1, 3 x {th}]", str(list(header["mask_hidden"].shape)) if "mask_hidden" in header
              else "MISSING", "mask_hidden" in header and header["mask_hidden"].shape == (1, 1, 3 * th)),
        Check("layer 0 input width", f"2 x {c.base.hidden_size}", str(width), width == 2 * c.base.hidden_size,
              "the token's embedding and the fused target states side by side"),
    ]  # fmt: skip
    for name in sorted(n for n in extras if n != "mask_hidden"):
        got = header.get(name)
        checks.append(Check(name, str(list(want[name][1])), "MISSING" if got is None else str(list(got.shape)),
                            got is not None and got.shape == want[name][1]))  # fmt: skip
    problem = layout_problem(c, header)  # as import and load hold it (a stray name too), from the header read
    layout = Check("layout", "every tensor at the config's shape and dtype, nothing else",
                   problem or "as expected", not problem)  # fmt: skip
    checks += [layout, Check("draft layers", "any", str(c.num_hidden_layers), True, informational=True)]
    return checks


def check_width(folder: Path, k: int, what: str) -> None:
    """Any k >= 1: the slots are causal by depth, so k drafts are k rows of one pass."""
    if k < 1:
        raise BadInput(f"{what} {k}: a P-EAGLE drafter drafts at least 1")
    folder_config(folder)


def load(folder: str | Path, dtype: Any, embedding: Any, lm_head: Any) -> Any:  # noqa: ARG001 (its own head)
    """The drafter from its folder, every tensor checked against the layout and finite, over the target's
    embedding where it ships none."""
    import torch

    from drafter.formats.checkpoint import EMBED, finite_state
    from drafter.model.eagle3 import Rotary
    from drafter.model.peagle import PEagleDrafter
    from drafter.model.vocab import validate_vocab_maps

    folder = Path(folder)
    c, header = _checked(folder)
    with torch.device("meta"):
        model = PEagleDrafter(c)
    state = finite_state(folder, header, dtype)
    validate_vocab_maps(state["d2t"], state["t2d"], c.base.draft_vocab_size, c.base.vocab_size, where=str(folder))
    if EMBED not in state:
        if tuple(embedding.shape) != (c.base.vocab_size, c.base.hidden_size):
            raise BadInput(f"target embedding has shape {list(embedding.shape)}, the drafter needs "
                           f"[{c.base.vocab_size}, {c.base.hidden_size}]")  # fmt: skip
        state[EMBED] = embedding.detach().to(dtype)
    model.load_state_dict(state, strict=True, assign=True)
    model.rotary = Rotary(c.base.rope_dim, c.base.rope, c.base.max_position_embeddings)
    model.has_embedding = True
    return model.eval()


def save(model: Any, folder: Path, dtype: str | None = None) -> None:
    """A P-EAGLE drafter (drafter/model/peagle.py) as SpecForge ships one, without the embedding (the target's), at
    `dtype` (None: its config's)."""
    from safetensors.torch import save_file

    from drafter.formats.checkpoint import EMBED

    folder.mkdir(parents=True, exist_ok=True)
    from drafter.formats.checkpoint import CONFIG_DTYPES, DTYPES

    dtype = dtype or model.parallel.base.torch_dtype
    torch_dtype = DTYPES[CONFIG_DTYPES[dtype]][0]
    state = {k: (v.detach().to(torch_dtype) if v.is_floating_point() else v.detach()).contiguous()
             for k, v in model.state_dict().items() if k != EMBED}  # fmt: skip
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    from dataclasses import replace

    cfg = replace(model.parallel, base=replace(model.parallel.base, torch_dtype=dtype))
    (folder / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")


def offline_stats(model: Any, dataset: Any, k: int) -> tuple[float, list[float]]:
    """Teacher-forced (sim_accept_len, conditional acceptance by depth) of every anchor of a held-out dataset."""
    return held_out(model, dataset, list(range(len(dataset))), k)


def export_for(src: Path, out: Path, engine: str, k: int) -> dict[str, Any]:
    """The folder vLLM loads (`method: eagle3` with `parallel_drafting`), in `out`: the weights as they are, the
    config under vLLM's EAGLE-3 architecture name (VLLM_ARCHITECTURE), the aux ids in vLLM's reading
    (drafter/formats/aux_layers) and the mask token under every name vLLM reads. Returns the aux-layer record."""
    import shutil

    from drafter.formats import aux_layers
    from drafter.formats.aux_layers import CONVENTION_KEY

    if engine == "sglang":
        raise BadInput(f"{src}: {SGLANG_REFUSAL}")
    if engine != "vllm":
        raise BadInput(f"{src}: a P-EAGLE drafter is exported for vllm ({engine} has no P-EAGLE reader)")
    if k < 1:
        raise BadInput(f"--k {k}: a P-EAGLE drafter drafts at least 1")
    c, _ = _checked(src)  # config and header read once
    out.mkdir(parents=True, exist_ok=True)
    for name in sorted(p.name for p in src.iterdir() if p.suffix == ".safetensors" or p.name.endswith(".index.json")):
        shutil.copyfile(src / name, out / name)
    record = aux_layers.mapping(list(c.aux_layer_ids), "vllm")
    raw = c.to_dict(VLLM_ARCHITECTURE)
    raw["eagle_config"] = {**raw["eagle_config"], "eagle_aux_hidden_state_layer_ids": record["handed_ids"]}
    raw.update({CONVENTION_KEY: "vllm", METHOD_KEY: NAME})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return record


def held_out(model: Any, dataset: Any, indices: list[int], k: int) -> tuple[float, list[float]]:
    """Teacher-forced (sim_accept_len, acceptance by depth) of `indices` at k drafts (finetune's validation)."""
    from drafter.data.dataset import layers_for
    from drafter.train.parallel_objective import parallel_stats

    return parallel_stats(model, layers_for(dataset, list(model.config.aux_layer_ids)), indices, k)


def train(model: Any, dataset: Any, cfg: Any, **kw: Any) -> Any:
    """A finetune run on DeepSpeed's engine (drafter/train/one_pass.py) with P-EAGLE's objective: COD-sampled
    slots by depth, soft cross-entropy against the target over the draft vocabulary."""
    from drafter.data.dataset import layers_for
    from drafter.train.one_pass import train_one_pass
    from drafter.train.parallel_objective import step_loss

    dataset = layers_for(dataset, list(model.config.aux_layer_ids))
    head_rows = dataset.target_head()[model.t2d].float()
    return train_one_pass(model, dataset, cfg, step_loss(head_rows), held_out, **kw)


def owns(model: Any) -> bool:
    """Whether `model` is this method's network (a finetune trial trains it with this method's objective)."""
    from drafter.model.peagle import PEagleDrafter

    return isinstance(model, PEagleDrafter)
