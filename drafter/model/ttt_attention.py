"""TTT attention in query blocks merged by log-sum-exp: memory linear in the sequence length.

A TTT step's query at position t sees the step-0 keys of positions <= t (of its own sample, not
padding, within the sliding window if the drafter has one) plus one key per earlier step at its own
position (the chain's "diagonal"). The eager path (drafter/model/eagle3.py, `attention="eager"`) keeps the
whole [heads, T, T + j] probability matrix of every step for backward: 75.6 GiB of activations for
the real K2 drafter at 4096 tokens and TTT 7.

This path keeps only each query's output, top score and softmax denominator. Forward and backward walk the queries in
blocks and recompute a block's scores in backward, as flash attention does (and SpecForge's `fa`
backend, which merges flash blocks by log-sum-exp); the diagonal keys join the same softmax. A block
reads only the keys some query of it may see (causal and window), so long sequences also do less
work. On CPU, torch's flex attention needs torch.compile and its flash kernel returns no gradient
for the log-sum-exp, so the blocks are plain torch matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MASKED = torch.finfo(torch.float32).min  # a score a query may not see
BLOCK_ELEMENTS = 1 << 24  # one query block's scores hold at most this many elements (64 MiB in fp32)


@dataclass(frozen=True)
class KeyRule:
    """Which step-0 keys a query may see: `query_pos` [B, M] its index into the sequence (the step's
    query for position t is at t); `key_ok` [B, T] False on padding; `segment_ids` [B, T] the packed
    sample of each position (None: one sample per row); `window` the sliding window counted from the
    query's own sequence position t + `offset` (None: unlimited)."""

    query_pos: torch.Tensor
    key_ok: torch.Tensor
    segment_ids: torch.Tensor | None = None
    window: int | None = None
    offset: int = 0

    def key_span(self, lo: int, hi: int) -> tuple[int, int]:
        """The keys queries lo..hi-1 may see at all: [first, last + 1)."""
        qp = self.query_pos[:, lo:hi]
        end = int(qp.max()) + 1
        start = 0 if self.window is None else max(0, int(qp.min()) + self.offset - self.window + 1)
        return min(start, end - 1), end  # at least one key (masked if unseen): a block never reduces over none

    def allowed(self, lo: int, hi: int, k0: int, k1: int) -> torch.Tensor:
        """[B, hi - lo, k1 - k0] bool: may query lo.. see key k0..?"""
        qp = self.query_pos[:, lo:hi, None]
        keys = torch.arange(k0, k1, device=qp.device)[None, None]
        ok = (keys <= qp) & self.key_ok[:, None, k0:k1]
        if self.window is not None:
            ok = ok & (qp + self.offset - keys < self.window)
        if self.segment_ids is not None:
            seg = self.segment_ids
            ok = ok & (torch.gather(seg, 1, self.query_pos[:, lo:hi])[:, :, None] == seg[:, None, k0:k1])
        return ok


def block_size(batch: int, heads: int, keys: int) -> int:
    """Queries per block: a block's scores stay within BLOCK_ELEMENTS, whatever the length."""
    return max(16, BLOCK_ELEMENTS // max(1, batch * heads * keys))


def _scores(q, keys, diag_k, rule: KeyRule, lo: int, hi: int, k0: int, k1: int, scale: float):
    """Block scores in fp32 (computed in the inputs' precision, as the eager path does), masked."""
    s = (torch.matmul(q[:, :, lo:hi], keys[:, :, k0:k1].transpose(-1, -2)) * scale).float()
    s = s.masked_fill(~rule.allowed(lo, hi, k0, k1)[:, None], MASKED)
    sd = ((q[:, :, lo:hi, None, :] * diag_k[:, :, lo:hi]).sum(-1) * scale).float()  # [B, h, C, J]
    return s, sd


def _probs(s, sd, top, total, lo: int, hi: int):  # noqa: ANN001
    """A block's probabilities from each row's top score and its sum of exp(score - top), kept apart
    rather than as one log-sum-exp: a row that may see no key (every score at the mask value) then
    averages its keys as the eager softmax does, where top + log(total) would round to top and sum them."""
    t, n = top[:, :, lo:hi, None], total[:, :, lo:hi, None]
    return (s - t).exp() / n, (sd - t).exp() / n


class _BlockwiseTTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, keys, values, diag_k, diag_v, rule: KeyRule, scale: float):  # noqa: ANN001
        with torch.autocast(q.device.type, enabled=False):
            b, h, m, _ = q.shape
            out = q.new_empty(b, h, m, values.shape[-1])  # values may be narrower than keys (MLA)
            top = torch.empty(b, h, m, dtype=torch.float32, device=q.device)
            total = torch.empty_like(top)
            step = block_size(b, h, keys.shape[2])
            for lo in range(0, m, step):
                hi = min(m, lo + step)
                k0, k1 = rule.key_span(lo, hi)
                s, sd = _scores(q, keys, diag_k, rule, lo, hi, k0, k1, scale)
                t = s.amax(-1) if not sd.shape[-1] else torch.maximum(s.amax(-1), sd.amax(-1))
                top[:, :, lo:hi] = t
                total[:, :, lo:hi] = (s - t[..., None]).exp().sum(-1) + (sd - t[..., None]).exp().sum(-1)
                p, pd = _probs(s, sd, top, total, lo, hi)
                p, pd = p.to(q.dtype), pd.to(q.dtype)
                o = torch.matmul(p, values[:, :, k0:k1]) + (pd[..., None] * diag_v[:, :, lo:hi]).sum(-2)
                out[:, :, lo:hi] = o
        ctx.save_for_backward(q, keys, values, diag_k, diag_v, out, top, total)
        ctx.rule, ctx.scale = rule, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001
        q, keys, values, diag_k, diag_v, out, top, total = ctx.saved_tensors
        rule, scale = ctx.rule, ctx.scale
        with torch.autocast(q.device.type, enabled=False):
            grad_out = grad_out.to(q.dtype)
            dq = torch.zeros_like(q, dtype=torch.float32)
            dk = torch.zeros_like(keys, dtype=torch.float32)
            dv = torch.zeros_like(values, dtype=torch.float32)
            ddk = torch.zeros_like(diag_k, dtype=torch.float32)
            ddv = torch.zeros_like(diag_v, dtype=torch.float32)
            b, h, m, _ = q.shape
            step = block_size(b, h, keys.shape[2])
            for lo in range(0, m, step):
                hi = min(m, lo + step)
                k0, k1 = rule.key_span(lo, hi)
                s, sd = _scores(q, keys, diag_k, rule, lo, hi, k0, k1, scale)
                p, pd = _probs(s, sd, top, total, lo, hi)
                go = grad_out[:, :, lo:hi]
                row = (go.float() * out[:, :, lo:hi].float()).sum(-1, keepdim=True)  # sum_k p dp = dO . O
                dp = torch.matmul(go, values[:, :, k0:k1].transpose(-1, -2)).float()
                dpd = (go[:, :, :, None, :] * diag_v[:, :, lo:hi]).sum(-1).float()
                ds = (p * (dp - row)).masked_fill(s == MASKED, 0.0).to(q.dtype)  # a masked score has no gradient
                dsd = pd * (dpd - row)
                qc = q[:, :, lo:hi]
                chain = (dsd[..., None] * diag_k[:, :, lo:hi]).sum(-2)
                dq[:, :, lo:hi] = (torch.matmul(ds, keys[:, :, k0:k1]).float() + chain) * scale
                dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qc).float() * scale
                dv[:, :, k0:k1] += torch.matmul(p.to(q.dtype).transpose(-1, -2), go).float()
                ddk[:, :, lo:hi] = dsd[..., None] * qc[:, :, :, None, :].float() * scale
                ddv[:, :, lo:hi] = pd[..., None] * go[:, :, :, None, :].float()
        return (dq.to(q.dtype), dk.to(keys.dtype), dv.to(values.dtype), ddk.to(diag_k.dtype), ddv.to(diag_v.dtype),
                None, None)  # fmt: skip


def blockwise_ttt_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    diag_k: torch.Tensor,
    diag_v: torch.Tensor,
    rule: KeyRule,
    scale: float,
) -> torch.Tensor:
    """q [B, h, M, d] against step-0 keys [B, h, T, d] and values [B, h, T, dv] and the chain's own keys
    and values [B, h, M, J, d or dv] (J earlier steps, at each query's position); returns [B, h, M, dv]."""
    return _BlockwiseTTTAttention.apply(q, keys, values, diag_k, diag_v, rule, scale)
