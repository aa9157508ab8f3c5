"""The S warpgroup's `overlap` schedule (config field: the next block's QK issued around the
score step), a mixin of `RingSkeletonSm90` (skeleton_sm90.py).

With `overlap` = h the S warpgroup issues the first h D chunks of QK[i+1] before the score step
of block i and the rest after it, into a second score accumulator, so the tensor cores hold
queued work (PV[i-1], QK[i+1]) while it computes P[i]; `_overlap_blocks` says how the steps
avoid WGMMAs in flight across branches and loop edges. The skeleton's `_score_tile` calls it in
place of its serial loop; routed for the FP8 forward up to D=384 (`config.plan_fwd`).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import const_expr
from cutlass.cute.nvgpu import warpgroup

from ..common.softmax import mn_view
from .ring_context import BlockSeq, ColLoads, ScoreFrags, ScoreIO, ScoreRegs, ScoreStep, Smem, Tile


class OverlapSchedule:
    """The `overlap` score loop (module docstring); needs the skeleton's `cfg`, `num_chunks`,
    `_chunk`, `_block`, `_stats_head`, `_score_step`, `_store_p`, `_refill_c` and `_trace`."""

    @cute.jit
    def _qk_chunks(self, mma_s: cute.TiledMma, regs: ScoreRegs, bars, acc, pos0,
                   c0: cutlass.Constexpr, c1: cutlass.Constexpr):
        """`overlap`: issue chunks c0..c1-1 of a block's S = R C^T into acc (chunk c at ring
        position pos0 + c), one commit group per chunk; nothing waits for them here."""
        ks = self.cfg.k_stages
        atom = cute.make_mma_atom(mma_s.op)  # a fresh atom: ACCUMULATE changes below
        for c in cutlass.range_constexpr(c0, c1):
            pos = pos0 + c
            s = pos % ks
            cute.arch.mbarrier_wait(bars.cols + s, (pos // ks) & 1)
            warpgroup.fence()
            _, first, n_k, r_k0 = self._chunk(c)
            for k in cutlass.range_constexpr(n_k):
                atom.set(warpgroup.Field.ACCUMULATE, not (first and k == 0))
                cute.gemm(atom, acc, regs.tSrR[None, None, r_k0 + k],
                          regs.tSrC[None, None, k, s], acc)
            warpgroup.commit_group()

    @cute.jit
    def _overlap_blocks(self, mma_s: cute.TiledMma, regs: ScoreRegs, smem: Smem, tile: Tile,
                        seq: BlockSeq, io: ScoreIO, frags: ScoreFrags, loads: ColLoads, extra,
                        base, hand, n_iter, n_count):
        """`overlap` (h = cfg.overlap of the C chunks): the tile's blocks with QK[i+1] issued
        around the score step of block i, so that the tensor cores hold queued work while the
        S warpgroup computes P. Block i's chunk c is at ring position base + C i + c. Step i
        (`_overlap_step`) starts with QK[i] retired in `cur` and nothing of the S warpgroup's
        in flight:
          a. QK[i+1] chunks 0..h-1 into `nxt` (queued behind PV[i-1]);
          b. the score step of block i on `cur`, P[i] stored (`_store_p`);
          c. QK[i+1] chunks h..C-1 into `nxt`, then P[i] published, so that PV[i] queues
             behind them; wait_group(0): QK[i+1] retired, its C stages refilled k_stages
             ahead.
        The score step of block i runs under PV[i-1] and QK[i+1]'s first h chunks; the S
        warpgroup waits only for QK[i+1]'s last chunks, behind PV[i-1]. The last step (no
        block i+1) is b. alone, and its P is published by the caller (`_score_tile`).

        ptxas serialises every WGMMA of the kernel (C7514 / C7515 / C7518, docs/design.md
        section 10) when a WGMMA may be in flight across a loop's back edge or a branch's
        join, or when its issue sits in a branch (the accumulator's value then merges at the
        join). So every step ends with nothing in flight, and no WGMMA is issued under a
        runtime condition short of a whole step: the loop runs the steps that have a next
        block two per trip (registers are not indexed at run time, so the two score
        accumulators swap between the two), and the one or two steps after it are
        compiled per parity of n_iter. Chunks of QK[i+2] 0..h-1 are requested a whole step
        ahead when k_stages >= C + h (the others during the score step before they are read);
        a step issues only chunks an earlier step requested, so no wait can deadlock."""
        C = self.num_chunks
        bars = smem.bars
        frags_a = frags
        frags_b = frags._replace(acc_S=regs.acc_2, acc_S_mn=mn_view(regs.acc_2), acc_2=None)
        if n_iter > 0:  # block 0 whole, retired, its stages refilled
            self._qk_chunks(mma_s, regs, bars, frags_a.acc_S, base, 0, C)
            warpgroup.wait_group(0)
            for c in cutlass.range_constexpr(C):
                self._refill_c(loads, base + c)
        args = (mma_s, regs, bars, tile, seq, io)
        tail = (loads, extra, base, hand, n_count)
        for j in cutlass.range(cutlass.max(n_iter - 1, 0) // 2, unroll=1):
            self._overlap_step(*args, frags_a, frags_b, *tail, 2 * j, True)
            self._overlap_step(*args, frags_b, frags_a, *tail, 2 * j + 1, True)
        if n_iter > 0:
            if n_iter % 2 == 0:
                self._overlap_step(*args, frags_a, frags_b, *tail, n_iter - 2, True)
                self._overlap_step(*args, frags_b, None, *tail, n_iter - 1, False)
            else:
                self._overlap_step(*args, frags_a, None, *tail, n_iter - 1, False)

    @cute.jit
    def _overlap_step(self, mma_s: cute.TiledMma, regs: ScoreRegs, bars, tile: Tile,
                      seq: BlockSeq, io: ScoreIO, cur: ScoreFrags, nxt, loads: ColLoads, extra,
                      base, hand, n_count, i, more: cutlass.Constexpr):
        """Step i of `_overlap_blocks` (a-c there; `more`: block i+1 exists, else b. only):
        block i's scores are in cur.acc_S; QK[i+1] goes into nxt.acc_S."""
        C = self.num_chunks
        h = self.cfg.overlap
        blk_head, n_block = self._block(seq, i)
        step = ScoreStep(i, n_block, self._stats_head(tile.head, blk_head), None)
        nxt_pos = base + C * (i + 1)  # ring position of block i+1's chunk 0
        self._trace(extra, 0, i)
        if const_expr(more):
            self._qk_chunks(mma_s, regs, bars, nxt.acc_S, nxt_pos, 0, h)
        self._trace(extra, 1, i)
        self._score_step(tile, io, cur, step, n_count)
        self._trace(extra, 2, i)
        self._store_p(regs, tile, io, cur, extra, hand, i, n_count)
        if const_expr(more):
            self._qk_chunks(mma_s, regs, bars, nxt.acc_S, nxt_pos, h, C)
            cute.arch.mbarrier_arrive(bars.p_full + (hand + i) % 2)
            warpgroup.wait_group(0)
            for c in cutlass.range_constexpr(C):
                self._refill_c(loads, nxt_pos + c)


__all__ = ["OverlapSchedule"]
