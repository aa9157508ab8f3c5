"""torch's jagged NestedTensor input to `attention`: q, k, v of shape [B, H, j, D], SDPA's NJT
layout (`nt.transpose(1, 2)` of a `torch.nested.nested_tensor(..., layout=torch.jagged)` of
[n_b, H, D] sequences).

A NestedTensor's values are packed sequences with cumulative lengths (its offsets), which is
`varlen_attention`'s input: without dropout, and where every tensor's sequences fill its values
from row 0 with no holes (no `lengths()`) and k and v share their offsets, the call is
`varlen_attention` on the values (one launch of the 16-bit kernels where they serve it, the
per-sequence route elsewhere). Otherwise (dropout, holes, k and v of different lengths, which
then raise there) each sequence runs as one dense `attention` call on a [1, H, n_b, D] view.
Both give `attention`'s semantics per sequence (causal bottom-right per sequence, GQA, window,
sinks) and pack the outputs into a NestedTensor on q's own offsets, so out has q's ragged
dimension (`out + q` works when Dv == D); with `return_lse`, lse is [B, Hq, j] the same way.
Differentiable through the values and the packing. No dense attn_mask and no FP8 inputs.
"""

from __future__ import annotations

import torch

__all__ = ["is_nested", "per_sequence"]

# varlen routes each sequence through the interface, which calls this module, so this module
# may not import varlen: varlen.py puts its `varlen_attention` here
PACKED: dict = {}


def is_nested(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_nested


def _check(q, k, v, attn_mask, fp8_args):
    for name, t in (("q", q), ("k", k), ("v", v)):
        jagged = is_nested(t) and t.layout == torch.jagged and t.dim() == 4
        if not (jagged and all(isinstance(t.shape[i], int) for i in (0, 1, 3))
                and not isinstance(t.shape[2], int)):
            got = (f"shape {tuple(t.shape)}, layout {t.layout}" if isinstance(t, torch.Tensor)
                   else type(t).__name__)
            raise TypeError("q, k, v must all be jagged NestedTensors [B, H, j, D] (layout="
                            "torch.jagged, ragged dim 2: nt.transpose(1, 2) of [B, j, H, D]) "
                            f"when one is; {name} has {got}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(f"q, k, v must hold the same number of sequences, got {q.shape[0]}, "
                         f"{k.shape[0]}, {v.shape[0]}")
    if attn_mask is not None:
        raise ValueError("attn_mask is not supported with NestedTensor inputs; pass is_causal "
                         "and window, or dense tensors")
    if any(a is not None for a in fp8_args):
        raise TypeError("q_descale, k_descale, v_descale and out_dtype (FP8) are not supported "
                        "with NestedTensor inputs")


def per_sequence(attention, q, k, v, attn_mask, fp8_args, return_lse, kw):
    """`attention(q_b, k_b, v_b, return_lse=return_lse, **kw)` for each sequence b of jagged
    q, k, v (as one `varlen_attention` call where the module docstring says); returns out
    (and lse) as NestedTensors on q's offsets."""
    _check(q, k, v, attn_mask, fp8_args)

    def pack(values):  # [total, H, ...] values on q's offsets, as [B, H, j, ...]
        return torch.nested.nested_tensor_from_jagged(values, q.offsets()).transpose(1, 2)

    bounds = _varlen_bounds(q, k, v, kw["dropout_p"])
    if bounds is not None:
        args = {name: val for name, val in kw.items() if name != "dropout_p"}
        packed = (t.values().transpose(0, 1) for t in (q, k, v))  # [total, H, D] views
        res = PACKED["varlen_attention"](*packed, q.offsets(), k.offsets(), *bounds,
                                         return_lse=return_lse, **args)
        out, lse = res if return_lse else (res, None)   # lse [Hq, total_q]
        return (pack(out), pack(lse.transpose(0, 1))) if return_lse else pack(out)
    outs, lses = [], []
    for qs, ks, vs in zip(q.unbind(), k.unbind(), v.unbind()):  # [H, n_b, D] each
        res = attention(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0),
                        return_lse=return_lse, **kw)
        out, lse = res if return_lse else (res, None)
        outs.append(out[0].transpose(0, 1))  # [n_b, Hq, Dv]
        lses.append(None if lse is None else lse[0].transpose(0, 1))
    return (pack(torch.cat(outs)), pack(torch.cat(lses))) if return_lse else pack(torch.cat(outs))


def _varlen_bounds(q, k, v, dropout_p):
    """(max_seqlen_q, max_seqlen_k) when jagged q, k, v are `varlen_attention`'s packed input
    (module docstring), else None. Reads the offsets on the host (one device sync on CUDA, as
    unbinding them would)."""
    if dropout_p != 0 or any(t.lengths() is not None for t in (q, k, v)):
        return None
    offsets = [t.offsets() for t in (q, k, v)]
    if len({o.device for o in offsets}) != 1:
        return None
    cq, ck, cv = torch.stack(offsets).tolist()
    if ck != cv or any(c[0] != 0 or c[-1] != t.values().shape[1]
                       for c, t in ((cq, q), (ck, k))):
        return None
    return tuple(max((b - a for a, b in zip(c, c[1:])), default=0) for c in (cq, ck))
