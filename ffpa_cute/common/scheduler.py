"""Tile schedules: which row tile a CTA computes.

The varlen walk (`varlen_tile`): one launch over packed sequences gives CTA t the t-th row
tile of sequence 0's tiles, then sequence 1's, ..., found by a walk over the cumulative
lengths (every thread of the CTA reads the same few words), with no host-side tile list. The
grid counts ceil(total / tile_m) + B tiles, at least every sequence's ceil(n_b / tile_m); a t
past the last tile gets an empty one (no rows).

The static persistent tile schedule: which row tiles a persistent CTA computes, in order.

A persistent kernel launches min(tiles, num_ctas) CTAs (num_ctas: the device's SM count, one
CTA per SM) and CTA c computes tiles c, c + grid, c + 2 grid, ... of the linear order

    t -> (m_idx = t % m_tiles, head = (t // m_tiles) % heads, batch = t // (m_tiles heads))

with row tile m_block = m_tiles - 1 - m_idx: the order of the one-CTA-per-tile grid (m fastest,
the longest causal tiles of a head first), so neighbouring CTAs share a head's K and V in L2.
Every warpgroup of a CTA walks the same list with no communication (the schedule is a function
of the CTA index), and a CTA's rings and barriers simply continue from one tile to the next.

Why static: the tiles it serves are equal in length (no right bound) or nearly so (a sliding
window: only the first window / 64 tiles of a head are shorter), so the round-robin assignment
balances; causal tiles without a window (lengths 1 .. m_tiles blocks) keep the one-CTA-per-tile
grid, whose hardware block scheduler balances them dynamically.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


def tile_coords(t, m_tiles, heads):
    """(m_block, head, batch) of linear tile t (module docstring). Plain integer arithmetic:
    traced into the kernel on Int32 values, and the same function on Python ints for the
    tests' model of the schedule."""
    per_batch = m_tiles * heads
    batch = t // per_batch
    rest = t - batch * per_batch
    head = rest // m_tiles
    return m_tiles - 1 - (rest - head * m_tiles), head, batch


@cute.jit
def varlen_tile(cu_r: cute.Tensor, cu_c: cute.Tensor, t: Int32, tile_m: cutlass.Constexpr,
                ascending: cutlass.Constexpr, keys_rows: cutlass.Constexpr):
    """(m_block, first row in R, rows of R, first row in C, rows of C, frame) of CTA tile t of
    the sequences' row tiles (module docstring): R's sequence b is rows cu_r[b]:cu_r[b + 1] of
    the packed tensor, C's cu_c[b]:cu_c[b + 1]. Within a sequence the tiles go last first (the
    longest under causal, as the dense grid orders them), or first first when `ascending`.
    frame: the sequence's bottom-right causal frame Nkv - Nq, which the kernels add to their
    runtime causal offset and window edge (R holds the keys when `keys_rows`: dV, dK). A t
    past the last tile: all 0."""
    rest = Int32(t)
    m_block, row0, row0_c = Int32(0), Int32(0), Int32(0)
    seqlen_r, seqlen_c = Int32(0), Int32(0)
    for b in cutlass.range(cute.size(cu_r) - 1, unroll=1):
        start = cu_r[b]
        rows = cu_r[b + 1] - start
        tiles = (rows + tile_m - 1) // tile_m
        if rest >= 0:
            if rest < tiles:
                m_block = tiles - 1 - rest
                if const_expr(ascending):
                    m_block = rest
                row0, seqlen_r = start, rows
                row0_c = cu_c[b]
                seqlen_c = cu_c[b + 1] - row0_c
        rest = rest - tiles
    frame = seqlen_c - seqlen_r
    if const_expr(keys_rows):
        frame = seqlen_r - seqlen_c
    return m_block, row0, seqlen_r, row0_c, seqlen_c, frame


def rows_from(t: cute.Tensor, row0, varlen: bool, mode: int = 0) -> cute.Tensor:
    """t from row `row0` of its mode `mode` on (a packed sequence's first row: TMA coordinates
    and cp.async tiles may start anywhere) when `varlen`, else t itself."""
    if not varlen:
        return t
    return cute.domain_offset(tuple(row0 if i == mode else 0 for i in range(cute.rank(t))), t)


def tile_count(m_tiles, heads, batch):
    """Tiles in the schedule (host or device values)."""
    return m_tiles * heads * batch


__all__ = ["rows_from", "tile_coords", "tile_count", "varlen_tile"]
