"""The TTT training step on a GPU, side by side with SpecForge's, at the real Kimi-K2 drafter's size.

Both sides train the same drafter (configs/reference/kimi-k2-eagle3.config.json: hidden 7168, 64 heads of
128, intermediate 18432, draft vocabulary 32000; 1.19 B trained parameters) from the same bf16 weights, on
the same inputs, at TTT 7 and batch 1, each with torch's fused AdamW over bf16 parameters:

- drafterops: drafter/train/loop.py's GPU step: the plan made on the host (drafter/model/ttt_plan.py), each TTT step's
  attention one flex_attention kernel under a block mask (drafter/model/flex_ttt.py), norms, rotary embeddings
  and SwiGLU compiled (drafter/model/compiled.py), each step scored as it comes by the fused soft cross-entropy
  (drafter/train/ttt_step.py, drafter/train/soft_ce.py). Its batch arrives in fp32, as the data loader gives it.
- SpecForge: its own `OnlineEagle3Model` over `LlamaForCausalLMEagle3` with its flex_attention backend
  (compiled, as its trainer runs it) and its Triton loss, imported from a checkout (SPECFORGE_SRC, a folder
  holding the `specforge` package: `git archive` of sgl-project/SpecForge). Its teacher is the target's
  full-vocabulary logits in bf16, computed before the step (its trainer gets them from the target).

Per length: the first step's time less a later step's is the compile time; then the median of timed steps;
activation memory is the step's peak allocation less the weights, gradients and optimizer states (the
gradients are kept allocated between steps, so their allocation is not counted twice), held to
drafter/memory_plan.activation_bytes. One step at 4096 tokens is profiled for kernel launches and host
synchronisations. `--check` holds the GPU path's loss and gradients in bf16 to an fp32 reference computed
on the CPU (Llama and MLA layers, padded and packed rows, a sliding window, TTT 1 to 7), beside the eager
attention in bf16 on the GPU. Needs torch with CUDA; neither MLflow nor DeepSpeed.

    SPECFORGE_SRC=/path/to/SpecForge python -m bench.train_gpu [--lengths 2048,4096,8192] [--mix] [--check]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from bench._common import RESULTS
from drafter.analysis.memory_plan import activation_bytes
from drafter.data.dataset import Batch, Sample
from drafter.data.packing import collate_packed
from drafter.model.config import DrafterConfig
from drafter.model.eagle3 import Eagle3Drafter
from drafter.model.ttt_plan import plan_steps
from drafter.train.loss import loss_positions, pred_mask_from_loss_mask, target_draft_logits
from drafter.train.ttt_step import ttt_step_loss

K2 = Path(__file__).resolve().parent.parent / "configs" / "reference" / "kimi-k2-eagle3.config.json"
TTT, WARMUP, TIMED, DECAY = 7, 2, 5, 0.8
GIB = 1024**3
DEVICE = "cuda"  # `--smoke` runs the whole bench on the CPU at a tiny size, to check the bench itself
# a drafter small enough for the CPU smoke run
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
    draft_vocab_size=128,
    aux_layer_ids=[0, 1, 2],
    max_position_embeddings=4096,
)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def allocated() -> int:
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()


def peak() -> int:
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


def k2_config() -> DrafterConfig:
    return DrafterConfig.from_file(K2)


# ----------------------------------------------------------------------------- the two sides
def build_ours(cfg: DrafterConfig, seed: int = 0) -> Eagle3Drafter:
    """The drafter in bf16 on the GPU, random weights (std 0.02, norms 1) drawn there, random vocab maps."""
    with torch.device(DEVICE):
        model = Eagle3Drafter(cfg)
    reinit(model, seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    model.t2d.copy_(t2d)
    model.d2t.copy_(ids - torch.arange(cfg.draft_vocab_size))
    model.has_embedding = True
    return model.to(torch.bfloat16).train()


@torch.no_grad()
def reinit(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or "norm." in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02 if name != "embed_tokens.weight" else 0.5, generator=g)


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, fused=DEVICE == "cuda")


def load_specforge():
    src = os.environ.get("SPECFORGE_SRC")
    if not src or not (Path(src) / "specforge").is_dir():
        return None
    sys.path.insert(0, src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from specforge.algorithms.eagle3.model import OnlineEagle3Model
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    return LlamaForCausalLMEagle3, OnlineEagle3Model


def build_specforge(cfg: DrafterConfig, api, ours: Eagle3Drafter):
    """SpecForge's draft model (flex_attention backend) holding our drafter's weights, and its TTT wrapper."""
    from transformers.models.llama.configuration_llama import LlamaConfig

    draft_cls, wrapper_cls = api
    lc = LlamaConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        num_hidden_layers=1,
        pad_token_id=0,
        rope_theta=cfg.rope.theta,
    )
    lc.draft_vocab_size = cfg.draft_vocab_size
    lc.target_hidden_size = cfg.target_hidden
    prior = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with warnings.catch_warnings(), torch.device(DEVICE):
            warnings.simplefilter("ignore")
            draft = draft_cls(lc, attention_backend="flex_attention")
    finally:
        torch.set_default_dtype(prior)
    missing, unexpected = draft.load_state_dict(ours.state_dict(), strict=False)
    if unexpected or any(not k.startswith("midlayer.self_attn.rotary") for k in missing):
        raise RuntimeError(f"SpecForge's names differ: missing {missing}, unexpected {unexpected}")
    draft = draft.to(torch.bfloat16).train()
    draft.embed_tokens.weight.requires_grad_(False)
    return draft, wrapper_cls(draft, length=TTT, attention_backend="flex_attention")


# ----------------------------------------------------------------------------- inputs and steps
class Inputs:
    """One batch as both sides take it: ours as the data loader gives it (fp32 states, host masks), theirs
    as its trainer does (bf16 states, the target's full logits)."""

    def __init__(self, cfg: DrafterConfig, samples: list[Sample], head: torch.Tensor, specforge: bool) -> None:
        batch = collate_packed(samples) if len(samples) > 1 else _single(samples[0])
        self.mask_host = pred_mask_from_loss_mask(batch.loss_mask, batch.segment_ids) & batch.attention_mask
        self.shape = tuple(batch.input_ids.shape)
        self.host = batch  # the plan is made from the host's masks, as drafter/train/loop.py makes it
        self.batch = batch.to(DEVICE)
        self.mask = self.mask_host.to(DEVICE)
        self.tokens = int(batch.attention_mask.sum())
        self.trained = int(self.mask_host.sum())
        self.full_logits = None
        if specforge:  # the target's logits over its whole vocabulary, what SpecForge's online trainer reads
            self.full_logits = self.batch.last_hidden.to(torch.bfloat16) @ head.T
        sync()

    def nbytes(self) -> int:
        tensors = [v for v in vars(self.batch).values() if v is not None] + [self.mask]
        tensors += [self.full_logits] if self.full_logits is not None else []
        return sum(t.numel() * t.element_size() for t in tensors)


def _single(s: Sample) -> Batch:
    t = len(s)
    return Batch(
        s.input_ids[None],
        torch.ones(1, t, dtype=torch.bool),
        s.loss_mask[None],
        s.aux_hidden[None].float(),
        s.last_hidden[None].float(),
        s.target_token[None],
    )


def random_sample(cfg: DrafterConfig, length: int, head: torch.Tensor, prompt: int = 0, seed: int = 0) -> Sample:
    """A sample whose target token is the head's argmax of its last state (so both teachers agree)."""
    g = torch.Generator().manual_seed(seed)
    loss_mask = torch.zeros(length, dtype=torch.bool)
    loss_mask[prompt:] = True
    last = torch.randn(length, cfg.target_hidden, generator=g)
    target = (last.to(DEVICE).to(torch.bfloat16) @ head.T).argmax(-1).cpu()
    return Sample(
        input_ids=torch.randint(0, cfg.vocab_size, (length,), generator=g),
        loss_mask=loss_mask,
        aux_hidden=torch.randn(length, 3 * cfg.target_hidden, generator=g),
        last_hidden=last,
        target_token=target,
    )


def ours_step(model: Eagle3Drafter, opt, x: Inputs, head_rows: torch.Tensor):
    """One training step as drafter/train/loop.py runs it on a GPU (no DeepSpeed here): no host wait."""
    plan = plan_steps(x.mask_host, TTT, x.shape, x.host.attention_mask, x.host.segment_ids).to(DEVICE)
    counts = loss_positions(x.batch.target_token, x.mask, model.t2d, TTT, x.batch.segment_ids)
    target = target_draft_logits(x.batch.last_hidden.to(torch.bfloat16), head_rows)
    loss, stats = ttt_step_loss(model, x.batch, x.mask, target, plan, DECAY, counts)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss.detach()


def specforge_step(wrapper, opt, x: Inputs):
    """One step of SpecForge's OnlineEagle3Model as its trainer runs it: the losses of the TTT steps weighted
    0.8**i, backward, optimizer."""
    plosses = wrapper(
        input_ids=x.batch.input_ids,
        attention_mask=x.batch.attention_mask.long(),
        target=x.full_logits,
        loss_mask=x.mask.long()[..., None],
        hidden_states=x.batch.aux_hidden.to(torch.bfloat16),
    )[0]
    loss = sum(DECAY**i * p for i, p in enumerate(plosses))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return loss.detach()


# ----------------------------------------------------------------------------- measuring
def measure(step, inputs_list: list[Inputs], timed: int = TIMED) -> dict:
    """Compile time (first step less a later one), median step time, the step's own allocations at their
    peak (above everything resident before it: both sides' weights, gradients and optimizer states, the
    inputs), losses."""
    sync()
    t0 = time.perf_counter()
    first_loss = step(inputs_list[0])
    sync()
    first = time.perf_counter() - t0
    for _ in range(WARMUP - 1):
        for x in inputs_list:
            step(x)
    sync()
    times, losses, top, highest = [], [float(first_loss)], 0, 0
    for _ in range(timed):
        before = allocated()
        reset_peak()
        t0 = time.perf_counter()
        out = [step(x) for x in inputs_list]
        sync()
        times.append(time.perf_counter() - t0)
        top, highest = max(top, peak() - before), max(highest, peak())
        losses.append(float(out[0]))
    median = statistics.median(times)
    return {
        "step_s": median,
        "spread": max(times) / min(times),
        "compile_s": max(0.0, first - median / len(inputs_list)),
        "activations": top,
        "peak": highest,  # everything allocated at the step's peak, both sides' weights and states included
        "inputs": max(x.nbytes() for x in inputs_list),
        "losses": losses,
    }


def profile_counts(step, x: Inputs) -> dict:
    """Kernel launches, host synchronisations and device-to-host copies in one step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(x)
        sync()
    counts = {"kernels": 0, "syncs": -1, "copies_to_host": 0, "launch_calls": 0}  # -1: the profiler's own sync
    for e in prof.events():
        name = e.name
        if e.device_type == DeviceType.CUDA:
            if "DtoH" in name or "Device -> Pageable" in name or "Device -> Pinned" in name:
                counts["copies_to_host"] += 1
            elif not name.startswith(("Memcpy", "Memset")):
                counts["kernels"] += 1
        elif name in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize"):
            counts["syncs"] += 1
        elif "LaunchKernel" in name:
            counts["launch_calls"] += 1
    return counts


def fall_back(results: dict, exc: Exception) -> bool:
    """After a failed first step: flex attention compiled per shape, then the eager norms and loss. Said in
    the results; False when nothing is left to fall back to."""
    import drafter.model.compiled
    import drafter.model.flex_ttt

    said = results["meta"].setdefault("fallbacks", [])
    said.append(f"{type(exc).__name__}: {str(exc)[:300]}")
    if drafter.model.flex_ttt.DYNAMIC:
        drafter.model.flex_ttt.DYNAMIC = False
        said.append("flex attention compiled per shape (dynamic shapes failed)")
        return True
    if drafter.model.compiled.on_device is not _never:
        drafter.model.compiled.on_device = _never
        said.append("norms, rotary, SwiGLU and the loss uncompiled")
        return True
    return False


def _never(x: torch.Tensor) -> bool:
    return False


# ----------------------------------------------------------------------------- correctness
def check(results: dict, deadline: float) -> None:
    """The GPU path's bf16 loss and gradients against an fp32 reference on the CPU (eager attention,
    drafter/loss.ttt_loss), beside the same reference for eager attention in bf16 on the GPU: the flex path
    must be no further from fp32 than bf16's own rounding puts the eager path (within 2x)."""
    from drafter.model.mla import MLASpec
    from drafter.train.loss import ttt_loss

    small = dict(
        TINY,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=4096,
        draft_vocab_size=1024,
    )
    # MLA at the public K2.5 MLA drafters' head widths: keys 128 + 64 (not a power of two), values 128
    mla = dict(
        small,
        num_attention_heads=2,
        mla=MLASpec(kv_lora_rank=128, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=96),
        fc_norm=True,
        norm_before_fc=True,
        norm_output=True,
        norm_before_residual=True,
    )
    cases = []
    for family, extra in (("llama", small), ("mla-eagle3.1", mla)):
        for window in (None, 96):
            for layout in ("padded", "packed"):
                for ttt in (1, 3, 7):
                    cases.append((family, extra, window, layout, ttt))
    rows = results.setdefault("check", [])
    for family, extra, window, layout, ttt in cases:
        if time.time() > deadline:
            rows.append({"case": "the rest", "skipped": "deadline"})
            break
        name = f"{family} {layout} window={window} ttt={ttt}"
        try:
            rows.append(
                {"case": name, **_check_case(DrafterConfig(**extra, sliding_window=window), layout, ttt, ttt_loss)}
            )
        except Exception as exc:  # noqa: BLE001 - a bench reports what failed and goes on
            rows.append({"case": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        print(json.dumps(rows[-1]), flush=True)


def _check_case(cfg: DrafterConfig, layout: str, ttt: int, ttt_loss) -> dict:  # noqa: ANN001
    from drafter.data.dataset import collate

    torch.manual_seed(0)
    cpu = Eagle3Drafter(cfg)
    cpu.init_weights(1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        cpu.embed_tokens.weight.normal_(0, 0.5, generator=g)
    ids = torch.randperm(cfg.vocab_size, generator=g)[: cfg.draft_vocab_size].sort().values
    cpu.t2d.zero_()[ids] = True
    cpu.d2t.copy_(ids - torch.arange(cfg.draft_vocab_size))
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.05
    samples = []
    for n, p in zip([300, 120, 200, 64], [80, 30, 50, 10], strict=True):
        lm = torch.zeros(n, dtype=torch.bool)
        lm[p:] = True
        samples.append(
            Sample(
                torch.randint(0, cfg.vocab_size, (n,), generator=g),
                lm,
                torch.randn(n, 3 * cfg.hidden_size, generator=g),
                torch.randn(n, cfg.hidden_size, generator=g),
                torch.randint(0, cfg.vocab_size, (n,), generator=g),
            )
        )
    batch = collate(samples) if layout == "padded" else collate_packed(samples)
    mask = pred_mask_from_loss_mask(batch.loss_mask, batch.segment_ids) & batch.attention_mask
    rows = head[cpu.t2d]

    def reference(model, b, m, r, dtype):  # noqa: ANN001, ANN202
        model.zero_grad()
        model.attention = "eager"
        steps = model(
            b.input_ids,
            b.aux_hidden.to(dtype),
            b.attention_mask,
            ttt_length=ttt,
            pred_mask=m,
            position_ids=b.position_ids,
            segment_ids=b.segment_ids,
        )
        counts = loss_positions(b.target_token, m, model.t2d, ttt, b.segment_ids)
        loss, _, _ = ttt_loss(
            steps,
            target_draft_logits(b.last_hidden.to(dtype), r),
            b.target_token,
            m,
            model.t2d,
            model.d2t,
            denominators=counts,
            segment_ids=b.segment_ids,
        )
        loss.backward()
        return float(loss), {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = reference(cpu, batch, mask, rows, torch.float32)
    gpu = Eagle3Drafter(cfg).to(DEVICE)
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.to(torch.bfloat16).train()
    gb, gm, grows = batch.to(DEVICE), mask.to(DEVICE), rows.to(DEVICE)
    eager_loss, eager_grads = reference(gpu, gb, gm, grows, torch.bfloat16)
    gpu.zero_grad()
    gpu.attention = "flex" if DEVICE == "cuda" else "blockwise"
    plan = plan_steps(mask, ttt, tuple(mask.shape), batch.attention_mask, batch.segment_ids).to(DEVICE)
    counts = loss_positions(gb.target_token, gm, gpu.t2d, ttt, gb.segment_ids)
    loss, _ = ttt_step_loss(
        gpu, gb, gm, target_draft_logits(gb.last_hidden.to(torch.bfloat16), grows), plan, DECAY, counts
    )
    loss.backward()
    flex_grads = {n: p.grad.float().cpu() for n, p in gpu.named_parameters() if p.grad is not None}

    def worst(grads: dict) -> float:
        return max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-12)) for n, g in ref_grads.items())

    e_eager, e_flex = worst(eager_grads), worst(flex_grads)
    l_eager, l_flex = abs(eager_loss - ref_loss) / abs(ref_loss), abs(float(loss) - ref_loss) / abs(ref_loss)
    return {
        "loss_fp32": round(ref_loss, 6),
        "loss_rel_err_eager_bf16": f"{l_eager:.1e}",
        "loss_rel_err_flex_bf16": f"{l_flex:.1e}",
        "grad_rel_err_eager_bf16": f"{e_eager:.1e}",
        "grad_rel_err_flex_bf16": f"{e_flex:.1e}",
        "holds": bool(e_flex <= 2 * e_eager + 1e-3 and l_flex <= 2 * l_eager + 1e-3),
    }


# ----------------------------------------------------------------------------- through DeepSpeed
SMALL = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=4096,
    draft_vocab_size=1024,
    aux_layer_ids=[0, 1, 2],
    max_position_embeddings=4096,
)


def deepspeed_trial(results: dict, steps: int = 16) -> None:
    """One finetune trial's training as drafter/train/loop.py runs it on this GPU (DeepSpeed, ZeRO-2, bf16, one
    rank) against the benchmark's step in a plain loop with DeepSpeed's optimizer arithmetic (fp32 master
    weights, AdamW, gradient clipping, its WarmupCosineLR): the same loss curve within bf16's rounding; and
    the run's peak memory against the memory plan."""
    import copy
    import tempfile

    try:
        import deepspeed  # noqa: F401
        from deepspeed.runtime.lr_schedules import WarmupCosineLR
    except ImportError as exc:
        results["deepspeed"] = {"skipped": f"DeepSpeed is not installed here ({exc})"}
        return
    import drafter.train.loop as train_module
    from drafter.analysis.memory_plan import plan
    from drafter.data.dataset import DatasetWriter, HiddenStateDataset, split_indices

    cfg = DrafterConfig(**(TINY if DEVICE == "cpu" else SMALL))
    g = torch.Generator().manual_seed(3)
    folder = Path(tempfile.mkdtemp()) / "ds"
    writer = DatasetWriter(
        folder,
        {"target": "synthetic", "layer_ids": [0, 1, 2], "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size},
    )
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.05
    writer.write_head(head.to(torch.bfloat16), (torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g) * 0.5))
    for k in range(24):
        n, p = 200 + 37 * k % 400, 40 + 13 * k % 120
        lm = torch.zeros(n, dtype=torch.bool)
        lm[p:] = True
        last = torch.randn(n, cfg.hidden_size, generator=g)
        writer.add(
            Sample(
                torch.randint(0, cfg.vocab_size, (n,), generator=g),
                lm,
                torch.randn(n, 3 * cfg.hidden_size, generator=g).bfloat16(),
                last.bfloat16(),
                (last @ head.T).argmax(-1),
            )
        )
    writer.finish()
    data = HiddenStateDataset(folder)
    tc = train_module.TrainConfig(
        max_steps=steps,
        batch_size=4,
        max_len=1024,
        peak_lr=3e-4,
        ttt_length=TTT,
        val_fraction=0.0,
        ds_config="zero2",
        log_every=4,
    )
    model = train_module.scratch_drafter(cfg, data, list(range(len(data))), seed=0)
    reference = copy.deepcopy(model)
    if DEVICE == "cpu":  # the smoke run: the GPU path forced on the CPU
        train_module.scored_as_it_comes = lambda device: True
    reset_peak()
    ds_run = train_module.train(model, data, tc, progress=False)
    ds_peak = peak()
    # the same steps in a plain loop: DeepSpeed's bf16 optimizer arithmetic by hand
    ref = reference.to(DEVICE)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    master = [p.detach().float().clone().requires_grad_(True) for p in trainable]
    ref.to(torch.bfloat16)
    trainable = [p for p in ref.parameters() if p.requires_grad]
    ds_cfg = train_module.load_ds_config("zero2", tc, steps)
    opt = torch.optim.AdamW(master, lr=tc.peak_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=tc.weight_decay)
    sched = WarmupCosineLR(opt, **ds_cfg["scheduler"]["params"])
    rows = data.target_head()[ref.t2d].float().to(DEVICE)
    train_idx, _ = split_indices(len(data), tc.val_fraction, tc.seed)
    losses = []
    for step in range(steps):
        samples = [data[i] for i in train_module.batch_indices(train_idx, tc.batch_size, tc.seed, step)]
        host = collate_packed(samples, tc.max_len)
        mask_host = pred_mask_from_loss_mask(host.loss_mask, host.segment_ids) & host.attention_mask
        plan_ = plan_steps(mask_host, TTT, tuple(mask_host.shape), host.attention_mask, host.segment_ids).to(DEVICE)
        b, mask = host.to(DEVICE), mask_host.to(DEVICE)
        counts = loss_positions(b.target_token, mask, ref.t2d, TTT, b.segment_ids)
        loss, _ = ttt_step_loss(
            ref, b, mask, target_draft_logits(b.last_hidden.to(torch.bfloat16), rows), plan_, tc.step_decay, counts
        )
        loss.backward()
        for m, p in zip(master, trainable, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(master, ds_cfg["gradient_clipping"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for m, p in zip(master, trainable, strict=True):
                p.copy_(m)
        losses.append(float(loss))
    curve = [h["train_loss"] for h in ds_run.history]
    rel = [abs(a - b) / abs(b) for a, b in zip(curve, losses, strict=True)]
    planned = plan(
        cfg,
        stage=2,
        bf16=True,
        world=1,
        micro_batch=tc.batch_size,
        max_len=tc.max_len,
        ttt_length=TTT,
        runtime=0,
        limit_bytes=1 << 50,
        attention="flex",
    )
    results["deepspeed"] = {
        "steps": steps,
        "deepspeed_losses": [round(v, 5) for v in curve],
        "plain_loop_losses": [round(v, 5) for v in losses],
        "first_step_rel_diff": f"{rel[0]:.1e}",
        "worst_rel_diff": f"{max(rel):.1e}",
        "peak_gib": round(ds_peak / GIB, 3),
        "plan_states_plus_activations_gib": round((planned.model_states + planned.activations) / GIB, 3),
        "plan_over_peak": round((planned.model_states + planned.activations) / ds_peak, 3) if ds_peak else None,
    }


# ----------------------------------------------------------------------------- the run
def mix_samples(cfg: DrafterConfig, head: torch.Tensor, n: int) -> list[Sample]:
    """ShareGPT-like single-turn conversations (bench/packing_mix.py's distribution), cut at 2048."""
    from bench.packing_mix import MAX_LEN, PROMPT_MEAN, REPLY_MEAN, SIGMA, lognormal

    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(n):
        prompt, reply = lognormal(PROMPT_MEAN, SIGMA, g), lognormal(REPLY_MEAN, SIGMA, g)
        length = min(prompt + reply, MAX_LEN)
        out.append(random_sample(cfg, length, head, prompt=min(prompt, length - 1), seed=100 + k))
    return out


def main() -> None:  # noqa: C901 - one run, section by section, each written as it completes
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--mix", type=int, default=16, help="conversations in the packed length mix (0: none)")
    parser.add_argument("--check", action="store_true", help="hold the GPU path's bf16 gradients to fp32")
    parser.add_argument("--check_budget", type=float, default=180, help="seconds the check may take at most")
    parser.add_argument("--profile", type=int, default=4096, help="the length profiled (0: none)")
    parser.add_argument("--deadline", type=float, default=0, help="seconds after which sections are skipped")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--smoke", action="store_true", help="the whole bench on the CPU at a tiny size")
    parser.add_argument("--deepspeed", action="store_true", help="a trial through DeepSpeed against the plain loop")
    args = parser.parse_args()
    global DEVICE
    if args.smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        raise SystemExit("bench.train_gpu needs a CUDA GPU (the CPU step is bench.specforge_step)")
    start = time.time()
    deadline = start + args.deadline if args.deadline else math.inf
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "none (smoke run on the CPU)"
    results: dict = {"meta": {"torch": torch.__version__, "gpu": gpu, "ttt": TTT}}

    def save() -> None:
        results["meta"]["elapsed_s"] = round(time.time() - start, 1)
        (out / "train_gpu.json").write_text(json.dumps(results, indent=2) + "\n")

    api = None
    try:
        api = load_specforge()
        results["meta"]["specforge"] = "found" if api else "not found (set SPECFORGE_SRC): only this project's step"
    except Exception as exc:  # noqa: BLE001
        results["meta"]["specforge"] = f"import failed: {type(exc).__name__}: {str(exc)[:300]}"
    cfg = DrafterConfig(**TINY) if args.smoke else k2_config()
    ours = build_ours(cfg)
    head = torch.randn(cfg.vocab_size, cfg.target_hidden, device=DEVICE, dtype=torch.bfloat16) * 0.02
    head_rows = head[ours.t2d]
    opt = adamw(ours)
    sides = {"drafterops": (ours, opt, lambda x: ours_step(ours, opt, x, head_rows))}
    if api is not None:
        try:
            sf_model, sf_wrapper = build_specforge(cfg, api, ours)
            sf_opt = adamw(sf_model)
            sides["SpecForge"] = (sf_model, sf_opt, lambda x: specforge_step(sf_wrapper, sf_opt, x))
        except Exception as exc:  # noqa: BLE001
            results["meta"]["specforge"] = f"could not build: {type(exc).__name__}: {str(exc)[:300]}"
    results["meta"]["trained_params"] = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    rows = results.setdefault("rows", [])

    def run_case(label: str, samples: list[Sample]) -> None:
        if time.time() > deadline:
            rows.append({"case": label, "skipped": "deadline"})
            return
        packed = len(samples) > 1
        x_ours = (
            [Inputs(cfg, samples[i : i + 4], head, False) for i in range(0, len(samples), 4)]
            if packed
            else [Inputs(cfg, samples, head, False)]
        )
        x_sf = [Inputs(cfg, [s], head, True) for s in samples] if "SpecForge" in sides else []
        trained = sum(x.trained for x in x_ours)
        tokens = sum(x.tokens for x in x_ours)
        measured = {}
        for name, (_, _, step) in sides.items():
            try:
                try:
                    m = measure(step, x_ours if name == "drafterops" else x_sf, 3 if packed else TIMED)
                except Exception as exc:
                    if name != "drafterops" or not fall_back(results, exc):
                        raise
                    m = measure(step, x_ours, 3 if packed else TIMED)
                measured[name] = m
            except Exception as exc:  # noqa: BLE001
                measured[name] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
        for name, m in measured.items():
            row = {"case": label, "side": name, "tokens": tokens, "trained": trained}
            if "error" in m:
                row["error"] = m["error"]
            else:
                row.update(
                    ms_per_step=round(1000 * m["step_s"], 1),
                    tok_per_s=round(tokens / m["step_s"]),
                    trained_tok_per_s=round(trained / m["step_s"]),
                    spread=round(m["spread"], 2),
                    compile_s=round(m["compile_s"], 1),
                    activations_gib=round(m["activations"] / GIB, 2),
                    peak_gib=round(m["peak"] / GIB, 2),
                    losses=[round(v, 5) for v in m["losses"]],
                )
                if name == "drafterops" and not packed and m["activations"]:
                    plan, batch = activation_bytes(cfg, 1, tokens, TTT, True, "flex"), m["activations"] + m["inputs"]
                    row["with_batch_gib"] = round(batch / GIB, 2)  # the plan counts the collated batch too
                    row["plan_gib"] = round(plan / GIB, 2)
                    row["plan_over_measured"] = round(plan / batch, 3)
            rows.append(row)
        if all("step_s" in m for m in measured.values()) and len(measured) == 2:
            rows[-2]["speed_vs_specforge"] = round(
                measured["SpecForge"]["step_s"] / measured["drafterops"]["step_s"], 3
            )
        print(json.dumps(rows[-len(measured) :]), flush=True)
        if label.startswith(f"{args.profile} tokens"):
            for name, (_, _, step) in sides.items():
                try:
                    results.setdefault("profile", {})[name] = profile_counts(
                        step, (x_ours if name == "drafterops" else x_sf)[0]
                    )
                except Exception as exc:  # noqa: BLE001
                    results.setdefault("profile", {})[name] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(json.dumps(results["profile"]), flush=True)
        del x_ours, x_sf
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        save()

    lengths = [int(t) for t in args.lengths.split(",") if t]
    for t in lengths:
        run_case(f"{t} tokens", [random_sample(cfg, t, head, seed=t)])
    if args.check:  # the gradients, before the sections that only add figures
        check(results, min(deadline, time.time() + args.check_budget))
        save()
    if args.mix:
        run_case(f"packed mix ({args.mix} conversations)", mix_samples(cfg, head, args.mix))
    # a second trial in the same process: new weights, a new optimizer, the compiled kernels reused
    if time.time() < deadline and lengths:
        reinit(ours, 7)
        opt2 = adamw(ours)
        x = Inputs(cfg, [random_sample(cfg, lengths[0], head, seed=1)], head, False)
        sync()
        t0 = time.perf_counter()
        ours_step(ours, opt2, x, head_rows)
        sync()
        results["meta"]["second_trial_first_step_s"] = round(time.perf_counter() - t0, 3)
        save()
    if args.deepspeed and time.time() < deadline:
        try:
            deepspeed_trial(results)
        except Exception as exc:  # noqa: BLE001
            import traceback

            results["deepspeed"] = {
                "error": f"{type(exc).__name__}: {str(exc)[:400]}",
                "where": traceback.format_exc()[-1500:],
            }
        print(json.dumps(results["deepspeed"]), flush=True)
        save()
    save()
    print(json.dumps(results["meta"]), flush=True)


if __name__ == "__main__":
    main()
