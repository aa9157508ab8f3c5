"""torch's native SDPA with ffpa_cute's semantics: the fallback path and the interim backward,
plus the torch math that gives the fallback a log-sum-exp and blocks their gradients.

Used for everything no kernel covers, and for the backward of the kernel path where no backward
kernel serves it. We bind `torch._C._nn.scaled_dot_product_attention` once and never call
`F.scaled_dot_product_attention`, which may be our own patch (recursion) or someone else's.

SDPA returns no log-sum-exp, so `native_lse` computes it with torch math over query chunks
(bounded memory, differentiable: `math_attention.math_lse`); `block_grads` is the
FlashAttention backward of one (query, key) block given the *global* out and lse of its rows,
which is what ring attention needs where no backward kernel serves a block.
"""

import torch
import torch.nn.functional as F

from .math_attention import math_grads, math_lse

# Bound once at import: the C entry point is what the public symbol wraps, and a monkey-patch of
# `F.scaled_dot_product_attention` (ours or anyone's) cannot redirect it.
native_sdpa = torch._C._nn.scaled_dot_product_attention


def gqa_in_native(q, v, mask) -> bool:
    """True when native SDPA can take grouped K/V itself without dropping to its MATH backend.

    Only the flash backend handles `enable_gqa` natively, and it needs CUDA half types, no
    tensor mask and head dims <= 256. Anything else gets K/V expanded first (costs memory, but
    MATH on D > 256 costs far more).
    """
    return (q.is_cuda and mask is None and q.dtype in (torch.float16, torch.bfloat16)
            and max(q.shape[-1], v.shape[-1]) <= 256)


def causal_split(nq, nkv, causal, offset):
    """(rows without keys at the top, use SDPA's is_causal, needs an explicit bool mask).

    Rows i with i + offset < 0 see no key (all rows when Nkv == 0). The rest is upper-left
    causal when the remaining offset is 0, unmasked when every row sees every key, and needs
    an explicit tril mask otherwise.
    """
    skip = nq if nkv == 0 else (min(max(-offset, 0), nq) if causal else 0)
    # Branches, not boolean expressions: with dynamic shapes under torch.compile the comparisons
    # are SymBools, and only a branch makes Dynamo guard them into the plain bools SDPA takes.
    if not causal:
        return skip, False, False
    if offset + skip == 0:
        return skip, True, False
    if 0 < offset + skip < nkv - 1:
        return skip, False, True
    return skip, False, False


def native_attention(q, k, v, *, causal, offset, mask, dropout_p, scale):
    """Native SDPA with our semantics: any causal offset, GQA, rows without keys -> 0.

    Rows without keys are dropped before SDPA and padded back as zeros, so neither the output
    nor the gradients ever see a fully masked (NaN) softmax row.
    """
    nq, nkv, hq, hkv = q.shape[-2], k.shape[-2], q.shape[-3], k.shape[-3]
    skip, is_causal, explicit = causal_split(nq, nkv, causal, offset)
    if skip == nq:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    q = q[..., skip:, :] if skip else q
    if explicit:
        rows = torch.arange(nq - skip, device=q.device).unsqueeze(-1)
        mask = torch.arange(nkv, device=q.device) <= rows + offset + skip
    gqa = hq != hkv
    if gqa and not gqa_in_native(q, v, mask):  # decided on the final mask
        k, v = k.repeat_interleave(hq // hkv, dim=-3), v.repeat_interleave(hq // hkv, dim=-3)
        gqa = False
    out = native_sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                       scale=scale, enable_gqa=gqa)
    return F.pad(out, (0, 0, skip, 0)) if skip else out


def sdpa_recompute_backward(q, k, v, dout, causal, causal_offset, scale, needs=(True,) * 3):
    """dq, dk, dv by re-running native SDPA under autograd (stand-in until backward kernels land).

    GQA K/V are expanded inside `native_attention`, so autograd sums dk/dv back over the group.
    """
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_(n) for t, n in zip((q, k, v), needs)]
        out = native_attention(*inputs, causal=causal, offset=causal_offset, mask=None,
                                dropout_p=0.0, scale=scale)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, dout) if wanted else ())
    return tuple(next(grads) if n else None for n in needs)


def native_lse(q, k, *, causal, offset, mask, scale):
    """log-sum-exp over keys of the scaled, masked scores: [..., Hq, Nq], natural log, in
    `math_attention.compute_dtype(q.dtype)`; -inf for rows that see no key.

    The same scores native SDPA softmaxes in `native_attention` (scale, causal offset, a bool
    mask's False entries at -inf, a float mask added), computed by `math_lse` chunk by chunk
    over query rows. Differentiable in q and k (Note [The gradient of lse] in
    math_attention.py); a float mask that requires grad: NotImplementedError (no gradient would
    reach it through lse).
    """
    if mask is not None:  # a broadcast view, sliced per chunk
        if mask.requires_grad and torch.is_grad_enabled():
            raise NotImplementedError("return_lse: a float attn_mask that requires grad gets "
                                      "no gradient through lse; detach it")
        mask = torch.broadcast_to(mask, (*q.shape[:-1], k.shape[-2]))
    return math_lse(q, k, hi=offset if causal else None, mask=mask, scale=scale)


def native_attention_lse(q, k, v, *, causal, offset, mask, scale):
    """(out, lse): `native_attention`'s out and `native_lse` of the same scores, both
    differentiable (no dropout)."""
    lse = native_lse(q, k, causal=causal, offset=offset, mask=mask, scale=scale)
    out = native_attention(q, k, v, causal=causal, offset=offset, mask=mask, dropout_p=0.0,
                           scale=scale)
    return out, lse


def block_grads(q, k, v, out, lse, dout, *, causal, offset, scale, dlse=None):
    """(dq, dk, dv) of one (query, key) block of a larger attention, in
    `math_attention.compute_dtype`.

    `out` and `lse` are the rows' *global* output and log-sum-exp (over every key block), so
    P = exp(S * scale - lse) is this block's share of the global softmax and the FlashAttention
    backward applies block by block: dV = P^T dO, dP = dO V^T, dS = P (dP - Delta) with
    Delta = rowsum(dO * O), dQ = scale dS K, dK = scale dS^T Q (`math_grads`). dk and dv are
    summed over each KV head's query heads (GQA). Rows whose lse is -inf (no key anywhere) get
    P = 0. dlse: the gradient of the rows' global lse, or None (Delta' = Delta - dlse: Note
    [The gradient of lse] in math_attention.py).
    """
    return math_grads(q, k, v, out, lse, dout, hi=offset if causal else None, scale=scale,
                      dlse=dlse)


def fallback_details(q, v, problem, mask) -> str:
    """What `native_attention` will do, for `explain()`; mirrors its decisions."""
    p = problem
    skip, _, explicit = causal_split(p.seqlen_q, p.seqlen_kv, p.causal, p.causal_offset)
    notes = [f"first {skip} rows see no key -> 0"] if skip else []
    if explicit:
        notes.append(f"causal offset {p.causal_offset} as an explicit bool mask")
    if p.heads_q != p.heads_kv:
        native = gqa_in_native(q, v, True if explicit else mask)
        notes.append("GQA natively (flash)" if native else
                     f"GQA by expanding K/V heads {p.qhead_per_kvhead}x")
    return "; ".join(notes)
