"""RoPE read in every spelling drafters ship with: a saved drafter gives the logits of a reference whose
rotary frequencies are computed here, independently, from the published formulas (numpy)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from common.errors import BadInput
from drafter.formats.checkpoint import load_drafter, save_drafter
from tests.helpers.drafters import tiny_drafter

HEAD_DIM, MAX_POS = 8, 256


def ref_default(theta: float) -> tuple[np.ndarray, float]:
    return 1.0 / theta ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM), 1.0


def ref_linear(theta: float, factor: float):
    inv, _ = ref_default(theta)
    return inv / factor, 1.0


def ref_llama3(theta, factor, low, high, original):
    """Llama 3.1 (Meta's reference apply_scaling)."""
    inv, _ = ref_default(theta)
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < original / high:
            out.append(f)
        elif wavelen > original / low:
            out.append(f / factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out), 1.0


def ref_yarn(theta, factor, original, beta_fast=32.0, beta_slow=1.0, mscale=None, mscale_all_dim=None):
    """YaRN (Peng et al. 2023; DeepSeek's mscale variant)."""
    dim = HEAD_DIM
    inv, _ = ref_default(theta)

    def corr(rot):
        return dim * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(corr(beta_fast)), 0)
    high = min(math.ceil(corr(beta_slow)), dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (unchanged frequency), 0: interpolate (divided by factor)
    freqs = inv / factor * (1 - keep) + inv * keep

    def m(scale, ms=1.0):
        return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

    attn = m(factor, mscale) / m(factor, mscale_all_dim) if mscale and mscale_all_dim else m(factor)
    return freqs, attn


SPELLINGS = {
    "top-level rope_theta": ({"rope_theta": 50000.0}, ref_default(50000.0)),
    "rope_parameters default": ({"rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}}, ref_default(5e4)),
    "rope_scaling linear": (
        {"rope_theta": 50000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        ref_linear(50000.0, 2.0),
    ),
    "rope_scaling legacy 'type'": (
        {"rope_theta": 20000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
        ref_linear(20000.0, 4.0),
    ),
    "rope_parameters llama3": (
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        ref_llama3(500000.0, 8.0, 1.0, 4.0, 64),
    ),  # fmt: skip
    "rope_scaling yarn": (
        {
            "rope_theta": 10000.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        },
        ref_yarn(10000.0, 4.0, 64),
    ),
    "rope_parameters yarn with mscale": (
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 40.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
            }
        },
        ref_yarn(10000.0, 40.0, 32, mscale=1.0, mscale_all_dim=0.707),
    ),  # fmt: skip
}


def _logits(model) -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=gen)
    aux = torch.randn(1, 40, 3 * model.config.hidden_size, generator=gen)
    with torch.no_grad():
        return model(ids, aux, ttt_length=2)[1]


def _saved_with(tmp_path, spelling: dict):
    model = tiny_drafter(seed=3, torch_dtype="float32")
    with torch.no_grad():  # sharp attention, so that the angles show in the logits
        model.midlayer.self_attn.q_proj.weight.mul_(20)
        model.midlayer.self_attn.k_proj.weight.mul_(20)
    folder = save_drafter(model, tmp_path / "d")
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("rope_theta", "rope_parameters", "rope_scaling"):
        cfg.pop(key, None)
    cfg.update(spelling)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_each_spelling_gives_the_reference_logits(tmp_path, name):
    spelling, (freqs, attn) = SPELLINGS[name]
    folder = _saved_with(tmp_path, spelling)
    loaded = load_drafter(folder).eval()
    reference = load_drafter(folder).eval()
    reference.rotary.inv_freq = torch.tensor(freqs, dtype=torch.float32)
    reference.rotary.scaling = attn
    assert torch.allclose(_logits(loaded), _logits(reference), atol=1e-5, rtol=1e-4), name
    naive = load_drafter(folder).eval()  # what reading only top-level rope_theta (or none) gave
    naive.rotary.inv_freq = torch.tensor(ref_default(10000.0)[0], dtype=torch.float32)
    naive.rotary.scaling = 1.0
    assert not torch.allclose(_logits(loaded), _logits(naive), atol=1e-4), "the spelling must change the angles"
    assert (
        json.loads((save_drafter(loaded, tmp_path / "again") / "config.json").read_text()).items()
        >= {k: v for k, v in spelling.items() if k != "rope_theta"}.items()
    ), "the spelling rides along when the drafter is written again"


@pytest.mark.parametrize(
    "spelling,named",
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
        ({"rope_scaling": {"rope_type": "yarn"}}, "factor"),
        ({"rope_scaling": "yarn"}, "rope_scaling"),
    ],
)
def test_other_rope_types_are_bad_input_naming_them(tmp_path, spelling, named):
    folder = _saved_with(tmp_path, spelling)
    with pytest.raises(BadInput, match=named):
        load_drafter(folder)
