"""Hidden-state datasets: a resumable shard writer, a streaming reader, and SpecForge's offline files.

A dataset is a folder: index.json + shard-NNNNN.safetensors (packed samples: input_ids int32 [T],
loss_mask bool [T], aux_hidden bf16 [T, 3H], last_hidden bf16 [T, H] after the final norm,
target_token int32 [T] (full-vocab argmax), offsets int64 [n+1]) + target_head.safetensors (the
target's full lm_head, written once). loss_mask[p] marks assistant token p.

Readers fetch each sample's rows with positional reads at the offsets the shard header gives, so the
resident set stays at one batch whatever the dataset size (a memory map would count every page it
ever touched towards RSS), and every shard's sha256 is checked against the index before first use.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from common.errors import BadInput
from drafter.formats.checkpoint import DTYPES, parse_header_bytes
from drafter.model.config import read_json

FORMAT = "drafterops-hidden-states"
VERSION = 1
INDEX = "index.json"
PARTIAL = "index.partial.json"
HEAD_FILE = "target_head.safetensors"
REGENERATED = "regenerated.jsonl"  # make_data --regenerate: the replies the target wrote, captured on
FIELDS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden", "target_token")


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class Sample:
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]
    aux_hidden: torch.Tensor  # [T, 3H]
    last_hidden: torch.Tensor  # [T, H]
    target_token: torch.Tensor  # int64 [T]

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass
class CapturedStates:
    """One prompt's states: aux [T, 3H] (the aux layers' outputs in id order), last [T, H] (after the final
    norm) and the target's greedy next token at every position [T]."""

    aux_hidden: torch.Tensor
    last_hidden: torch.Tensor
    target_token: torch.Tensor


# ---------------------------------------------------------------------------------------------- writing
@dataclass
class DatasetWriter:
    """Appends samples and writes a shard whenever `shard_tokens` tokens are buffered.

    `meta` identifies what is being captured (target, layers, prompts digest, max_len, ...). A folder
    that holds a finished dataset with other meta is refused; an unfinished one with the same meta is
    resumed: its finished shards are kept (their samples are skipped by the caller through
    `done_samples`), and a shard half-written when the run died (a *.tmp file) is discarded."""

    folder: Path
    meta: dict[str, Any]
    shard_tokens: int = 65536
    shards: list[dict[str, Any]] = field(default_factory=list)
    _buffer: list[Sample] = field(default_factory=list)
    _buffered_tokens: int = 0

    def __post_init__(self) -> None:
        self.folder = Path(self.folder)
        if self.folder.exists() and not self.folder.is_dir():
            raise BadInput(f"{self.folder}: --out is a file, not a folder")
        if (self.folder / INDEX).is_file():
            index = read_json(self.folder / INDEX)
            if index.get("meta") != self.meta:
                raise BadInput(
                    f"{self.folder}: already holds a different dataset (index.json meta differs); "
                    "choose another output folder"
                )
            check_shards(self.folder, index.get("shards", []))
            raise DatasetComplete(index)
        refuse_foreign(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        for tmp in self.folder.glob("*.tmp"):
            if _ours(tmp.name, recorded=True):  # refuse_foreign let through only what this writer names so
                tmp.unlink()
        if (self.folder / PARTIAL).is_file():
            partial = read_json(self.folder / PARTIAL)
            if partial.get("meta") != self.meta:
                raise BadInput(
                    f"{self.folder}: holds an unfinished capture of a different dataset; choose another output folder"
                )
            for shard in partial.get("shards", []):
                path = self.folder / shard["file"]
                if not path.is_file() or sha256_file(path) != shard["sha256"]:
                    break
                self.shards.append(shard)
        # shards past the last good one (written after a kill, never recorded) are captured again
        recorded = {s["file"] for s in self.shards}
        for stale in self.folder.glob("shard-*.safetensors"):
            if stale.name not in recorded:
                stale.unlink()
        self._save_partial()  # from here on the folder is recognisably ours, even before the head file

    @property
    def done_samples(self) -> int:
        return sum(s["num_samples"] for s in self.shards)

    def write_head(self, lm_head: torch.Tensor, embedding: torch.Tensor | None = None) -> None:
        """The target's lm_head (and input embedding, which a drafter's frozen embed_tokens copies),
        so that training needs no target model."""
        path = self.folder / HEAD_FILE
        if not path.is_file():
            tensors = {"lm_head.weight": lm_head}
            if embedding is not None:
                tensors["embed_tokens.weight"] = embedding
            save_file({k: v.detach().to(torch.bfloat16).contiguous() for k, v in tensors.items()}, str(path) + ".tmp")
            os.replace(str(path) + ".tmp", path)

    def add(self, sample: Sample) -> None:
        self._buffer.append(sample)
        self._buffered_tokens += len(sample)
        if self._buffered_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._buffer:
            return
        lengths = [len(s) for s in self._buffer]
        offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        tensors = {
            "input_ids": torch.cat([s.input_ids for s in self._buffer]).to(torch.int32),
            "loss_mask": torch.cat([s.loss_mask for s in self._buffer]).to(torch.bool),
            "aux_hidden": torch.cat([s.aux_hidden for s in self._buffer]).to(torch.bfloat16),
            "last_hidden": torch.cat([s.last_hidden for s in self._buffer]).to(torch.bfloat16),
            "target_token": torch.cat([s.target_token for s in self._buffer]).to(torch.int32),
            "offsets": offsets,
        }
        name = f"shard-{len(self.shards):05d}.safetensors"
        tmp = self.folder / (name + ".tmp")
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, self.folder / name)
        self.shards.append(
            {
                "file": name,
                "sha256": sha256_file(self.folder / name),
                "num_samples": len(lengths),
                "num_tokens": int(offsets[-1]),
            }
        )
        self._buffer, self._buffered_tokens = [], 0
        self._save_partial()

    def _save_partial(self) -> None:
        tmp = self.folder / (PARTIAL + ".tmp")
        tmp.write_text(json.dumps({"meta": self.meta, "shards": self.shards}, indent=1))
        os.replace(tmp, self.folder / PARTIAL)

    def finish(self) -> dict[str, Any]:
        """Flush, then publish index.json (the dataset exists only from this moment)."""
        self.flush()
        if not self.shards:
            raise BadInput(f"{self.folder}: no samples were captured")
        digest = hashlib.sha256(
            json.dumps({"meta": self.meta, "shards": [s["sha256"] for s in self.shards]}, sort_keys=True).encode()
        ).hexdigest()
        index = {
            "format": FORMAT,
            "version": VERSION,
            **{k: self.meta[k] for k in ("target", "layer_ids", "hidden_size", "vocab_size") if k in self.meta},
            "aux_hidden_size": len(self.meta["layer_ids"]) * self.meta["hidden_size"],
            "dtype": "bfloat16",
            "num_samples": self.done_samples,
            "num_tokens": sum(s["num_tokens"] for s in self.shards),
            "shards": self.shards,
            "head_file": HEAD_FILE,
            "digest": digest,
            "meta": self.meta,
        }
        tmp = self.folder / (INDEX + ".tmp")
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, self.folder / INDEX)
        (self.folder / PARTIAL).unlink(missing_ok=True)
        return index


SHARD_NAME = re.compile(r"shard-\d{5}\.safetensors")


def check_shards(folder: Path, shards: list[dict[str, Any]]) -> None:
    """Every shard a finished dataset recorded is there with the sha256 it was written with."""
    for shard in shards:
        path = Path(folder) / str(shard.get("file", ""))
        if not path.is_file():
            raise BadInput(f"{path}: shard recorded in index.json is missing; delete the folder and capture again")
        if sha256_file(path) != shard.get("sha256"):
            raise BadInput(f"{path}: shard changed since it was written (sha256 differs from index.json)")


OWN = {PARTIAL, HEAD_FILE, INDEX, REGENERATED, REGENERATED.replace(".jsonl", ".json")}


def _ours(name: str, recorded: bool) -> bool:
    """A name this writer gives its files; shards (and their half-written .tmp) only in a folder whose record
    (`index.partial.json`) says a capture of ours is under way there: a writer deletes what it would rewrite,
    so it must never take someone else's `shard-00000.safetensors` or `notes.tmp` for its own."""
    base = name.removesuffix(".tmp")
    return base in OWN or bool(recorded and SHARD_NAME.fullmatch(base))


def refuse_foreign(folder: Path) -> None:
    """A folder that holds anything but a dataset's own files is not written into (nothing in it is deleted)."""
    leftovers = [p.name for p in folder.iterdir()] if folder.is_dir() else []
    recorded = PARTIAL in leftovers
    foreign = [n for n in leftovers if not _ours(n, recorded)]
    if foreign:
        raise BadInput(f"{folder}: exists and is not a drafterops dataset ({foreign[0]}); refusing to mix")


def preflight(folder: str | Path) -> None:
    """What can be refused about an output folder before any model is loaded: a file in its place,
    a finished dataset whose record is corrupt or whose shards are gone or changed."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise BadInput(f"{folder}: --out is a file, not a folder")
    if (folder / INDEX).is_file():
        check_shards(folder, read_json(folder / INDEX).get("shards", []))
    else:
        refuse_foreign(folder)
        if (folder / PARTIAL).is_file():
            read_json(folder / PARTIAL)


class DatasetComplete(Exception):
    """Raised by DatasetWriter when the folder already holds this exact dataset: nothing to do."""

    def __init__(self, index: dict[str, Any]) -> None:
        super().__init__("dataset already complete")
        self.index = index


# ---------------------------------------------------------------------------------------------- reading
class _Shard:
    """Positional reads of sample rows from one shard; the header is parsed once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        with path.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if 8 + n > size:
                raise BadInput(f"{path}: safetensors header length {n} is larger than the file")
            entries = parse_header_bytes(fh.read(n), size, str(path))
        missing = [f for f in (*FIELDS, "offsets") if f not in entries]
        if missing:
            raise BadInput(f"{path}: shard lacks tensors {missing}")
        self.base = 8 + n
        self.entries = entries
        self.fd = os.open(path, os.O_RDONLY)  # one descriptor per shard, not one per tensor read
        self.offsets = self._read("offsets", 0, None)

    def __del__(self) -> None:
        fd = getattr(self, "fd", None)
        if fd is not None:
            os.close(fd)

    def _read(self, name: str, start: int, stop: int | None) -> torch.Tensor:
        entry = self.entries[name]
        dtype, itemsize = DTYPES[entry["dtype"]]
        shape = entry["shape"]
        row = math.prod(shape[1:]) * itemsize
        stop = shape[0] if stop is None else stop
        begin = self.base + entry["data_offsets"][0] + start * row
        raw = os.pread(self.fd, (stop - start) * row, begin)
        return torch.frombuffer(bytearray(raw), dtype=dtype).view(stop - start, *shape[1:])

    def sample(self, i: int) -> Sample:
        s, e = int(self.offsets[i]), int(self.offsets[i + 1])
        return Sample(
            input_ids=self._read("input_ids", s, e).long(),
            loss_mask=self._read("loss_mask", s, e).bool(),
            aux_hidden=self._read("aux_hidden", s, e),
            last_hidden=self._read("last_hidden", s, e),
            target_token=self._read("target_token", s, e).long(),
        )


class HiddenStateDataset:
    """A captured dataset, read sample by sample. Opening it checks the index; each shard's sha256 is
    checked before its first read."""

    def __init__(self, folder: str | Path, verify: bool = True) -> None:
        self.folder = Path(folder)
        path = self.folder / INDEX
        if not path.is_file():
            hint = " (capture unfinished: rerun make_data to resume)" if (self.folder / PARTIAL).is_file() else ""
            raise BadInput(f"{self.folder}: not a dataset, no {INDEX}{hint}")
        self.index = read_json(path)
        if self.index.get("format") != FORMAT:
            raise BadInput(f"{path}: not a {FORMAT} index")
        self.verify = verify
        self._shards: dict[int, _Shard] = {}
        self.locations: list[tuple[int, int]] = []
        for si, shard in enumerate(self.index["shards"]):
            self.locations += [(si, i) for i in range(shard["num_samples"])]

    @property
    def layer_ids(self) -> list[int]:
        return list(self.index["layer_ids"])

    @property
    def hidden_size(self) -> int:
        return int(self.index["hidden_size"])

    @property
    def digest(self) -> str:
        return self.index["digest"]

    def __len__(self) -> int:
        return len(self.locations)

    def _shard(self, si: int) -> _Shard:
        if si not in self._shards:
            meta = self.index["shards"][si]
            path = self.folder / meta["file"]
            if not path.is_file():
                raise BadInput(f"{path}: shard listed in index.json is missing")
            if self.verify and sha256_file(path) != meta["sha256"]:
                raise BadInput(f"{path}: sha256 does not match index.json; refusing to read a corrupt shard")
            self._shards[si] = _Shard(path)
        return self._shards[si]

    def __getitem__(self, i: int) -> Sample:
        si, j = self.locations[i]
        return self._shard(si).sample(j)

    def _head_tensor(self, name: str) -> torch.Tensor | None:
        """One tensor of the target's head file (the lm_head and the embedding are each V x H: a
        caller that needs one never holds both)."""
        from safetensors import safe_open

        path = self.folder / self.index.get("head_file", HEAD_FILE)
        if not path.is_file():
            raise BadInput(f"{path}: the target's lm_head is missing from the dataset")
        with safe_open(str(path), framework="pt") as fh:
            return fh.get_tensor(name) if name in set(fh.keys()) else None

    def target_head(self) -> torch.Tensor:
        head = self._head_tensor("lm_head.weight")
        if head is None:
            raise BadInput(f"{self.folder}: the dataset's head file has no lm_head.weight")
        return head

    def target_embedding(self) -> torch.Tensor | None:
        return self._head_tensor("embed_tokens.weight")


class SpecForgeDataset:
    """SpecForge's offline files (one torch file per sample: input_ids, loss_mask, hidden_state,
    aux_hidden_state), read with weights_only=True. hidden_state is taken as the target's last hidden
    state after its final norm; target_token is computed from it with the target's lm_head."""

    SUFFIXES = (".ckpt", ".pt", ".pth")

    def __init__(
        self,
        folder: str | Path,
        target_head: torch.Tensor,
        layer_ids: list[int],
        target_embedding: torch.Tensor | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.files = sorted(
            (p for p in self.folder.rglob("*") if p.suffix in self.SUFFIXES),
            key=lambda p: (len(p.parts), _natural_key(p)),
        )
        if not self.files:
            raise BadInput(f"{self.folder}: no SpecForge hidden-state files (*.ckpt)")
        self.head = target_head
        self.embedding = target_embedding
        self._layer_ids = list(layer_ids)
        self.hidden_size = int(target_head.shape[1])

    @property
    def layer_ids(self) -> list[int]:
        return self._layer_ids

    def __len__(self) -> int:
        return len(self.files)

    def target_head(self) -> torch.Tensor:
        return self.head

    def target_embedding(self) -> torch.Tensor | None:
        return self.embedding

    def __getitem__(self, i: int) -> Sample:
        path = self.files[i]
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # unpickling errors come in many types; the message names the file
            raise BadInput(f"{path}: not a readable SpecForge sample ({exc.__class__.__name__})") from None
        missing = [k for k in ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state") if k not in data]
        if missing:
            raise BadInput(f"{path}: SpecForge sample lacks {missing}")

        def flat(t: torch.Tensor, dims: int) -> torch.Tensor:
            while t.dim() > dims:
                t = t[0]
            return t

        last = flat(data["hidden_state"], 2)
        aux = flat(data["aux_hidden_state"], 2)
        if aux.shape[-1] != 3 * self.hidden_size or last.shape[-1] != self.hidden_size:
            raise BadInput(
                f"{path}: hidden sizes {last.shape[-1]}/{aux.shape[-1]} do not fit the target head ({self.hidden_size})"
            )
        target_token = (last.float() @ self.head.float().T).argmax(-1)
        return Sample(flat(data["input_ids"], 1).long(), flat(data["loss_mask"], 1).bool(), aux, last, target_token)


def token_counts(
    dataset: HiddenStateDataset | SpecForgeDataset, vocab_size: int, indices: list[int] | None = None
) -> torch.Tensor:
    """How often each target token is the target's next-token prediction (for a scratch drafter's
    vocab maps); pass the training indices so validation samples do not leak into them."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in range(len(dataset)) if indices is None else indices:
        counts += torch.bincount(dataset[i].target_token, minlength=vocab_size)[:vocab_size]
    return counts


def _natural_key(path: Path) -> list[Any]:
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(path))]


class LayerView:
    """A dataset as a drafter that reads some of its captured layers sees it (a capture of several drafters' union:
    make_data --drafter a,b): each sample's aux states cut to those layers' columns, in the drafter's order.
    Everything else is the dataset's own."""

    def __init__(self, base: Any, ids: list[int]) -> None:
        self.base, self._ids = base, list(ids)
        held, h = list(base.layer_ids), int(base.hidden_size)
        self._cols = torch.cat([torch.arange(held.index(i) * h, (held.index(i) + 1) * h) for i in self._ids])

    @property
    def layer_ids(self) -> list[int]:
        return list(self._ids)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Sample:
        s = self.base[i]
        return Sample(s.input_ids, s.loss_mask, s.aux_hidden[:, self._cols], s.last_hidden, s.target_token)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.base, name)


def layers_for(dataset: Any, ids: list[int]) -> Any:
    """The dataset as a drafter reading target layers `ids` sees it: itself when it holds exactly those, in that
    order; a LayerView when it holds them among others; bad input naming the ones it lacks."""
    held = list(dataset.layer_ids)
    if held == list(ids):
        return dataset
    missing = [i for i in ids if i not in held]
    if missing:
        raise BadInput(f"the dataset holds layers {held}; the drafter reads {list(ids)} ({missing} not captured)")
    return LayerView(dataset, ids)


def open_dataset(folder: str | Path, **specforge: Any) -> HiddenStateDataset | SpecForgeDataset:
    """Our format when index.json is there; SpecForge's files otherwise (needs target_head, layer_ids)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise BadInput(f"{folder}: dataset folder not found")
    if (folder / INDEX).is_file() or (folder / PARTIAL).is_file() or not specforge:
        return HiddenStateDataset(folder)
    return SpecForgeDataset(folder, **specforge)


# ---------------------------------------------------------------------------------------------- batching
@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] bool
    loss_mask: torch.Tensor  # [B, T] bool (assistant tokens)
    aux_hidden: torch.Tensor  # [B, T, 3H] float32
    last_hidden: torch.Tensor  # [B, T, H] float32
    target_token: torch.Tensor  # [B, T] int64
    position_ids: torch.Tensor | None = None  # [B, T] when rows hold packed samples (drafter/data/packing.py)
    segment_ids: torch.Tensor | None = None  # [B, T] the sample each position belongs to; pad -1

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> Batch:
        """On `device`; to a GPU from pinned memory, without waiting for it."""
        if torch.device(device).type != "cuda":
            return Batch(**{k: None if v is None else v.to(device) for k, v in vars(self).items()})
        return Batch(
            **{k: None if v is None else v.pin_memory().to(device, non_blocking=True) for k, v in vars(self).items()}
        )


def collate(samples: list[Sample], max_len: int | None = None) -> Batch:
    """Right-pad samples (cut to max_len) into one batch."""
    lengths = cut_lengths(samples, max_len)
    return fill_rows(samples, lengths, [[i] for i in range(len(samples))], max(lengths), packed=False)


def cut_lengths(samples: list[Sample], max_len: int | None) -> list[int]:
    return [min(len(s), max_len) if max_len else len(s) for s in samples]


def fill_rows(samples: list[Sample], lengths: list[int], rows: list[list[int]], width: int, packed: bool) -> Batch:
    """A batch whose row r holds samples rows[r] one after another, right-padded to `width`; a packed
    batch also carries each sample's own positions and its segment id (pad -1)."""
    r = len(rows)
    aux_w, h = samples[0].aux_hidden.shape[-1], samples[0].last_hidden.shape[-1]
    out = Batch(
        input_ids=torch.zeros(r, width, dtype=torch.long),
        attention_mask=torch.zeros(r, width, dtype=torch.bool),
        loss_mask=torch.zeros(r, width, dtype=torch.bool),
        aux_hidden=torch.zeros(r, width, aux_w),
        last_hidden=torch.zeros(r, width, h),
        target_token=torch.zeros(r, width, dtype=torch.long),
        position_ids=torch.zeros(r, width, dtype=torch.long) if packed else None,
        segment_ids=torch.full((r, width), -1, dtype=torch.long) if packed else None,
    )
    for row, members in enumerate(rows):
        start = 0
        for i in members:
            s, n = samples[i], lengths[i]
            at = slice(start, start + n)
            out.input_ids[row, at] = s.input_ids[:n]
            out.attention_mask[row, at] = True
            out.loss_mask[row, at] = s.loss_mask[:n]
            out.aux_hidden[row, at] = s.aux_hidden[:n].float()
            out.last_hidden[row, at] = s.last_hidden[:n].float()
            out.target_token[row, at] = s.target_token[:n]
            if packed:
                out.position_ids[row, at] = torch.arange(n)
                out.segment_ids[row, at] = i
            start += n
    return out


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Deterministic train/validation split by sample (at least one of each when n >= 2)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    n_val = min(max(1 if n >= 2 and val_fraction > 0 else 0, round(n * val_fraction)), n - 1) if n > 1 else 0
    return sorted(order[n_val:]), sorted(order[:n_val])


def iterate_batches(
    dataset: Any,
    indices: list[int],
    batch_size: int,
    max_len: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    epoch: int = 0,
) -> Iterator[Batch]:
    """Batches over `indices`, shuffled across shards by (seed, epoch); samples of similar length are
    not grouped, so every order is reproducible from the seed alone."""
    order = list(indices)
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    for start in range(0, len(order), batch_size):
        yield collate([dataset[i] for i in order[start : start + batch_size]], max_len)
