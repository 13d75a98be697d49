"""Draft-vocabulary maps. d2t[i]: draft id i -> target id i + d2t[i]; t2d[v]: v is in the draft vocab.

Build them once, for a drafter trained from scratch. A drafter imported from elsewhere keeps its own
maps through fine-tuning: rebuilding them misaligns lm_head rows and destroys acceptance silently.
"""

from __future__ import annotations

import torch

from common.errors import BadInput


def build_vocab_maps(token_counts: torch.Tensor, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top `draft_vocab_size` target ids by frequency (ties: lower id first), sorted ascending.

    When fewer distinct ids were seen than draft_vocab_size, unseen ids (lowest first) fill the rest.
    """
    counts = token_counts.to(torch.float64).flatten()
    vocab = counts.numel()
    if not 0 < draft_vocab_size <= vocab:
        raise BadInput(f"draft_vocab_size {draft_vocab_size} must be in 1..{vocab}")
    ids = torch.arange(vocab)
    # stable sort on (-count, id): sort by id is the identity, so a stable sort by -count suffices
    order = torch.sort(-counts, stable=True).indices
    chosen = torch.sort(ids[order[:draft_vocab_size]]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    d2t = chosen - torch.arange(draft_vocab_size)
    return d2t.to(torch.int64), t2d


def validate_vocab_maps(
    d2t: torch.Tensor, t2d: torch.Tensor, draft_vocab_size: int, vocab_size: int, where: str = "drafter"
) -> None:
    """Raise BadInput naming the first broken invariant."""
    if tuple(d2t.shape) != (draft_vocab_size,):
        raise BadInput(f"{where}: d2t has shape {list(d2t.shape)}, expected [{draft_vocab_size}]")
    if tuple(t2d.shape) != (vocab_size,):
        raise BadInput(f"{where}: t2d has shape {list(t2d.shape)}, expected [{vocab_size}]")
    n_true = int(t2d.bool().sum())
    if n_true != draft_vocab_size:
        raise BadInput(f"{where}: t2d has {n_true} true entries, expected draft_vocab_size={draft_vocab_size}")
    targets = torch.arange(draft_vocab_size) + d2t.long()
    if int(targets.min()) < 0 or int(targets.max()) >= vocab_size:
        raise BadInput(f"{where}: d2t maps draft ids outside the target vocab [0, {vocab_size})")
    expected = torch.nonzero(t2d.bool()).flatten()
    bad = torch.nonzero(targets != expected).flatten()
    if bad.numel():
        i = int(bad[0])
        raise BadInput(
            f"{where}: d2t and t2d disagree at draft id {i} (d2t gives target {int(targets[i])}, "
            f"t2d's {i}-th entry is {int(expected[i])}); {bad.numel()} ids differ"
        )
