"""One EAGLE-3 training run through the DeepSpeed engine (finetune's trials and the mini world's drafter).

Runs as a single CPU process (it sets up the one-rank distributed environment itself, gloo backend)
or under the `deepspeed` launcher on many GPUs (logging from rank 0 only). Batches are a pure
function of (seed, step), so a run resumed from a DeepSpeed checkpoint sees exactly the batches an
uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from common.errors import BadInput
from drafter.data.dataset import collate, split_indices, token_counts
from drafter.data.packing import collate_packed
from drafter.model.config import DrafterConfig, check_depth
from drafter.model.eagle3 import Eagle3Drafter
from drafter.model.ttt_plan import plan_steps
from drafter.model.vocab import build_vocab_maps
from drafter.train.loss import StepStats, loss_positions, pred_mask_from_loss_mask, target_draft_logits, ttt_loss
from drafter.train.ttt_step import ttt_step_loss

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs" / "deepspeed"


class TrainingDiverged(RuntimeError):
    """The loss became NaN/Inf; carries the step so a study can report it and go on."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"loss is {loss} at step {step}")
        self.step = step


class TrainingStopped(RuntimeError):
    """A validation hook asked to stop (an Optuna pruner, typically)."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped at step {step}")
        self.step = step


@dataclass
class TrainConfig:
    max_steps: int = 200
    batch_size: int = 8
    max_len: int = 512
    peak_lr: float = 1e-3
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    ttt_length: int = 3
    step_decay: float = 0.8
    noise_std: float = 0.0
    val_fraction: float = 0.1
    val_every: int = 50
    val_draft_steps: int = 3  # validation drafts this deep (the deployment's draft steps), whatever ttt_length
    seed: int = 0
    ds_config: str = "zero0"  # a name in configs/deepspeed, or a path
    ds_overrides: dict[str, Any] = field(default_factory=dict)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: checkpoint at every validation
    packing: bool = True  # pack a batch's samples into rows (drafter/data/packing.py); False pads each to the longest
    log_every: int = 0  # steps whose figures are read from the device at once; 0: every step on a CPU, 10 on a GPU

    def to_params(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("ds_overrides", "checkpoint_dir", "log_every")}


@dataclass
class TrainResult:
    model: Eagle3Drafter
    val: StepStats | None
    steps: int
    tokens: int
    seconds: float
    history: list[dict[str, float]]
    warmup_seconds: float = 0.0  # the first logging interval's time beyond the steady step time (compiling)


def warmup_seconds(intervals: list[tuple[int, float]]) -> float:
    """What the first logging interval took beyond its steps at the later intervals' steady pace: on a GPU
    the compilation (drafter/model/compiled.py), on a CPU little more than page-ins. 0 with a single interval."""
    if len(intervals) < 2:
        return 0.0
    steps, seconds = sum(n for n, _ in intervals[1:]), sum(t for _, t in intervals[1:])
    return max(0.0, intervals[0][1] - intervals[0][0] * seconds / max(steps, 1))


def ensure_distributed() -> None:
    """One-rank process group when not started by a launcher (gloo on CPU, nccl on GPUs).

    A one-rank group whose store this process hosts has nobody to meet at its port, so when that port was
    taken (picked free, or inherited from a parent that had picked it) another one is as good.
    """
    import deepspeed
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", free_port())
    own_store = os.environ.get("WORLD_SIZE") == "1" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    for attempt in range(5):
        try:
            deepspeed.init_distributed(dist_backend=backend, verbose=False)
            return
        except dist.DistNetworkError:  # the port was taken between choosing it and listening on it
            if not own_store or attempt == 4:
                raise
            os.environ["MASTER_PORT"] = free_port()


def free_port() -> str:
    """A port free now (the OS's pick); another process may still take it before we listen on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def is_rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def load_ds_config(name_or_path: str, cfg: TrainConfig, total_steps: int) -> dict[str, Any]:
    """A DeepSpeed config with its "auto" fields filled from the TrainConfig."""
    path = Path(name_or_path)
    if not path.is_file():
        path = CONFIG_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
        raise BadInput(f"DeepSpeed config {name_or_path!r} not found (known: {', '.join(known)})")
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path}: DeepSpeed config is not valid JSON ({exc.msg}, line {exc.lineno})") from None
    if not isinstance(ds, dict):
        raise BadInput(f"{path}: DeepSpeed config must be a JSON object")
    fills = {
        "lr": cfg.peak_lr,
        "weight_decay": cfg.weight_decay,
        "total_num_steps": total_steps,
        "warmup_num_steps": max(1, int(cfg.warmup_ratio * total_steps)),
        "train_micro_batch_size_per_gpu": micro_batch(cfg.batch_size, world_size()),
    }

    def fill(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (fills[k] if v == "auto" and k in fills else fill(v)) for k, v in node.items()}
        return node

    ds = fill(ds)
    for key, value in cfg.ds_overrides.items():
        node = ds
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return ds


def check_fit(cfg: DrafterConfig, dataset: Any) -> Any:
    """The dataset must carry the states this drafter reads: its layers (among others, for a capture of several
    drafters' union), hidden size and vocab. Returns the dataset as the drafter reads it (dataset.layers_for)."""
    from drafter.data.dataset import layers_for

    problems = []
    if any(i not in list(dataset.layer_ids) for i in cfg.aux_layer_ids):
        problems.append(f"layer ids {list(dataset.layer_ids)} vs drafter's {list(cfg.aux_layer_ids)}")
    if int(dataset.hidden_size) != cfg.target_hidden:
        problems.append(f"hidden size {dataset.hidden_size} vs drafter's target hidden {cfg.target_hidden}")
    head = dataset.target_head()
    if int(head.shape[0]) != cfg.vocab_size:
        problems.append(f"target vocab {head.shape[0]} vs drafter's vocab_size {cfg.vocab_size}")
    if problems:
        raise BadInput("dataset does not fit the drafter: " + "; ".join(problems))
    return layers_for(dataset, list(cfg.aux_layer_ids))


def scratch_drafter(cfg: DrafterConfig, dataset: Any, train_indices: list[int], seed: int = 0,
                    model: Eagle3Drafter | None = None) -> Eagle3Drafter:  # fmt: skip
    """Random weights, vocab maps from the training data's token counts, the target's embedding; `model`: a
    network of another EAGLE-3 method over `cfg` (P-EAGLE's), else EAGLE-3's own."""
    dataset = check_fit(cfg, dataset)
    model = Eagle3Drafter(cfg) if model is None else model
    model.init_weights(seed)
    d2t, t2d = build_vocab_maps(token_counts(dataset, cfg.vocab_size, train_indices), cfg.draft_vocab_size)
    model.d2t.copy_(d2t)
    model.t2d.copy_(t2d)
    attach_target_embedding(model, dataset)
    return model


def attach_target_embedding(model: Eagle3Drafter, dataset: Any) -> None:
    """embed_tokens is a frozen copy of the target's; the dataset carries it (target_head file)."""
    emb = dataset.target_embedding()
    if emb is None:
        if getattr(model, "has_embedding", False):
            return
        raise BadInput("the dataset carries no target embedding and the drafter has none")
    if tuple(emb.shape) != tuple(model.embed_tokens.weight.shape):
        raise BadInput(
            f"target embedding {list(emb.shape)} does not fit the drafter's {list(model.embed_tokens.weight.shape)}"
        )
    with torch.no_grad():
        model.embed_tokens.weight.copy_(emb.to(model.embed_tokens.weight.dtype))
    model.has_embedding = True


def batch_indices(train: list[int], batch_size: int, seed: int, step: int) -> list[int]:
    """The samples of a global step: epochs reshuffled by (seed, epoch), full batches only (an
    epoch's remainder is left to the next shuffle); a pure function of step."""
    size = min(batch_size, len(train))
    per_epoch = len(train) // size
    epoch, k = divmod(step, per_epoch)
    order = list(train)
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order[k * size : (k + 1) * size]


def world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def micro_batch(global_batch: int, world: int) -> int:
    """Samples per rank and step: `batch_size` is the global batch, split evenly over the ranks."""
    if global_batch % world:
        raise BadInput(f"batch_size {global_batch} (the global batch) must be divisible by the {world} ranks")
    return global_batch // world


def rank_share(indices: list[int], rank: int, world: int) -> list[int]:
    """This rank's disjoint part of a global batch."""
    per = len(indices) // world
    return indices[rank * per : (rank + 1) * per]


@torch.no_grad()
def offline_stats(
    model: Eagle3Drafter,
    dataset: Any,
    indices: list[int],
    head_rows: torch.Tensor,
    ttt_length: int,
    batch_size: int = 8,
    max_len: int | None = None,
) -> StepStats:
    """Teacher-forced acceptance per draft position over `indices` (acc_pos_<i>, sim_accept_len)."""
    was_training = model.training
    model.eval()
    total = None
    weight = next(model.parameters())
    for start in range(0, len(indices), batch_size):
        b = collate_packed([dataset[i] for i in indices[start : start + batch_size]], max_len).to(weight.device)
        mask = pred_mask_from_loss_mask(b.loss_mask, b.segment_ids) & b.attention_mask
        steps = model(
            b.input_ids, b.aux_hidden.to(weight.dtype), b.attention_mask, ttt_length=ttt_length, pred_mask=mask,
            position_ids=b.position_ids, segment_ids=b.segment_ids,
        )  # fmt: skip
        _, _, stats = ttt_loss(
            steps, target_draft_logits(b.last_hidden, head_rows), b.target_token, mask, model.t2d, model.d2t,
            segment_ids=b.segment_ids,
        )  # fmt: skip
        total = stats if total is None else total + stats
    model.train(was_training)
    return total


def full_state_dict(engine: Any) -> dict[str, torch.Tensor]:
    """The module's full weights, gathered from ZeRO-3 partitions when needed."""
    import deepspeed

    module = engine.module
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}
    return {k: v.detach().clone().cpu() for k, v in module.state_dict().items()}


@dataclass
class _Setup:
    """Everything a training step needs, built once: the DeepSpeed engine, the ranks, the target's head rows,
    the validation split and where checkpoints go."""

    engine: Any
    scheduler: Any
    world: int
    rank: int
    dtype: torch.dtype
    head_rows: torch.Tensor
    train_idx: list[int]
    val_dataset: Any
    val_idx: list[int]
    val_rows: torch.Tensor
    ckpt_dir: Path | None
    start_step: int


def train(
    model: Eagle3Drafter,
    dataset: Any,
    cfg: TrainConfig,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    on_validate: Callable[[int, StepStats], bool] | None = None,
    progress: bool = True,
    val_dataset: Any | None = None,
) -> TrainResult:
    """Train `model` (weights, d2t/t2d, embedding already in place) on `dataset` for cfg.max_steps.

    on_step(step, metrics) gets train_loss, train_acc_<i>, lr; on_validate(step, stats) gets the
    validation counts at cfg.val_draft_steps (on `val_dataset` when given, else on a held-out
    val_fraction of `dataset`) and returns True to stop (raises TrainingStopped).

    Under a launcher with W ranks, each global batch of cfg.batch_size samples is split into W
    disjoint parts, and the loss is normalised by the global token count, so W ranks compute the
    gradient one rank would on the whole batch."""
    dataset = check_fit(model.config, dataset)  # a capture of several drafters' layers: this one's columns
    val_dataset = check_fit(model.config, val_dataset) if val_dataset is not None else None
    run = _setup(model, dataset, cfg, val_dataset)
    history: list[dict[str, float]] = []
    val_stats, tokens, t0 = None, 0, time.perf_counter()
    bar = tqdm(range(run.start_step, cfg.max_steps), initial=run.start_step, total=cfg.max_steps, desc="train",
               disable=not (progress and is_rank0()), unit="step")  # fmt: skip
    pending: list[_Pending] = []
    intervals: list[tuple[int, float]] = []  # (steps, seconds) of each logging interval, validation left out
    every = cfg.log_every or (10 if run.engine.device.type == "cuda" else 1)
    began = time.perf_counter()
    for step in bar:
        pending.append(_step(run, dataset, cfg, step))
        done = step + 1
        if len(pending) >= every or done == cfg.max_steps or _due(run, cfg, done):
            for p, (metrics, step_tokens) in zip(pending, _read(pending), strict=True):  # one wait per interval
                tokens += step_tokens
                history.append(metrics)
                if on_step is not None and is_rank0():
                    on_step(p.step, metrics)
            bar.set_postfix(loss=f"{history[-1]['train_loss']:.3f}", acc0=f"{history[-1]['train_acc_0']:.2f}")
            intervals.append((len(pending), time.perf_counter() - began))
            pending = []
        validated = _validate_and_checkpoint(run, cfg, done)
        if not pending:
            began = time.perf_counter()
        if validated is not None:
            val_stats = validated
            if on_validate is not None and on_validate(done, validated) and done < cfg.max_steps:
                raise TrainingStopped(done)
    bar.close()
    seconds = time.perf_counter() - t0
    return TrainResult(_trained(run, model), val_stats, cfg.max_steps - run.start_step, tokens, seconds, history,
                       warmup_seconds(intervals))  # fmt: skip


def _setup(model: Eagle3Drafter, dataset: Any, cfg: TrainConfig, val_dataset: Any | None) -> _Setup:
    """Checks, the validation split, the process group, the DeepSpeed engine, and a resumed checkpoint."""
    import deepspeed

    if cfg.max_steps < 1 or cfg.batch_size < 1 or cfg.ttt_length < 1:
        raise BadInput("max_steps, batch_size and ttt_length must be >= 1")
    check_depth(model.config, cfg.ttt_length, "ttt_length")
    check_depth(model.config, cfg.val_draft_steps, "the validation's draft steps")
    if val_dataset is not None:  # both checked by train(), which hands them in as the drafter reads them
        train_idx, val_idx = list(range(len(dataset))), list(range(len(val_dataset)))
    else:
        train_idx, val_idx = split_indices(len(dataset), cfg.val_fraction, cfg.seed)
        val_dataset = dataset
    if not train_idx:
        raise BadInput("dataset has no training samples")
    ensure_distributed()
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    ds_config = load_ds_config(cfg.ds_config, cfg, cfg.max_steps)
    bf16 = bool(ds_config.get("bf16", {}).get("enabled"))
    torch.manual_seed(cfg.seed)
    model.train()
    head_rows = dataset.target_head()[model.t2d].float()
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)  # its per-run notices are noise beside our own logs
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config
    )
    head_rows = head_rows.to(engine.device)
    val_rows = head_rows if val_dataset is dataset else val_dataset.target_head()[model.t2d].float().to(engine.device)
    start_step = 0
    ckpt_dir = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else None
    if ckpt_dir is not None and (ckpt_dir / "latest").is_file():
        _, client = engine.load_checkpoint(str(ckpt_dir))
        start_step = int((client or {}).get("step", 0))
    dtype = torch.bfloat16 if bf16 else torch.float32
    return _Setup(engine, scheduler, world, rank, dtype, head_rows, train_idx, val_dataset, val_idx, val_rows,
                  ckpt_dir, start_step)  # fmt: skip


@dataclass
class _Pending:
    """A finished step whose figures are still on the device: read with the rest of its logging interval."""

    step: int
    loss: torch.Tensor  # the global batch's loss
    stats: StepStats
    tokens: torch.Tensor  # the global batch's tokens
    lr: float


def _step(run: _Setup, dataset: Any, cfg: TrainConfig, step: int) -> _Pending:
    """One optimizer step on this rank's share of the global batch. The batch and its masks are made on
    the host; on a GPU the step's plan is made there too (drafter/model/ttt_plan.py), each TTT step is scored as
    it comes (drafter/train/ttt_step.py), and nothing waits for the device: the figures stay there."""
    import torch.distributed as dist

    engine, world, device = run.engine, run.world, run.engine.device
    mine = rank_share(batch_indices(run.train_idx, cfg.batch_size, cfg.seed, step), run.rank, world)
    batch = (collate_packed if cfg.packing else collate)([dataset[i] for i in mine], cfg.max_len)
    segments = batch.segment_ids
    mask = pred_mask_from_loss_mask(batch.loss_mask, segments) & batch.attention_mask
    step_tokens = torch.tensor([float(batch.num_tokens)])
    fused = scored_as_it_comes(device)
    if fused:
        plan = plan_steps(mask, cfg.ttt_length, tuple(mask.shape), batch.attention_mask, segments).to(device)
        batch, mask, step_tokens = batch.to(device), mask.to(device), step_tokens.to(device)
    else:
        batch, mask = batch.to(device), mask.to(device)
    segments = batch.segment_ids
    counts = loss_positions(batch.target_token, mask, engine.module.t2d, cfg.ttt_length, segments)
    if world > 1:  # the loss is a mean over the global batch's positions, not each rank's
        dist.all_reduce(counts)
        dist.all_reduce(step_tokens)
    target = target_draft_logits(batch.last_hidden.to(run.dtype) if fused else batch.last_hidden, run.head_rows)
    if fused:
        loss, stats = ttt_step_loss(engine.module, batch, mask, target, plan, cfg.step_decay, counts, world,
                                    cfg.noise_std)  # fmt: skip
    else:
        steps = engine(
            batch.input_ids, batch.aux_hidden.to(run.dtype), batch.attention_mask, ttt_length=cfg.ttt_length,
            noise_std=cfg.noise_std, pred_mask=mask,  # compute only what the loss reads
            position_ids=batch.position_ids, segment_ids=segments,
        )  # fmt: skip
        loss, _, stats = ttt_loss(
            steps, target, batch.target_token, mask, engine.module.t2d, engine.module.d2t, decay=cfg.step_decay,
            denominators=counts, world_size=world, segment_ids=segments,
        )  # fmt: skip
    shown = loss.detach().clone()
    if world > 1:  # the global batch's loss: the mean of the ranks' parts
        dist.all_reduce(shown)
        shown /= world
    if not fused and not math.isfinite(shown.item()):  # on the CPU nothing is lost by looking at once
        raise TrainingDiverged(step + 1, shown.item())
    engine.backward(loss)
    engine.step()
    lr = run.scheduler.get_last_lr()[0] if run.scheduler is not None else cfg.peak_lr
    return _Pending(step + 1, shown, stats, step_tokens, float(lr))


def scored_as_it_comes(device: torch.device) -> bool:
    """Whether steps run the GPU path (a host-made plan, each TTT step scored as it comes, figures left on
    the device): on CUDA. The CPU keeps the reference path, whose memory plan was measured there."""
    return device.type == "cuda"


def _read(pending: list[_Pending]) -> list[tuple[dict[str, float], int]]:
    """The pending steps' (metrics, tokens) in one read from the device; a loss that is not finite
    stops the run at the step that made it."""
    flat = torch.cat([torch.cat([p.loss.reshape(1).double(), p.tokens.reshape(1).double(), p.stats.correct.double(),
                                 p.stats.total.double()]) for p in pending]).tolist()  # fmt: skip
    width = len(flat) // len(pending)
    out = []
    for i, p in enumerate(pending):
        row = flat[i * width : (i + 1) * width]
        loss, step_tokens, steps = row[0], int(row[1]), (width - 2) // 2
        if not math.isfinite(loss):
            raise TrainingDiverged(p.step, loss)
        accuracy = [c / max(n, 1.0) for c, n in zip(row[2 : 2 + steps], row[2 + steps :], strict=True)]
        out.append(({"train_loss": loss, "lr": p.lr, **{f"train_acc_{j}": a for j, a in enumerate(accuracy)}},
                    step_tokens))  # fmt: skip
    return out


def _due(run: _Setup, cfg: TrainConfig, done: int) -> bool:
    """Whether a validation or checkpoint follows this step (the figures are read before it)."""
    every = cfg.checkpoint_every or cfg.val_every
    return bool(run.val_idx) and done % cfg.val_every == 0 or (run.ckpt_dir is not None and done % every == 0)


def _validate_and_checkpoint(run: _Setup, cfg: TrainConfig, done: int) -> StepStats | None:
    """Validation counts when one is due (None otherwise), and a checkpoint when one is due."""
    val_stats = None
    if run.val_idx and (done % cfg.val_every == 0 or done == cfg.max_steps):
        val_stats = offline_stats(  # a rank's share of the batch at a time: what the memory plan planned
            run.engine.module, run.val_dataset, run.val_idx, run.val_rows, cfg.val_draft_steps,
            micro_batch(cfg.batch_size, run.world), cfg.max_len,
        )  # fmt: skip
    every = cfg.checkpoint_every or cfg.val_every
    if run.ckpt_dir is not None and (done % every == 0 or done == cfg.max_steps):
        run.engine.save_checkpoint(str(run.ckpt_dir), tag=f"step{done}", client_state={"step": done})
    return val_stats


def _trained(run: _Setup, model: Eagle3Drafter) -> Eagle3Drafter:
    """The trained weights gathered from every rank into a plain fp32 drafter in eval mode."""
    state = full_state_dict(run.engine)
    trained = Eagle3Drafter(model.config)
    trained.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    trained.has_embedding = True
    trained.eval()
    return trained
