"""Acceptance measured two ways, and what it means for a deployment.

Offline: teacher-forced acceptance per draft position on a held-out hidden-state dataset
(acc_pos_<i>, sim_accept_len = 1 + sum_i prod_{j<=i} acc_j). Online: real speculative decoding
against the target on held-out prompts (accept_len with a bootstrap interval over prompts, the
per-position acceptance of the decoding trace, and this host's measured speedup).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from drafter.cost import Profile, break_even_accept_len, fit_conditional_acceptance, projected_tps
from drafter.errors import BadInput
from drafter.model import Eagle3Drafter
from drafter.speculate import speculative_generate, target_generate
from drafter.target import Target


@dataclass
class OnlineResult:
    """A decoding trace over prompts, each stopped after the cycle where EOS landed. accept_len is
    pooled over verify cycles: sum of (accepted drafts + 1) / cycles, as serving engines count it."""

    k: int
    accepted: list[list[int]]  # per prompt, drafts accepted per verify cycle
    baseline_tokens: int
    baseline_seconds: float  # decode only (prefill excluded), the steady state a profile models
    spec_tokens: int
    spec_seconds: float  # decode only, likewise
    verify_seconds: float
    draft_seconds: float
    mismatches: int = 0  # greedy outputs that differed from the target's own (must be 0)
    truncated: int = 0
    outputs: list[list[int]] = field(default_factory=list)  # the target's own decoding, per prompt
    cycles: int = field(init=False)

    def __post_init__(self) -> None:
        self.cycles = sum(len(a) for a in self.accepted)

    @property
    def num_prompts(self) -> int:
        return len(self.accepted)

    @property
    def accept_len(self) -> float:
        return pooled_accept_len(self.per_prompt)

    @property
    def per_prompt(self) -> list[tuple[int, int]]:
        """(tokens the verify cycles yielded, cycles) per prompt: all that accept_len and its CI need."""
        return [(sum(n + 1 for n in a), len(a)) for a in self.accepted]

    def accept_len_ci(self, iters: int = 2000, seed: int = 0) -> tuple[float, float]:
        return bootstrap_ci(self.per_prompt, iters, seed)

    @property
    def acc_pos(self) -> list[float]:
        return acceptance_by_position(self.accepted, self.k)

    @property
    def host_tps_baseline(self) -> float:
        return self.baseline_tokens / max(self.baseline_seconds, 1e-9)

    @property
    def host_tps_spec(self) -> float:
        return self.spec_tokens / max(self.spec_seconds, 1e-9)

    @property
    def host_cycle_ms(self) -> float:
        """The whole measured cycle (drafting, verify, acceptance, cache crops, drafter extend)."""
        return 1000 * self.spec_seconds / max(1, self.cycles)

    def metrics(self, profile: Profile, host: Profile | None = None) -> dict[str, float]:
        lo, hi = self.accept_len_ci()
        L = self.accept_len
        tps = projected_tps(L, profile)
        out = {
            "accept_len": L,
            "accept_len_ci_low": lo,
            "accept_len_ci_high": hi,
            **{f"acc_pos_{i}": a for i, a in enumerate(self.acc_pos)},
            "cond_acc": fit_conditional_acceptance(L, self.k),
            "break_even_accept_len": break_even_accept_len(profile),
            "projected_tps": tps,
            "projected_speedup": tps / profile.baseline_tps,
            "host_tps_baseline": self.host_tps_baseline,
            "host_tps_spec": self.host_tps_spec,
            "host_speedup": self.host_tps_spec / max(self.host_tps_baseline, 1e-9),
            "host_cycle_ms": self.host_cycle_ms,
            "host_verify_ms": 1000 * self.verify_seconds / max(1, self.cycles),
            "host_draft_step_ms": 1000 * self.draft_seconds / max(1, self.cycles * self.k),
            "num_prompts": float(self.num_prompts),
        }
        if host is not None:  # this host's profile projects what was just measured: do they agree?
            # compared as speed-ups (the cost model's cycle/plain-step ratio): a busier or quieter
            # machine moves plain and speculative tok/s together and says nothing about the model
            projected = projected_tps(L, host.with_draft_steps(self.k))
            out["host_tps_projected"] = projected * self.host_tps_baseline / host.baseline_tps
            out["host_speedup_projected"] = projected / host.baseline_tps
            out["host_projection_error"] = out["host_speedup_projected"] / max(out["host_speedup"], 1e-9) - 1
            out["host_baseline_drift"] = self.host_tps_baseline / host.baseline_tps - 1
        return out


def acceptance_by_position(accepted: list[list[int]], k: int) -> list[float]:
    """Conditional acceptance at draft position i: P(accepted > i | accepted >= i), over every cycle of
    every prompt given (drafts accepted per cycle, per prompt)."""
    flat = [n for a in accepted for n in a]
    out = []
    for i in range(k):
        reached = sum(1 for n in flat if n >= i)
        out.append(sum(1 for n in flat if n > i) / reached if reached else 0.0)
    return out


def pooled_accept_len(per_prompt: list[tuple[int, int]]) -> float:
    """Tokens over cycles, pooled across prompts (a prompt with more cycles weighs more)."""
    from drafter.workload import pooled

    return pooled(per_prompt)


def bootstrap_ci(per_prompt: list[tuple[int, int]], iters: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the pooled accept_len, resampling prompts (cycles within a prompt are not
    independent): the traffic mix's interval with one class, so every figure uses one method."""
    from drafter.workload import mix_ci

    return mix_ci([(1.0, per_prompt)], iters, seed)


def prompt_ids(tokenizer: Any, record: dict[str, Any], max_len: int) -> tuple[torch.Tensor, bool]:
    """The prompt a user would send: a conversation up to its last user turn (the recorded reply is
    dropped), with the generation prompt; plain text as is. Cut from the left when too long."""
    if "messages" in record:
        msgs = list(record["messages"])
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs:
            raise BadInput("a prompt conversation has no user turn")
        text = (
            tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            if getattr(tokenizer, "chat_template", None)
            else "".join(f"{m['role']}: {m['content']}\n" for m in msgs)
        )
    else:
        text = record["text"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cut = len(ids) > max_len
    return torch.tensor(ids[-max_len:] if cut else ids), cut


@torch.no_grad()
def evaluate_online(
    target: Target,
    drafter: Eagle3Drafter,
    records: list[dict[str, Any]],
    k: int,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    progress: bool = True,
) -> OnlineResult:
    """Speculative decoding on each prompt, timed against the target decoding alone."""
    if target.tokenizer is None:
        raise BadInput(f"{target.folder}: target has no tokenizer; online evaluation needs one")
    target.set_aux_layers(list(drafter.config.aux_layer_ids))
    ctx = int(getattr(target.model.config, "max_position_embeddings", 4096))
    prompts, truncated = encode_prompts(target.tokenizer, records, ctx, max_new_tokens, k)
    eos = stop_token(target.tokenizer)
    accepted, mismatches, outputs = [], 0, []
    base_tok = spec_tok = 0
    base_s = spec_s = verify_s = draft_s = 0.0
    for i, ids in enumerate(tqdm(prompts, desc="evaluate", unit="prompt", disable=not progress)):
        g1 = torch.Generator().manual_seed(seed + i)
        g2 = torch.Generator().manual_seed(seed + i)
        base = target_generate(target, ids, max_new_tokens, temperature, g1, eos)
        spec = speculative_generate(target, drafter, ids, max_new_tokens, k, temperature, g2, eos)
        if temperature <= 0 and spec.tokens != base.tokens:
            mismatches += 1
        accepted.append(spec.accepted)
        outputs.append(base.tokens)
        # decode-only throughput: the first token comes from the prefill, not from a cycle
        base_tok, base_s = base_tok + len(base.tokens) - 1, base_s + base.seconds - base.prefill_seconds
        spec_tok, spec_s = spec_tok + len(spec.tokens) - 1, spec_s + spec.seconds - spec.prefill_seconds
        verify_s, draft_s = verify_s + spec.verify_seconds, draft_s + spec.draft_seconds
    return OnlineResult(
        k, accepted, base_tok, base_s, spec_tok, spec_s, verify_s, draft_s, mismatches, truncated, outputs
    )


def stop_token(tokenizer: Any) -> int | None:
    """Where a chat reply ends: <|im_end|> when the vocabulary has it, else the tokenizer's EOS."""
    if "<|im_end|>" in tokenizer.get_vocab():
        return tokenizer.convert_tokens_to_ids("<|im_end|>")
    return tokenizer.eos_token_id


def target_tokenizer(target: str | Path) -> tuple[Any, int]:
    """The target's tokenizer and context length (what prompts are encoded and cut with), or bad input."""
    from transformers import AutoTokenizer

    from drafter.config import TargetConfig

    try:
        tokenizer = AutoTokenizer.from_pretrained(target)
    except (OSError, ValueError) as exc:
        raise BadInput(f"{target}: no tokenizer to encode the prompts ({str(exc).splitlines()[0][:120]})") from None
    return tokenizer, int(TargetConfig.from_file(target).text_config.get("max_position_embeddings", 4096))


def encode_prompts(
    tokenizer: Any, records: list[dict[str, Any]], context: int, max_new_tokens: int, k: int
) -> tuple[list[torch.Tensor], int]:
    """The prompts as token ids (what every engine is sent), cut from the left to leave room for the
    reply and a verify block; with the number that were cut."""
    limit = max(8, context - max_new_tokens - k - 2)
    out, cut = [], 0
    for rec in records:
        ids, was_cut = prompt_ids(tokenizer, rec, limit)
        out.append(ids)
        cut += was_cut
    return out, cut


def acceptance_figure(offline: list[float] | None, online: list[float], title: str):
    """Per-position conditional acceptance, offline (teacher forced) beside online (decoding trace)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = list(range(len(online)))
    w = 0.38
    if offline:
        ax.bar([x - w / 2 for x in xs], offline[: len(xs)], w, label="offline (teacher forced)")
    ax.bar([x + (w / 2 if offline else 0) for x in xs], online, w, label="online (decoding)")
    ax.set_xticks(xs, [f"pos {x}" for x in xs])
    ax.set_ylim(0, 1)
    ax.set_ylabel("conditional acceptance")
    ax.set_title(title)
    ax.legend(loc="upper right")
    fig.tight_layout()
    return fig


def break_even_figure(accept_len: float, ci: tuple[float, float], break_even: float, k: int, title: str):
    """Measured accept_len (with its 95% interval) against the deployment's break-even and k + 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    color = "tab:green" if ci[0] > break_even else ("tab:orange" if accept_len > break_even else "tab:red")
    ax.bar(["accept_len"], [accept_len], yerr=[[accept_len - ci[0]], [ci[1] - accept_len]], color=color, capsize=8)
    ax.axhline(break_even, color="black", linestyle="--", label=f"break-even {break_even:.2f}")
    ax.axhline(k + 1, color="grey", linestyle=":", label=f"ceiling k+1 = {k + 1}")
    ax.set_ylim(0, k + 1.5)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def drafters_figure(rows: list[tuple[str, float, float, float]], break_even: float, k: int, title: str):
    """Every drafter's accept_len with its 95% interval, side by side against break-even and k + 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = [r[0] for r in rows]
    means = [r[1] for r in rows]
    err = [[r[1] - r[2] for r in rows], [r[3] - r[1] for r in rows]]
    colors = ["tab:green" if r[2] > break_even else ("tab:orange" if r[1] > break_even else "tab:red") for r in rows]
    ax.bar(labels, means, yerr=err, color=colors, capsize=8, label="accept_len (95% CI)")
    ax.axhline(break_even, color="black", linestyle="--", label=f"break-even {break_even:.2f}")
    ax.axhline(k + 1, color="grey", linestyle=":", label=f"ceiling k+1 = {k + 1}")
    ax.set_ylim(0, k + 1.6)
    ax.set_ylabel("accept_len (tokens per verify cycle)")
    ax.set_xlabel("drafter")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def class_bars_figure(
    rows: list[tuple[str, float, float, float, float]],
    break_even: float,
    floor: float,
    min_share: float,
    k: int,
    title: str,
):
    """accept_len per traffic class (and the mix, last) with 95% intervals against break-even; a class
    projected below the floor is red, one too small to be held to it grey, the rest green."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels, colors = [], []
    for name, share, L, lo, _ in rows:
        if name == "mix":
            labels.append("traffic mix")
            colors.append("tab:green" if lo > break_even else "tab:red")
            continue
        labels.append(f"{name}\n{share:.0%} of traffic")
        held = share >= min_share
        colors.append("tab:gray" if not held else ("tab:green" if L / break_even >= floor else "tab:red"))
    means = [r[2] for r in rows]
    err = [[r[2] - r[3] for r in rows], [r[4] - r[2] for r in rows]]
    ax.bar(labels, means, yerr=err, color=colors, capsize=8)
    ax.axhline(break_even, color="black", linestyle="--", label=f"break-even {break_even:.2f}")
    if floor != 1.0:
        ax.axhline(floor * break_even, color="tab:red", linestyle=":", label=f"class floor {floor:g}x")
    ax.axhline(k + 1, color="grey", linestyle=":", label=f"ceiling k+1 = {k + 1}")
    ax.set_ylim(0, k + 1.6)
    ax.set_ylabel("accept_len (tokens per verify cycle)")
    ax.set_title(title)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    return fig
