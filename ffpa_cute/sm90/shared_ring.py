"""The K ring's `shared_kv` variant (config field: V is K's first Dv columns), a mixin of
`RingSkeletonSm90` (skeleton_sm90.py).

With `shared_kv` the kernel loads no V: each accumulator warpgroup's B operand is its columns of
a block's V chunks in the C ring, whose stages hold two whole blocks of the Dv / 64 V chunks
(block slot i % 2 for block i) and one block of the chunks past Dv. A C-ring chunk is refilled
by its last reader: a chunk past Dv by the S warpgroup after QK[i] (with block i + 1's), a V
chunk by its accumulator warpgroup after PV[i] (with block i + 2's). The skeleton's loops call
these methods where `shared_kv` changes a stage's position, its refill or PV's B operand;
sm90/fwd_protocol.py models the protocol (no hang or hazard; tests/test_shared_kv.py). Not
routed: measured slower than the planned forward (docs/design.md section 3).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import warpgroup

from .ring_context import BlockSeq, ColLoads, Operands, OutFrags, Smem, Tile


class SharedKVRing:
    """The `shared_kv` ring's stage map, refills and PV (module docstring); needs the
    skeleton's `cfg`, `num_chunks`, `tile_n`, `mma_k`, `_load_c_chunk` and `_c_partition`."""

    def _shared_stage(self, i, c: int):
        """(C-ring stage, barrier phase) of chunk c (compile time) of block i: a V
        chunk (c < Dv / 64) in block slot i % 2, filled for the (i // 2)-th time; a chunk past
        Dv in its own stage after the V chunks, filled for the i-th time."""
        cv = self.cfg.v_chunks
        if c < cv:
            return (i % 2) * cv + c, (i // 2) & 1
        return 2 * cv + c - cv, i & 1

    @cute.jit
    def _refill_shared(self, loads: ColLoads, i, c: cutlass.Constexpr):
        """chunk c of block i has been read by QK[i]. A chunk past Dv is refilled
        with block i + 1's (its stage holds one block); a V chunk waits for PV[i], after which
        its accumulator warpgroup refills it (`_shared_pv`)."""
        if const_expr(c >= self.cfg.v_chunks):
            pos = (i + 1) * self.num_chunks + c
            if pos < loads.total:
                self._load_c_chunk(loads, pos, self._shared_stage(i + 1, c)[0])

    @cute.jit
    def _shared_v_loads(self, ops: Operands, smem: Smem, tile: Tile, seq: BlockSeq, extra,
                        tidx) -> ColLoads:
        """An accumulator warpgroup's view of the C ring's loads (the S warpgroup's TMA of C,
        tiled at the tile's C head: `_c_partition`), for the V chunks it refills."""
        tCs, tCg = self._c_partition(ops, smem.c, tile)
        return ColLoads(ops.tma_c, tCg, tCs, None, None, None, ops.gC_tma, smem.c, None,
                        smem.bars.cols, seq, seq.n_count * self.num_chunks, 0, tile.m_block,
                        tile.head, extra, tile.o_part, tidx)

    @cute.jit
    def _shared_pv(self, atom, frags: OutFrags, loads: ColLoads, half: cutlass.Constexpr, i,
                   slot):
        """`shared_kv` hand-over i: O += P[slot] V[i], V[i] this warpgroup's V chunks of block i
        in block slot i % 2 of the C ring. QK[i] waited for them; waiting again costs nothing
        and makes the TMA's writes visible to this warpgroup's WGMMAs by the barrier itself."""
        acc_O, tOrP, tOrB, _ = frags
        per = self.cfg.v_chunks // 2
        for j in cutlass.range_constexpr(per):
            s, phase = self._shared_stage(i, half * per + j)
            cute.arch.mbarrier_wait(loads.bar + s, phase)
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.tile_n // self.mma_k):
            cute.gemm(atom, acc_O, tOrP[None, None, k, slot], tOrB[None, None, k, i % 2], acc_O)
        warpgroup.commit_group()

    @cute.jit
    def _refill_shared_v(self, loads: ColLoads, half: cutlass.Constexpr, i):
        """after PV[i] (and QK[i] before it) the warpgroup's V chunks of block i
        are read: load block i + 2's into them."""
        per = self.cfg.v_chunks // 2
        if i + 2 < loads.seq.n_count:
            for j in cutlass.range_constexpr(per):
                c = half * per + j
                self._load_c_chunk(loads, (i + 2) * self.num_chunks + c,
                                   self._shared_stage(i + 2, c)[0])


__all__ = ["SharedKVRing"]
