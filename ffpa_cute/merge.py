"""Exact combination of attention computed over disjoint key sets (split-KV, ring attention).

Attention of a query row over keys K = K_1 u ... u K_n (disjoint) follows from the parts:
with lse_i the log-sum-exp of the row's scaled scores over K_i and out_i its softmax-weighted
values over K_i,

    lse = log(sum_i exp(lse_i)),    out = sum_i exp(lse_i - lse) * out_i.

A part that sees none of the row's keys has lse_i = -inf and weight 0; a row with no key in any
part gets out = 0 and lse = -inf, never NaN. The arithmetic runs in float32 (float64 when an
input is float64). `merge_attention` is plain torch ops, so autograd differentiates it, also
through the lses (their gradient is finite on every row, -inf rows included);
`merge_into` is the in-place two-part form the ring loop uses (no autograd).
"""

from __future__ import annotations

import torch

__all__ = ["merge_attention", "merge_into"]


def _check(outs, lses):
    if not isinstance(outs, (list, tuple)) or not isinstance(lses, (list, tuple)):
        raise TypeError(f"outs and lses must be lists or tuples of tensors, got "
                        f"{type(outs).__name__} and {type(lses).__name__}")
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"outs and lses must hold the same number (>= 1) of parts, got "
                         f"{len(outs)} and {len(lses)}")
    for i, (o, s) in enumerate(zip(outs, lses)):
        for name, t in ((f"outs[{i}]", o), (f"lses[{i}]", s)):
            if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
                raise TypeError(f"{name} must be a floating torch.Tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
        if o.dim() < 1 or o.shape != outs[0].shape:
            raise ValueError(f"outs[{i}] has shape {tuple(o.shape)}, outs[0] "
                             f"{tuple(outs[0].shape)}: every part must have one shape "
                             "[..., Nq, Dv]")
        if s.shape != o.shape[:-1]:
            raise ValueError(f"lses[{i}] has shape {tuple(s.shape)}, expected outs' shape "
                             f"without the last dim {tuple(o.shape[:-1])}")
        if o.device != outs[0].device or s.device != outs[0].device:
            raise ValueError(f"outs[{i}] / lses[{i}] are on {o.device} / {s.device}, outs[0] "
                             f"on {outs[0].device}: every part must be on one device")


def merge_attention(outs, lses):
    """(out, lse) of attention over the union of the parts' disjoint key sets.

    outs: parts' outputs, each [..., Nq, Dv] (e.g. [B, H, Nq, Dv]); lses: their log-sum-exps,
    each [..., Nq] (natural log, as `attention(..., return_lse=True)` returns them). Returns out
    in outs[0]'s dtype and lse in float32 (float64 if any input is float64); parts with
    lse = -inf contribute nothing, and rows that are -inf in every part give out 0, lse -inf.
    Differentiable by autograd in outs and lses.
    """
    _check(outs, lses)
    dtype = torch.float32
    for t in (*outs, *lses):
        dtype = torch.promote_types(dtype, t.dtype)
    s = torch.stack([x.to(dtype) for x in lses])  # [parts, ..., Nq]
    # log-sum-exp with a finite shift: -inf rows keep a shift of 0, so exp() sees -inf - 0 and
    # neither the value nor its gradient meets -inf - -inf. The shift is a constant (any shift
    # gives the same value), hence detached.
    m = s.detach().amax(0)
    m = m.masked_fill(torch.isneginf(m), 0.0)
    total = torch.exp(s - m).sum(0)
    empty = total == 0
    lse = torch.where(empty, float("-inf"), m + torch.log(total.masked_fill(empty, 1.0)))
    weights = torch.exp(s - lse.masked_fill(empty, 0.0))  # 0 for -inf parts and rows
    out = sum(w.unsqueeze(-1) * o.to(dtype) for w, o in zip(weights, outs))
    return out.to(outs[0].dtype), lse


@torch.no_grad()
def merge_into(out, lse, part_out, part_lse) -> None:
    """out, lse <- merge_attention([out, part_out], [lse, part_lse]), in place.

    `out` / `lse` are the running accumulators (float32 or float64, possibly views of rows of
    a larger buffer); the part may be in any floating dtype. Two passes over `out` (a scale,
    then a fused multiply-add reading the part in its own dtype), no temporary of its size:
    this runs once per ring step, where it is memory-bound.
    """
    part_lse = part_lse.to(lse.dtype)
    new = torch.logaddexp(lse, part_lse)  # -inf where both are -inf
    shift = new.masked_fill(torch.isneginf(new), 0.0)
    out.mul_(torch.exp(lse - shift).unsqueeze(-1))
    out.addcmul_(part_out, torch.exp(part_lse - shift).unsqueeze(-1))
    lse.copy_(new)
