"""Rotary embedding settings, read in every spelling drafters ship with, and the frequencies they mean.

Drafter configs spell RoPE three ways: a top-level `rope_theta` (Llama, SpecForge), transformers 5's
`rope_parameters` ({rope_type, rope_theta, ...}), and `rope_scaling` ({rope_type or type, factor, ...})
beside a top-level `rope_theta`. The scaling types EAGLE-3 drafters use are default, linear, llama3 and
yarn; any other type is refused by name rather than run as default RoPE, which would decode with the
wrong angles and only show up as a lower acceptance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from common.errors import BadInput

SUPPORTED = ("default", "linear", "llama3", "yarn")
DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str = "default"
    theta: float = DEFAULT_THETA
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def scaling(self) -> dict[str, Any] | None:
        """`rope_scaling` as a config spells it (None for default RoPE)."""
        if self.rope_type == "default":
            return None
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.original_max_position_embeddings is not None:
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "llama3":
            out.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)
        if self.rope_type == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow)
            for key in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(self, key) is not None:
                    out[key] = getattr(self, key)
        return out

    def frequencies(self, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
        """(inverse frequencies [head_dim / 2], the factor cos and sin are scaled by)."""
        base = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        if self.rope_type == "default":
            return base.float(), 1.0
        if self.rope_type == "linear":
            return (base / self.factor).float(), 1.0
        original = self.original_max_position_embeddings or max_position_embeddings
        if self.rope_type == "llama3":
            return _llama3(base, self.factor, self.low_freq_factor, self.high_freq_factor, original).float(), 1.0
        return _yarn(self, base, head_dim, original)


def _llama3(inv: torch.Tensor, factor: float, low: float, high: float, original: int) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv
    smooth = ((original / wavelen) - low) / (high - low)
    blended = (1 - smooth) * inv / factor + smooth * inv
    out = torch.where(wavelen > low_wavelen, inv / factor, inv)
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, blended, out)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(spec: RopeSpec, inv: torch.Tensor, dim: int, original: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale attention."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = correction_dim(spec.beta_fast), correction_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    out = (inv / spec.factor) * (1 - extrapolation) + inv * extrapolation
    if spec.attention_factor is not None:
        scale = spec.attention_factor
    elif spec.mscale and spec.mscale_all_dim:
        scale = _yarn_mscale(spec.factor, spec.mscale) / _yarn_mscale(spec.factor, spec.mscale_all_dim)
    else:
        scale = _yarn_mscale(spec.factor)
    return out.float(), float(scale)


def _number(d: dict[str, Any], key: str, where: str, default: Any = None) -> Any:
    value = d.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise BadInput(f"{where}: field '{key}' must be a positive number, got {value!r}")
    return value


def rope_from_config(raw: dict[str, Any], where: str = "config.json") -> RopeSpec:
    """The RoPE a config means, whichever way it is spelled; an unknown rope type is bad input."""
    params = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    field_name = "rope_parameters" if isinstance(params, dict) else "rope_scaling"
    chosen = params if isinstance(params, dict) else scaling if isinstance(scaling, dict) else {}
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise BadInput(f"{where}: field '{name}' must be an object, got {value!r}")
    scope = f"{where} ({field_name})"
    rope_type = chosen.get("rope_type", chosen.get("type", "default")) or "default"
    if rope_type not in SUPPORTED:
        raise BadInput(
            f"{scope}: rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED)}); "
            "refusing to decode with the wrong rotary angles"
        )
    theta = _number(chosen, "rope_theta", scope, None) or _number(raw, "rope_theta", where, DEFAULT_THETA)
    if rope_type == "default":
        return RopeSpec(theta=float(theta))
    factor = _number(chosen, "factor", scope, None)
    if factor is None:
        raise BadInput(f"{scope}: rope type {rope_type!r} needs a 'factor'")
    original = chosen.get("original_max_position_embeddings")
    if original is not None:
        original = int(_number(chosen, "original_max_position_embeddings", scope))
    if rope_type == "llama3" and original is None:
        raise BadInput(f"{scope}: rope type 'llama3' needs 'original_max_position_embeddings'")
    return RopeSpec(
        rope_type=rope_type,
        theta=float(theta),
        factor=float(factor),
        low_freq_factor=float(_number(chosen, "low_freq_factor", scope, 1.0)),
        high_freq_factor=float(_number(chosen, "high_freq_factor", scope, 4.0)),
        original_max_position_embeddings=original,
        beta_fast=float(_number(chosen, "beta_fast", scope, 32.0)),
        beta_slow=float(_number(chosen, "beta_slow", scope, 1.0)),
        mscale=chosen.get("mscale"),
        mscale_all_dim=chosen.get("mscale_all_dim"),
        attention_factor=chosen.get("attention_factor"),
        truncate=bool(chosen.get("truncate", True)),
    )
