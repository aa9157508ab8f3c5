"""Exact FLOP counts for attention, from the number of visible (query, key) pairs.

Convention (shared with docs/perf-log.md and the anchor tables):

* forward = 4 * B * Hq * pairs * D  (two matmuls, QK^T and PV, 2 FLOPs per multiply-add);
  with a value head dim Dv != D it is 2 * B * Hq * pairs * (D + Dv);
* backward = 2.5 * forward (five matmuls against the forward's two);
* pairs = Nq * Nkv without a mask; with a causal mask query row i sees key j iff
  j <= i + causal_offset, clamped per row to [0, Nkv]. Bottom-right alignment (FlashAttention,
  ffpa_cute.attention(is_causal=True)) is offset = Nkv - Nq, the default here; upper-left
  alignment (SDPA's is_causal) is offset = 0.

GQA does not change the count: every query head does its own work, so Hq is what counts.
"""

from __future__ import annotations

BWD_FACTOR = 2.5


def _sum_range(lo: int, hi: int) -> int:
    """Sum of the integers in [lo, hi) (0 when empty)."""
    if hi <= lo:
        return 0
    return (lo + hi - 1) * (hi - lo) // 2


def valid_pairs(nq: int, nkv: int, causal: bool, causal_offset: int | None = None) -> int:
    """Number of (query, key) pairs that attend, in closed form.

    Row i of `nq` sees min(max(i + offset + 1, 0), nkv) keys when causal, `nkv` otherwise.
    `causal_offset=None` means bottom-right alignment (offset = nkv - nq).
    """
    nq, nkv = int(nq), int(nkv)
    if nq < 0 or nkv < 0:
        raise ValueError(f"negative sequence length: nq={nq}, nkv={nkv}")
    if not causal:
        return nq * nkv
    off = nkv - nq if causal_offset is None else int(causal_offset)
    # Rows [0, i0) see nothing; rows [i0, i1) see i + off + 1 keys (0 < . < nkv);
    # rows [i1, nq) see all nkv keys.
    i0 = min(max(-off, 0), nq)
    i1 = min(max(nkv - off - 1, i0), nq)
    return _sum_range(i0 + off + 1, i1 + off + 1) + (nq - i1) * nkv


def valid_pairs_bruteforce(nq: int, nkv: int, causal: bool,
                           causal_offset: int | None = None) -> int:
    """Row-by-row count (the definition); for tests and small shapes only."""
    if not causal:
        return nq * nkv
    off = nkv - nq if causal_offset is None else causal_offset
    return sum(min(max(i + off + 1, 0), nkv) for i in range(nq))


def attn_flops_fwd(batch: int, heads_q: int, nq: int, nkv: int, head_dim: int, causal: bool,
                   causal_offset: int | None = None, head_dim_v: int | None = None) -> int:
    """Forward FLOPs: 2 * B * Hq * pairs * (D + Dv), i.e. 4 * B * Hq * pairs * D when Dv == D."""
    dv = head_dim if head_dim_v is None else head_dim_v
    pairs = valid_pairs(nq, nkv, causal, causal_offset)
    return 2 * batch * heads_q * pairs * (head_dim + dv)


def attn_flops_bwd(batch: int, heads_q: int, nq: int, nkv: int, head_dim: int, causal: bool,
                   causal_offset: int | None = None, head_dim_v: int | None = None) -> float:
    """Backward FLOPs: 2.5 x forward."""
    return BWD_FACTOR * attn_flops_fwd(batch, heads_q, nq, nkv, head_dim, causal,
                                       causal_offset, head_dim_v)


def attn_flops(direction: str, *args, **kwargs) -> float:
    """`attn_flops("fwd" | "bwd", ...)` with the arguments of attn_flops_fwd."""
    if direction == "fwd":
        return attn_flops_fwd(*args, **kwargs)
    if direction == "bwd":
        return attn_flops_bwd(*args, **kwargs)
    raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")


def tflops(flops: float, ms: float | None) -> float | None:
    """TFLOP/s for `flops` done in `ms` milliseconds (None when there is no time)."""
    if ms is None or ms <= 0:
        return None
    return flops / (ms * 1e-3) / 1e12
