"""Which KV blocks a Q tile visits, and masking of score fragments (seqlen residue + causal).

Causal convention (one rule for both alignments): query row i sees key j iff
j <= i + causal_offset. Bottom-right (FlashAttention, `attention(is_causal=True)`) passes
offset = Nkv - Nq; upper-left (SDPA's `is_causal`) passes 0. The offset is a runtime value, so one
compiled kernel serves both.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def n_block_max(m_block: cutlass.Int32, seqlen_k: cutlass.Int32, causal_offset: cutlass.Int32,
                tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr, causal: cutlass.Constexpr):
    """One past the last KV block a Q tile must visit (0: the tile sees no key at all)."""
    n_max = (seqlen_k + tile_n - 1) // tile_n
    if cutlass.const_expr(causal):
        # keys visible to the tile's last row: j <= (m_block + 1) * tile_m - 1 + offset
        visible = cutlass.max((m_block + 1) * tile_m + causal_offset, 0)
        n_max = cutlass.min(n_max, (visible + tile_n - 1) // tile_n)
    return n_max


@cute.jit
def block_needs_mask(m_block: cutlass.Int32, n_block: cutlass.Int32, seqlen_k: cutlass.Int32,
                     causal_offset: cutlass.Int32, tile_m: cutlass.Constexpr,
                     tile_n: cutlass.Constexpr, causal: cutlass.Constexpr):
    """True when some (row, col) of the block is out of range or above the causal diagonal."""
    col_end = (n_block + 1) * tile_n
    need = col_end > seqlen_k
    if cutlass.const_expr(causal):
        # the tile's first row sees keys up to m_block * tile_m + offset
        need = need | (col_end - 1 > m_block * tile_m + causal_offset)
    return need


@cute.jit
def apply_mask(acc_S_mn: cute.Tensor, tScS_mn: cute.Tensor, m_block: cutlass.Int32,
               n_block: cutlass.Int32, seqlen_k: cutlass.Int32, causal_offset: cutlass.Int32,
               tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr, causal: cutlass.Constexpr):
    """Set masked scores to -inf. tScS_mn holds tile-local (row, col) of each fragment element."""
    col_base = n_block * tile_n
    for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
        col_limit = seqlen_k - col_base  # first invalid tile-local column
        if cutlass.const_expr(causal):
            row = m_block * tile_m + tScS_mn[r, 0][0]
            col_limit = cutlass.min(col_limit, row + causal_offset + 1 - col_base)
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            if tScS_mn[0, c][1] >= col_limit:
                acc_S_mn[r, c] = -cutlass.Float32.inf
