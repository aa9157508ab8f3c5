"""torch's native SDPA with ffpa_cute's semantics: the fallback path and the interim backward,
plus the torch math that gives the fallback a log-sum-exp and blocks their gradients.

Used for everything no kernel covers, and for the backward of the kernel path where no backward
kernel serves it. We bind `torch._C._nn.scaled_dot_product_attention` once and never call
`F.scaled_dot_product_attention`, which may be our own patch (recursion) or someone else's.

SDPA returns no log-sum-exp, so `native_lse` computes it with torch math over query chunks
(bounded memory); `block_grads` is the FlashAttention backward of one (query, key) block given
the *global* out and lse of its rows, which is what ring attention needs where no backward
kernel serves a block.
"""

import math

import torch
import torch.nn.functional as F

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


# Score elements (rows x keys, over batch and heads) per chunk of the torch-math functions below:
# 2^24 float32 values are 64 MiB, so the math never holds a full Nq x Nkv score matrix.
CHUNK_ELEMS = 1 << 24


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit and float32 inputs, float64 for float64: what the math below runs in
    and what its lse comes back as."""
    return torch.promote_types(dtype, torch.float32)


def _row_chunks(q, nkv):
    """Query-row ranges of at most CHUNK_ELEMS score elements each."""
    nq = q.shape[-2]
    per_row = max(1, math.prod(q.shape[:-2]) * nkv)
    step = max(1, CHUNK_ELEMS // per_row)
    return [(i, min(nq, i + step)) for i in range(0, nq, step)]


def _scores(q, k, rows, causal, offset, scale, dtype):
    """Scaled scores of query rows `rows` = (i, j) against all keys, [..., Hq, j - i, Nkv] in
    `dtype`, causal entries (key > row + offset) at -inf. GQA without expanding K: q's heads are
    grouped as [..., Hkv, G, rows, D] against k's [..., Hkv, 1, D, Nkv]."""
    i, j = rows
    hkv = k.shape[-3]
    qc = q[..., i:j, :].to(dtype).unflatten(-3, (hkv, -1))
    s = torch.matmul(qc, k.to(dtype).unsqueeze(-3).transpose(-1, -2)).flatten(-4, -3)
    s.mul_(scale)
    if causal:
        r = torch.arange(i, j, device=q.device).unsqueeze(-1)
        s.masked_fill_(torch.arange(k.shape[-2], device=q.device) > r + offset, float("-inf"))
    return s


def native_lse(q, k, *, causal, offset, mask, scale):
    """log-sum-exp over keys of the scaled, masked scores: [..., Hq, Nq], natural log, in
    `compute_dtype(q.dtype)`; -inf for rows that see no key.

    The same scores native SDPA softmaxes in `native_attention` (scale, causal offset, a bool
    mask's False entries at -inf, a float mask added), computed chunk by chunk over query rows.
    No gradient: the caller runs it under no_grad.
    """
    dtype = compute_dtype(q.dtype)
    nkv = k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if mask is not None:  # a broadcast view, sliced per chunk
        mask = torch.broadcast_to(mask, (*q.shape[:-1], nkv))
    lse = torch.empty(q.shape[:-1], dtype=dtype, device=q.device)
    for i, j in _row_chunks(q, nkv):
        s = _scores(q, k, (i, j), causal, offset, scale, dtype)
        if mask is not None:
            m = mask[..., i:j, :]
            if m.dtype == torch.bool:
                s.masked_fill_(~m, float("-inf"))
            else:
                s.add_(m.to(dtype))
        lse[..., i:j] = torch.logsumexp(s, dim=-1)
    return lse


def native_attention_lse(q, k, v, *, causal, offset, mask, scale):
    """(out, lse): `native_attention`'s out (differentiable as usual, no dropout) and
    `native_lse` of the same scores (no gradient)."""
    out = native_attention(q, k, v, causal=causal, offset=offset, mask=mask, dropout_p=0.0,
                           scale=scale)
    with torch.no_grad():
        lse = native_lse(q, k, causal=causal, offset=offset, mask=mask, scale=scale)
    return out, lse


def block_grads(q, k, v, out, lse, dout, *, causal, offset, scale):
    """(dq, dk, dv) of one (query, key) block of a larger attention, in `compute_dtype`.

    `out` and `lse` are the rows' *global* output and log-sum-exp (over every key block), so
    P = exp(S * scale - lse) is this block's share of the global softmax and the FlashAttention
    backward applies block by block: dV = P^T dO, dP = dO V^T, dS = P (dP - Delta) with
    Delta = rowsum(dO * O), dQ = scale dS K, dK = scale dS^T Q. dk and dv are summed over each
    KV head's query heads (GQA). Rows whose lse is -inf (no key anywhere) get P = 0.
    """
    dtype = compute_dtype(q.dtype)
    hkv, nkv = k.shape[-3], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    kd, vd = k.to(dtype), v.to(dtype)
    dq = torch.empty(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=dtype, device=k.device)
    dv = torch.zeros(v.shape, dtype=dtype, device=v.device)
    # -inf rows become +inf, so exp(S - lse) = 0 there instead of NaN
    lse = lse.to(dtype).masked_fill(torch.isneginf(lse), float("inf"))
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1)
    for i, j in _row_chunks(q, nkv):
        p = torch.exp(_scores(q, k, (i, j), causal, offset, scale, dtype)
                      - lse[..., i:j, None])  # [..., Hq, rows, Nkv]
        do = dout[..., i:j, :].to(dtype)
        ds = p * (torch.matmul(do.unflatten(-3, (hkv, -1)), vd.unsqueeze(-3).transpose(-1, -2))
                  .flatten(-4, -3) - delta[..., i:j, None])
        dv += torch.matmul(p.transpose(-1, -2).unflatten(-3, (hkv, -1)),
                           do.unflatten(-3, (hkv, -1))).sum(-3)
        dq[..., i:j, :] = torch.matmul(ds.unflatten(-3, (hkv, -1)), kd.unsqueeze(-3)).flatten(
            -4, -3) * scale
        dk += torch.matmul(ds.transpose(-1, -2).unflatten(-3, (hkv, -1)),
                           q[..., i:j, :].to(dtype).unflatten(-3, (hkv, -1))).sum(-3) * scale
    return dq, dk, dv
