"""make_data as a service: where a capture's hidden states come from (the target loaded here, a vLLM server
started for it or run by the user, SpecForge on SGLang), the target's replies regenerated first when asked,
and the dataset's meta that contamination and evidence are later checked by."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from common.errors import BadInput
from common.prompt_files import file_digest, read_prompts
from common.values import none_if_empty
from drafter.data.capture import TargetFacts
from drafter.data.dataset import REGENERATED
from drafter.data.regenerate import count_changes, regenerate
from drafter.model.config import TargetConfig
from drafter.model.target import check_layer_ids, load_target, resolve_local, target_precision
from engines.environment import find_python
from serving.workload import prompt_key

CAPTURE_MOUNT = "/mnt/drafterops-capture"  # the printed command's storage when --capture_dir names none


@dataclass(frozen=True)
class Capture:
    """One capture as asked: the target and prompts, the sample length, where the states come from, and the
    regeneration settings ("none" or "" where a setting is not given)."""

    target: str
    prompts: str
    out: str
    max_len: int
    limit: int
    dtype: str
    engine: str  # in-process, vllm or sglang
    endpoint: str
    capture_dir: str
    engine_python: str
    specforge: str
    chat_template: str
    tensor_parallel: int
    regenerate: bool
    max_new_tokens: int
    regen_temperature: float
    seed: int
    progress: bool

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> Capture:
        return cls(**{f.name: values[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class Reader:
    """A drafter the capture is for: the target layers it reads and the target width it expects."""

    ref: str
    method: str
    layers: tuple[int, ...]
    target_hidden: int


def readers_of(refs: list[str]) -> list[Reader]:
    """Each drafter named (folder, models:/ URI or hub id), read by its own method from its config alone."""
    from drafter.methods import folder_method_or_default
    from registry.access.resolve import resolve_drafter

    out = []
    for ref in refs:
        folder = resolve_drafter(ref, config_only=True).folder
        method = folder_method_or_default(folder)
        layers, hidden = method.reads(folder)
        out.append(Reader(ref, method.NAME, tuple(layers), hidden))
    return out


def union_of(readers: list[Reader]) -> list[int]:
    """The layers every named drafter reads, once each, in layer order (one capture trains them all)."""
    return sorted({i for r in readers for i in r.layers})


def union_said(readers: list[Reader]) -> str:
    return "the union of " + " and ".join(f"{r.ref}'s ({r.method}) {list(r.layers)}" for r in readers)


def checked_target(target: str, layers: list[int], readers: list[Reader]) -> tuple[Path, TargetConfig]:
    """The target's folder and config, the layers in its range and its width each drafter's: from the config
    alone, before any model or server starts."""
    folder, _ = resolve_local(target)
    cfg = TargetConfig.from_file(folder)
    check_layer_ids(cfg, layers, folder)
    for r in readers:
        if r.target_hidden != cfg.hidden_size:
            raise BadInput(f"{r.ref}: reads a target of hidden size {r.target_hidden}; {target}'s is {cfg.hidden_size}")
        missing = [i for i in r.layers if i not in layers]
        if missing:
            raise BadInput(f"--layers {layers} lacks layer(s) {missing} that {r.ref} reads")
    return folder, cfg


def context_of(cfg: TargetConfig) -> int | None:
    ctx = cfg.text_config.get("max_position_embeddings")
    return int(ctx) if ctx else None


@contextlib.contextmanager
def source_of(job: Capture, facts: TargetFacts, layers: list[int], records: list[dict] | None = None) -> Iterator[Any]:
    """Where the states come from: the target loaded here, or a vLLM server serving it (started for the
    capture, or the user's --endpoint)."""
    dtype = target_precision(job.target, job.dtype)
    if job.engine == "in-process":
        target = load_target(facts.folder, dtype=dtype, progress=job.progress, tokenizer=False)
        target.tokenizer = facts.tokenizer
        yield target
        return
    python = none_if_empty(job.engine_python)
    if job.engine == "sglang":
        from engines.capture_sglang import specforge_capture  # deferred: a GPU machine's path only

        with specforge_capture(
            facts.folder, layers, job.max_len, facts.tokenizer, facts.context_length, records,
            find_python("sglang", python), Path(job.specforge), job.chat_template, job.tensor_parallel,
        ) as states:  # fmt: skip
            yield states
        return
    from engines.capture import served_capture  # deferred: the served path's own modules

    longest = job.max_len + (job.max_new_tokens if job.regenerate else 0)  # a prompt, or one being answered
    capture_dir = none_if_empty(job.capture_dir)
    with served_capture(
        facts.folder, layers, dtype, longest, facts.tokenizer, facts.context_length,
        python=find_python("vllm", python) if python else None, endpoint=none_if_empty(job.endpoint),
        storage=Path(capture_dir) if capture_dir else None,
    ) as served:  # fmt: skip
        print(f"make_data: states from {served.url}")
        yield served


def capture_server_command(job: Capture, cfg: TargetConfig, layers: list[int]) -> list[str]:
    """The server `--engine vllm` starts, for a target served elsewhere (`--print_server_command`): on a GPU,
    with vLLM's own connector, writing to a storage this machine must share (--capture_dir, as mounted there)."""
    from engines.capture import served_layer_ids, server_command  # deferred: the served path's own modules

    handed = served_layer_ids(layers, cfg.num_hidden_layers)
    model_len = min(job.max_len + 1, context_of(cfg) or job.max_len + 1)
    return server_command(
        "python", job.target, 8000, handed, Path(none_if_empty(job.capture_dir) or CAPTURE_MOUNT),
        target_precision(job.target, job.dtype), model_len, cuda=True,
    )  # fmt: skip


def regenerated(job: Capture, target: Any, facts: TargetFacts, records: list[dict]):
    """The records with every assistant turn the target's own, written once to <out>/regenerated.jsonl with its
    settings beside it (a resumed capture reads them back, so it captures the same replies, and refuses them
    if anything they were written under differs), and what changed against the shipped ones."""
    path = Path(job.out) / REGENERATED
    settings = {"prompts_sha256": file_digest(job.prompts), "limit": job.limit, "max_len": job.max_len,
                "by": captured_by(job, target), "temperature": job.regen_temperature,
                "max_new_tokens": job.max_new_tokens, "seed": job.seed}  # fmt: skip
    sidecar = path.with_suffix(".json")
    if path.is_file():
        try:
            before = json.loads(sidecar.read_text())
            written = read_prompts(str(path))
            turns, changed, records_changed = count_changes(records, written)
        except (OSError, ValueError, BadInput):
            raise BadInput(f"{path}: unreadable or not these prompts' replies; choose another --out") from None
        if before != settings:
            raise BadInput(f"{path}: was written under other settings ({before}); choose another --out")
    else:
        temperature, seed, n = job.regen_temperature, job.seed, job.max_new_tokens
        calls = iter(range(10**9))

        def write(ids: list[int], stop: list[int]) -> list[int]:
            return target.reply(ids, stop, n, temperature, seed + next(calls))

        done = regenerate(records, facts.tokenizer, write, n, max_prompt=job.max_len, progress=job.progress)
        written, turns, changed, records_changed = done.records, done.turns, done.changed, done.records_changed
        path.parent.mkdir(parents=True, exist_ok=True)
        for dest, text in ((sidecar, json.dumps(settings) + "\n"),
                           (path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in written))):  # fmt: skip
            tmp = dest.with_suffix(".tmp")
            tmp.write_text(text)
            os.replace(tmp, dest)
    print(f"make_data: the target wrote {turns} assistant turns; {changed} differ from the shipped ones")
    info = {**settings, "turns": turns, "changed": changed, "records_changed": records_changed,
            "sha256": file_digest(str(path))}  # fmt: skip
    return written, info


def dataset_meta(job: Capture, target: Any, layers: list[int], records: list[dict], regen: dict | None = None) -> dict:
    """What contamination and evidence are checked by, where the states came from, and who wrote the replies."""
    meta = {
        "target": str(job.target),
        "layer_ids": layers,
        "hidden_size": target.hidden_size,
        "vocab_size": int(target.lm_head_weight.shape[0]),
        "prompts_sha256": file_digest(job.prompts),
        "prompt_keys": sorted({prompt_key(r) for r in records}),  # what contamination is checked by
        "max_len": job.max_len,
        "limit": job.limit,
        "target_precision": target_precision(job.target, job.dtype),
        "captured_by": captured_by(job, target),
    }
    if regen is not None:
        meta["regenerated"] = regen
    return meta


def captured_by(job: Capture, source: Any) -> str:
    """Where the states came from, for the dataset's meta: in-process, or the vLLM server and its URL."""
    if job.engine == "in-process":
        return "in-process"
    if job.engine == "sglang":
        return f"sglang via SpecForge (chat template {job.chat_template}, tp {job.tensor_parallel})"
    return f"vllm {'endpoint ' + source.url if source.endpoint else 'server started by make_data'}"
