"""A reference for the window / sinks / varlen / KV-cache tests, written out independently of
ffpa_cute: the visibility matrix built entry by entry from the definition, then a softmax whose
denominator holds the sink term, in float64 by default (truth) or in the inputs' dtype (the
"what torch gets in this dtype" baseline of the error bound).

Definitions (README, "Framework features"): query row i sits at key position p = i + frame
(frame = Nkv - Nq: bottom-right). With window = (left, right) it sees key j iff
p - left <= j <= p + right (a None side is unbounded); causal also needs j <= p. With sinks,
row i of head h has denominator sum_j exp(s_ij) + exp(sinks[h]) over the scaled scores s_ij;
lse is the log of that denominator; a row with no key gives out 0.
"""

from __future__ import annotations

import math

import torch

INF = float("inf")


def visible(nq, nkv, *, causal=False, frame=None, window=None):
    """[nq, nkv] bool: may query row i see key j (entry by entry, from the definition)."""
    frame = nkv - nq if frame is None else frame
    left, right = window if window is not None else (None, None)
    rows = []
    for i in range(nq):
        p = i + frame
        rows.append([(not causal or j <= p) and (left is None or j >= p - left)
                     and (right is None or j <= p + right) for j in range(nkv)])
    return torch.tensor(rows, dtype=torch.bool).reshape(nq, nkv)


def ref_attention(q, k, v, *, causal=False, frame=None, window=None, sinks=None, scale=None,
                  mask=None, dtype=torch.float64):
    """(out, lse) in `dtype` for q [..., Hq, Nq, D], k [..., Hkv, Nkv, D], v [..., Hkv, Nkv, Dv]
    (K/V heads repeated for GQA). Differentiable by autograd everywhere, rows without keys
    included (their shift and denominator are made safe, so no NaN reaches a gradient)."""
    nq, nkv, g = q.shape[-2], k.shape[-2], q.shape[-3] // k.shape[-3]
    q, k, v = (t.to(dtype) for t in (q, k, v))
    k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    vis = visible(nq, nkv, causal=causal, frame=frame, window=window).to(s.device)
    if mask is not None and mask.dtype == torch.bool:
        vis = vis & mask
    elif mask is not None:
        s = s + mask.to(dtype)
    s = s.masked_fill(~vis, -INF)
    sink = (torch.full((q.shape[-3],), -INF, dtype=dtype, device=q.device) if sinks is None
            else sinks.to(dtype)).unsqueeze(-1)  # [Hq, 1]
    m = sink.expand(s.shape[:-1]) if nkv == 0 else torch.maximum(s.amax(-1), sink)
    m = m.detach().masked_fill(torch.isneginf(m.detach()), 0.0)  # a shift: any value is exact
    e = torch.exp(s - m.unsqueeze(-1))
    den = e.sum(-1) + torch.exp(sink - m)
    empty = den == 0
    safe = den.masked_fill(empty, 1.0)
    out = torch.matmul(e / safe.unsqueeze(-1), v)
    lse = (m + torch.log(safe)).masked_fill(empty, -INF)
    return out, lse


def rel_err(a, ref) -> float:
    """||a - ref|| / ||ref|| in float64; equal infinities (lse -inf rows) count as equal, any
    other non-finite entry gives inf."""
    a, ref = a.detach().double(), ref.detach().double()
    assert a.shape == ref.shape, (tuple(a.shape), tuple(ref.shape))
    same = torch.isinf(a) & (a == ref)
    a, ref = a.masked_fill(same, 0.0), ref.masked_fill(same, 0.0)
    if not (torch.isfinite(a).all() and torch.isfinite(ref).all()):
        return INF
    num, den = (a - ref).norm().item(), ref.norm().item()
    return 0.0 if num == 0 else num / den if den else INF


def bound(same_dtype_err: float) -> float:
    """The acceptance bound: 2x torch's same-dtype error + 1e-3 (the issue's)."""
    return 2 * same_dtype_err + 1e-3
