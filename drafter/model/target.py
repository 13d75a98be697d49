"""Target models through transformers: load (flat or Kimi-K2.5-style wrapper), capture aux states.

Capture follows SGLang's convention: layer id i means the *output* of decoder layer i (transformers'
`output_hidden_states[i + 1]`). Forward hooks take exactly those outputs, so a capture never holds
every layer's states, and the same code serves training data, offline eval and online decoding.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from common.errors import BadInput
from drafter.data.dataset import CapturedStates
from drafter.formats.checkpoint import read_header, weight_files
from drafter.model.config import TargetConfig

HUB_PATTERNS = [
    "config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*",
    "*.jinja",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template*",
]


@dataclass
class TargetOutput:
    logits: torch.Tensor  # [B, T, V]
    aux_hidden: torch.Tensor  # [B, T, 3H] outputs of the aux layers, concatenated in id order
    last_hidden: torch.Tensor  # [B, T, H] after the final norm: logits = last_hidden @ lm_head.T
    past_key_values: Any


def resolve_local(source: str | Path, revision: str | None = None) -> tuple[Path, str | None]:
    """A local folder as is; a hub id through snapshot_download (configs, safetensors, tokenizer only).

    Returns (folder, resolved commit or None)."""
    path = Path(source)
    if path.exists():
        if not path.is_dir():
            raise BadInput(f"{source}: not a model folder")
        return path, None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        folder = Path(snapshot_download(str(source), revision=revision, allow_patterns=HUB_PATTERNS))
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise BadInput(
            f"{source}: not a local folder and not downloadable from the hub "
            f"({exc.__class__.__name__}: {str(exc).splitlines()[0][:160]})"
        ) from None
    return folder, folder.name


def check_layer_ids(cfg: TargetConfig, layer_ids: list[int], folder: Path | str) -> None:
    """Aux layer ids in the project's reading (id i = output of decoder layer i) that the target has."""
    n = cfg.num_hidden_layers
    bad = [i for i in layer_ids if not 0 <= i < n]
    if bad:
        raise BadInput(
            f"aux layer ids {bad} out of range for target {folder} with {n} layers "
            f"(valid ids 0..{n - 1}; id i = output of decoder layer i)"
        )


def load_tokenizer(folder: Path, trust_remote_code: bool = False) -> Any:
    """The target's tokenizer from its files alone (None where it has none)."""
    from transformers import AutoTokenizer

    if not any(Path(folder).glob("tokenizer*")):
        return None
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)


class Target:
    """A causal LM target plus what a drafter needs of it: aux states, final-norm states, head, embedding."""

    def __init__(self, model: torch.nn.Module, config: TargetConfig, folder: Path, tokenizer: Any = None):
        self.model = model.eval()
        self.config = config
        self.folder = folder
        self.tokenizer = tokenizer
        self._captured: dict[int, torch.Tensor] = {}
        self._layer_ids: list[int] = []
        self._hooks: list[Any] = []
        # transformers 5 names the KV-cache argument `cache`; 4.x `past_key_values`. Looked up once, not per token.
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    # -------------------------------------------------------------- structure
    @property
    def decoder_layers(self) -> torch.nn.ModuleList:
        return self.model.model.layers

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def context_length(self) -> int | None:
        ctx = getattr(self.model.config, "max_position_embeddings", None)
        return int(ctx) if ctx else None

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight

    def check_layer_ids(self, layer_ids: list[int]) -> None:
        check_layer_ids(self.config, layer_ids, self.folder)

    def set_aux_layers(self, layer_ids: list[int]) -> None:
        """Install output hooks on exactly these decoder layers."""
        self.check_layer_ids(layer_ids)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._layer_ids = list(layer_ids)
        for i in sorted(set(layer_ids)):

            def hook(_mod, _inp, out, i=i):
                self._captured[i] = out[0] if isinstance(out, tuple) else out

            self._hooks.append(self.decoder_layers[i].register_forward_hook(hook))

    # -------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, past_key_values: Any = None, attention_mask: torch.Tensor | None = None
    ) -> TargetOutput:
        if not self._layer_ids:
            raise RuntimeError("call set_aux_layers() first")
        self._captured.clear()
        final: dict[str, torch.Tensor] = {}
        norm_hook = self.model.model.norm.register_forward_hook(lambda _m, _i, o: final.__setitem__("h", o))
        try:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=True,
                **{self._cache_kw: past_key_values},
            )
        finally:
            norm_hook.remove()
        aux = torch.cat([self._captured[i] for i in self._layer_ids], dim=-1)
        cache = getattr(out, "cache", None)
        return TargetOutput(out.logits, aux, final["h"], cache if cache is not None else out.past_key_values)

    def capture_states(self, input_ids: list[int]) -> CapturedStates:
        """One prompt's states for a dataset (drafter.data.capture.StateSource): aux, final-norm, greedy next tokens."""
        res = self.forward(torch.tensor([input_ids]))
        return CapturedStates(res.aux_hidden[0], res.last_hidden[0], res.logits[0].argmax(-1))

    @torch.no_grad()
    def reply(
        self, input_ids: list[int], stop: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> list[int]:
        """The target's own continuation of a prompt, greedy or sampled at `temperature` (from `seed`), ending
        at a stop token (included) or after `max_new_tokens` (make_data --regenerate)."""
        ids = torch.tensor([input_ids])
        sampling = {"do_sample": False} if temperature == 0 else {"do_sample": True, "temperature": temperature,
                                                                  "top_k": 0, "top_p": 1.0}  # fmt: skip
        if temperature:
            torch.manual_seed(seed)
        out = self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, eos_token_id=stop,
            pad_token_id=stop[0], **sampling,
        )  # fmt: skip
        return out[0, len(input_ids) :].tolist()

    @staticmethod
    def crop_cache(cache: Any, length: int) -> None:
        """Keep the first `length` positions (after a rejection); a negative crop works on every
        transformers version (v5 refuses positive ones)."""
        remove = cache.get_seq_length() - length
        if remove > 0:
            cache.crop(-remove)

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)


def _text_model_from_wrapper(
    folder: Path, cfg: TargetConfig, header: dict[str, Any], dtype: torch.dtype, trust_remote_code: bool
):
    """Build the text model from text_config and load the `language_model.`-prefixed weights into it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    text = dict(cfg.text_config)
    model_type = text.pop("model_type", None)
    if model_type == "kimi_k2":  # Kimi's text model is DeepSeek-V3 (text_config.architectures says so)
        model_type = "deepseek_v3"
    try:
        text_cfg = AutoConfig.for_model(model_type, **{k: v for k, v in text.items() if k != "architectures"})
    except ValueError as exc:
        raise BadInput(
            f"{folder}/config.json: text_config model_type {model_type!r} is unknown to transformers ({exc})"
        ) from None
    prefix = cfg.weight_prefix
    check_config_fits_weights(folder, text_cfg, header, prefix, trust_remote_code)
    model = AutoModelForCausalLM.from_config(text_cfg, trust_remote_code=trust_remote_code, dtype=dtype)
    params = model.state_dict()  # views of the model's own tensors: each weight is copied straight in
    have = {name[len(prefix) :] for name in header if name.startswith(prefix)}
    missing, unexpected = sorted(set(params) - have), sorted(have - set(params))
    if getattr(text_cfg, "tie_word_embeddings", False) and missing == ["lm_head.weight"]:
        missing = []
    if missing or unexpected:
        raise BadInput(
            f"{folder}: weights under '{prefix}' do not fit the text model: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}"
        )
    # one tensor at a time, never a second copy of the whole model (a full state dict doubled the peak)
    with torch.no_grad():
        for fname in weight_files(folder):
            with safe_open(str(folder / fname), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118
                    if name.startswith(prefix):
                        params[name[len(prefix) :]].copy_(fh.get_tensor(name))
    if getattr(text_cfg, "tie_word_embeddings", False):
        model.tie_weights()
    return model


def check_config_fits_weights(
    folder: Path, config: Any, header: dict[str, Any], prefix: str = "", trust_remote_code: bool = False
) -> None:
    """config.json and the weights agree, checked on a meta-device model against the headers before a
    byte is loaded: a shape the config gets wrong is bad input naming the tensor, not transformers'
    state-dict error. (Tensors transformers renames on load, such as fused MoE experts, are left to
    its own check, which `load_target` turns into the same bad input.)"""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        expected = {
            k: tuple(v.shape)
            for k, v in AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
            .state_dict()
            .items()
        }
    have = {name[len(prefix) :]: info for name, info in header.items() if name.startswith(prefix)}
    for key, shape in expected.items():
        info = have.get(key)
        if info is not None and tuple(info.shape) != shape:
            raise BadInput(
                f"{folder}/config.json disagrees with its weights: {prefix}{key} is {list(info.shape)} in "
                f"{info.file}, the config makes it {list(shape)}"
            )


def quiet_loading() -> None:
    """No 'Loading weights' bar and no load report from transformers (for --no-progress)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
FLOATING = ("F32", "BF16", "F16")


def own_precision(cfg: TargetConfig, header: dict[str, Any]) -> str:
    """The precision a checkpoint is stored at, which is the one it is served at: its config's
    `torch_dtype` (or `dtype`; text_config first), else the floating dtype most of the text model's
    weights are stored in (a wrapper's vision tower does not count)."""
    for raw in (cfg.text_config, cfg.raw):
        name = raw.get("torch_dtype") or raw.get("dtype")
        if isinstance(name, str) and name in PRECISIONS:
            return name
    counts: dict[str, int] = {}
    for name, info in header.items():
        if name.startswith(cfg.weight_prefix) and info.dtype in FLOATING:
            counts[info.dtype] = counts.get(info.dtype, 0) + info.nbytes
    stored = max(counts, key=counts.get) if counts else "F32"
    return {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[stored]


def check_precision(requested: str) -> str:
    """A --dtype as given: auto or a precision name, else bad input naming the flag."""
    if requested != "auto" and requested not in PRECISIONS:
        raise BadInput(f"--dtype must be auto or one of {', '.join(PRECISIONS)}, got {requested!r}")
    return requested


def target_precision(source: str | Path, requested: str = "auto") -> str:
    """The precision a target is loaded and served at: its own ('auto'), or the one asked for."""
    if check_precision(requested) != "auto":
        return requested
    folder, _ = resolve_local(source)
    return own_precision(TargetConfig.from_file(folder), read_header(folder))


def load_target(
    source: str | Path,
    dtype: torch.dtype | str = "auto",
    revision: str | None = None,
    trust_remote_code: bool = False,
    tokenizer: bool = True,
    progress: bool = True,
) -> Target:
    """Load a target from a folder or hub id, at its own precision unless `dtype` says otherwise
    (a name or torch dtype); multimodal wrappers (Kimi-K2.5) are unwrapped."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not progress:
        quiet_loading()
    folder, _ = resolve_local(source, revision)
    cfg = TargetConfig.from_file(folder)
    header = read_header(folder)  # every shard's header is sound before anything is loaded
    if isinstance(dtype, str):
        dtype = PRECISIONS[own_precision(cfg, header) if check_precision(dtype) == "auto" else dtype]
    if cfg.weight_prefix:
        model = _text_model_from_wrapper(folder, cfg, header, dtype, trust_remote_code)
    else:
        try:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise BadInput(f"{folder}: transformers cannot load this target ({str(exc).splitlines()[0]})") from None
        check_config_fits_weights(folder, config, header, "", trust_remote_code)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                folder, config=config, dtype=dtype, trust_remote_code=trust_remote_code
            )
        except (OSError, ValueError) as exc:
            raise BadInput(f"{folder}: transformers cannot load this target ({str(exc).splitlines()[0]})") from None
        except RuntimeError as exc:
            if "mismatch" not in str(exc):
                raise
            raise BadInput(
                f"{folder}/config.json disagrees with its weights (a tensor's size does not match)"
            ) from None
    tok = load_tokenizer(folder, trust_remote_code) if tokenizer else None
    return Target(model, cfg, folder, tok)
