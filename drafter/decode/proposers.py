"""What the decoding loop asks of a drafter, one adapter per drafting shape: a chain (EAGLE-3, k passes a
cycle; P-EAGLE, whose `propose` drafts its k in one pass over the same cache) or a block (DFlash, one pass a
cycle). The loop in drafter/decode/speculate.py is the same for both.

`begin` sees the prompt's target states and the first token; `propose` drafts k tokens (with their
distributions, for lossless sampling); `advance` takes the tokens a cycle emitted and the target's states of the
tokens it verified (the cycle's input token and the accepted drafts).
"""

from __future__ import annotations

from typing import Protocol

import torch

from drafter.model.dflash import BlockContext, DFlashDrafter
from drafter.model.eagle3 import Eagle3Drafter


class Proposer(Protocol):
    def begin(self, prompt: torch.Tensor, first: int, aux: torch.Tensor) -> None: ...

    def propose(
        self, k: int, temperature: float, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def advance(self, emitted: list[int], aux: torch.Tensor) -> None: ...


class ChainProposer:
    """EAGLE-3: the drafter pairs each token with the target state before it, and drafts step by step."""

    def __init__(self, drafter: Eagle3Drafter) -> None:
        self.drafter, self.cache = drafter, drafter.new_cache()
        self.hidden = torch.empty(0)

    def begin(self, prompt: torch.Tensor, first: int, aux: torch.Tensor) -> None:
        self.hidden = self.drafter.extend(self.cache, torch.cat([prompt[1:], torch.tensor([first])]), aux)

    def propose(self, k: int, temperature: float, generator: torch.Generator | None):
        return self.drafter.propose(self.cache, self.hidden[:, -1:], k, temperature=temperature, generator=generator)

    def advance(self, emitted: list[int], aux: torch.Tensor) -> None:
        self.hidden = self.drafter.extend(self.cache, torch.tensor(emitted), aux)


class BlockProposer:
    """DFlash: the target's states join the context at their own positions; the last emitted token is the next
    block's bonus token."""

    def __init__(self, drafter: DFlashDrafter) -> None:
        self.drafter, self.context, self.bonus = drafter, BlockContext(), -1

    def begin(self, prompt: torch.Tensor, first: int, aux: torch.Tensor) -> None:
        self.drafter.extend(self.context, aux)
        self.bonus = first

    def propose(self, k: int, temperature: float, generator: torch.Generator | None):
        return self.drafter.propose(self.context, self.bonus, k, temperature=temperature, generator=generator)

    def advance(self, emitted: list[int], aux: torch.Tensor) -> None:
        self.drafter.extend(self.context, aux)
        self.bonus = emitted[-1]


def proposer_for(drafter: Eagle3Drafter | DFlashDrafter) -> Proposer:
    """The adapter for a drafter's shape (a chain unless it drafts blocks)."""
    return BlockProposer(drafter) if isinstance(drafter, DFlashDrafter) else ChainProposer(drafter)
