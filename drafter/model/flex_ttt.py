"""TTT attention as one fused kernel per step on a GPU: torch's flex_attention under a block mask.

A TTT step's query at position t sees the step-0 keys of positions <= t (of its own sample, not
padding, within the sliding window if the drafter has one) plus one key per earlier step at its own
position (the chain's "diagonal"): the rule drafter/model/ttt_attention.py walks block by block in Python,
here handed to one compiled kernel forward and one backward. The keys are step 0's [T] followed by
each earlier step's chain keys [M each], and the mask says which a query may see:

    main:     key index k < T, not padding, lo(query) <= k <= t(query), the query's own sample
    diagonal: key index T + i*M + q for every earlier step i (the query's own chain)

The block mask skips every block no query of it may see (future blocks, blocks behind the window or
in another packed sample), and blocks wholly visible run without the mask: the work is the causal
half, not the square. This is what SpecForge's flex_attention backend does. The mask reads only
tensors (no Python number that changes from step to step), so one compiled kernel serves every
length and step; its tables are padded past the sequence's end, where a kernel may look.

flex_attention runs forward on a CPU (compiled) but has no backward there: the CPU path is the
blockwise one, which is also the reference this one is tested against (tests/test_flex_ttt.py).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from drafter.model import compiled
from drafter.model.ttt_attention import KeyRule

PAD = 256  # mask tables reach this far past the last query and key: a kernel may read a block beyond
DYNAMIC = os.environ.get("DRAFTEROPS_FLEX_DYNAMIC", "1") != "0"  # one compiled kernel for every length


@functools.cache
def kernels(dynamic: bool = True):
    """(flex_attention, create_block_mask) compiled once per process: compiling is what makes flex
    attention a fused kernel at all. With dynamic shapes (on a GPU) every length and step shares one
    compilation; on a CPU each shape compiles its own (torch's CPU code generator fails some dynamic shapes,
    `cur_kvSplitSize<n>` undeclared)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, compiled.RECOMPILE_LIMIT)
    mode = True if dynamic else None
    return torch.compile(flex_attention, dynamic=mode), torch.compile(create_block_mask, dynamic=mode)


def _ceil(n: int) -> int:
    return -(-n // PAD) * PAD + PAD


def _tail(x: torch.Tensor, length: int, value: int | bool) -> torch.Tensor:
    """x [..., n] right-padded to `length` with `value`."""
    return F.pad(x, (0, length - x.shape[-1]), value=value)


def _main_mask(qpos, lo, key_ok, diag):  # noqa: ANN001, ANN202
    def mask_mod(b, h, q, k):  # noqa: ANN001, ANN202
        p = qpos[b, q]
        return (key_ok[b, k] & (k <= p) & (k >= lo[b, q])) | (diag[k] == q)

    return mask_mod


def _packed_mask(qpos, lo, key_ok, diag, qseg, kseg):  # noqa: ANN001, ANN202
    def mask_mod(b, h, q, k):  # noqa: ANN001, ANN202
        p = qpos[b, q]
        return (key_ok[b, k] & (k <= p) & (k >= lo[b, q]) & (kseg[b, k] == qseg[b, q])) | (diag[k] == q)

    return mask_mod


def ttt_block_mask(rule: KeyRule, queries: int, keys: int, chain: int, dynamic: bool = True):
    """The block mask of one step: `queries` queries against `keys` step-0 keys and `chain` earlier
    steps' keys, `queries` each, laid out after them."""
    b = rule.query_pos.shape[0]
    device = rule.query_pos.device
    length = keys + chain * queries
    q_len, k_len = _ceil(queries), _ceil(length)
    qpos = _tail(rule.query_pos, q_len, 0)
    lo = torch.zeros_like(qpos) if rule.window is None else qpos + (rule.offset - rule.window + 1)
    key_ok = _tail(rule.key_ok.bool(), k_len, False)  # chain keys are seen by the diagonal rule alone
    diag = torch.arange(chain * queries, device=device) % max(queries, 1)
    diag = _tail(F.pad(diag, (keys, 0), value=-1), k_len, -1)
    if rule.segment_ids is None:
        mask_mod = _main_mask(qpos, lo, key_ok, diag)
    else:
        qseg = _tail(torch.gather(rule.segment_ids, 1, rule.query_pos), q_len, -3)
        kseg = _tail(rule.segment_ids, k_len, -2)
        mask_mod = _packed_mask(qpos, lo, key_ok, diag, qseg, kseg)
    maker = kernels(dynamic)[1] if rule.query_pos.is_cuda else create_block_mask  # small on a CPU: not compiled
    return maker(mask_mod, b, None, queries, length, device=device)


def flex_ttt_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    chain_k: list[torch.Tensor],
    chain_v: list[torch.Tensor],
    rule: KeyRule,
    scale: float,
) -> torch.Tensor:
    """q [B, h, M, d] against step-0 keys [B, h, T, d] and values [B, h, T, dv] and the chain's own keys
    and values (one [B, h, M, d or dv] per step of the chain, at each query's position); returns
    [B, h, M, dv], as drafter/ttt_attention.blockwise_ttt_attention does for the chain stacked."""
    m = q.shape[2]
    chain = len(chain_k)
    if chain:  # each earlier step's keys as a block of M after the step-0 keys: one copy
        keys = torch.cat([keys, *chain_k], dim=2)
        values = torch.cat([values, *chain_v], dim=2)
    dynamic = DYNAMIC and q.is_cuda  # torch's CPU code generator fails some dynamic shapes: one per shape there
    block_mask = ttt_block_mask(rule, m, keys.shape[2] - chain * m, chain, dynamic)
    return kernels(dynamic)[0](q.contiguous(), keys.contiguous(), values.contiguous(), block_mask=block_mask,
                               scale=scale)  # fmt: skip
