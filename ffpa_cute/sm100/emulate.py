"""The sm100 forward's arithmetic, step for step, in torch: what `FFPAFwdSm100` (and its FP8
and NVFP4 forms) computes, for the CPU tests of a kernel that never ran (no sm_100 GPU here).

Per 128-row tile it walks the KV blocks of 128 keys from the causal / Nkv bound down to 0 (the
kernels' order), and per row: the block's raw max; the frame (running max) moves only when the
max grew by more than RESCALE_THRESHOLD in log2 units, and then O and the row sum are rescaled;
P = exp2(s * scale_log2 - frame * scale_log2) in fp32, rounded to the operand dtype (bf16 /
fp16, e4m3, or NVFP4: per 16 keys with an E4M3 scale, tensor scale 1) for the P V product
while the row sum adds the unrounded P; finally O / row_sum
and LSE = (frame * scale_log2 + log2(row_sum)) ln 2. A sliding window's left edge skips the
blocks left of the tile's first row and masks the crossing ones; sinks join the final factors
in the frame max(row frame, sink). tests/test_sm100_emulate.py checks it
against float64 and checks the bound the FP8 path relies on: P <= 2^RESCALE_THRESHOLD < 448.
`backward` walks and masks as the gradient kernels do (dQ over key blocks, dK / dV over query
blocks, a window's edges on both walks).
"""

from __future__ import annotations

import math

import torch

from .config import RESCALE_THRESHOLD, TILE_M

TILE_N = 128
LOG2_E = 1.4426950408889634


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
            causal_offset: int | None = None, scale: float | None = None,
            p_dtype: torch.dtype = torch.bfloat16, record: dict | None = None,
            window_lo: int | None = None, sinks: torch.Tensor | None = None):
    """(out fp32 [B, Hq, Nq, Dv], lse fp32 [B, Hq, Nq]) as the kernel computes them, for
    q [B, Hq, Nq, D], k / v [B, Hkv, Nkv, D | Dv] (GQA by head // (Hq / Hkv)). `p_dtype`: the
    P operand's dtype (torch.float8_e4m3fn for the FP8 form, "nvfp4" for the NVFP4 form; its
    q, k, v are then the dequantised operands). `record`: if given, receives
    "p_max" (the largest P before rounding) and "rescales" (frame moves after a first one).
    window_lo: query i sees key j only if j >= i + window_lo; sinks: [Hq] logits."""
    b, hq, nq, d = q.shape
    nkv = k.shape[2]
    g = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    sl2 = scale * LOG2_E
    offset = nkv - nq if causal_offset is None else causal_offset
    out = torch.zeros(b, hq, nq, v.shape[-1])
    lse = torch.full((b, hq, nq), -math.inf)
    p_max, rescales = 0.0, 0
    for m0 in range(0, nq, TILE_M):
        rows = torch.arange(m0, min(m0 + TILE_M, nq))
        n_max = -(-nkv // TILE_N)
        if causal:
            n_max = min(n_max, -(-max(m0 + TILE_M + offset, 0) // TILE_N))
        n_min = 0 if window_lo is None else max(m0 + window_lo, 0) // TILE_N
        qt = q[:, :, rows].float()
        kk = k.float().repeat_interleave(g, 1)
        vv = v.float().repeat_interleave(g, 1)
        frame = torch.full((b, hq, len(rows)), -math.inf)
        rowsum = torch.zeros(b, hq, len(rows))
        o = torch.zeros(b, hq, len(rows), v.shape[-1])
        for i in range(max(n_max - n_min, 0)):
            n = n_max - 1 - i
            cols = torch.arange(n * TILE_N, min((n + 1) * TILE_N, nkv))
            s = qt @ kk[:, :, cols].transpose(-1, -2)
            if causal:
                s = s.masked_fill(cols[None, :] > rows[:, None] + offset, -math.inf)
            if window_lo is not None:
                s = s.masked_fill(cols[None, :] < rows[:, None] + window_lo, -math.inf)
            new = torch.maximum(frame, s.amax(-1))
            grow = (new - frame) * sl2 > RESCALE_THRESHOLD  # NaN (-inf - -inf): no
            factor = torch.where(grow, torch.exp2((frame - new) * sl2), torch.ones_like(new))
            if i > 0:
                rescales += int((grow & (frame > -math.inf)).sum())
            frame = torch.where(grow, new, frame)
            shift = torch.where(frame > -math.inf, frame * sl2, torch.zeros_like(frame))
            p = torch.exp2(s * sl2 - shift[..., None])
            p_max = max(p_max, float(p.max()))
            rowsum = rowsum * factor + p.sum(-1)
            o = o * factor[..., None] + _rounded(p, p_dtype) @ vv[:, :, cols]
        if sinks is None:
            inv = torch.where(rowsum > 0, 1.0 / rowsum, torch.zeros_like(rowsum))
            out[:, :, rows] = o * inv[..., None]
            lse[:, :, rows] = torch.where(rowsum > 0,
                                          (frame * sl2 + torch.log2(rowsum)) / LOG2_E,
                                          torch.full_like(rowsum, -math.inf))
        else:  # the sink in the frame top = max(row frame, sink)
            m = frame * sl2
            sink = (sinks.float() * LOG2_E)[None, :, None].expand_as(m)
            top = torch.maximum(m, sink)
            a = torch.exp2(m - top)
            s_tot = rowsum * a + torch.exp2(sink - top)
            out[:, :, rows] = o * (a / s_tot)[..., None]
            lse[:, :, rows] = (top + torch.log2(s_tot)) / LOG2_E
    if record is not None:
        record.update(p_max=p_max, rescales=rescales)
    return out, lse


def backward(q, k, v, dout, lse, delta, causal: bool = False, causal_offset: int | None = None,
             scale: float | None = None, window_lo: int | None = None):
    """(dq, dk, dv) fp32 as the sm100 gradient kernels walk and mask (bwd_sm100.py): dQ per
    128-query tile over the forward's key blocks (from the window's first block up to the
    causal bound); dK and dV per 128-key tile over the query blocks of every query head of
    its KV head, from the first holding a query that sees the tile's first key (causal) up to
    the last holding a query that sees its last key (window), each block masked per element
    as the skeleton's `_mask`; P = exp2(S scale_log2 - LSE log2 e) with LSE = -inf read as
    +inf (P = 0), dS = P (dP - Delta). lse and delta: [B, Hq, Nq] (the forward's; sinks are
    in the lse). Computed without rounding: this checks the walks and masks, not the
    arithmetic's precision."""
    b, hq, nq, d = q.shape
    nkv, g = k.shape[2], hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    sl2 = scale * LOG2_E
    offset = nkv - nq if causal_offset is None else causal_offset
    q, k, v, dout = (t.float() for t in (q, k, v, dout))
    lse2 = torch.where(torch.isneginf(lse), math.inf, lse.float() * LOG2_E)
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)

    def visible(rows, cols):  # [rows, cols]: query rows[r] sees key cols[c]
        ok = torch.ones(len(rows), len(cols), dtype=torch.bool)
        if causal:
            ok &= cols[None, :] <= rows[:, None] + offset
        if window_lo is not None:
            ok &= cols[None, :] >= rows[:, None] + window_lo
        return ok

    def ds_p(rows, cols):  # (dS, P) [B, Hq, rows, cols] of the block
        s = q[:, :, rows] @ kk[:, :, cols].transpose(-1, -2)
        s = s.masked_fill(~visible(rows, cols), -math.inf)
        p = torch.exp2(s * sl2 - lse2[:, :, rows, None])
        dp = dout[:, :, rows] @ vv[:, :, cols].transpose(-1, -2)
        return p * (dp - delta.float()[:, :, rows, None]), p

    dq = torch.zeros(q.shape)
    for m0 in range(0, nq, TILE_M):  # dQ: rows are queries, the forward's walk
        rows = torch.arange(m0, min(m0 + TILE_M, nq))
        n_max = -(-nkv // TILE_N)
        if causal:
            n_max = min(n_max, -(-max(m0 + TILE_M + offset, 0) // TILE_N))
        n_min = 0 if window_lo is None else max(m0 + window_lo, 0) // TILE_N
        for n in range(n_min, n_max):
            cols = torch.arange(n * TILE_N, min((n + 1) * TILE_N, nkv))
            dq[:, :, rows] += ds_p(rows, cols)[0] @ kk[:, :, cols] * scale
    dk, dv = torch.zeros(b, hq, nkv, d), torch.zeros(b, hq, nkv, v.shape[-1])
    for j0 in range(0, nkv, TILE_M):  # dK, dV: rows are keys, query blocks of each head
        cols = torch.arange(j0, min(j0 + TILE_M, nkv))
        n_top = -(-nq // TILE_N)
        if window_lo is not None:  # queries <= the tile's last key - window_lo
            n_top = min(n_top, -(-max(j0 + TILE_M - window_lo, 0) // TILE_N))
        n_low = max(j0 - offset, 0) // TILE_N if causal else 0
        for n in range(n_low, n_top):
            rows = torch.arange(n * TILE_N, min((n + 1) * TILE_N, nq))
            ds, p = ds_p(rows, cols)
            dv[:, :, cols] += p.transpose(-1, -2) @ dout[:, :, rows]
            dk[:, :, cols] += ds.transpose(-1, -2) @ q[:, :, rows] * scale
    return dq, dk.unflatten(1, (-1, g)).sum(2), dv.unflatten(1, (-1, g)).sum(2)


def _rounded(p: torch.Tensor, p_dtype) -> torch.Tensor:
    """P as the P V product reads it (fp32): in p_dtype, or NVFP4 per 16 keys (the block's
    columns past Nkv are the kernel's masked zeros)."""
    if p_dtype != "nvfp4":
        return p.to(p_dtype).float()
    from ..nvfp4 import BLOCK, quantize_nvfp4

    n = p.shape[-1]
    padded = torch.nn.functional.pad(p, (0, -n % BLOCK))
    return quantize_nvfp4(padded, tensor_scale=1.0).dequantize()[..., :n]


__all__ = ["backward", "forward"]
