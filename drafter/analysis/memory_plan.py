"""The memory a fine-tuning run needs per rank, worked out before launch from shapes alone.

A 1.19 B-parameter drafter needs about 16 bytes per trained parameter under AdamW (weights, gradients,
two moments, and fp32 master weights under bf16) before a single activation: a user should learn
that it does not fit from a one-line refusal, not from a run that dies after an hour of capture.

- Model states follow DeepSpeed's arithmetic (its `estimate_zero{2,3}_model_states_mem_needs`): per
  trained parameter 16 bytes, of which ZeRO-1 partitions the optimizer states over the ranks, ZeRO-2
  the gradients too, ZeRO-3 the weights as well; the frozen embedding (the target's) is held in the
  training precision, partitioned only under ZeRO-3.
- A plan fits when it does with a 15% margin: its error against measured peaks (bench/memory_plan).
- Activations are counted from the TTT forward (drafter/model/eagle3.py) at the worst case the settings
  allow: every sample as long as `max_len`, every position trained, each on its own row: per TTT step
  the norms, projections, MLP and draft logits kept for backward, the attention's outputs and
  log-sum-exp (drafter/model/ttt_attention.py: no probability matrix is kept, so all of it grows linearly
  with length), the target's draft-vocabulary distribution, and the largest transients of the
  backward pass.
- The runtime (interpreter, torch, DeepSpeed) is what this process holds when the plan is made, once
  a one-parameter backward and AdamW step has paged in what every run pays for, plus the arenas the
  C allocator keeps (64 MiB per compute thread).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from drafter.model.config import DrafterConfig

GIB = 1024**3
MARGIN = 0.15  # the plan's error against measured peaks (bench/memory_plan): a fit must hold with it
STAGES = (0, 1, 2, 3)
WORLDS = (1, 2, 4, 8, 16, 32, 64)


def parameter_counts(cfg: DrafterConfig) -> tuple[int, int]:
    """(trained, frozen) parameters: the frozen one is the target's embedding."""
    h, i, vd, ht = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size, cfg.target_hidden
    if cfg.mla is None:
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        attention = 2 * h * (q + 2 * kv) + q * h  # over [embed; hidden]
    else:
        attention = sum(math.prod(s) for s in cfg.mla.tensors(cfg.num_attention_heads, 2 * h, h).values())
    layer = attention + 3 * h * i + 3 * h  # attention, MLP, 3 norms
    norms = 3 * ht * (int(cfg.fc_norm) + int(cfg.norm_before_fc))  # EAGLE-3.1's norms before fc
    trained = 3 * ht * h + norms + layer + h + h * vd  # fc, the layer, final norm, lm_head
    return trained, cfg.vocab_size * h


def model_state_bytes(trained: int, frozen: int, stage: int, bf16: bool, world: int) -> int:
    """Per rank. fp32: weights 4 + gradients 4 + Adam moments 8; bf16: weights 2 + gradients 2 +
    fp32 master weights and moments 12 (DeepSpeed's figures)."""
    weights, grads, optim = (2, 2, 12) if bf16 else (4, 4, 8)
    share = lambda nbytes, from_stage: nbytes / world if stage >= from_stage else nbytes  # noqa: E731
    per = share(weights * trained, 3) + share(grads * trained, 2) + share(optim * trained, 1)
    return int(per + share(weights * frozen, 3))


def activation_bytes(
    cfg: DrafterConfig, rows: int, width: int, ttt: int, bf16: bool, attention: str = "blockwise"
) -> int:
    """Peak bytes of one micro-batch's forward kept for backward, plus the backward's transients.

    `attention="blockwise"` (drafter/model/ttt_attention.py) keeps per step and position only the query's
    output, its log-sum-exp and the chain's own keys and values: every term is linear in `width`
    except one query block's scores, which are bounded. `"eager"` keeps each step's whole probability
    matrix, [heads, width, width + step] per row. `"flex"` is the GPU path (drafter/model/flex_ttt.py)."""
    from drafter.model.ttt_attention import BLOCK_ELEMENTS

    h, i, vd, ht = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size, cfg.target_hidden
    heads = cfg.num_attention_heads
    q, k, v, o, kept = cfg.attention_widths  # Llama: k = v = kv heads' width, o = q; MLA: its own widths
    a, f = (2 if bf16 else 4), 4  # activations in the autocast precision; norms, softmax and loss in fp32
    n = rows * width
    batch = n * (4 * (3 * ht + h) + 3 * 8 + 3) + (n * 3 * ht * a if bf16 else 0)  # collated batch (+ cast)
    batch += n * 3 * ht * f * (int(cfg.fc_norm) + int(cfg.norm_before_fc))  # EAGLE-3.1: fc's input normed first
    target = 2 * n * vd * f  # the target's draft-vocab logits and distribution
    # per step and position: four norms keep their inputs and an fp32 reciprocal norm (drafter/model/lean_ops.py),
    # projections their inputs and outputs, SwiGLU gate and up, the logits in both precisions
    # (MLA: its latents too); the EAGLE-3.1 norms before fc are per position once, in the batch's width
    per_step_position = f * 4 + a * (7 * h + q + k + v + o + kept + 2 * i + vd) + f * vd
    head_rows = vd * h * f  # the target's lm_head rows of the draft vocabulary, the loss's teacher
    logits_backward = 2 * n * vd * f  # log-softmax and softmax backward
    if attention == "flex":
        return _fused_activation_bytes(cfg, rows, width, ttt, bf16)
    if attention == "eager":
        masks = rows * width * width + width * width  # allowed keys per row, causal
        matrix = rows * heads * width * width * (f + (a if bf16 else 0))  # probabilities (+ their cast)
        per_step = n * per_step_position + matrix
        return int(batch + target + masks + ttt * per_step + n * a * h + logits_backward + 2 * matrix + head_rows)
    # the chain's keys and values taken per step (on average (ttt - 1) / 2 of each) and the log-sum-exp
    per_step = n * (per_step_position + a * (q + o) / 2 * (ttt - 1) + f * heads)
    block = min(rows * heads * width * width, max(BLOCK_ELEMENTS, rows * heads * 16 * width))
    block_transients = 6 * f * block  # scores, probabilities, their gradient, the mask, in one block
    accumulators = n * f * (2 * q + o + (q + o) / 2 * (ttt - 1))  # backward's fp32 gradients of q, k, v, the chain
    transients = logits_backward + block_transients + accumulators
    return int(batch + target + ttt * per_step + n * a * h + transients + head_rows)


def _fused_activation_bytes(cfg: DrafterConfig, rows: int, width: int, ttt: int, bf16: bool) -> int:
    """The GPU path (drafter/train/ttt_step.py over drafter/model/flex_ttt.py): per step and position the compiled norms
    keep their inputs and an fp32 reciprocal norm, the projections their inputs, flex attention its query,
    output and log-sum-exp, SwiGLU gate and up, and the fused loss its gradient of the logits (no fp32
    log-softmax); step j's keys and values are step 0's and the j earlier steps' side by side, kept whole
    for the kernel's backward. The collated batch arrives in fp32 and is cast; the teacher's draft-vocab
    logits come in the states' precision and its distribution in fp32."""
    h, i, vd, ht = cfg.hidden_size, cfg.intermediate_size, cfg.draft_vocab_size, cfg.target_hidden
    q, _, _, o, kept = cfg.attention_widths
    keys = q + o  # keys and values as the kernel reads them (GQA expanded; MLA per head)
    a, f = (2 if bf16 else 4), 4
    n = rows * width
    batch = n * (4 * (3 * ht + ht) + 3 * 8 + 3) + n * (3 * ht + ht) * a * int(bf16)  # fp32 batch, its cast
    batch += n * 3 * ht * a * (int(cfg.fc_norm) + int(cfg.norm_before_fc))  # EAGLE-3.1's norms before fc
    target = n * vd * (a + f)  # the teacher's logits and its fp32 distribution
    per_step = a * (7 * h + q + 2 * o + 3 * i + vd + kept) + f * (4 + cfg.num_attention_heads)
    chain = a * keys * (ttt * (ttt + 1) // 2 + (ttt - 1))  # each step's keys whole; earlier steps' in full layout
    transients = a * (vd + 2 * i + 4 * h + q + ttt * keys) + f * q  # the last step's backward
    return int(batch + target + n * (a * h + ttt * per_step + chain + transients))


def allocator_bytes() -> int:
    """What the C allocator keeps after frees: glibc's malloc holds up to one 64 MiB arena per
    compute thread (HEAP_MAX_SIZE on 64-bit), which a run's peak RSS includes."""
    import torch

    return 64 * 1024**2 * max(1, torch.get_num_threads())


def warmed_runtime_bytes() -> int:
    """This process's RSS once the training machinery has run once (a one-parameter backward and
    AdamW step page in the kernels and optimizer code every run pays for)."""
    import torch

    w = torch.zeros(8, requires_grad=True)
    (w * 2).sum().backward()
    torch.optim.AdamW([w]).step()
    return current_rss_bytes() + allocator_bytes()


def current_rss_bytes() -> int:
    """What this process holds now (Linux /proc; 0 where unknown)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def available_memory() -> tuple[int, str]:
    """(bytes a rank can have, where): the smallest free GPU memory when training runs on GPUs,
    else this host's available memory plus what this process already holds."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count():
        device = int(os.environ.get("LOCAL_RANK", "0"))  # this rank's GPU only: no context on the others
        return torch.cuda.mem_get_info(device)[0], f"GPU {device} ({torch.cuda.get_device_name(device)})"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 + current_rss_bytes(), "this host"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") + current_rss_bytes(), "this host"


@dataclass(frozen=True)
class MemoryPlan:
    stage: int
    bf16: bool
    world: int
    ranks_here: int  # ranks sharing the memory that was measured (all of them on one CPU host)
    micro_batch: int
    max_len: int
    ttt_length: int
    trained_params: int
    frozen_params: int
    model_states: int
    activations: int
    runtime: int
    available: int
    where: str
    hint: str | None = None  # the fewest ranks, then the lowest stage, at which one rank per device fits

    @property
    def per_rank(self) -> int:
        return self.model_states + self.activations + self.runtime

    @property
    def needed_here(self) -> int:
        return self.per_rank * self.ranks_here

    @property
    def fits(self) -> bool:
        return self.needed_here * (1 + MARGIN) <= self.available

    def describe(self) -> str:
        many = f" x {self.ranks_here} ranks here" if self.ranks_here > 1 else ""
        return (
            f"needs {gib(self.per_rank)} per rank{many} with ZeRO-{self.stage} on {self.world} "
            f"rank{'s' if self.world > 1 else ''} ({'bf16' if self.bf16 else 'fp32'}: model states "
            f"{gib(self.model_states)}, activations {gib(self.activations)} for {self.micro_batch} x "
            f"{self.max_len} tokens, TTT {self.ttt_length}, runtime {gib(self.runtime)}); {self.where} has "
            f"{gib(self.available)}"
        )

    def refusal(self) -> str:
        hint = self.hint
        if hint:
            return f"does not fit: {self.describe()}; try {hint}"
        return (
            f"does not fit: {self.describe()}; no ZeRO stage up to 64 ranks fits: one micro-batch's activations "
            f"({gib(self.activations)}) grow with the samples per rank, max_len and TTT depth: lower those"
        )

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "per_rank": self.per_rank,
            "needed_here": self.needed_here,
            "fits": self.fits,
            "summary": self.describe(),
        }


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= 0.1 * GIB else f"{nbytes / 1024**2:.0f} MiB"


def plan(
    cfg: DrafterConfig,
    *,
    stage: int,
    bf16: bool,
    world: int,
    micro_batch: int,
    max_len: int,
    ttt_length: int,
    ranks_here: int = 1,
    runtime: int | None = None,
    limit_bytes: int | None = None,
    attention: str = "blockwise",
) -> MemoryPlan:
    """The plan for these settings against the memory this process sees (or `limit_bytes`)."""
    trained, frozen = parameter_counts(cfg)
    available, where = available_memory() if limit_bytes is None else (limit_bytes, "--memory_limit_gib")
    runtime = warmed_runtime_bytes() if runtime is None else runtime
    global_batch = micro_batch * world
    hint = None
    for w in WORLDS:
        if global_batch % w:  # finetune refuses a global batch the ranks cannot split evenly
            continue
        rows = global_batch // w
        acts = activation_bytes(cfg, rows, max_len, ttt_length, bf16, attention)
        for st in STAGES:
            need = model_state_bytes(trained, frozen, st, bf16, w) + acts + runtime
            if need * (1 + MARGIN) <= available and (w, st) != (world, stage) and hint is None:
                ranks = f"{w} rank{'s' if w > 1 else ''}"
                hint = f"ZeRO-{st} on {ranks} ({rows} samples each), one per GPU or host: {gib(need)} per rank"
    return MemoryPlan(
        stage=stage, bf16=bf16, world=world, ranks_here=ranks_here, micro_batch=micro_batch, max_len=max_len,
        ttt_length=ttt_length, trained_params=trained, frozen_params=frozen,
        model_states=model_state_bytes(trained, frozen, stage, bf16, world),
        activations=activation_bytes(cfg, micro_batch, max_len, ttt_length, bf16, attention),
        runtime=runtime, available=available, where=where, hint=hint,
    )  # fmt: skip
