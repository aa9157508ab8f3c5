"""The static persistent tile schedule: which row tiles a persistent CTA computes, in order.

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


def tile_coords(t, m_tiles, heads):
    """(m_block, head, batch) of linear tile t (module docstring). Plain integer arithmetic:
    traced into the kernel on Int32 values, and the same function on Python ints for the
    tests' model of the schedule."""
    per_batch = m_tiles * heads
    batch = t // per_batch
    rest = t - batch * per_batch
    head = rest // m_tiles
    return m_tiles - 1 - (rest - head * m_tiles), head, batch


def tile_count(m_tiles, heads, batch):
    """Tiles in the schedule (host or device values)."""
    return m_tiles * heads * batch


__all__ = ["tile_coords", "tile_count"]
