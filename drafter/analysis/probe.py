"""Will a drafter trained on one target transfer to another? Compare the two targets' hidden states
on the same prompts (per aux layer the drafter reads, and after the final norm) and their next-token
choices, streamed sample by sample from two captured datasets so memory stays bounded.

Similarity per layer: the mean cosine similarity of the two states at each token, and linear CKA
(Kornblith et al., 2019) over all tokens, accumulated as uncentred second moments (d x d) and means,
so it needs one pass and O(d^2) memory whatever the number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# verdict thresholds on the mean cosine of the aux layers the drafter reads
WARM_START_HELPS = 0.8  # states this close: the drafter's features carry over; fine-tuning adapts them
STATES_DIFFER = 0.5  # below this: the drafter reads different features; expect to retrain


class StreamingCKA:
    """Linear CKA of two feature sets seen in chunks of rows (tokens)."""

    def __init__(self, dx: int, dy: int) -> None:
        self.n = 0
        self.sx = torch.zeros(dx, dtype=torch.float64)
        self.sy = torch.zeros(dy, dtype=torch.float64)
        self.xx = torch.zeros(dx, dx, dtype=torch.float64)
        self.yy = torch.zeros(dy, dy, dtype=torch.float64)
        self.xy = torch.zeros(dx, dy, dtype=torch.float64)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double(), y.double()
        self.n += x.shape[0]
        self.sx += x.sum(0)
        self.sy += y.sum(0)
        self.xx += x.T @ x
        self.yy += y.T @ y
        self.xy += x.T @ y

    def value(self) -> float:
        n = max(self.n, 1)
        mx, my = self.sx / n, self.sy / n
        cxy = self.xy - n * torch.outer(mx, my)
        cxx = self.xx - n * torch.outer(mx, mx)
        cyy = self.yy - n * torch.outer(my, my)
        denom = torch.linalg.matrix_norm(cxx) * torch.linalg.matrix_norm(cyy)
        return float((torch.linalg.matrix_norm(cxy) ** 2 / denom).clamp(max=1.0)) if denom > 0 else 0.0


@dataclass
class LayerSimilarity:
    layer: str  # an aux layer id, or "final" for the final-norm states
    cosine: float
    cka: float


@dataclass
class Similarity:
    layers: list[LayerSimilarity]
    token_agreement: float  # share of positions where both targets pick the same next token
    tokens: int


class _Pair:
    def __init__(self, dim: int) -> None:
        self.cos_sum, self.n = 0.0, 0
        self.cka = StreamingCKA(dim, dim)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.float(), y.float()
        self.cos_sum += float(torch.nn.functional.cosine_similarity(x, y, dim=-1).sum())
        self.n += x.shape[0]
        self.cka.add(x, y)


def compare(old: Any, new: Any, layer_ids: list[int]) -> Similarity:
    """Two hidden-state datasets captured from the same prompts with the same aux layers."""
    if len(old) != len(new) or list(old.layer_ids) != list(new.layer_ids):
        raise ValueError("the two datasets must hold the same prompts and layers")
    h_old, h_new = int(old.hidden_size), int(new.hidden_size)
    if h_old != h_new:
        raise ValueError(f"hidden sizes differ ({h_old} vs {h_new}): states cannot be compared one to one")
    pairs = {str(i): _Pair(h_old) for i in layer_ids} | {"final": _Pair(h_old)}
    same = total = 0
    for k in range(len(old)):
        a, b = old[k], new[k]
        if not torch.equal(a.input_ids, b.input_ids):
            raise ValueError(f"sample {k}: the datasets hold different tokens")
        for j, layer in enumerate(layer_ids):
            pairs[str(layer)].add(
                a.aux_hidden[:, j * h_old : (j + 1) * h_old], b.aux_hidden[:, j * h_old : (j + 1) * h_old]
            )
        pairs["final"].add(a.last_hidden, b.last_hidden)
        same += int((a.target_token == b.target_token).sum())
        total += a.target_token.numel()
    layers = [LayerSimilarity(name, p.cos_sum / max(p.n, 1), p.cka.value()) for name, p in pairs.items()]
    return Similarity(layers, same / max(total, 1), total)


def verdict(sim: Similarity, zero_shot_old: float, zero_shot_new: float) -> str:
    """One line in plain words: what the figures say about warm-starting on the new target."""
    aux = [s for s in sim.layers if s.layer != "final"]
    names = ", ".join(s.layer for s in aux)
    cos = "/".join(f"{s.cosine:.2f}" for s in aux)
    mean = sum(s.cosine for s in aux) / max(len(aux), 1)
    kept = (zero_shot_new - 1) / (zero_shot_old - 1) if zero_shot_old > 1 else 0.0
    if mean >= WARM_START_HELPS:
        advice = "Expect a warm start to help"
    elif mean >= STATES_DIFFER:
        advice = "A warm start may help; fine-tune on the new target's states before relying on it"
    else:
        advice = "The states differ: expect to retrain rather than transfer"
    return (
        f"{advice}: layers {names}: cosine {cos}; next-token agreement {sim.token_agreement:.0%}; zero-shot "
        f"sim_accept_len {zero_shot_old:.2f} -> {zero_shot_new:.2f} ({kept:.0%} of the gain kept)"
    )
