"""Variable-length attention on packed sequences: `varlen_attention`, FlashAttention's varlen
convention.

Layout: q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] hold B sequences back to
back; sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and
cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v (int32 or int64, [B + 1], starting at 0). lse
comes back [Hq, total_q], FlashAttention's varlen `softmax_lse` shape.

Today this is a loop on the host: cu_seqlens are read there (one device sync on CUDA) and each
sequence is one call of the routine behind `attention()`, routed like it (a kernel where one
serves that sequence, window and sinks included, else the native fallback, logged once per
reason; strict raises). On CUDA the sequences are issued longest first, round-robin on
`STREAMS` side streams forked from and joined to the caller's stream, so one kernel's last,
partial wave overlaps the next kernel's first (the kernels hold one CTA per SM; on one stream
each tail would idle the rest of the GPU); autograd runs each backward on its forward's stream.
A varlen kernel would do all sequences in one launch; none exists yet.
"""

from __future__ import annotations

import contextlib
import logging
import numbers

import torch

from .math_attention import compute_dtype
from .interface import _attention
from .validate import check_args, check_return_lse, check_window_sinks

__all__ = ["varlen_attention"]

CU_DTYPES = (torch.int32, torch.int64)
STREAMS = 4  # side streams the sequences are spread over on CUDA
_SIDE: dict = {}  # device index -> its side streams (created once)


def _side_streams(device: torch.device, n: int) -> list:
    """`n` side streams of `device`, forked from its current stream (they wait for it)."""
    if device.index not in _SIDE:
        _SIDE[device.index] = [torch.cuda.Stream(device) for _ in range(STREAMS)]
    streams = _SIDE[device.index][:n]
    main = torch.cuda.current_stream(device)
    for s in streams:
        s.wait_stream(main)
    return streams


def _check_packed(q, k, v):
    """The first shape error of packed q, k, v (or None); check_args checks the rest."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            return ValueError(f"{name} must be packed [total_tokens, heads, head_dim] (3-D), got "
                              f"shape {tuple(t.shape)}")
    if k.shape[:2] != v.shape[:2]:
        return ValueError(f"k and v must agree on total_k and heads (dims 0, 1), got "
                          f"{tuple(k.shape)} and {tuple(v.shape)}")
    return None


def _nothing():
    return contextlib.nullcontext()


def sequence_bounds(name: str, cu, total: int, max_name: str, max_seqlen, device):
    """[(start, end)] per sequence from a cumulative-lengths tensor, or raise naming it."""
    if not isinstance(cu, torch.Tensor) or cu.dtype not in CU_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor [B + 1], got "
                        f"{getattr(cu, 'dtype', type(cu).__name__)}")
    if cu.dim() != 1 or cu.numel() == 0:
        raise ValueError(f"{name} must be 1-D [B + 1] (0 first, then each sequence's end), got "
                         f"shape {tuple(cu.shape)}")
    if cu.device.type != "cpu" and cu.device != device:
        raise ValueError(f"{name} must be on the CPU or on q's device ({device}), got {cu.device}")
    ends = cu.tolist()
    if ends[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {ends[0]}")
    for b in range(1, len(ends)):
        if ends[b] < ends[b - 1]:
            raise ValueError(f"{name} must be non-decreasing: {name}[{b}] = {ends[b]} < "
                             f"{name}[{b - 1}] = {ends[b - 1]}")
    if ends[-1] != total:
        raise ValueError(f"{name}[-1] = {ends[-1]} must equal the packed length {total}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral):
        raise TypeError(f"{max_name} must be a Python int, got {type(max_seqlen).__name__}")
    longest = max((b - a for a, b in zip(ends, ends[1:])), default=0)
    if max_seqlen < longest:
        raise ValueError(f"{max_name}={max_seqlen} is below the longest sequence of {name} "
                         f"({longest})")
    return list(zip(ends, ends[1:]))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     is_causal=False, scale=None, enable_gqa=False, window=None, sinks=None,
                     return_lse=False, strict=None):
    """Attention of each packed sequence against its own keys; returns out [total_q, Hq, Dv] in
    q's dtype, or with `return_lse=True` (out, lse [Hq, total_q]).

    q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv]; cu_seqlens_q / cu_seqlens_k
    int32 or int64 [B + 1] (cumulative lengths from 0, on the CPU or q's device);
    max_seqlen_q / max_seqlen_k Python ints >= the longest sequence. Empty sequences are
    allowed (no keys: out rows 0, lse -inf, or the sink with sinks).

    The arguments mean what they mean in `attention()`, per sequence: `is_causal` is
    bottom-right (query i of a sequence with nq queries and nkv keys sees key j iff
    j <= i + nkv - nq), `window=(left, right)` is in the same frame, `sinks` [Hq] joins every
    row's denominator, GQA needs `enable_gqa=True`; lse is float32 (float64 for float64
    inputs) and carries no gradient. Differentiable in q, k, v and sinks. Each sequence runs
    as one `attention()`-routed call (a host loop; see the module docstring).
    """
    err = (_check_packed(q, k, v)
           or check_args(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), None, 0.0,
                         is_causal, scale, enable_gqa)
           or check_return_lse(return_lse, 0.0)
           or check_window_sinks(window, sinks, q.transpose(0, 1)))
    if err is not None:
        raise err
    seq_q = sequence_bounds("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q",
                            max_seqlen_q, q.device)
    seq_k = sequence_bounds("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k",
                            max_seqlen_k, q.device)
    if len(seq_q) != len(seq_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {len(seq_q)} and {len(seq_k)}")
    strict = None if strict is None else bool(strict)
    outs, lses = [None] * len(seq_q), [None] * len(seq_q)
    order = sorted(range(len(seq_q)), key=lambda i: -(seq_q[i][1] - seq_q[i][0])
                   * (seq_k[i][1] - seq_k[i][0]))  # the most work first
    streams = (_side_streams(q.device, min(STREAMS, len(order)))
               if q.device.type == "cuda" and len(order) > 1 else [])
    for n, i in enumerate(order):
        (qa, qb), (ka, kb) = seq_q[i], seq_k[i]
        qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, n, D] views
                      for t, a, b in ((q, qa, qb), (k, ka, kb), (v, ka, kb)))
        with torch.cuda.stream(streams[n % len(streams)]) if streams else _nothing():
            res = _attention(qs, ks, vs, None, 0.0, is_causal, scale, upper_left=False,
                             strict=strict, level=logging.WARNING, return_lse=return_lse,
                             window=window, sinks=sinks)
        out, lse = res if return_lse else (res, None)
        outs[i], lses[i] = out[0].transpose(0, 1), lse
    if streams:  # join: the caller's stream waits for every side stream, and its allocator
        main = torch.cuda.current_stream(q.device)  # knows the outputs are used there
        for s in streams:
            main.wait_stream(s)
        for t in (*outs, *lses):
            if t is not None:
                t.record_stream(main)
    hq, dv = q.shape[1], v.shape[-1]
    out = torch.cat(outs) if outs else q.new_zeros(0, hq, dv)
    if not return_lse:
        return out
    dtype = compute_dtype(q.dtype)
    lse = (torch.cat([x[0].to(dtype) for x in lses], dim=-1) if lses
           else torch.zeros(hq, 0, dtype=dtype, device=q.device))
    return out, lse
