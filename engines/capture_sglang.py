"""Hidden states from SGLang (`make_data --engine sglang`), through SpecForge's offline capture: its
`scripts/prepare_hidden_states.py` runs the target on an SGLang engine (a GPU, tensor parallel over
`--nproc_per_node` ranks) and writes one `.ckpt` per sample (`input_ids`, `loss_mask`, `hidden_state` after
the final norm, `aux_hidden_state`); the project then takes each prompt's states from those files (read with
`weights_only=True`, drafter/data/dataset.py `SpecForgeDataset`) into its own dataset.

SpecForge tokenizes with a chat template of its own, named (`--chat-template`); the project's dataset keeps
the target's own template. Each prompt's tokens from SpecForge must therefore be exactly the tokens the
target's template gives (the loss mask is then the project's); a prompt SpecForge tokenized otherwise, or
left out, is refused by name. SGLang needs a GPU: on this machine the command is built and the files it
writes are read (tests make them); the capture itself cannot run here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import BadInput, InternalError
from drafter.data.dataset import CapturedStates, SpecForgeDataset
from engines.capture import FilesBackedSource, TargetFiles

SCRIPT = Path("scripts") / "prepare_hidden_states.py"


def specforge_inputs(records: list[dict[str, Any]], out: Path) -> Path:
    """The prompts as SpecForge's data file: one conversation per line (`conversations`: role and content)."""
    lines = []
    for i, rec in enumerate(records):
        if "messages" not in rec:
            raise BadInput(f"prompt {i + 1}: SpecForge's capture takes conversations ('messages'), not plain text")
        lines.append(json.dumps({"id": str(i), "conversations": rec["messages"]}, ensure_ascii=False))
    path = out / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def draft_config(layers: list[int], files: TargetFiles, out: Path) -> Path:
    """The draft config SpecForge resolves its capture layers from: the drafter's ids (SGLang reads them as the
    project does: the output of layer i) at the target's sizes."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layers)},
        "eagle_aux_hidden_state_layer_ids": list(layers),
        "hidden_size": files.config.hidden_size,
        "vocab_size": files.config.vocab_size,
        "draft_vocab_size": files.config.vocab_size,
        "num_hidden_layers": 1,
    }
    path = out / "draft_config.json"
    path.write_text(json.dumps(cfg, indent=1) + "\n")
    return path


def specforge_command(
    python: Path | str, specforge: Path, target: Path | str, data: Path, output: Path, config: Path, chat_template: str,
    max_len: int, tensor_parallel: int = 1,
) -> list[str]:  # fmt: skip
    """SpecForge's offline capture, as its README runs it (torchrun over the tensor-parallel ranks)."""
    return [
        str(python), "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tensor_parallel}",
        str(specforge / SCRIPT), "--target-model-path", str(target), "--data-path", str(data),
        "--output-path", str(output), "--chat-template", chat_template, "--max-length", str(max_len),
        "--tp-size", str(tensor_parallel), "--strategy", "eagle3", "--draft-model-config", str(config),
    ]  # fmt: skip


@dataclass
class SpecForgeStates(FilesBackedSource):
    """SpecForge's capture files as a drafter.data.capture.StateSource: each prompt's states found by its tokens."""

    files: TargetFiles
    tokenizer: Any
    context_length: int | None
    capture: Path  # the folder prepare_hidden_states.py wrote
    layers: list[int] = field(default_factory=list)
    _by_tokens: dict[tuple[int, ...], int] = field(default_factory=dict)
    _dataset: SpecForgeDataset | None = None
    url: str = "SpecForge offline capture on SGLang"
    endpoint: bool = False

    def _index(self) -> SpecForgeDataset:
        if self._dataset is None:
            self._dataset = SpecForgeDataset(self.capture, self.files.lm_head, self.layers, self.files.embedding)
            for i in range(len(self._dataset)):
                self._by_tokens[tuple(self._dataset[i].input_ids.tolist())] = i
        return self._dataset

    def capture_states(self, input_ids: list[int]) -> CapturedStates:
        dataset = self._index()
        i = self._by_tokens.get(tuple(input_ids))
        if i is None:
            raise BadInput(
                f"{self.capture}: SpecForge captured no sample with the tokens the target's chat template gives a "
                f"prompt ({len(input_ids)} tokens, starting {input_ids[:8]}): its --chat-template tokenizes otherwise, "
                "or it dropped the prompt"
            )
        sample = dataset[i]
        return CapturedStates(sample.aux_hidden, sample.last_hidden, sample.target_token)

    def preflight(self, prompts: list[list[int]]) -> None:
        """Every prompt found among SpecForge's samples before anything is written."""
        _ = self.files.embedding
        self._index()
        for ids in prompts:
            if tuple(ids) not in self._by_tokens:
                self.capture_states(ids)  # raises, naming the prompt


@contextlib.contextmanager
def specforge_capture(
    target: Path, layers: list[int], max_len: int, tokenizer: Any, context_length: int | None,
    records: list[dict[str, Any]], python: Path, specforge: Path, chat_template: str, tensor_parallel: int = 1,
    log: Path | None = None,
) -> Iterator[SpecForgeStates]:  # fmt: skip
    """Run SpecForge's capture on SGLang (a GPU machine) into a scratch folder and serve its files as states."""
    if not (Path(specforge) / SCRIPT).is_file():
        raise BadInput(f"--specforge {specforge}: no {SCRIPT} there (a SpecForge checkout)")
    files = TargetFiles(target)
    work = Path(tempfile.mkdtemp(prefix="drafterops-specforge-"))
    try:
        data = specforge_inputs(records, work)
        config = draft_config(layers, files, work)
        cmd = specforge_command(
            python, Path(specforge), target, data, work / "states", config, chat_template, max_len, tensor_parallel
        )
        if log is None:
            from engines.environment import engines_home

            log = engines_home() / "logs" / f"specforge-capture-{os.getpid()}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as fh:
            done = subprocess.run(
                cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(specforge)}
            )
        if done.returncode != 0:
            raise InternalError(f"SpecForge's capture exited with {done.returncode}; its log: {log}")
        yield SpecForgeStates(files, tokenizer, context_length, work / "states", list(layers))
    finally:
        shutil.rmtree(work, ignore_errors=True)
