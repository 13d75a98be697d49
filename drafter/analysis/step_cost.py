"""What one draft step reads, by family: the figure a draft step's cost scales with.

At serving batch sizes a draft step is bound by reading its weights: the draft layer (Llama q/k/v/o or
MLA's low-rank q/kv projections), its norms, the final norm and the head over the draft vocabulary (the
whole vocabulary for a ModelOpt drafter without d2t). The fc projection of the aux states (with EAGLE-3.1's
fc norms) runs once a cycle beside the verify, and the embedding is a row lookup. So a drafter whose step
reads 1.5x the parameters of the one a profile's draft_step_ms was timed with costs about 1.5x a step
(serving.cost.priced_for). Counted from the config, which the shape gate holds to the headers.

    python -m drafter.analysis.step_cost FOLDER [FOLDER ...]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import BadInput
from drafter.formats.checkpoint import EMBED, expected_tensors
from drafter.model.config import DrafterConfig

PER_CYCLE = ("fc.weight", "fc_norm.", "input_norm.weight")  # read once a cycle, with the aux states
NOT_READ = (EMBED, "d2t", "t2d")  # a row lookup and the vocabulary maps


@dataclass(frozen=True)
class StepCost:
    per_step: int  # parameters each draft step reads
    per_cycle: int  # parameters read once a cycle (fc and its norms)


def step_cost(cfg: DrafterConfig) -> StepCost:
    """Parameters read per draft step and per cycle for this config (any family, any EAGLE-3.1 norms)."""
    per_step = per_cycle = 0
    for name, (_, shape) in expected_tensors(cfg).items():
        if name in NOT_READ:
            continue
        if name.startswith(PER_CYCLE):
            per_cycle += math.prod(shape)
        else:
            per_step += math.prod(shape)
    return StepCost(per_step, per_cycle)


def folder_step_cost(folder: str | Path) -> StepCost:
    """A drafter folder in any layout the project reads (drafter/formats/layouts.py), or of another draft method
    (drafter/methods: a DFlash pass reads its layers and the target's head; `per_step` is then one pass's)."""
    from drafter.formats.layouts import view
    from drafter.methods import folder_method

    found = folder_method(folder)
    if found is not None:
        method, raw = found
        return StepCost(*method.pass_parameters(method.read_config(raw, f"{folder}/config.json")))
    return step_cost(view(folder).config)


def priced_for_folder(profile: Any, folder: str | Path) -> tuple[Any, Any, str]:
    """(the profile shaped for the drafter's method, that view priced at what its pass reads, the sentence that says
    so): every decision prices a drafter this one way (serving.cost.priced_for; Profile.shaped)."""
    from drafter.methods import DEFAULT, METHODS, folder_method_or_default
    from serving.cost import priced_for

    unknown = sorted({n for op in profile.operating_points for n, _ in op.method_cycles} - {m.NAME for m in METHODS})
    if unknown:  # a misspelt method would leave its drafters priced by shape, silently
        known = ", ".join(m.NAME for m in METHODS)
        raise BadInput(f"profile {profile.name}: method_cycle_ms_measured names {', '.join(unknown)}, not a draft "
                       f"method other than {DEFAULT.NAME} (known: {known})")  # fmt: skip
    method = folder_method_or_default(folder)
    shaped = profile.shaped(method.SHAPE, method.NAME)
    priced, said = priced_for(shaped, folder_step_cost(folder).per_step)
    return shaped, priced, said


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="parameters one draft step reads (what draft_step_params records)")
    p.add_argument("folders", nargs="+")
    args = p.parse_args(argv)
    for folder in args.folders:
        cost = folder_step_cost(folder)
        print(f"{folder}: {cost.per_step} parameters a draft step, {cost.per_cycle} once a cycle")


if __name__ == "__main__":
    main()
