"""Which KV blocks a Q tile visits, and masking of score fragments (seqlen residue, causal
diagonal, sliding window's left edge).

Causal convention (one rule for both alignments): query row i sees key j iff
j <= i + causal_offset. Bottom-right (FlashAttention, `attention(is_causal=True)`) passes
offset = Nkv - Nq; upper-left (SDPA's `is_causal`) passes 0. The offset is a runtime value, so one
compiled kernel serves both. A sliding window's right edge is the same rule (the host passes
offset = min(causal offset, window_hi)); its left edge is `window_lo`: query i sees key j only
if j >= i + window_lo. `window_lo` is None when the kernel was compiled without a left edge (a
compile-time absence: those kernels carry no code for it), else a runtime Int32.

Packed rows (`row_period`, the decode kernel's chunked prefill): the tile's rows are G query
heads of Nq queries each, row r being query r % Nq; the causal rule then reads j <= r % Nq +
offset (None: rows are queries).
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
def n_block_min(m_block: cutlass.Int32, window_lo, tile_m: cutlass.Constexpr,
                tile_n: cutlass.Constexpr):
    """The first KV block a Q tile must visit: 0, or under a window's left edge the block of
    the first key its first row sees (j >= m_block * tile_m + window_lo). Blocks below it are
    skipped, not masked."""
    n_min = 0
    if cutlass.const_expr(window_lo is not None):
        n_min = cutlass.max(m_block * tile_m + window_lo, 0) // tile_n
    return n_min


@cute.jit
def query_block_range(k_block: cutlass.Int32, seqlen_q: cutlass.Int32,
                      causal_offset: cutlass.Int32, window_lo, tile_k: cutlass.Constexpr,
                      tile_q: cutlass.Constexpr, causal: cutlass.Constexpr):
    """(n_top, n_low): the query blocks n_low .. n_top-1 a key tile must visit (the gradient
    kernels whose rows are keys: dV, dK). All of them; under causal from the block of the first
    query that sees the tile's first key (i >= k_block * tile_k - offset); under a window's
    left edge up to the block of the last query that sees its last key (i <= last key -
    window_lo). Blocks outside are skipped, not masked."""
    n_top = (seqlen_q + tile_q - 1) // tile_q
    if cutlass.const_expr(window_lo is not None):
        seen = cutlass.max((k_block + 1) * tile_k - window_lo, 0)  # queries <= last
        n_top = cutlass.min(n_top, (seen + tile_q - 1) // tile_q)
    n_low = 0
    if cutlass.const_expr(causal):
        n_low = cutlass.max(k_block * tile_k - causal_offset, 0) // tile_q
    return n_top, n_low


@cute.jit
def block_needs_mask(m_block: cutlass.Int32, n_block: cutlass.Int32, seqlen_k: cutlass.Int32,
                     causal_offset: cutlass.Int32, tile_m: cutlass.Constexpr,
                     tile_n: cutlass.Constexpr, causal: cutlass.Constexpr, window_lo=None,
                     row_period=None):
    """True when some (row, col) of the block is out of range, above the causal diagonal or
    left of the window (packed rows: the smallest query index is taken as 0)."""
    col_end = (n_block + 1) * tile_n
    need = col_end > seqlen_k
    if cutlass.const_expr(causal and row_period is not None):
        need = need | (col_end - 1 > causal_offset)
    elif cutlass.const_expr(causal):
        # the tile's first row sees keys up to m_block * tile_m + offset
        need = need | (col_end - 1 > m_block * tile_m + causal_offset)
    if cutlass.const_expr(window_lo is not None):
        # the tile's last row sees keys from (m_block + 1) * tile_m - 1 + window_lo
        need = need | (n_block * tile_n < (m_block + 1) * tile_m - 1 + window_lo)
    return need


@cute.jit
def apply_mask(acc_S_mn: cute.Tensor, tScS_mn: cute.Tensor, m_block: cutlass.Int32,
               n_block: cutlass.Int32, seqlen_k: cutlass.Int32, causal_offset: cutlass.Int32,
               tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr, causal: cutlass.Constexpr,
               window_lo=None, row_period=None):
    """Set masked scores to -inf. tScS_mn holds tile-local (row, col) of each fragment element;
    with `row_period` row r is query r % row_period (packed rows)."""
    col_base = n_block * tile_n
    for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
        col_limit = seqlen_k - col_base  # first invalid tile-local column
        row = m_block * tile_m + tScS_mn[r, 0][0]
        if cutlass.const_expr(row_period is not None):
            row = row % row_period
        if cutlass.const_expr(causal):
            col_limit = cutlass.min(col_limit, row + causal_offset + 1 - col_base)
        if cutlass.const_expr(window_lo is not None):
            col_first = row + window_lo - col_base  # first visible tile-local column
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                col = tScS_mn[0, c][1]
                if col >= col_limit or col < col_first:
                    acc_S_mn[r, c] = -cutlass.Float32.inf
        else:
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                if tScS_mn[0, c][1] >= col_limit:
                    acc_S_mn[r, c] = -cutlass.Float32.inf


@cute.jit
def transposed_needs_mask(m_block: cutlass.Int32, n_block: cutlass.Int32,
                          seqlen_q: cutlass.Int32, causal_offset: cutlass.Int32,
                          tile_m: cutlass.Constexpr, tile_n: cutlass.Constexpr,
                          causal: cutlass.Constexpr, window_lo=None):
    """The transposed tile (rows: keys of K tile m_block; columns: queries of block n_block,
    as the dV / dK kernels score it): True when some query is past Nq, cannot see some key of
    the tile under causal (j > i + offset), or sees it only outside the window's left edge
    (j < i + window_lo)."""
    col0 = n_block * tile_n
    need = col0 + tile_n > seqlen_q
    if cutlass.const_expr(causal):
        need = need | (m_block * tile_m + tile_m - 1 > col0 + causal_offset)
    if cutlass.const_expr(window_lo is not None):
        need = need | (m_block * tile_m < col0 + tile_n - 1 + window_lo)
    return need


@cute.jit
def apply_mask_transposed(acc_S_mn: cute.Tensor, tScS_mn: cute.Tensor, m_block: cutlass.Int32,
                          n_block: cutlass.Int32, seqlen_q: cutlass.Int32,
                          causal_offset: cutlass.Int32, tile_m: cutlass.Constexpr,
                          tile_n: cutlass.Constexpr, causal: cutlass.Constexpr, window_lo=None):
    """-inf where query i (column) is past Nq, or key j (row) is hidden from it: j > i + offset
    under causal, j < i + window_lo under a window's left edge."""
    col0 = n_block * tile_n
    for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
        j = m_block * tile_m + tScS_mn[r, 0][0]
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            q = col0 + tScS_mn[0, c][1]
            bad = q >= seqlen_q
            if cutlass.const_expr(causal):
                bad = bad | (j > q + causal_offset)
            if cutlass.const_expr(window_lo is not None):
                bad = bad | (j < q + window_lo)
            if bad:
                acc_S_mn[r, c] = -cutlass.Float32.inf


@cute.jit
def mask_row(acc: cute.Tensor, coords: cute.Tensor, lo, hi):
    """-inf where an element's tile-local column (coords[e][1]) lies outside [lo, hi): for
    fragments whose thread owns (part of) one row, as the sm100 kernels' (TMEM lane = row);
    the caller derives lo / hi from the rule above for its row."""
    for e in cutlass.range_constexpr(cute.size(acc)):
        col = coords[e][1]
        if col < lo or col >= hi:
            acc[e] = -cutlass.Float32.inf
