"""Training throughput on a realistic length mix, side by side with SpecForge, each side batching as
its users run it.

The samples: single-turn conversations, a prompt (context, never a target) then a reply (trained),
lengths drawn from log-normal distributions whose means are ShareGPT's (161 prompt and 338 reply
tokens per turn, Kwon et al., "Efficient Memory Management for LLM Serving with PagedAttention",
SOSP 2023, section 6.1) with sigma 1.0 (a long right tail: the median reply is 205 tokens, one in
twenty passes 1000), cut at 2048 tokens (SpecForge's default max_length). About 68% of the tokens
are trained. The same samples go to every side.

- drafterops: 4 samples per micro-batch, packed into rows as long as the longest (drafter/data/packing.py),
  the forward computing only what the loss reads; and one sample per step.
- SpecForge, batch 4: its collator pads each sample to the batch's longest.
- SpecForge, batch 1: what its example configs run (no padding, one sample per step), with its sdpa
  backend and with its flex_attention backend where this CPU runs it (its `fa` backend needs
  flash-attn's CUDA kernels).

Both use SpecForge's own modules and TTT loop for its side (see bench/specforge_step.py) and the same
plain-torch soft cross-entropy; the figure is trained (reply) tokens per second over the whole set,
the best and the spread of interleaved rounds.

    SPECFORGE_SRC=/path/to/SpecForge python -m bench.packing_mix
"""

from __future__ import annotations

import math

import torch

from bench._common import write_results
from bench.specforge_step import MEDIUM, load_specforge, ours_model, specforge_model, specforge_ttt_step, timed
from drafter.data.dataset import Sample, collate
from drafter.data.packing import collate_packed
from drafter.train.loss import loss_positions, pred_mask_from_loss_mask, target_draft_logits, ttt_loss

PROMPT_MEAN, REPLY_MEAN, SIGMA, MAX_LEN = 161.0, 338.0, 1.0, 2048
N_SAMPLES, MICRO_BATCH, ROUNDS = 12, 4, 3


def lognormal(mean: float, sigma: float, g: torch.Generator) -> int:
    """One draw with the given mean: mu = ln(mean) - sigma^2 / 2."""
    mu = math.log(mean) - sigma**2 / 2
    return max(1, round(math.exp(mu + sigma * float(torch.randn((), generator=g)))))


def conversations(m: dict, n: int, sigma: float = SIGMA, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt, reply = lognormal(PROMPT_MEAN, sigma, g), lognormal(REPLY_MEAN, sigma, g)
        length = min(prompt + reply, MAX_LEN)
        loss_mask = torch.zeros(length, dtype=torch.bool)
        loss_mask[min(prompt, length - 1) :] = True
        out.append(
            Sample(
                input_ids=torch.randint(0, m["vocab"], (length,), generator=g),
                loss_mask=loss_mask,
                aux_hidden=torch.randn(length, 3 * m["hidden"], generator=g).bfloat16(),
                last_hidden=torch.randn(length, m["hidden"], generator=g).bfloat16(),
                target_token=torch.randint(0, m["draft_vocab"], (length,), generator=g),
            )
        )
    return out


def head_and_maps(m: dict, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(m["vocab"], m["hidden"], generator=g) * 0.02
    t2d = torch.zeros(m["vocab"], dtype=torch.bool)
    t2d[: m["draft_vocab"]] = True
    return head[t2d], t2d, torch.zeros(m["draft_vocab"], dtype=torch.long)


def ours(m: dict, samples: list[Sample], batch: int = MICRO_BATCH):
    rows, t2d, d2t = head_and_maps(m)
    model, opt = ours_model(m, t2d, d2t)
    batches = [collate_packed(samples[i : i + batch]) for i in range(0, len(samples), batch)]

    def epoch():
        for b in batches:
            mask = pred_mask_from_loss_mask(b.loss_mask, b.segment_ids) & b.attention_mask
            steps = model(
                b.input_ids, b.aux_hidden, b.attention_mask, ttt_length=m["ttt"], pred_mask=mask,
                position_ids=b.position_ids, segment_ids=b.segment_ids,
            )  # fmt: skip
            counts = loss_positions(b.target_token, mask, model.t2d, m["ttt"], b.segment_ids)
            loss, _, _ = ttt_loss(
                steps, target_draft_logits(b.last_hidden, rows), b.target_token, mask, model.t2d, model.d2t,
                denominators=counts, segment_ids=b.segment_ids,
            )  # fmt: skip
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    return epoch, sum(int(b.attention_mask.sum()) for b in batches)  # each row runs cut to its content


def specforge(m: dict, samples: list[Sample], api, batch: int, backend: str = "sdpa"):
    model, opt = specforge_model(m, api, backend)
    rows, _, d2t = head_and_maps(m)
    batches = [collate(samples[i : i + batch]) for i in range(0, len(samples), batch)]  # pad to the longest

    def epoch():
        for b in batches:
            mask = pred_mask_from_loss_mask(b.loss_mask) & b.attention_mask
            specforge_ttt_step(
                model, opt, api[1], m["ttt"], b.input_ids, b.aux_hidden, b.last_hidden, rows, b.attention_mask,
                mask, b.target_token, d2t, backend,
            )  # fmt: skip

    return epoch, sum(int(b.input_ids.numel()) for b in batches)


def main() -> None:
    api = load_specforge()
    if api is None:
        raise SystemExit("bench.packing_mix: set SPECFORGE_SRC to a SpecForge checkout (a side-by-side bench)")
    m = MEDIUM
    samples = conversations(m, N_SAMPLES)
    lengths = sorted(len(s) for s in samples)
    real = sum(lengths)
    trained = sum(int(pred_mask_from_loss_mask(s.loss_mask).sum()) for s in samples)
    rows, refused = [], {}
    for bf16 in (False, True):
        sides = {
            f"drafterops, {MICRO_BATCH} per micro-batch, packed": ours(m, samples),
            "drafterops, batch 1": ours(m, samples, 1),
            f"SpecForge, batch {MICRO_BATCH}, padded to the longest": specforge(m, samples, api, MICRO_BATCH),
            "SpecForge, batch 1": specforge(m, samples, api, 1),
            "SpecForge, batch 1, flex_attention": specforge(m, samples, api, 1, "flex_attention"),
        }
        for name, (epoch, _) in list(sides.items()):
            try:
                timed(epoch, bf16)  # warm-up: allocator, autocast caches (and a backend's compile)
            except Exception as exc:  # a backend this CPU cannot run is said, not measured
                refused[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                del sides[name]
        seconds: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(ROUNDS):  # interleaved, so machine load falls on every side alike
            for name, (epoch, _) in sides.items():
                seconds[name].append(timed(epoch, bf16))
        reference = min(seconds["SpecForge, batch 1"])
        padded_ref = min(seconds[f"SpecForge, batch {MICRO_BATCH}, padded to the longest"])
        best_ref = min(min(v) for k, v in seconds.items() if k.startswith("SpecForge"))
        for name, (_, processed) in sides.items():
            best, worst = min(seconds[name]), max(seconds[name])
            rows.append(
                {
                    "side": name,
                    "precision": "bf16 autocast" if bf16 else "fp32",
                    "positions computed": f"{processed} ({processed / real:.2f}x real)",
                    "trained tokens/s (best)": f"{trained / best:.0f}",
                    "spread (worst/best)": f"{worst / best:.2f}",
                    "vs SpecForge batch 1": f"{reference / best:.2f}x",
                    f"vs SpecForge batch {MICRO_BATCH}": f"{padded_ref / best:.2f}x",
                    "vs SpecForge's best side": f"{best_ref / best:.2f}x",
                }
            )
    notes = (
        f"{N_SAMPLES} conversations, lengths {lengths[0]}-{lengths[-1]} (median {lengths[len(lengths) // 2]}), "
        f"{real} real tokens of which {trained} trained ({trained / real:.0%}); prompt and reply log-normal, means "
        f"{PROMPT_MEAN:.0f}/{REPLY_MEAN:.0f} (ShareGPT per turn, the vLLM paper), sigma {SIGMA}, cut at {MAX_LEN}. "
        f"Medium drafter (hidden {m['hidden']}, draft vocab {m['draft_vocab']}), TTT {m['ttt']}, forward + soft "
        f"cross-entropy + backward + AdamW per step; best of {ROUNDS} interleaved rounds over the whole set after "
        f"a warm-up, torch {torch.__version__}, {torch.get_num_threads()} threads."
        + "".join(f" {name} did not run here: {why}." for name, why in refused.items())
    )
    print(write_results("packing_mix", rows, notes))


if __name__ == "__main__":
    main()
