"""The training step against SpecForge's, side by side on this CPU: drafter forward over all TTT
steps, soft cross-entropy against the target's draft-vocabulary distribution, backward, AdamW, at the
medium config (hidden 1024, intermediate 2816, 8 heads, vocabulary 32000, draft vocabulary 8000,
sequence 512, TTT 3), in fp32 and in bf16 autocast.

SpecForge's modules (`specforge/modeling/draft/llama3_eagle.py`, the TTT loop of
`specforge/algorithms/eagle3/model.py`: embed, project, backbone with its hidden-state cache, logits,
shift) are imported from a checkout when one is present (SPECFORGE_SRC, a folder holding the
`specforge` package; e.g. `git archive` of sgl-project/SpecForge); its Triton loss cannot run on a
CPU, so both sides use the same plain-torch soft cross-entropy. No SpecForge code is in this project.

    SPECFORGE_SRC=/path/to/SpecForge python -m bench.specforge_step
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from bench._common import write_results
from drafter.model.config import DrafterConfig
from drafter.model.eagle3 import Eagle3Drafter
from drafter.train.loss import target_draft_logits, ttt_loss

MEDIUM = dict(hidden=1024, intermediate=2816, heads=8, kv_heads=8, vocab=32000, draft_vocab=8000, seq=512, ttt=3)
BATCH, WARMUP, REPS = 1, 1, 7
# trained (assistant) share of the positions: a conversation's prompt is context, never a target. 1.0
# scores every position; 0.5 is the mini world's conversations (48 prompt + 48 reply tokens).
ASSISTANT_SHARES = (1.0, 0.5)


def load_specforge():
    src = os.environ.get("SPECFORGE_SRC")
    if not src or not (Path(src) / "specforge").is_dir():
        return None
    sys.path.insert(0, src)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
        from specforge.utils import padding
    return LlamaForCausalLMEagle3, padding


def inputs(m: dict, share: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, m["vocab"], (BATCH, m["seq"]), generator=g)
    aux = torch.randn(BATCH, m["seq"], 3 * m["hidden"], generator=g)
    last = torch.randn(BATCH, m["seq"], m["hidden"], generator=g)
    head = torch.randn(m["vocab"], m["hidden"], generator=g) * 0.02
    t2d = torch.zeros(m["vocab"], dtype=torch.bool)
    t2d[: m["draft_vocab"]] = True
    d2t = torch.zeros(m["draft_vocab"], dtype=torch.long)
    mask = torch.zeros(BATCH, m["seq"], dtype=torch.bool)
    mask[:, m["seq"] - int(share * m["seq"]) :] = True  # the prompt first, then the assistant's reply
    return ids, aux, last, head, t2d, d2t, mask


def ours_model(m: dict, t2d: torch.Tensor, d2t: torch.Tensor):
    """This project's drafter at the bench's shapes, its vocabulary maps, frozen embedding, and AdamW."""
    cfg = DrafterConfig(
        hidden_size=m["hidden"], intermediate_size=m["intermediate"], num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"], vocab_size=m["vocab"], draft_vocab_size=m["draft_vocab"],
        aux_layer_ids=[1, 2, 3], max_position_embeddings=4096,
    )  # fmt: skip
    model = Eagle3Drafter(cfg)
    model.init_weights(0)
    model.t2d.copy_(t2d)
    model.d2t.copy_(d2t)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def ours(m: dict, share: float):
    ids, aux, last, head, t2d, d2t, mask = inputs(m, share)
    model, opt = ours_model(m, t2d, d2t)
    rows = head[t2d]

    def step():
        logits = model(ids, aux, None, ttt_length=m["ttt"], pred_mask=mask)
        loss, _, _ = ttt_loss(logits, target_draft_logits(last, rows), ids, mask, model.t2d, model.d2t)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def specforge_model(m: dict, api, backend: str = "sdpa"):
    """SpecForge's draft model (its `backend`: sdpa, flex_attention) at the bench's shapes, frozen embedding,
    and its AdamW."""
    from transformers.models.llama.configuration_llama import LlamaConfig

    cls, _ = api
    cfg = LlamaConfig(
        hidden_size=m["hidden"], intermediate_size=m["intermediate"], num_attention_heads=m["heads"],
        num_key_value_heads=m["kv_heads"], vocab_size=m["vocab"], max_position_embeddings=4096,
        rms_norm_eps=1e-6, num_hidden_layers=1, pad_token_id=0,
    )  # fmt: skip
    cfg.draft_vocab_size = m["draft_vocab"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(cfg, attention_backend=backend)
    model.embed_tokens.weight.requires_grad_(False)
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def specforge_ttt_step(
    model, opt, padding, ttt, ids, aux, last, rows, attention_mask, pred_mask, target, d2t, backend: str = "sdpa"
):  # fmt: skip
    """SpecForge's OnlineEagle3Model TTT loop: embed, backbone with its cache (sdpa: its hidden-state lists and
    a 4-D mask; flex_attention: a DynamicCache and the 2-D mask, as its model.py hands them), logits, its
    per-step accuracy metric (`_compute_metric_acc`, as its loop logs it), shift; the soft cross-entropy in
    plain torch (its Triton loss cannot run on a CPU); backward and AdamW."""
    from transformers.cache_utils import DynamicCache

    target_p = torch.softmax(target_draft_logits(last, rows), dim=-1)
    hidden = model.project_hidden_states(aux)
    b, t = ids.shape
    position_ids = torch.arange(t).unsqueeze(0)
    if backend == "flex_attention":
        attn, cache_hidden, past = attention_mask.bool(), None, DynamicCache()
    else:
        attn, cache_hidden, past = (
            model.prepare_decoder_attention_mask(attention_mask.long(), hidden, b, t, 0),
            [[], []],
            None,
        )
    step_ids, tp, pm, step_tgt = ids, target_p, pred_mask.float(), target
    loss = hidden.new_zeros(())
    for idx in range(ttt):
        emb = model.embed_input_ids(step_ids).to(hidden.dtype)
        hidden = model.backbone(emb, hidden, cache_hidden, attn, position_ids, past_key_values=past)
        logits = model.compute_logits(hidden)
        logp = F.log_softmax(logits.float(), dim=-1)
        ce = -(tp * logp).sum(-1)
        with torch.no_grad():
            pred = logits.argmax(-1)
            (((pred + d2t[pred]) == step_tgt) * pm).sum() / pm.sum().clamp(min=1e-6)
        loss = loss + 0.8**idx * (ce * pm).sum() / pm.sum().clamp(min=1)
        step_ids, tp, pm = padding(step_ids, left=False), padding(tp, left=False), padding(pm, left=False)
        step_tgt = padding(step_tgt, left=False)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def specforge(m: dict, share: float, api):
    model, opt = specforge_model(m, api)
    ids, aux, last, head, t2d, d2t, mask = inputs(m, share)
    rows = head[t2d]
    every = torch.ones_like(mask)
    return lambda: specforge_ttt_step(model, opt, api[1], m["ttt"], ids, aux, last, rows, every, mask, ids, d2t)


def timed(step, bf16: bool) -> float:
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    with ctx:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0


def main() -> None:
    api = load_specforge()
    m = MEDIUM
    tokens = BATCH * m["seq"]
    rows, notes = [], []
    if api is None:
        notes.append("SpecForge not present (set SPECFORGE_SRC to a checkout): only this project's step measured.")
    for share in ASSISTANT_SHARES:
        for bf16 in (False, True):
            sides = {"drafterops": ours(m, share)}
            if api is not None:
                sides["SpecForge"] = specforge(m, share, api)
            for step in sides.values():
                for _ in range(WARMUP):
                    timed(step, bf16)
            seconds: dict[str, list[float]] = {k: [] for k in sides}
            for r in range(REPS):  # interleaved pairs, the order alternating, so load falls on both alike
                for name in sorted(sides, reverse=bool(r % 2)):
                    seconds[name].append(timed(sides[name], bf16))
            best = {k: min(v) for k, v in seconds.items()}
            paired = (
                statistics.median(a / b for a, b in zip(seconds["SpecForge"], seconds["drafterops"], strict=True))
                if "SpecForge" in seconds
                else None
            )
            for name, s in best.items():
                spread = max(seconds[name]) / s
                rows.append(
                    {
                        "step": name,
                        "precision": "bf16 autocast" if bf16 else "fp32",
                        "trained positions": f"{share:.0%}",
                        "seconds_per_step": f"{s:.3f}",
                        "tokens_per_s": f"{tokens / s:.0f}",
                        "spread (worst/best)": f"{spread:.2f}",
                        "speed-up vs SpecForge": f"{best['SpecForge'] / s:.2f}x" if "SpecForge" in best else "n/a",
                        "median of paired ratios": f"{paired:.2f}x" if paired and name == "drafterops" else "",
                    }
                )
    notes.append(
        f"medium drafter (hidden {m['hidden']}, intermediate {m['intermediate']}, {m['heads']} heads, vocab "
        f"{m['vocab']}, draft vocab {m['draft_vocab']}), batch {BATCH} x {m['seq']}, TTT {m['ttt']}; forward over "
        f"all TTT steps + soft cross-entropy + backward + AdamW; best of {REPS} interleaved steps after {WARMUP} "
        f"warm-up (and the median of the {REPS} paired ratios, each pair run back to back), torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads."
    )
    print(write_results("specforge_step", rows, " ".join(notes)))


if __name__ == "__main__":
    main()
