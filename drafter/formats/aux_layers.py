"""Which target layers feed the drafter, in each engine's reading of `eagle_aux_hidden_state_layer_ids`.

The registry keeps the project's meaning, which is SGLang's and SpecForge's: id i is the *output* of
decoder layer i. vLLM 0.32 reads id i as the *input* of layer i (its DeepSeek/Llama forward records
`hidden_states + residual` before layer i runs; id == num_layers is the last layer's output), so the
same layers are handed to vLLM as i + 1. Handed untranslated, vLLM feeds a drafter the layer below
each one it was trained on, silently: no error, only a lower acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.errors import BadInput


@dataclass(frozen=True)
class Convention:
    engine: str
    offset: int  # handed id = project id + offset
    meaning: str


CONVENTIONS = {
    "sglang": Convention("sglang", 0, "output of layer i"),
    "in-process": Convention("in-process", 0, "output of layer i"),
    "vllm": Convention("vllm", 1, "input of layer i (the output of layer i - 1)"),
}
PROJECT = CONVENTIONS["sglang"]
CONVENTION_KEY = "drafterops_aux_layer_convention"  # written into a drafter folder exported for an engine


def convention(engine: str) -> Convention:
    try:
        return CONVENTIONS[engine]
    except KeyError:
        raise BadInput(f"unknown engine {engine!r} (known: {', '.join(sorted(CONVENTIONS))})") from None


def handed_ids(project_ids: list[int], engine: str) -> list[int]:
    """The ids to write for `engine` so that it feeds the layers the project's ids mean."""
    return [i + convention(engine).offset for i in project_ids]


def project_ids(handed: list[int], engine: str) -> list[int]:
    """The project's ids for ids written in `engine`'s convention (reading an exported folder)."""
    return [i - convention(engine).offset for i in handed]


def fed_layers(handed: list[int], engine: str) -> list[int]:
    """Whose output each handed id gives the drafter in `engine` (-1: the embeddings)."""
    return [i - convention(engine).offset for i in handed]


def mapping(project: list[int], engine: str, handed: list[int] | None = None) -> dict:
    """The record of what was handed to an engine and what it feeds (evidence, shape gate)."""
    handed = handed_ids(project, engine) if handed is None else list(handed)
    fed = fed_layers(handed, engine)
    return {
        "engine": engine,
        "project_ids": list(project),
        "handed_ids": handed,
        "engine_reads_id_as": convention(engine).meaning,
        "target_layer_outputs_fed": fed,
        "matches_training": fed == list(project),
    }
