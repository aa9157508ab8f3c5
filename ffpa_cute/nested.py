"""torch's jagged NestedTensor input to `attention`: q, k, v of shape [B, H, j, D], SDPA's NJT
layout (`nt.transpose(1, 2)` of a `torch.nested.nested_tensor(..., layout=torch.jagged)` of
[n_b, H, D] sequences).

Each sequence runs as one dense `attention` call on a [1, H, n_b, D] view (its routing, its
checks and errors), so everything `attention` takes per call applies per sequence (causal
bottom-right per sequence, GQA, window, sinks, dropout). The outputs are packed into a
NestedTensor on q's own offsets, so out has q's ragged dimension (`out + q` works when Dv ==
D); with `return_lse`, lse is [B, Hq, j] the same way. Differentiable through the unbinding
and the packing. A host loop over sequences (as `varlen_attention`); no dense attn_mask and
no FP8 inputs.
"""

from __future__ import annotations

import torch

__all__ = ["is_nested", "per_sequence"]


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
    q, k, v; returns out (and lse) as NestedTensors on q's offsets."""
    _check(q, k, v, attn_mask, fp8_args)
    outs, lses = [], []
    for qs, ks, vs in zip(q.unbind(), k.unbind(), v.unbind()):  # [H, n_b, D] each
        res = attention(qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0),
                        return_lse=return_lse, **kw)
        out, lse = res if return_lse else (res, None)
        outs.append(out[0].transpose(0, 1))  # [n_b, Hq, Dv]
        lses.append(None if lse is None else lse[0].transpose(0, 1))

    def pack(parts):  # [total, H, ...] values on q's offsets, as [B, H, j, ...]
        packed = torch.nested.nested_tensor_from_jagged(torch.cat(parts), q.offsets())
        return packed.transpose(1, 2)

    return (pack(outs), pack(lses)) if return_lse else pack(outs)
