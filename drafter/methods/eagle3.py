"""EAGLE-3 (with its 3.1 flags): the chain method, the project's own format. Read and gated by drafter/formats and
drafter/analysis/compat; drafted by drafter/model/eagle3.py. Here only what the method table needs of it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

NAME = "eagle3"
LABEL = "EAGLE-3"  # as a user writes it
VLLM_METHOD = "eagle3"
SGLANG_ALGORITHM = "EAGLE3"  # --speculative-algorithm
SHAPE = "chain"  # k drafter passes a cycle, one draft each


def drafter_passes(k: int) -> int:
    """Drafter forward passes in one cycle at k drafts: one per draft."""
    return k


def reads(folder: Path) -> tuple[list[int], int]:
    """(the target layers it reads, the target hidden size it expects), from its config alone (make_data)."""
    from drafter.formats.checkpoint import load_config
    from drafter.formats.layouts import view

    weights = any(Path(folder).glob("*.safetensors"))  # a hub drafter fetched config-only has none
    cfg = view(folder).config if weights else load_config(folder)  # any layout drafter/formats reads
    return list(cfg.aux_layer_ids), int(cfg.target_hidden)


def fit_checks(folder: Path, target: str | Path) -> list:
    """The shape gate's checks of the drafter against the target, from headers (drafter/analysis/compat)."""
    from drafter.analysis.compat import check_compat, drafter_facts, target_facts

    return check_compat(drafter_facts(folder), target_facts(target))


def check_width(folder: Path, k: int, what: str) -> None:
    """k draft steps the drafter's attention reaches over (a sliding window must span the chain)."""
    from drafter.formats.checkpoint import load_config
    from drafter.model.config import check_depth

    check_depth(load_config(folder), k, what)


def load(folder: Path, dtype: Any, embedding: Any, lm_head: Any) -> Any:  # noqa: ARG001 (its own head)
    """The drafter, strictly loaded, over the target's embedding where it ships none."""
    from drafter.formats.checkpoint import load_drafter

    return load_drafter(folder, dtype, embedding=embedding.detach().to(dtype)).eval()


def offline_stats(model: Any, dataset: Any, k: int) -> tuple[float, list[float]]:
    """Teacher-forced (sim_accept_len, conditional acceptance by step) on a held-out hidden-state dataset."""
    from drafter.train.loop import check_fit
    from drafter.train.loop import offline_stats as stats_of

    dataset = check_fit(model.config, dataset)
    s = stats_of(model, dataset, list(range(len(dataset))), dataset.target_head()[model.t2d].float(), k)
    return s.sim_accept_len, s.conditional_acceptance
