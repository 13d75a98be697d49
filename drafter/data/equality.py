"""Two hidden-state datasets of the same prompts held to each other: what an engine captured against what
the target loaded here captured. Token ids and loss masks must be identical; the states must point the
same way token by token (cosine, worst case per field); the target's next tokens agree on nearly every
position (a near-tie at bf16 may part a few). A capture whose layer ids are one off passes the first
and fails the second: the neighbour layer's states point elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter.data.dataset import HiddenStateDataset

MIN_COSINE = 0.999
MIN_TOKEN_AGREEMENT = 0.99


@dataclass
class Equality:
    samples: int
    tokens: int
    ids_identical: bool
    masks_identical: bool
    worst_cosine: dict[str, float]  # field -> the lowest per-token cosine over every sample
    low_cosine: dict[str, float]  # field -> the 1st percentile of the per-token cosines
    token_agreement: float  # share of positions whose target token is the same
    heads_identical: bool

    @property
    def holds(self) -> bool:
        return (
            self.ids_identical
            and self.masks_identical
            and self.heads_identical
            and all(c >= MIN_COSINE for c in self.worst_cosine.values())
            and self.token_agreement >= MIN_TOKEN_AGREEMENT
        )

    def failures(self) -> list[str]:
        out = [name for name, ok in (("token ids", self.ids_identical), ("loss masks", self.masks_identical),
                                     ("target head", self.heads_identical)) if not ok]  # fmt: skip
        out += [f"{f} cosine {c:.4f} < {MIN_COSINE}" for f, c in self.worst_cosine.items() if c < MIN_COSINE]
        if self.token_agreement < MIN_TOKEN_AGREEMENT:
            out.append(f"target tokens agree on {self.token_agreement:.2%} < {MIN_TOKEN_AGREEMENT:.0%}")
        return out

    def row(self) -> dict[str, str]:
        return {
            "samples": str(self.samples),
            "tokens": str(self.tokens),
            "ids / masks identical": f"{self.ids_identical} / {self.masks_identical}",
            **{
                f"worst cosine {name} (1st pct)": f"{self.worst_cosine[key]:.5f} ({self.low_cosine[key]:.5f})"
                for name, key in (("aux", "aux_hidden"), ("last", "last_hidden"))
            },
            "target-token agreement": f"{self.token_agreement:.2%}",
            "holds": "yes" if self.holds else "no: " + "; ".join(self.failures()),
        }


def per_layer_cosine(a: torch.Tensor, b: torch.Tensor, layers: int) -> torch.Tensor:
    """[T, layers]: each aux layer's cosine on its own, so one wrong layer is not averaged away."""
    t = a.shape[0]
    return torch.nn.functional.cosine_similarity(a.float().view(t, layers, -1), b.float().view(t, layers, -1), dim=-1)


def compare(a: HiddenStateDataset, b: HiddenStateDataset) -> Equality:
    """Hold dataset `a` (say, engine-captured) to `b` (in-process) sample by sample."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} samples against {len(b)}")
    layers = len(a.layer_ids)
    cosines: dict[str, list[torch.Tensor]] = {"aux_hidden": [], "last_hidden": []}
    ids_ok = masks_ok = True
    agree = total = 0
    for i in range(len(a)):
        x, y = a[i], b[i]
        if not torch.equal(x.input_ids, y.input_ids):
            ids_ok = False
            continue
        masks_ok &= torch.equal(x.loss_mask, y.loss_mask)
        cosines["aux_hidden"].append(per_layer_cosine(x.aux_hidden, y.aux_hidden, layers).flatten())
        cosines["last_hidden"].append(
            torch.nn.functional.cosine_similarity(x.last_hidden.float(), y.last_hidden.float(), dim=-1)
        )
        agree += int((x.target_token == y.target_token).sum())
        total += len(x)
    every = {k: torch.cat(v) if v else torch.zeros(1) for k, v in cosines.items()}
    worst = {k: float(v.min()) for k, v in every.items()}
    low = {k: float(v.quantile(0.01)) for k, v in every.items()}
    heads = torch.equal(a.target_head(), b.target_head())
    return Equality(len(a), total, ids_ok, masks_ok, worst, low, agree / max(total, 1), heads)


def main(argv: list[str] | None = None) -> None:
    """`python -m drafter.data.equality A B`: hold dataset A (an engine's capture, say) to B (in-process)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m drafter.data.equality", description=main.__doc__)
    p.add_argument("a")
    p.add_argument("b")
    args = p.parse_args(argv)
    eq = compare(HiddenStateDataset(args.a), HiddenStateDataset(args.b))
    for key, value in eq.row().items():
        print(f"{key}: {value}")
    raise SystemExit(0 if eq.holds else 1)


if __name__ == "__main__":
    main()
