"""Reference attention for tests and benchmarks: explicit matmuls, no fused kernels.

Why explicit matmuls and not SDPA: the reference must never be another kernel under test, and
SDPA's fused backends differ by device and version. `attention_ref` upcasts (float64 by default,
so it is truth for bf16/fp16 outputs on any device; pass `upcast=torch.float32` where fp64 is
slow); `attention_same_dtype` runs the same math in the inputs' dtype, which is roughly what a
plain PyTorch implementation gets. Tests bound a kernel's error by twice the latter's error
(FlashAttention's ratio test), so the bound scales with what the dtype can deliver.

Semantics match `ffpa_cute.attention`: [..., H, N, D] layout, GQA by repeating K/V heads,
`causal_offset` (query i sees key j iff j <= i + offset) defaulting to bottom-right alignment
(Nkv - Nq), and rows that see no key give out = 0 and lse = -inf.
"""

from __future__ import annotations

import math

import torch

__all__ = ["attention_grads", "attention_ref", "attention_same_dtype", "rel_err"]


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    hq, hkv = q.shape[-3], k.shape[-3]
    if hq == hkv:
        return k, v
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    rep = hq // hkv
    return k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)


def _attention_math(q, k, v, causal, causal_offset, scale, compute_dtype, window_lo=None,
                    sinks=None):
    """Softmax(q k^T * scale) v in `compute_dtype`; returns (out, lse) in that dtype.
    window_lo: row i sees key j only if j >= i + window_lo; sinks: [Hq] logits joining each
    row's denominator and lse (Note [Sinks] in common/softmax.py)."""
    nq, nkv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    k, v = _expand_kv(q, k, v)
    q, k, v = (t.to(compute_dtype) for t in (q, k, v))
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    rows = torch.arange(nq, device=q.device).unsqueeze(-1)
    cols = torch.arange(nkv, device=q.device)
    if causal:
        offset = nkv - nq if causal_offset is None else int(causal_offset)
        scores = scores.masked_fill(cols > rows + offset, float("-inf"))
    if window_lo is not None:
        scores = scores.masked_fill(cols < rows + int(window_lo), float("-inf"))
    # logsumexp is computed in at least fp32 even for the same-dtype path (torch's softmax does the
    # same internally); the probabilities are then rounded to compute_dtype before the PV matmul.
    lse = torch.logsumexp(scores.float() if scores.element_size() < 4 else scores, dim=-1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(lse.dtype).unsqueeze(-1).expand_as(lse))
    empty = torch.isneginf(lse)
    probs = torch.exp(scores - lse.to(scores.dtype).unsqueeze(-1))
    probs = probs.masked_fill(empty.unsqueeze(-1), 0.0)
    out = torch.matmul(probs.to(compute_dtype), v)
    return out, lse.to(compute_dtype)


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                  causal_offset: int | None = None, scale: float | None = None,
                  upcast: torch.dtype = torch.float64, *, window_lo: int | None = None,
                  sinks: torch.Tensor | None = None):
    """Ground-truth attention on `upcast` copies of the inputs.

    q [..., Hq, Nq, D], k [..., Hkv, Nkv, D], v [..., Hkv, Nkv, Dv] with Hq % Hkv == 0.
    Returns (out [..., Hq, Nq, Dv], lse [..., Hq, Nq]) both in `upcast` (kept high precision so
    the caller chooses when to round); lse is the natural-log logsumexp of the scaled scores.
    window_lo: a sliding window's left edge (row i sees key j only if j >= i + window_lo);
    sinks: [Hq] logits in each row's denominator (rows with no key: out 0, lse the sink).
    """
    return _attention_math(q, k, v, causal, causal_offset, scale, upcast, window_lo, sinks)


def attention_same_dtype(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                         causal_offset: int | None = None, scale: float | None = None, *,
                         window_lo: int | None = None, sinks: torch.Tensor | None = None):
    """The same math as `attention_ref` carried out in the inputs' dtype ("what torch gets").

    Used as the error baseline: a kernel is accepted when its error against `attention_ref` is at
    most ~2x this function's error, plus a small noise floor.
    """
    return _attention_math(q, k, v, causal, causal_offset, scale, q.dtype, window_lo, sinks)


def attention_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                    causal: bool = False, causal_offset: int | None = None,
                    scale: float | None = None, dtype: torch.dtype = torch.float64, *,
                    window_lo: int | None = None, sinks: torch.Tensor | None = None,
                    dlse: torch.Tensor | None = None):
    """(dq, dk, dv) of `attention_ref`'s output for `dout` (and its lse for `dlse`, if given),
    written out (no autograd) in `dtype`: dS = P (dP - Delta + dlse), Delta = rowsum(dO * O);
    dk, dv summed over each KV head's query heads. window_lo / sinks as in `attention_ref` (the
    sinks' own gradient is not computed).

    Written out because autograd through a softmax row that sees no key gives NaN (our kernels,
    like the forward, treat such rows as P = 0); float64 is truth, the inputs' dtype gives the
    "what torch gets" baseline, as for the forward.
    """
    g = q.shape[-3] // k.shape[-3]
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    k, v = _expand_kv(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    nq, nkv = q.shape[-2], k.shape[-2]
    rows = torch.arange(nq, device=q.device).unsqueeze(-1)
    cols = torch.arange(nkv, device=q.device)
    if causal:
        offset = nkv - nq if causal_offset is None else int(causal_offset)
        s = s.masked_fill(cols > rows + offset, float("-inf"))
    if window_lo is not None:
        s = s.masked_fill(cols < rows + int(window_lo), float("-inf"))
    # softmax in at least fp32 (as torch's), rounded to dtype; rows that see no key: P = 0
    sf = s if s.element_size() >= 4 else s.float()
    if sinks is None:
        p = torch.softmax(sf, dim=-1).nan_to_num(0.0)
    else:  # P = exp(s - lse), the lse with the sink in its denominator
        lse = torch.logaddexp(torch.logsumexp(sf, dim=-1),
                              sinks.to(sf.dtype).unsqueeze(-1).expand(sf.shape[:-1]))
        p = torch.exp(sf - lse.unsqueeze(-1))
    p = p.to(dtype)
    dv = torch.matmul(p.transpose(-1, -2), dout)
    dp = torch.matmul(dout, v.transpose(-1, -2))
    delta = (dout * torch.matmul(p, v)).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(dtype).unsqueeze(-1)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, k) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale
    return dq, dk.unflatten(-3, (-1, g)).sum(-3), dv.unflatten(-3, (-1, g)).sum(-3)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||a - ref|| / ||ref|| in float64.

    Entries where both tensors hold the same infinity (e.g. lse = -inf on empty rows) count as
    equal; any other non-finite entry makes the error infinite so it can never pass a bound.
    """
    a64, r64 = a.detach().to(torch.float64), ref.detach().to(torch.float64)
    if a64.shape != r64.shape:
        raise ValueError(f"shape mismatch: {tuple(a64.shape)} vs reference {tuple(r64.shape)}")
    same_inf = torch.isinf(a64) & (a64 == r64)
    a64 = a64.masked_fill(same_inf, 0.0)
    r64 = r64.masked_fill(same_inf, 0.0)
    if not (torch.isfinite(a64).all() and torch.isfinite(r64).all()):
        return math.inf
    denom = r64.norm().item()
    num = (a64 - r64).norm().item()
    if denom == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / denom

