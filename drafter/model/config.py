"""Drafter and target configs: the config.json contract of docs/design.md, read strictly, written losslessly."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import BadInput
from drafter.formats.aux_layers import CONVENTION_KEY, project_ids
from drafter.model import mla
from drafter.model.mla import MLASpec
from drafter.model.rope import RopeSpec, rope_from_config

ARCHITECTURE = "LlamaForCausalLMEagle3"
LLAMA_ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")
# EAGLE-3.1's norms, as vLLM 0.32's llama_eagle3.py and deepseek_eagle3.py read them (all off by default):
# fc_norm: one RMSNorm per aux state before fc; norm_before_fc: one over the three together;
# norm_output: the next draft step reads the final norm's output, not the pre-norm state;
# norm_before_residual: the residual stream starts at hidden_norm(hidden), not at hidden.
NORM_FLAGS = ("fc_norm", "norm_before_fc", "norm_output", "norm_before_residual")

# More draft layers than this is no drafter: its contract would list every tensor of it (a config could name 10^9).
MAX_DRAFT_LAYERS = 128

# Keys the drafter cannot be built without (docs/design.md, checkpoint format).
REQUIRED_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "draft_vocab_size",
)
# Keys modelled as fields; everything else in config.json rides along in `extra`.
_KNOWN = {
    "architectures",
    *REQUIRED_KEYS,
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "torch_dtype",
    "eagle_config",
    "target_hidden_size",
    CONVENTION_KEY,  # read once: the in-memory config always holds the project's layer ids
    *mla.KEYS,
    *NORM_FLAGS,
}
# What engines need to build the right model from the folder alone (vLLM builds a 32-layer drafter,
# silently accepting nothing, when num_hidden_layers is missing; it refuses a folder without model_type).
ENGINE_KEYS = {"model_type": "llama", "num_hidden_layers": 1, "hidden_act": "silu", "tie_word_embeddings": False}
MLA_ENGINE_KEYS = {**ENGINE_KEYS, "model_type": mla.MODEL_TYPE}
MLA_REQUIRED = tuple(k for k in REQUIRED_KEYS if k != "num_key_value_heads")


def family_of(raw: dict[str, Any], where: str) -> str:
    """ "llama" or "mla", from the architecture the config declares; MLA keys under a Llama
    architecture (or the reverse) are a mixed layout, refused rather than guessed."""
    archs = raw.get("architectures") or [ARCHITECTURE]
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise BadInput(f"{where}: field 'architectures' must name one architecture, got {archs!r}")
    arch = archs[0]
    mla_keys = sorted(k for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim") if k in raw)
    if arch in mla.ARCHITECTURES:
        return "mla"
    if arch in LLAMA_ARCHITECTURES:
        if mla_keys:
            raise BadInput(f"{where}: architecture {arch} with MLA keys {', '.join(mla_keys)}: mixed layout")
        return "llama"
    known = ", ".join((*LLAMA_ARCHITECTURES, *mla.ARCHITECTURES))
    raise BadInput(f"{where}: unknown drafter architecture {arch!r} (known: {known})")


def _flags(raw: dict[str, Any], where: str) -> dict[str, bool]:
    eagle = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    out = {}
    for key in NORM_FLAGS:
        value = raw.get(key, eagle.get(key, False) if key == "norm_before_fc" else False)
        if not isinstance(value, bool):
            raise BadInput(f"{where}: field '{key}' must be true or false, got {value!r}")
        out[key] = value
    return out


def read_json(path: Path) -> dict[str, Any]:
    """Read a JSON object, naming the file in any error."""
    path = Path(path)
    if not path.is_file():
        raise BadInput(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadInput(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _int(raw: dict[str, Any], key: str, where: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInput(f"{where}: field '{key}' must be a positive integer, got {value!r}")
    return value


def _window(raw: dict[str, Any], where: str) -> int | None:
    """The draft layer's sliding window, as vLLM's Llama layer reads it: `sliding_window` applies when
    `layer_types` marks the layer "sliding_attention"; without `layer_types` it is not applied (and
    rides along unread), as vLLM serves it."""
    types = raw.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != 1 or types[0] not in ("full_attention", "sliding_attention"):
        raise BadInput(
            f"{where}: field 'layer_types' must be ['full_attention'] or ['sliding_attention'], got {types!r}"
        )
    if types[0] == "full_attention":
        return None
    return _int(raw, "sliding_window", where)


def check_depth(cfg: DrafterConfig, depth: int, what: str) -> None:
    """A sliding window must reach over the draft chain: training joins every earlier draft step's key to
    a step's softmax, a windowed decoder drops the ones the window has passed; past sliding_window + 1
    steps the two compute different networks (tests/test_model.py finds where)."""
    if cfg.sliding_window is not None and depth > cfg.sliding_window + 1:
        raise BadInput(
            f"{what} {depth} reach past the drafter's sliding_window {cfg.sliding_window} (at most "
            f"{cfg.sliding_window + 1}): training and decoding would see different draft-step keys"
        )


@dataclass
class DrafterConfig:
    """An EAGLE-3 drafter's config.json (SGLang/vLLM `LlamaForCausalLMEagle3`)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int]
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "bfloat16"
    target_hidden_size: int | None = None
    sliding_window: int | None = None  # the draft layer sees at most this many positions back (None: all)
    mla: MLASpec | None = None  # the MLA draft layer's dimensions (drafter/model/mla.py); None: Llama attention
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    rope: RopeSpec | None = None  # None: default RoPE with rope_theta

    def __post_init__(self) -> None:
        if self.rope is None:
            self.rope = RopeSpec(theta=self.rope_theta)
        if self.mla is not None:  # every head its own key and value; queries and keys are qk_head_dim wide
            self.num_key_value_heads = self.num_attention_heads
            self.head_dim = self.mla.qk_head_dim
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        # eagle_config's other keys ride in `extra`; the layer ids live in their own field
        eagle = dict(self.extra.get("eagle_config") or {})
        eagle.pop("eagle_aux_hidden_state_layer_ids", None)
        eagle.setdefault("use_aux_hidden_state", True)
        self.extra = {**self.extra, "eagle_config": eagle}

    @property
    def family(self) -> str:
        return "llama" if self.mla is None else "mla"

    @property
    def rope_dim(self) -> int:
        """The dimensions RoPE rotates: the whole head (Llama), or MLA's decoupled rope part."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def attention_widths(self) -> tuple[int, int, int, int, int]:
        """Per position, all heads: (query, key, value, attention output, what the low-rank projections
        keep besides them) widths, what the memory plan counts for either family."""
        heads = self.num_attention_heads
        if self.mla is None:
            q, kv = heads * self.head_dim, self.num_key_value_heads * self.head_dim
            return q, kv, kv, q, 0
        sp = self.mla
        kept = 2 * (sp.q_lora_rank or 0) + 2 * sp.kv_lora_rank + sp.qk_rope_head_dim  # latents and their norms
        q = heads * sp.qk_head_dim
        return q, q, heads * sp.v_head_dim, heads * sp.v_head_dim, kept + heads * (sp.qk_nope_head_dim + sp.v_head_dim)

    @property
    def target_hidden(self) -> int:
        """Hidden size of the target whose states feed `fc` (3 of them side by side)."""
        return self.target_hidden_size or self.hidden_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> DrafterConfig:
        family = family_of(raw, where)
        required = REQUIRED_KEYS if family == "llama" else MLA_REQUIRED
        missing = [k for k in required if k not in raw]
        if missing:
            raise BadInput(f"{where}: missing required field(s) {', '.join(missing)}")
        ints = {k: _int(raw, k, where) for k in required}
        spec = MLASpec.from_dict(raw, where) if family == "mla" else None
        if spec is not None:
            ints["num_key_value_heads"] = ints["num_attention_heads"]
        eagle = raw.get("eagle_config") or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids")
        if layers is None:
            raise BadInput(f"{where}: missing field 'eagle_config.eagle_aux_hidden_state_layer_ids'")
        if (
            not isinstance(layers, list)
            or len(layers) != 3
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers)
        ):
            raise BadInput(
                f"{where}: 'eagle_config.eagle_aux_hidden_state_layer_ids' must be 3 layer ids >= 0, got {layers!r}"
            )
        if ints["draft_vocab_size"] > ints["vocab_size"]:
            raise BadInput(
                f"{where}: draft_vocab_size {ints['draft_vocab_size']} exceeds vocab_size {ints['vocab_size']}"
            )
        head_dim = raw.get("head_dim")
        if spec is not None:
            head_dim = None  # MLA's widths are its own keys
        elif head_dim is not None:
            head_dim = _int(raw, "head_dim", where)
        elif ints["hidden_size"] % ints["num_attention_heads"]:
            raise BadInput(f"{where}: no 'head_dim' and hidden_size is not divisible by num_attention_heads")
        if ints["num_attention_heads"] % ints["num_key_value_heads"]:
            raise BadInput(f"{where}: num_attention_heads must be a multiple of num_key_value_heads")
        target_hidden = raw.get("target_hidden_size")
        if target_hidden is not None:
            target_hidden = _int(raw, "target_hidden_size", where)
        if raw.get("num_hidden_layers", 1) != 1:
            raise BadInput(
                f"{where}: field 'num_hidden_layers' is {raw['num_hidden_layers']!r}; an EAGLE-3 drafter has 1"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise BadInput(
                f"{where}: field 'hidden_act' {raw['hidden_act']!r} is not supported (the drafter's MLP is SiLU)"
            )
        convention = raw.get(CONVENTION_KEY)
        if convention is not None:
            try:
                layers = project_ids(list(layers), str(convention))
            except BadInput as exc:
                raise BadInput(f"{where}: field '{CONVENTION_KEY}': {exc}") from None
        rope = rope_from_config(raw, where)
        window = _window(raw, where)
        if spec is not None:
            mla.check_rope(rope, where)
        if spec is not None and window is not None:
            raise BadInput(f"{where}: field 'layer_types': an MLA draft layer has no sliding window in vLLM or SGLang")
        engine_keys = ENGINE_KEYS if spec is None else MLA_ENGINE_KEYS
        return cls(
            sliding_window=window,
            mla=spec,
            **_flags(raw, where),
            **ints,
            aux_layer_ids=list(layers),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            rope=rope,
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            torch_dtype=str(raw.get("torch_dtype", "bfloat16")),
            target_hidden_size=target_hidden,
            extra={
                k: v
                for k, v in raw.items()
                if (k not in _KNOWN or k == "eagle_config") and not (k in engine_keys and engine_keys[k] == v)
            },
        )

    @classmethod
    def from_file(cls, path: str | Path) -> DrafterConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(read_json(path), where=str(path))

    def to_dict(self) -> dict[str, Any]:
        """config.json content; keys this class does not model come back as they were read."""
        out: dict[str, Any] = {"architectures": [ARCHITECTURE if self.mla is None else mla.ARCHITECTURES[0]]}
        extra = dict(self.extra)
        eagle = dict(extra.pop("eagle_config", {}) or {})
        eagle.pop("norm_before_fc", None)  # written once, at the top level (vLLM reads both)
        eagle["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        eagle.setdefault("use_aux_hidden_state", True)
        out["eagle_config"] = eagle
        out.update(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            draft_vocab_size=self.draft_vocab_size,
            bos_token_id=self.bos_token_id,
            eos_token_id=self.eos_token_id,
            torch_dtype=self.torch_dtype,
        )
        if self.target_hidden_size and self.target_hidden_size != self.hidden_size:
            out["target_hidden_size"] = self.target_hidden_size
        if self.mla is not None:  # no head_dim: vLLM's MLA reads its widths from the MLA keys
            del out["head_dim"]
            out.update(self.mla.to_dict())
        out.update({k: True for k in NORM_FLAGS if getattr(self, k)})  # absent means false to every loader
        if self.rope.scaling() and not ({"rope_scaling", "rope_parameters"} & extra.keys()):
            out["rope_scaling"] = self.rope.scaling()  # a config built here, not read: its RoPE written out
        out.update(ENGINE_KEYS if self.mla is None else MLA_ENGINE_KEYS)
        out.update(extra)  # layer_types and sliding_window, as read, ride here
        if self.sliding_window is not None:  # vLLM's Llama layers read both (layer_types per draft layer)
            out.update(sliding_window=self.sliding_window, layer_types=["sliding_attention"])
        return out

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path


@dataclass
class TargetConfig:
    """The facts about a target model a drafter depends on, unwrapped from multimodal wrappers."""

    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    model_type: str
    weight_prefix: str  # "" for flat models, "language_model." for Kimi-K2.5-style wrappers
    text_config: dict[str, Any]
    raw: dict[str, Any]

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "config.json") -> TargetConfig:
        text = raw.get("text_config")
        wrapped = isinstance(text, dict)
        inner = text if wrapped else raw
        scope = f"{where} (text_config)" if wrapped else where
        for key in ("hidden_size", "num_hidden_layers", "vocab_size"):
            if key not in inner:
                raise BadInput(f"{scope}: missing required field '{key}'")
            _int(inner, key, scope)

        def pick(key: str) -> Any:
            return inner.get(key, raw.get(key))

        return cls(
            hidden_size=inner["hidden_size"],
            num_hidden_layers=inner["num_hidden_layers"],
            vocab_size=inner["vocab_size"],
            bos_token_id=pick("bos_token_id"),
            eos_token_id=pick("eos_token_id"),
            model_type=str(inner.get("model_type", raw.get("model_type", "?"))),
            weight_prefix="language_model." if wrapped else "",
            text_config=dict(inner),
            raw=raw,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> TargetConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(read_json(path), where=str(path))

    @property
    def embedding_name(self) -> str:
        return f"{self.weight_prefix}model.embed_tokens.weight"

    @property
    def lm_head_name(self) -> str:
        return f"{self.weight_prefix}lm_head.weight"
