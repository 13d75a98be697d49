"""Build the mini world: `python -m miniworld.build` (deterministic, seeded, about 30 minutes on 2 cores).

It replays the seed's story in miniature with real trained models:
1. a byte-level BPE tokenizer trained on text from the local Python installation (standard-library
   sources and the English documentation that ships in pydoc_data), split into two eras;
2. k2-mini: a DeepSeek-V3 (MLA + MoE) language model trained on era one, saved as a flat HF folder;
3. k2.5-mini: k2-mini continued on a mix shifted to era two, saved the way Kimi-K2.5 ships;
4. prompt sets whose assistant turns each target wrote itself (greedy), as SpecForge regenerates data;
5. aq-mini-eagle3: an EAGLE-3 drafter trained (drafter/train/loop.py, DeepSpeed) on k2-mini hidden states
   from 20x more conversations than the K2.5 fine-tuning set, saved like AQ-MedAI's release;
6. (`--stage families`, over the pool) the K2.5-era public drafters of every family, trained for k2.5-mini
   and shipped in their exporters' layouts (miniworld/families.py).
7. (`--stage methods`, over the pool) the public drafters of the other draft methods (DFlash, P-EAGLE), trained for
   k2.5-mini and shipped in their makers' layouts (miniworld/methods.py).
Figures and hashes land in miniworld/build_record.json.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import random
import shutil
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from miniworld.models import deepseek_config, save_k25_style, train_tokenizer

HERE = Path(__file__).resolve().parent
TARGET_LAYERS = 6
AUX_LAYERS = [1, 3, 4]  # early, middle, late: as [2, 30, 58] of Kimi-K2's 61


@dataclass
class BuildConfig:
    seed: int = 0
    vocab_size: int = 4096
    hidden_size: int = 128
    corpus_chars: int = 3_000_000
    seq_len: int = 128
    batch_size: int = 32
    k2_steps: int = 1200
    k25_steps: int = 500
    lr: float = 3e-3
    prompt_tokens: int = 48
    reply_tokens: int = 48
    aq_train_prompts: int = 1600
    k25_train_prompts: int = 80
    k25_val_prompts: int = 40
    k25_test_prompts: int = 40
    k2_val_prompts: int = 60
    draft_vocab_size: int = 1024
    drafter_steps: int = 3000
    drafter_batch: int = 16
    drafter_lr: float = 3e-3


# ------------------------------------------------------------------------------------------- corpus
def corpus(limit_chars: int) -> tuple[list[str], list[str], dict[str, str]]:
    """Era one: stdlib modules a-m and the first half of the docs; era two: the rest.

    Returns (era1, era2, sources) where sources maps each file read to its sha256."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))
    from pydoc_data import topics

    docs = [topics.topics[k] for k in sorted(topics.topics)]
    sources = {str(p.relative_to(stdlib)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    sources["pydoc_data/topics.py"] = hashlib.sha256(Path(topics.__file__).read_bytes()).hexdigest()
    era1 = [p.read_text(errors="replace") for p in files if p.name[0] <= "m"] + docs[: len(docs) // 2]
    era2 = [p.read_text(errors="replace") for p in files if p.name[0] > "m"] + docs[len(docs) // 2 :]
    return _cap(era1, limit_chars // 2), _cap(era2, limit_chars // 2), sources


def _cap(texts: list[str], chars: int) -> list[str]:
    out, n = [], 0
    for t in texts:
        if n >= chars:
            break
        out.append(t[: chars - n])
        n += len(out[-1])
    return out


def token_stream(tok, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for t in texts:
        ids += tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def chat_text(tok, user: str, reply: str) -> str:
    return tok.apply_chat_template(
        [{"role": "user", "content": user}, {"role": "assistant", "content": reply}], tokenize=False
    )


def chat_stream(tok, stream: torch.Tensor, cfg: BuildConfig, n: int, rng: random.Random) -> torch.Tensor:
    """Conversations cut from the text: the user gives a passage, the assistant continues it."""
    out: list[int] = []
    span = cfg.prompt_tokens + cfg.reply_tokens
    for _ in range(n):
        s = rng.randrange(0, len(stream) - span)
        user = "Continue:\n" + tok.decode(stream[s : s + cfg.prompt_tokens])
        reply = tok.decode(stream[s + cfg.prompt_tokens : s + span])
        out += tok(chat_text(tok, user, reply), add_special_tokens=False)["input_ids"]
    return torch.tensor(out, dtype=torch.long)


# ------------------------------------------------------------------------------------------- targets
def train_lm(
    model, streams: list[tuple[torch.Tensor, float]], cfg: BuildConfig, steps: int, seed: int, desc: str
) -> list[float]:
    """Plain next-token training on random windows drawn from weighted token streams."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    weights = torch.tensor([w for _, w in streams])
    losses = []
    model.train()
    bar = tqdm(range(steps), desc=desc, unit="step")
    for step in bar:
        lr = cfg.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        which = torch.multinomial(weights, cfg.batch_size, replacement=True, generator=gen)
        rows = []
        for w in which.tolist():
            stream = streams[w][0]
            s = int(torch.randint(0, len(stream) - cfg.seq_len - 1, (1,), generator=gen))
            rows.append(stream[s : s + cfg.seq_len + 1])
        batch = torch.stack(rows)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, windows: int = 64) -> float:
    starts = torch.linspace(0, len(stream) - seq_len - 2, windows).long()
    batch = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).item()


# ------------------------------------------------------------------------------------------- prompts
@torch.no_grad()
def self_distilled(model, tok, stream: torch.Tensor, starts: list[int], cfg: BuildConfig) -> list[dict]:
    """Conversations whose assistant turn is the target's own greedy reply (SpecForge's regeneration)."""
    users = ["Continue:\n" + tok.decode(stream[s : s + cfg.prompt_tokens]) for s in starts]
    records = []
    tok.padding_side = "left"
    for i in tqdm(range(0, len(users), 64), desc="replies", unit="batch"):
        chunk = users[i : i + 64]
        texts = [
            tok.apply_chat_template([{"role": "user", "content": u}], tokenize=False, add_generation_prompt=True)
            for u in chunk
        ]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out = model.generate(
            **enc,
            max_new_tokens=cfg.reply_tokens,
            do_sample=False,
            eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tok.pad_token_id,
        )
        for u, row in zip(chunk, out[:, enc["input_ids"].shape[1] :], strict=True):
            reply = tok.decode(row, skip_special_tokens=True)
            records.append({"messages": [{"role": "user", "content": u}, {"role": "assistant", "content": reply}]})
    return records


def disjoint_starts(length: int, span: int, counts: list[int], rng: random.Random) -> list[list[int]]:
    """Non-overlapping windows, dealt out to several prompt sets (so the sets share no text)."""
    slots = list(range(0, length - span, span))
    rng.shuffle(slots)
    need = sum(counts)
    if need > len(slots):
        raise RuntimeError(f"corpus too small for {need} prompts")
    out, k = [], 0
    for c in counts:
        out.append(sorted(slots[k : k + c]))
        k += c
    return out


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


# ------------------------------------------------------------------------------------------- drafter
def drafter_config(cfg: BuildConfig, tok):
    from drafter.model.config import DrafterConfig

    return DrafterConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=2 * cfg.hidden_size,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=cfg.hidden_size // 4,
        vocab_size=len(tok),
        draft_vocab_size=cfg.draft_vocab_size,
        aux_layer_ids=AUX_LAYERS,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        torch_dtype="bfloat16",
        extra={"model_type": "llama", "hidden_act": "silu", "num_hidden_layers": 1, "tie_word_embeddings": False},
    )


MODEL_CARD = """---
license: mit
base_model: k2-mini
tags: [eagle3, speculative-decoding, drafterops-miniworld]
---
# aq-mini-eagle3

An EAGLE-3 draft model for **k2-mini**, the mini world's stand-in for AQ-MedAI/Kimi-K2-Instruct-eagle3.
Built by `python -m miniworld.build` (drafterops).

- Target: k2-mini (DeepSeek-V3 architecture, {layers} layers, hidden {hidden})
- Auxiliary hidden-state layers: {aux}
- Draft vocabulary: {vd} of {v} tokens
- Training samples: {samples} conversations ({tokens} tokens)
- Simulated accept_len on k2-mini held-out data (3 draft steps, bonus token included): {sim:.2f}

## License
MIT
"""


def capture_set(target_dir: Path, records: list[dict], out: Path, max_len: int = 256) -> Path:
    from drafter.data.capture import capture, plan_capture
    from drafter.model.target import load_target

    target = load_target(target_dir)
    meta = {
        "target": target_dir.name,
        "layer_ids": AUX_LAYERS,
        "hidden_size": target.config.hidden_size,
        "vocab_size": target.config.vocab_size,
        "prompts_sha256": hashlib.sha256(json.dumps(records).encode()).hexdigest(),
        "max_len": max_len,
        "limit": 0,
    }
    capture(target, plan_capture(target, records, max_len), out, AUX_LAYERS, meta)
    return out


def sim_accept_len(model, dataset_dir: Path, steps: int = 3) -> tuple[float, list[float]]:
    from drafter.data.dataset import HiddenStateDataset
    from drafter.train.loop import offline_stats

    ds = HiddenStateDataset(dataset_dir)
    stats = offline_stats(model, ds, list(range(len(ds))), ds.target_head()[model.t2d].float(), steps)
    return stats.sim_accept_len, stats.conditional_acceptance


def sha256_tree(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


# ------------------------------------------------------------------------------------------- main
def prepare(cfg: BuildConfig, tok=None):
    """Corpus, tokenizer, token streams and the seeded rng, exactly as the full build sees them."""
    rng = random.Random(cfg.seed)
    era1, era2, sources = corpus(cfg.corpus_chars)
    tok = tok or train_tokenizer(era1 + era2, cfg.vocab_size)
    s1, s2 = token_stream(tok, era1), token_stream(tok, era2)
    # the last 5% of each era is held out for loss figures and prompt sets
    cut1, cut2 = int(0.95 * len(s1)), int(0.95 * len(s2))
    streams = {"train1": s1[:cut1], "held1": s1[cut1:], "train2": s2[:cut2], "held2": s2[cut2:]}
    streams["chat1"] = chat_stream(tok, streams["train1"], cfg, 4000, rng)
    streams["chat2"] = chat_stream(tok, streams["train2"], cfg, 4000, rng)
    return tok, streams, rng, sources, {"era1": len(s1), "era2": len(s2)}


def build_targets(cfg: BuildConfig, out: Path, figures: dict) -> tuple[list[dict], list[dict]]:
    """k2-mini, k2.5-mini and the prompt sets; returns the aq drafter's conversations and k2's held-out ones."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(cfg.seed)
    tok, st, rng, _, tokens = prepare(cfg)
    figures["tokens"], figures["log_vocab"] = tokens, math.log(len(tok))
    model = DeepseekV3ForCausalLM(
        deepseek_config(len(tok), hidden_size=cfg.hidden_size, layers=TARGET_LAYERS, max_position_embeddings=1024)
    )
    k2_losses = train_lm(model, [(st["train1"], 0.6), (st["chat1"], 0.4)], cfg, cfg.k2_steps, cfg.seed, "k2-mini")
    figures["k2-mini"] = lm_figures(model, k2_losses, st, cfg)
    k2_dir = out / "k2-mini"
    shutil.rmtree(k2_dir, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(k2_dir)
    tok.save_pretrained(k2_dir)
    model.float()
    # the aq drafter's data and the k2 held-out prompts, written by k2-mini itself
    aq_records = self_distilled(model, tok, st["train1"], aq_starts(cfg, st, rng), cfg)
    k2_val_starts = disjoint_starts(len(st["held1"]), cfg.prompt_tokens + 1, [cfg.k2_val_prompts], rng)[0]
    k2_val_records = self_distilled(model, tok, st["held1"], k2_val_starts, cfg)
    mix = [(st["train2"], 0.5), (st["chat2"], 0.3), (st["train1"], 0.1), (st["chat1"], 0.1)]
    k25_losses = train_lm(model, mix, cfg, cfg.k25_steps, cfg.seed + 1, "k2.5-mini")
    figures["k2.5-mini"] = lm_figures(model, k25_losses, st, cfg)
    k25_dir = out / "k2.5-mini"
    shutil.rmtree(k25_dir, ignore_errors=True)
    save_k25_style(model.to(torch.bfloat16), k25_dir, tok)
    model.float()
    counts = [cfg.k25_train_prompts, cfg.k25_val_prompts, cfg.k25_test_prompts]
    sets = disjoint_starts(len(st["held2"]), cfg.prompt_tokens + 1, counts, rng)
    for name, starts in zip(("k2.5-train", "k2.5-val", "k2.5-test"), sets, strict=True):
        write_jsonl(out / "prompts" / f"{name}.jsonl", self_distilled(model, tok, st["held2"], starts, cfg))
    write_jsonl(out / "prompts" / "k2-val.jsonl", k2_val_records)
    return aq_records, k2_val_records


def aq_starts(cfg: BuildConfig, st: dict, rng: random.Random) -> list[int]:
    return disjoint_starts(len(st["train1"]), cfg.prompt_tokens + 1, [cfg.aq_train_prompts], rng)[0]


def lm_figures(model, losses: list[float], st: dict, cfg: BuildConfig) -> dict:
    e1, e2 = heldout_loss(model, st["held1"], cfg.seq_len), heldout_loss(model, st["held2"], cfg.seq_len)
    return {
        "train_loss_last": sum(losses[-20:]) / len(losses[-20:]),
        "heldout_loss_era1": e1,
        "heldout_loss_era2": e2,
        "perplexity_era1": math.exp(e1),
        "perplexity_era2": math.exp(e2),
    }


def replay_aq_records(cfg: BuildConfig, out: Path) -> list[dict]:
    """The aq drafter's conversations of an earlier full build, regenerated exactly: same tokenizer,
    same rng draws, the same (saved) k2-mini writing the replies."""
    from transformers import AutoTokenizer, DeepseekV3ForCausalLM

    tok = AutoTokenizer.from_pretrained(out / "k2-mini")
    _, st, rng, _, _ = prepare(cfg, tok)
    model = DeepseekV3ForCausalLM.from_pretrained(out / "k2-mini", dtype=torch.float32).eval()
    return self_distilled(model, tok, st["train1"], aq_starts(cfg, st, rng), cfg)


def build_drafter(cfg: BuildConfig, out: Path, aq_records: list[dict], figures: dict) -> None:
    """aq-mini-eagle3: trained with drafter/train/loop.py (DeepSpeed) on k2-mini hidden states."""
    from transformers import AutoTokenizer

    from drafter.data.dataset import HiddenStateDataset
    from drafter.formats.checkpoint import save_drafter
    from drafter.train.loop import TrainConfig, scratch_drafter, train

    tok = AutoTokenizer.from_pretrained(out / "k2-mini")
    k2_val_records = [json.loads(x) for x in (out / "prompts" / "k2-val.jsonl").read_text().splitlines()]
    k25_val_records = [json.loads(x) for x in (out / "prompts" / "k2.5-val.jsonl").read_text().splitlines()]
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        aq_data = capture_set(out / "k2-mini", aq_records, tmp / "aq-data")
        k2_val = capture_set(out / "k2-mini", k2_val_records, tmp / "k2-val")
        k25_val = capture_set(out / "k2.5-mini", k25_val_records, tmp / "k25-val")
        ds = HiddenStateDataset(aq_data)
        drafter = scratch_drafter(drafter_config(cfg, tok), ds, list(range(len(ds))), seed=cfg.seed)
        tcfg = TrainConfig(
            max_steps=cfg.drafter_steps,
            batch_size=cfg.drafter_batch,
            max_len=256,
            peak_lr=cfg.drafter_lr,
            warmup_ratio=0.03,
            ttt_length=3,
            val_fraction=0.05,
            val_every=500,
            seed=cfg.seed,
        )
        result = train(drafter, ds, tcfg)
        sim_k2, acc_k2 = sim_accept_len(result.model, k2_val)
        sim_k25, acc_k25 = sim_accept_len(result.model, k25_val)
        figures["aq-mini-eagle3"] = {
            "train_samples": len(ds),
            "train_tokens": ds.index["num_tokens"],
            "sim_accept_len_k2_mini": sim_k2,
            "acc_pos_k2_mini": acc_k2,
            "sim_accept_len_k2.5_mini": sim_k25,
            "acc_pos_k2.5_mini": acc_k25,
            "drop": sim_k2 - sim_k25,
            "train_seconds": result.seconds,
        }
        aq_dir = out / "aq-mini-eagle3"
        shutil.rmtree(aq_dir, ignore_errors=True)
        save_drafter(result.model, aq_dir, include_embedding=False)
        (aq_dir / "README.md").write_text(
            MODEL_CARD.format(
                layers=TARGET_LAYERS,
                hidden=cfg.hidden_size,
                aux=AUX_LAYERS,
                vd=cfg.draft_vocab_size,
                v=len(tok),
                samples=len(ds),
                tokens=ds.index["num_tokens"],
                sim=sim_k2,
            )
        )


POOL_CONVERSATIONS = 400  # the scale planner's ladder reaches 320


def build_pool(cfg: BuildConfig, out: Path, n: int = POOL_CONVERSATIONS) -> dict:
    """A larger pool of K2.5 conversations for the data-scaling ladder, written by k2.5-mini itself.
    Its prompts come from the era-2 training stream (as a real fine-tuning set's prompts need not be
    held out from the target), so the held-out stream behind k2.5-val and k2.5-test stays untouched."""
    record, tok, model = over_full_build(cfg, out, "pool")
    t0 = time.perf_counter()
    _, st, _, _, _ = prepare(cfg, tok)
    starts = disjoint_starts(len(st["train2"]), cfg.prompt_tokens + 1, [n], random.Random(cfg.seed + 2))[0]
    write_jsonl(out / "prompts" / "k2.5-pool.jsonl", self_distilled(model, tok, st["train2"], starts, cfg))
    record["pool"] = {"conversations": n, "prompts_from": "era-2 training stream", "seconds": time.perf_counter() - t0}
    record["artifacts"]["prompts"] = sha256_tree(out / "prompts")
    (out / "build_record.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def over_full_build(cfg: BuildConfig, out: Path, stage: str):
    """(build record, tokenizer, k2.5-mini in fp32) of an earlier full build with these settings."""
    from transformers import AutoTokenizer

    from drafter.model.target import load_target

    record = json.loads((out / "build_record.json").read_text())
    if record.get("config") != asdict(cfg):
        raise SystemExit(f"--stage {stage} needs an earlier full build with the same settings")
    tok = AutoTokenizer.from_pretrained(out / "k2.5-mini")
    return record, tok, load_target(out / "k2.5-mini").model.float().eval()


WORKLOAD_PROMPTS = 24  # per traffic class


def unseen_sources(cfg: BuildConfig) -> tuple[list[Path], list[str]]:
    """Standard-library files past each era's corpus cap, and the English documentation (pydoc topics,
    also past the cap): the same kinds of text the targets were trained on, none of it seen in training."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))
    unseen: list[Path] = []
    for era in ([p for p in files if p.name[0] <= "m"], [p for p in files if p.name[0] > "m"]):
        n = 0
        for path in era:
            if n >= cfg.corpus_chars // 2:
                unseen.append(path)
            else:
                n += len(path.read_text(errors="replace"))
    from pydoc_data import topics

    return unseen, [topics.topics[k] for k in sorted(topics.topics)]


def repl_sessions(text: str) -> list[list[str]]:
    """Interactive sessions quoted in docstrings: runs of `>>>` lines with their output."""
    blocks, cur = [], []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith(">>>") or (cur and s and not s.startswith('"""')):
            cur.append(s)
            continue
        if sum(c.startswith(">>>") for c in cur) >= 2:
            blocks.append(cur)
        cur = []
    return blocks


def workload_texts(cfg: BuildConfig) -> dict[str, list[str]]:
    """Three traffic classes of held-out text: source code (REPL sessions taken out), documentation, and
    the REPL sessions themselves."""
    files, docs = unseen_sources(cfg)
    code, repl = [], []
    for path in files:
        text = path.read_text(errors="replace")
        sessions = repl_sessions(text)
        repl += ["\n".join(b) for b in sessions]
        quoted = {line for b in sessions for line in b}
        code.append("\n".join(line for line in text.splitlines() if line.strip() not in quoted))
    return {"code": code, "docs": docs, "repl": repl}


def build_workload(cfg: BuildConfig, out: Path, n: int = WORKLOAD_PROMPTS) -> dict:
    """The deployment's traffic classes, answered greedily by k2.5-mini as the other prompt sets are:
    workload-<class>.jsonl, disjoint from every training, validation, test and pool prompt (their text
    never entered the targets' corpus, which every other set is cut from)."""
    t0 = time.perf_counter()
    record, tok, model = over_full_build(cfg, out, "workload")
    rng = random.Random(cfg.seed + 3)
    classes = {}
    for name, texts in workload_texts(cfg).items():
        stream = token_stream(tok, texts)
        starts = disjoint_starts(len(stream), cfg.prompt_tokens + 1, [n], rng)[0]
        path = out / "prompts" / f"workload-{name}.jsonl"
        write_jsonl(path, self_distilled(model, tok, stream, starts, cfg))
        classes[name] = {
            "prompts": n,
            "source_tokens": len(stream),
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        }
    record["workload"] = {"classes": classes, "seconds": time.perf_counter() - t0}
    record["artifacts"]["prompts"] = sha256_tree(out / "prompts")
    (out / "build_record.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


LONG_PROMPTS = 16
LONG_TOKENS = (512, 896)  # prompt lengths: with a 64-token reply each conversation lies in the 512-2k bucket


def long_sources() -> list[Path]:
    """Standard-library package modules (stdlib/<package>/*.py): never in the targets' corpus (top-level
    modules and the docs), long enough to hold a long prompt, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*/*.py") if "test" not in p.parts[-2] and not p.name.startswith("_"))
    return [p for p in files if p.stat().st_size > 12_000]


def long_conversations(model, tok, cfg: BuildConfig, n: int, rng: random.Random) -> list[dict]:
    """n conversations of 512-896 prompt tokens, each cut from another long module, with k2.5-mini's
    own greedy reply (as every other prompt set is answered)."""
    files = long_sources()
    rng.shuffle(files)
    users = []
    for path in files:
        ids = tok(path.read_text(errors="replace"), add_special_tokens=False)["input_ids"]
        length = rng.randint(*LONG_TOKENS)
        if len(ids) <= length:
            continue
        start = rng.randrange(0, len(ids) - length)
        users.append("Continue:\n" + tok.decode(ids[start : start + length]))
        if len(users) == n:
            break
    if len(users) < n:
        raise SystemExit(f"only {len(users)} standard-library modules hold a long prompt; {n} wanted")
    records = []
    tok.padding_side = "left"
    for user in tqdm(users, desc="long replies", unit="prompt"):
        text = tok.apply_chat_template([{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True)
        enc = tok(text, return_tensors="pt", add_special_tokens=False)
        stop = tok.convert_tokens_to_ids("<|im_end|>")
        row = model.generate(**enc, max_new_tokens=cfg.reply_tokens, do_sample=False, eos_token_id=stop,
                             pad_token_id=tok.pad_token_id)  # fmt: skip
        reply = tok.decode(row[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        records.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]})
    return records


def build_long(cfg: BuildConfig, out: Path, n: int = LONG_PROMPTS) -> dict:
    """The deployment's long-context traffic class, workload-long.jsonl: prompts of 512-896 tokens from
    standard-library package modules no target or drafter was trained on, so that acceptance by context
    length has conversations past 512 tokens to measure."""
    t0 = time.perf_counter()
    record, tok, model = over_full_build(cfg, out, "long")
    path = out / "prompts" / "workload-long.jsonl"
    with torch.no_grad():
        write_jsonl(path, long_conversations(model, tok, cfg, n, random.Random(cfg.seed + 4)))
    record.setdefault("workload", {}).setdefault("classes", {})["long"] = {
        "prompts": n,
        "prompt_tokens": list(LONG_TOKENS),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "seconds": time.perf_counter() - t0,
    }
    record["artifacts"]["prompts"] = sha256_tree(out / "prompts")
    (out / "build_record.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def build(cfg: BuildConfig, out: Path, stage: str = "all") -> dict:
    """stage 'all' builds everything; 'drafter' rebuilds aq-mini-eagle3 over an earlier full build."""
    record_path = out / "build_record.json"
    previous = json.loads(record_path.read_text()) if record_path.is_file() else {}
    if (
        stage == "drafter"
        and previous.get("config", {})
        and {k: v for k, v in previous["config"].items() if not k.startswith("drafter_")}
        != {k: v for k, v in asdict(cfg).items() if not k.startswith("drafter_")}
    ):
        raise SystemExit("--stage drafter needs an earlier full build with the same target settings")
    t0 = time.perf_counter()
    seconds = dict(previous.get("stage_seconds", {}))
    if stage == "all":
        figures: dict = {}
        aq_records, _ = build_targets(cfg, out, figures)
        seconds["targets"] = time.perf_counter() - t0
    else:
        figures = dict(previous["figures"])
        aq_records = replay_aq_records(cfg, out)
        seconds["replay"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    build_drafter(cfg, out, aq_records, figures)
    seconds["drafter"] = time.perf_counter() - t1
    sources = corpus(cfg.corpus_chars)[2]
    record = {
        "config": asdict(cfg),
        "aux_layer_ids": AUX_LAYERS,
        "target_layers": TARGET_LAYERS,
        "torch": torch.__version__,
        "corpus_sources": len(sources),
        "corpus_digest": hashlib.sha256(json.dumps(sources, sort_keys=True).encode()).hexdigest(),
        "figures": figures,
        "stage_seconds": seconds,
        "artifacts": {name: sha256_tree(out / name) for name in ("k2-mini", "k2.5-mini", "aq-mini-eagle3", "prompts")},
    }
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return record


def drafters_stage(cfg: BuildConfig, out: Path, stage: str, build_them, names: list[str], quick: bool = False) -> dict:
    """Drafters trained over an earlier full build (`build_them(out, capture_set, aux, seed, quick)` returns their
    figures), recorded under `stage` with their files' hashes; the stage's other drafters keep their figures."""
    record = json.loads((out / "build_record.json").read_text())
    if record.get("config") != asdict(cfg):
        raise SystemExit(f"--stage {stage} needs an earlier full build with the same settings")
    t0 = time.perf_counter()
    figures = record.setdefault("figures", {})
    figures[stage] = {**figures.get(stage, {}), **build_them(out, capture_set, AUX_LAYERS, cfg.seed, quick)}
    record.setdefault("stage_seconds", {})[stage] = time.perf_counter() - t0
    for name in names:
        record["artifacts"][name] = sha256_tree(out / name)
    (out / "build_record.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def build_families_stage(cfg: BuildConfig, out: Path, quick: bool = False) -> dict:
    """The K2.5-era family drafters (miniworld/families.py) over an earlier full build."""
    from miniworld.families import RECIPES, build_families

    return drafters_stage(cfg, out, "families", build_families, [r.name for r in RECIPES], quick)


def build_methods_stage(cfg: BuildConfig, out: Path, quick: bool = False, only: tuple[str, ...] = ()) -> dict:
    """The other draft methods' public drafters (miniworld/methods.py; `only` these) over an earlier full build."""
    from miniworld.methods import NAMES, build_methods

    names = only or NAMES
    unknown = sorted(set(names) - set(NAMES))
    if unknown:
        raise SystemExit(f"--drafter {', '.join(unknown)}: not a drafter of this stage (known: {', '.join(NAMES)})")
    build = functools.partial(build_methods, only=names)
    return drafters_stage(cfg, out, "methods", build, list(names), quick)


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m miniworld.build", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=str(HERE), help="where the artifacts go (default: miniworld/)")
    p.add_argument("--quick", action="store_true", help="a few steps of everything (smoke test, not for use)")
    p.add_argument(
        "--stage",
        choices=["all", "drafter", "pool", "workload", "long", "families", "methods"],
        default="all",
        help="'drafter': retrain aq-mini-eagle3 only; 'pool': write the K2.5 conversation pool; 'workload': write the "
        "traffic classes of the deployment profile; 'long': its long-context class; 'families': the K2.5-era "
        "drafters of every family (MLA/TorchSpec, ModelOpt, speculators); 'methods': the other draft methods' "
        "public drafters (DFlash, P-EAGLE); each over an "
        "earlier full build in --out",
    )
    p.add_argument("--drafter", action="append", default=[], help="with --stage methods: build only this drafter "
                   "(repeatable; default: every method's)")  # fmt: skip
    args = p.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    cfg = BuildConfig()
    if args.quick:
        cfg = BuildConfig(
            corpus_chars=400_000,
            k2_steps=20,
            k25_steps=10,
            aq_train_prompts=64,
            k25_train_prompts=8,
            k25_val_prompts=8,
            k25_test_prompts=8,
            k2_val_prompts=8,
            drafter_steps=20,
        )
    if args.stage == "pool":
        print(json.dumps(build_pool(cfg, Path(args.out))["pool"], indent=2))
        return
    if args.stage == "workload":
        print(json.dumps(build_workload(cfg, Path(args.out))["workload"], indent=2))
        return
    if args.stage == "families":
        print(json.dumps(build_families_stage(cfg, Path(args.out), args.quick)["figures"]["families"], indent=2))
        return
    if args.stage == "methods":
        print(
            json.dumps(
                build_methods_stage(cfg, Path(args.out), args.quick, tuple(args.drafter))["figures"]["methods"],
                indent=2,
            )
        )
        return
    if args.stage == "long":
        print(json.dumps(build_long(cfg, Path(args.out))["workload"]["classes"]["long"], indent=2))
        return
    record = build(cfg, Path(args.out), args.stage)
    print(json.dumps(record["figures"], indent=2))


if __name__ == "__main__":
    main()
