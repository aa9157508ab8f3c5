"""Error column: relative Frobenius error against an explicit-matmul reference on upcast inputs.

The reference runs in float32 (float64 for float32 inputs) with TF32 off, one head at a time and
in chunks of query rows, so N = 64K with H = 1 or N = 16K with H = 32 never materialises more
than ~`chunk_bytes` of scores. It covers a subset of heads (evenly spaced, first and last
included); for the backward it takes whole KV-head groups, since dK/dV of a KV head sum over
every query head of its group.

Causal masking is bottom-right aligned by default (query i sees key j iff j <= i + Nkv - Nq);
rows that see no key output 0 (and get zero gradients).
"""

from __future__ import annotations

import contextlib
import math

import torch


@contextlib.contextmanager
def no_tf32():
    """Full-precision float32 matmuls inside (restores the previous setting)."""
    old = torch.backends.cuda.matmul.allow_tf32
    old_cudnn = torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
        torch.backends.cudnn.allow_tf32 = old_cudnn


def ref_dtype_for(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def spaced(n: int, k: int) -> list[int]:
    """k indices in [0, n) evenly spaced, first and last included (all when k >= n)."""
    if k >= n:
        return list(range(n))
    if k <= 1:
        return [0]
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def fwd_heads(hq: int, k: int) -> list[int]:
    """Query heads checked in the forward."""
    return spaced(hq, k)


def bwd_heads(hq: int, hkv: int, k: int) -> tuple[list[int], list[int]]:
    """(query heads, KV heads) checked in the backward: whole groups of about k query heads."""
    group = hq // hkv
    kv = spaced(hkv, max(1, k // group))
    return [g * group + j for g in kv for j in range(group)], kv


def _row_chunk(nkv: int, elem: int, chunk_bytes: int, live: int) -> int:
    return max(1, chunk_bytes // max(1, nkv * elem * live))


def _scores(qc, kh, scale, r0, nkv, nq, causal, offset, keep=None):
    """Scaled scores of query rows r0.. (qc) against every key, masked: causal (bottom-right
    `offset`) and / or `keep`, a bool [Nq or 1, Nkv] of the pairs a dense mask keeps."""
    s = (qc @ kh.transpose(0, 1)) * scale
    if keep is not None:
        s = s.masked_fill(~(keep if keep.shape[0] == 1 else keep[r0:r0 + qc.shape[0]]),
                          float("-inf"))
    if causal:
        rows = torch.arange(r0, r0 + qc.shape[0], device=qc.device).unsqueeze(1)
        cols = torch.arange(nkv, device=qc.device).unsqueeze(0)
        s = s.masked_fill(cols > rows + offset, float("-inf"))
    return s


def _probs(s):
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    return p / torch.where(denom == 0, torch.ones_like(denom), denom)


def _setup(q, k, scale, causal_offset, ref_dtype):
    """Sizes, reference dtype, scale, causal offset (bottom-right default) and GQA group."""
    b, hq, nq, d = q.shape
    hkv, nkv = k.shape[1], k.shape[2]
    rd = ref_dtype or ref_dtype_for(q.dtype)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    offset = nkv - nq if causal_offset is None else causal_offset
    return b, hq, nq, d, hkv, nkv, rd, scale, offset, hq // hkv


def _keep(mask, bi):
    """Batch element bi's [Nq or 1, Nkv] of a bool keep mask [B or 1, 1, Nq or 1, Nkv]."""
    return None if mask is None else mask[bi if mask.shape[0] > 1 else 0, 0].to(torch.bool)


def ref_forward(q, k, v, *, causal: bool, heads: list[int] | None = None, scale=None,
                causal_offset: int | None = None, ref_dtype=None,
                chunk_bytes: int = 1 << 30, mask=None) -> torch.Tensor:
    """Output for query heads `heads` as [B, len(heads), Nq, Dv] in `ref_dtype`; `mask`: the
    pairs a dense mask keeps, bool [B or 1, 1, Nq or 1, Nkv], on q's device."""
    b, hq, nq, d, hkv, nkv, rd, scale, offset, group = _setup(q, k, scale, causal_offset, ref_dtype)
    heads = list(range(hq)) if heads is None else heads
    out = torch.empty(b, len(heads), nq, v.shape[-1], dtype=rd, device=q.device)
    step = _row_chunk(nkv, torch.finfo(rd).bits // 8, chunk_bytes, 2)
    with no_tf32():
        for bi in range(b):
            for oi, h in enumerate(heads):
                kh = k[bi, h // group].to(rd)
                vh = v[bi, h // group].to(rd)
                for r0 in range(0, nq, step):
                    qc = q[bi, h, r0:r0 + step].to(rd)
                    p = _probs(_scores(qc, kh, scale, r0, nkv, nq, causal, offset,
                                       _keep(mask, bi)))
                    out[bi, oi, r0:r0 + step] = p @ vh
    return out


def ref_backward(q, k, v, dout, *, causal: bool, kv_heads: list[int] | None = None, scale=None,
                 causal_offset: int | None = None, ref_dtype=None, chunk_bytes: int = 1 << 30,
                 mask=None):
    """(dq, dk, dv) for KV heads `kv_heads` and every query head of their groups (`mask` as
    in `ref_forward`).

    dq is [B, len(kv_heads) * group, Nq, D] (query heads in group order), dk/dv are
    [B, len(kv_heads), Nkv, D].
    """
    b, hq, nq, d, hkv, nkv, rd, scale, offset, group = _setup(q, k, scale, causal_offset, ref_dtype)
    kv_heads = list(range(hkv)) if kv_heads is None else kv_heads
    dq = torch.empty(b, len(kv_heads) * group, nq, d, dtype=rd, device=q.device)
    dk = torch.zeros(b, len(kv_heads), nkv, d, dtype=rd, device=q.device)
    dv = torch.zeros(b, len(kv_heads), nkv, v.shape[-1], dtype=rd, device=q.device)
    step = _row_chunk(nkv, torch.finfo(rd).bits // 8, chunk_bytes, 4)
    with no_tf32():
        for bi in range(b):
            for gi, g in enumerate(kv_heads):
                kh, vh = k[bi, g].to(rd), v[bi, g].to(rd)
                for j in range(group):
                    h = g * group + j
                    for r0 in range(0, nq, step):
                        qc = q[bi, h, r0:r0 + step].to(rd)
                        doc = dout[bi, h, r0:r0 + step].to(rd)
                        p = _probs(_scores(qc, kh, scale, r0, nkv, nq, causal, offset,
                                           _keep(mask, bi)))
                        o = p @ vh
                        dp = doc @ vh.transpose(0, 1)
                        delta = (doc * o).sum(dim=-1, keepdim=True)
                        ds = p * (dp - delta) * scale
                        dq[bi, gi * group + j, r0:r0 + step] = ds @ kh
                        dk[bi, gi] += ds.transpose(0, 1) @ qc
                        dv[bi, gi] += p.transpose(0, 1) @ doc
    return dq, dk, dv


def rel_fro(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_F / ||ref||_F in the reference dtype (absolute when ref is all zeros)."""
    x = x.to(ref.dtype)
    num = torch.linalg.vector_norm(x - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    if not math.isfinite(num):
        return float("nan")
    return num / den if den > 0 else num


def fwd_error(out_bhnd: torch.Tensor, ref: torch.Tensor, heads: list[int]) -> float:
    return rel_fro(out_bhnd[:, heads], ref)


def bwd_error(grads_bhnd, ref_grads, q_heads: list[int], kv_heads: list[int]) -> float:
    """max of the dq, dk, dv relative errors."""
    dq, dk, dv = grads_bhnd
    rq, rk, rv = ref_grads
    return max(rel_fro(dq[:, q_heads], rq), rel_fro(dk[:, kv_heads], rk),
               rel_fro(dv[:, kv_heads], rv))
