"""Exact attention in torch math with a sliding window, attention sinks, any causal offset and
an optional dense mask, forward and backward: the fallback for what native SDPA cannot express
(SDPA has no sink term, and a window passed to it as a dense mask costs Nq x Nkv memory).

Visibility: query row i sees key j iff lo <= j - i <= hi (None: that side unbounded); causal
attention with offset c folds into hi as min(hi, c); a bool mask's False entries are hidden, a
float mask is added to the scores.

Sinks (GPT-OSS style): one learned logit per query head h, in the units of the *scaled* scores
s_ij = scale * q_i . k_j. It joins every row's softmax denominator and carries no value:

    lse_i = log(sum_j exp(s_ij) + exp(sink_h)),   out_i = sum_j exp(s_ij - lse_i) v_j.

A row that sees no key gives out 0 and lse = sink_h (-inf without sinks).

The math runs in `compute_dtype` (float32 for 16-bit and float32 inputs, float64 for
float64) over chunks of query rows of at most `CHUNK_ELEMS` score elements, and each
chunk scores only the keys some of its rows can see: keys outside the window are skipped, not
masked. The backward recomputes the scores chunk by chunk from the saved lse (the
FlashAttention backward: dS = P (dP - Delta), Delta = rowsum(dO * O)); the sink is a key with
value 0, so d sink_h = -sum_i exp(sink_h - lse_i) Delta_i over the rows of head h.

`math_lse` is the fallback's log-sum-exp (`fallback.native_lse`) and `math_grads` one block's
gradients given its rows' global out and lse (`fallback.block_grads`, the ring backward's
unit): the same chunked math (math_grads without autograd).

Note [The gradient of lse]: lse_i = log(sum_j exp(s_ij) [+ exp(sink)]) has d lse_i / d s_ij =
P_ij (and exp(sink - lse_i) for the sink), so a loss that reads lse (e.g. through
`merge_attention` of split-KV parts) adds dlse_i P_ij to dS_ij. With the output's dS = P (dP -
Delta) that is dS = P (dP - (Delta - dlse)): every backward takes the lse's gradient by
replacing Delta with Delta' = Delta - dlse, the sinks' gradient included (-sum_i
exp(sink - lse_i) Delta'_i). The backward kernels read Delta from memory, so they need no
change (`launch.run_bwd(dlse=...)`).
"""

from __future__ import annotations

import math

import torch

__all__ = ["CHUNK_ELEMS", "apply_sinks", "compute_dtype", "lse_delta", "math_attention",
           "math_grads", "math_lse", "math_lse_grads"]

_INF = float("inf")
# Score elements (rows x keys, over batch and heads) per chunk: 2^24 float32 values are 64 MiB,
# so the math never holds a full Nq x Nkv score matrix.
CHUNK_ELEMS = 1 << 24


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit and float32 inputs, float64 for float64: what the math runs in and
    what its lse comes back as."""
    return torch.promote_types(dtype, torch.float32)


def _softmax_scale(q, scale) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _chunks(q, nkv, lo, hi):
    """(row start, row end, key start, key end) for each chunk of query rows: the keys
    [ks, ke) that some row of the chunk may see, at most `CHUNK_ELEMS` scores."""
    nq, per_row = q.shape[-2], max(1, math.prod(q.shape[:-2]))
    budget = CHUNK_ELEMS
    width = nkv if lo is None or hi is None else min(nkv, max(0, hi - lo + 1))
    step = max(1, budget // (per_row * max(1, width)))
    while step > 1 and per_row * step * min(nkv, step + width - 1) > budget:
        step //= 2
    chunks = []
    for i in range(0, nq, step):
        j = min(nq, i + step)
        ks = 0 if lo is None else min(max(i + lo, 0), nkv)
        ke = nkv if hi is None else min(max(j + hi, 0), nkv)
        chunks.append((i, j, ks, max(ks, ke)))
    return chunks


def _grouped(t, hkv):
    """[..., Hq, n, d] as [..., Hkv, G, n, d]: GQA without expanding K/V."""
    return t.unflatten(-3, (hkv, -1))


def _scores(q, k, rows, keys, lo, hi, mask, scale, dtype):
    """Scaled scores of query rows [i, j) against keys [ks, ke): [..., Hq, j - i, ke - ks] in
    `dtype`; entries outside the window or hidden by a bool mask at -inf, a float mask added."""
    (i, j), (ks, ke) = rows, keys
    hkv = k.shape[-3]
    kc = k[..., ks:ke, :].to(dtype).unsqueeze(-3)  # [..., Hkv, 1, n, D]
    s = torch.matmul(_grouped(q[..., i:j, :].to(dtype), hkv), kc.transpose(-1, -2))
    s = s.flatten(-4, -3).mul_(scale)
    if lo is not None or hi is not None:
        rel = (torch.arange(ks, ke, device=q.device)
               - torch.arange(i, j, device=q.device).unsqueeze(-1))  # j - i per entry
        hidden = torch.zeros(rel.shape, dtype=torch.bool, device=q.device)
        if lo is not None:
            hidden |= rel < lo
        if hi is not None:
            hidden |= rel > hi
        s.masked_fill_(hidden, -_INF)
    if mask is not None:
        m = mask[..., i:j, ks:ke]
        if m.dtype == torch.bool:
            s.masked_fill_(~m, -_INF)
        else:
            s.add_(m.to(dtype))
    return s


def _forward(q, k, v, lo, hi, sinks, mask, scale):
    dtype, hkv, nkv = compute_dtype(q.dtype), k.shape[-3], k.shape[-2]
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full(q.shape[:-1], -_INF, dtype=dtype, device=q.device)
    sink = None if sinks is None else sinks.to(dtype).unsqueeze(-1)  # [Hq, 1]
    for i, j, ks, ke in _chunks(q, nkv, lo, hi):
        s = _scores(q, k, (i, j), (ks, ke), lo, hi, mask, scale, dtype) if ke > ks else None
        row_lse = lse[..., i:j] if s is None else torch.logsumexp(s, dim=-1)
        if sink is not None:
            row_lse = torch.logaddexp(row_lse, sink)
        lse[..., i:j] = row_lse
        if s is not None:  # -inf rows become +inf: P = 0 there, never NaN
            p = torch.exp(s - row_lse.masked_fill(torch.isneginf(row_lse), _INF).unsqueeze(-1))
            vc = v[..., ks:ke, :].to(dtype).unsqueeze(-3)
            out[..., i:j, :] = torch.matmul(_grouped(p, hkv), vc).flatten(-4, -3)
    return out, lse


def _backward(q, k, v, out, lse, dout, lo, hi, sinks, mask, scale, dlse=None):
    """(dq, dk, dv, dsinks) in `compute_dtype` (dsinks None without sinks; dv None when dout is
    None, i.e. only lse carries a gradient). dlse: the gradient of lse, or None (Note [The
    gradient of lse])."""
    dtype, hkv, nkv = compute_dtype(q.dtype), k.shape[-3], k.shape[-2]
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = None if dout is None else torch.zeros(v.shape, dtype=dtype, device=v.device)
    safe_lse = lse.to(dtype).masked_fill(torch.isneginf(lse), _INF)
    delta = lse_delta(None if dout is None else (dout.to(dtype) * out.to(dtype)).sum(-1), dlse,
                      lse.shape, dtype, q.device)  # [..., Hq, Nq]
    for i, j, ks, ke in _chunks(q, nkv, lo, hi):
        if ke == ks:
            continue
        p = torch.exp(_scores(q, k, (i, j), (ks, ke), lo, hi, mask, scale, dtype)
                      - safe_lse[..., i:j, None])
        qc = _grouped(q[..., i:j, :].to(dtype), hkv)
        kc = k[..., ks:ke, :].to(dtype).unsqueeze(-3)
        if dout is None:  # dP = 0
            ds = _grouped(p * -delta[..., i:j, None], hkv)
        else:
            do = _grouped(dout[..., i:j, :].to(dtype), hkv)
            vc = v[..., ks:ke, :].to(dtype).unsqueeze(-3)
            dp = torch.matmul(do, vc.transpose(-1, -2)).flatten(-4, -3)
            ds = _grouped(p * (dp - delta[..., i:j, None]), hkv)
            dv[..., ks:ke, :] += torch.matmul(_grouped(p, hkv).transpose(-1, -2), do).sum(-3)
        dq[..., i:j, :] = torch.matmul(ds, kc).flatten(-4, -3) * scale
        dk[..., ks:ke, :] += torch.matmul(ds.transpose(-1, -2), qc).sum(-3) * scale
    dsinks = None
    if sinks is not None:
        p_sink = torch.exp(sinks.to(dtype).unsqueeze(-1) - safe_lse)  # [..., Hq, Nq]
        dsinks = -(p_sink * delta).sum(-1).reshape(-1, sinks.shape[0]).sum(0)
    return dq, dk, dv, dsinks


def lse_delta(delta, dlse, shape, dtype, device):
    """Delta' = Delta - dlse (Note [The gradient of lse]); delta / dlse None: zero."""
    if dlse is None:
        return torch.zeros(shape, dtype=dtype, device=device) if delta is None else delta
    dlse = dlse.to(dtype)
    return -dlse if delta is None else delta - dlse


class _MathAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, lo, hi, mask, scale):
        out, lse = _forward(q, k, v, lo, hi, sinks, mask, scale)
        ctx.save_for_backward(q, k, v, sinks, mask, out, lse)
        ctx.args = (lo, hi, scale)
        ctx.set_materialize_grads(False)  # None: that output carries no gradient
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, sinks, mask, out, lse = ctx.saved_tensors
        lo, hi, scale = ctx.args
        if dout is None and dlse is None:
            return (None,) * 8
        grads = _backward(q, k, v, out, lse, dout, lo, hi, sinks, mask, scale, dlse)
        grads = [None if g is None or not need else g.to(t.dtype)
                 for g, t, need in zip(grads, (q, k, v, sinks), ctx.needs_input_grad)]
        return (*grads, None, None, None, None)


def math_attention(q, k, v, *, causal: bool, offset: int, bounds, sinks, mask, scale):
    """(out [..., Hq, Nq, Dv] in q.dtype, lse [..., Hq, Nq] in `compute_dtype(q.dtype)`) of
    q [..., Hq, Nq, D] against k [..., Hkv, Nkv, D], v [..., Hkv, Nkv, Dv] (Hq % Hkv == 0).

    bounds: the window's (lo, hi) (row i sees key j iff i + lo <= j <= i + hi; None entries
    unbounded) or None; `causal` intersects it with j <= i + offset. sinks: [Hq] logits or
    None. mask: a bool / float tensor broadcastable to [..., Hq, Nq, Nkv], or None (no
    gradient flows to it). out and lse are both differentiable in q, k, v and sinks.
    """
    lo, hi = bounds if bounds is not None else (None, None)
    if causal:
        hi = offset if hi is None else min(hi, offset)
    scale = _softmax_scale(q, scale)
    if mask is not None:
        if mask.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("attn_mask: a float mask that requires grad gets no "
                                      "gradient with window / sinks; detach it")
        mask = torch.broadcast_to(mask, (*q.shape[:-1], k.shape[-2]))  # a view, sliced per chunk
    return _MathAttention.apply(q, k, v, sinks, lo, hi, mask, scale)


def _lse(q, k, lo, hi, mask, scale):
    nkv = k.shape[-2]
    dtype = compute_dtype(q.dtype)
    lse = torch.full(q.shape[:-1], -_INF, dtype=dtype, device=q.device)
    with torch.no_grad():
        for i, j, ks, ke in _chunks(q, nkv, lo, hi):
            if ke > ks:
                s = _scores(q, k, (i, j), (ks, ke), lo, hi, mask, scale, dtype)
                lse[..., i:j] = torch.logsumexp(s, dim=-1)
    return lse


class _MathLse(torch.autograd.Function):
    """lse alone, differentiable in q and k (its gradient: the softmax, Note [The gradient of
    lse])."""

    @staticmethod
    def forward(ctx, q, k, lo, hi, mask, scale):
        lse = _lse(q, k, lo, hi, mask, scale)
        ctx.save_for_backward(q, k, mask, lse)
        ctx.args = (lo, hi, scale)
        return lse

    @staticmethod
    def backward(ctx, dlse):
        q, k, mask, lse = ctx.saved_tensors
        lo, hi, scale = ctx.args
        dq, dk = math_lse_grads(q, k, lse, dlse, lo=lo, hi=hi, mask=mask, scale=scale)
        needs = ctx.needs_input_grad
        return (dq.to(q.dtype) if needs[0] else None, dk.to(k.dtype) if needs[1] else None,
                None, None, None, None)


def math_lse(q, k, *, lo=None, hi=None, mask=None, scale=None):
    """lse [..., Hq, Nq] in `compute_dtype(q.dtype)` of the scaled scores row i sees (keys j
    with i + lo <= j <= i + hi; a mask broadcast to [..., Hq, Nq, Nkv]); -inf for rows that
    see no key. Differentiable in q and k (not in a float mask)."""
    scale = _softmax_scale(q, scale)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _MathLse.apply(q, k, lo, hi, mask, scale)
    return _lse(q, k, lo, hi, mask, scale)


def math_lse_grads(q, k, lse, dlse, *, lo=None, hi=None, mask=None, scale=None):
    """(dq, dk) in `compute_dtype(q.dtype)` of the rows' lse (over the keys they see, as
    `math_lse`) given its gradient dlse: dS = P dlse (Note [The gradient of lse]); dk summed
    over each KV head's query heads. No autograd."""
    with torch.no_grad():
        dq, dk, _, _ = _backward(q, k, None, None, lse, None, lo, hi, None, mask,
                                 _softmax_scale(q, scale), dlse)
    return dq, dk


def math_grads(q, k, v, out, lse, dout, *, lo=None, hi=None, scale=None, dlse=None):
    """(dq, dk, dv) in `compute_dtype(q.dtype)` of the attention of rows over the keys they see
    (i + lo <= j <= i + hi), given the rows' `out` and `lse` over a possibly larger key set
    (exp(S * scale - lse) is then this key set's share of their softmax); dk, dv summed over
    each KV head's query heads. dlse: the gradient of the rows' lse too (Note [The gradient of
    lse]), or None. No autograd."""
    with torch.no_grad():
        dq, dk, dv, _ = _backward(q, k, v, out, lse, dout, lo, hi, None, None,
                                  _softmax_scale(q, scale), dlse)
    return dq, dk, dv


def apply_sinks(out, lse, sinks):
    """(out, lse) of attention over some key set, with the sink term added to each row's
    denominator: lse' = log(exp(lse) + exp(sink_h)), out' = out * exp(lse - lse'). Exact for
    any (out, lse), e.g. the merge of split-KV parts. out [..., Hq, Nq, Dv], lse [..., Hq, Nq],
    sinks [Hq]; returns out in its dtype and lse in its own."""
    new = torch.logaddexp(lse, sinks.to(lse.dtype).unsqueeze(-1))
    shift = new.masked_fill(torch.isneginf(new), 0.0)  # -inf rows: weight exp(-inf) = 0
    weight = torch.exp(lse - shift).unsqueeze(-1)
    return (out.to(weight.dtype) * weight).to(out.dtype), new
