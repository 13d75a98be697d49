"""finetune's memory check: the worst case its settings and search space allow, planned from the
drafter's config alone before any data is read (drafter/analysis/memory_plan.py holds the arithmetic)."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from common.errors import BadInput
from drafter.analysis.memory_plan import GIB, MemoryPlan, plan
from drafter.model.config import DrafterConfig
from drafter.train.loop import TrainConfig, load_ds_config


def init_config(init: str, arch: str) -> DrafterConfig | None:
    """The drafter config `init` names, reading config.json only (no weights); None for another draft method
    (a warm start or from scratch), whose one-pass trial the plan does not model (drafter/train/one_pass.py)."""
    if init == "scratch":
        from tuning.register import arch_config_path

        return _eagle3_config(arch_config_path(arch), init)
    if init.startswith("models:/"):
        from registry.access import store

        c = store.client()
        mv = store.get_version(init, c)
        local = store.local_folder(c, mv)
        if local is not None:
            return _eagle3_config(local / "config.json", init)
        import tempfile

        import mlflow

        with tempfile.TemporaryDirectory() as tmp:
            uri = c.get_model_version_download_uri(mv.name, mv.version).rstrip("/") + "/config.json"
            return _eagle3_config(Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp)), init)
    from registry.access.resolve import resolve_drafter

    return _eagle3_config(resolve_drafter(init, config_only=True).folder / "config.json", init)


def _eagle3_config(path: Path, init: str) -> DrafterConfig | None:  # noqa: ARG001
    """The EAGLE-3 config at `path`; None for another draft method's (its trial trains on DeepSpeed with the
    method's own objective, drafter/train/one_pass.py, and the memory plan models EAGLE-3's TTT only)."""
    from drafter.methods import config_file_method

    # an unreadable file is EAGLE-3's to refuse: DrafterConfig.from_file says what is wrong with it, naming the file
    return None if config_file_method(path) is not None else DrafterConfig.from_file(path)


def _whole(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value) or value < 1:
        raise BadInput(f"{where} must be a whole number >= 1, not {value!r}")
    return int(value)


def worst_case(base: TrainConfig, space: dict[str, dict[str, Any]], fixed: dict[str, Any] | None) -> TrainConfig:
    """The settings a trial can run with that need the most memory: every fixed value as given (its
    DeepSpeed config and overrides too), searched sizes at their top."""
    values: dict[str, Any] = dict(fixed or {})
    for key in ("batch_size", "max_len", "ttt_length"):
        if fixed and key in fixed:
            values[key] = _whole(fixed[key], f"--fixed_params {key}")
        elif key in space:
            spec = space[key]
            tops = spec.get("choices") or ([spec["high"]] if "high" in spec else None)
            if not tops:
                raise BadInput(f"search space {key}: needs 'high' or 'choices'")
            values[key] = max(_whole(v, f"search space {key}") for v in tops)
        else:
            values[key] = _whole(getattr(base, key), key)
    return replace(base, **values)


def ds_configs(train: TrainConfig, space: dict[str, dict[str, Any]], total_steps: int) -> list[dict[str, Any]]:
    """The DeepSpeed configs a trial can run under (each choice when the space searches them)."""
    names = space.get("ds_config", {}).get("choices") or [train.ds_config]
    return [load_ds_config(str(name), replace(train, ds_config=str(name)), total_steps) for name in names]


def ranks_sharing_memory(world: int) -> int:
    """Ranks whose memory is the one measured: each GPU its own, on a CPU host all local ranks
    (torchrun says how many in LOCAL_WORLD_SIZE, the deepspeed launcher in LOCAL_SIZE)."""
    import torch

    if torch.cuda.is_available():
        return 1
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world)


def check(
    cfg: DrafterConfig | None, train: TrainConfig, configs: list[dict[str, Any]], world: int, limit_gib: float | None
) -> MemoryPlan | None:
    """The plan for one rank under the most demanding config; BadInput (exit 2, one line) when it
    cannot fit. None: no plan (another draft method's config)."""
    import torch

    if cfg is None:
        print("memory plan: none (not an EAGLE-3 drafter: the plan models EAGLE-3's TTT steps)")  # said, not an error
        return None

    quiet_import_deepspeed()  # training imports it: its memory is part of the runtime planned
    attention = "flex" if torch.cuda.is_available() else "blockwise"  # the path drafter/train/loop.py takes there
    plans = [
        plan(
            cfg,
            stage=int(ds.get("zero_optimization", {}).get("stage", 0)),
            bf16=bool(ds.get("bf16", {}).get("enabled")),
            world=world,
            micro_batch=max(train.batch_size // world, 1),
            max_len=train.max_len,
            ttt_length=train.ttt_length,
            ranks_here=ranks_sharing_memory(world),
            limit_bytes=None if limit_gib is None else int(limit_gib * GIB),
            attention=attention,
        )  # fmt: skip
        for ds in configs
    ]
    result = max(plans, key=lambda p: p.per_rank)
    if not result.fits:
        raise BadInput(f"{result.refusal()} (--memory_limit_gib overrides what it sees)")
    print(f"memory plan: {result.describe()}: fits")  # said, not an error: a refusal after it stays one line
    return result


def quiet_import_deepspeed() -> None:
    """Import DeepSpeed without its accelerator notice on the terminal (its logger writes to stdout);
    its later messages go where they always do."""
    import contextlib
    import io
    import logging

    with contextlib.redirect_stdout(io.StringIO()):
        import deepspeed  # noqa: F401
    for handler in logging.getLogger("DeepSpeed").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(sys.stdout)


def memory_limit(text: str) -> float | None:
    """--memory_limit_gib: 'auto' (what the device or host has free) or a positive number of GiB."""
    if text.strip().lower() in ("", "auto", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value < 1e6):
        raise BadInput(f"--memory_limit_gib must be 'auto' or a positive number of GiB, not {text!r}")
    return value
