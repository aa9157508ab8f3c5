"""Hopper backward on the warp-specialised ring: dV, then dQ and dK below (docs/design.md).

    P = exp(scale * Q K^T - LSE)   (LSE from the forward: no running max)
    dV = P^T dO;   dP = dO V^T;   dS = P (dP - Delta), Delta = rowsum(dO * O)
    dQ = scale * dS K;   dK = scale * dS^T Q

Each kernel is a sibling of the forward on `RingSkeletonSm90` (skeleton_sm90.py: S warpgroup +
two accumulator warpgroups, self-fed TMA rings, P handed over through smem) with its tensors in
the skeleton's roles:

    role                         dV              dQ                        dK
    resident rows (R)            64-row K tile   64-row Q tile (streamed)  64-row K tile (streamed)
    streamed columns (C)         Q, 128 queries  K chunks, then V chunks   Q chunks, then dO chunks
    second product's rows        -               dO (beside V)             V (beside dO)
    score step                   P^T             S, dP -> dS               S^T, dP^T -> dS^T
    accumulator B operand (B)    dO              K                         Q
    output (O, fp32 registers)   dV              dQ                        dK

The accumulators read no factors (`rescale_o` False: one P_empty arrival per warp), the S
warpgroup publishes none (`_write_factors` does nothing; the factor buffer stages each block's
column statistics instead) and there is no LSE output (`_final_factors` is None).

Block walk: dQ walks the forward's (the skeleton's default: the KV blocks of its own KV head,
causal bound of the row tile). dV and dK own a KV tile and walk the query blocks of all G =
Hq / Hkv query heads of its KV head (heads outer; per head, the blocks that see some key of the
tile: under causal those with i >= j - offset, highest first), so the gradient is summed over
the group in registers: GQA / MQA without atomics, deterministic.

Queries whose LSE is -inf (they see no key) contribute nothing: their LSE is read as +inf, so
P = exp2(finite - inf) = 0. Every kernel loads the per-row / per-column statistics (LSE, Delta) a
block's score step reads before the block's WGMMAs (`_block_prefetch`), so their latency hides
behind them.

From 520 to 576 (16-bit, not varlen) one CTA holds the gradient (`wide_o`: 288-column shares
as m64n96 WGMMAs with `setmaxnreg`, as the forward holds O). Above it, and under varlen above
512, two CTAs split a gradient's columns; with `kv_pair` (the default) they form a cluster
and split the score blocks: CTA r scores blocks 2i + r and sends its P / dS tile to the peer
(the skeleton's `_send_p`; no row statistics cross: the LSE is known). With few KV tiles the dV
and dK kernels split each head group over S CTAs (`group_split`: fp32 partial sums in a
workspace the host adds up in a fixed order). `varlen`: one launch over packed sequences.

Status (all three kernels, D up to 1024 with the gradient split over a CTA pair above 512, D %
16 == 8 included, dK's sequential score products at D <= 512, Dv != D, split head groups,
varlen): run and tested on the H200 against float64 (tests/test_backward_sm90_gpu.py,
tests/test_features_gpu.py; docs/verification.md); the gradient in one CTA from 520 to 576
(`wide_o`): run, tested and sanitizer-clean on an H100 only. Constraints: those of
`FwdConfigSm90`; configs and planners in config.py.
"""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline  # noqa: F401  (NamedBarrier)
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from ..common.mask import apply_mask_transposed, query_block_range, transposed_needs_mask
from ..common.softmax import mn_view
from ..common.tensors import (LOG2_E, aligned_bhnd, fake_args, fake_cu, fake_grad_args,
                              fake_tensor)
from .config import (TILE_M, BwdDKConfigSm90, BwdDQConfigSm90, BwdDVConfigSm90,
                     can_implement_dq, can_implement_dv)
from .ring_context import BLoads, ColLoads, Roles, ScoreFrags, ScoreIO, ScoreStep, Tile
from .skeleton_sm90 import WG_THREADS, RingSkeletonSm90


def _workspace_out(fakes: tuple, index: int, cfg) -> tuple:
    """Stand-ins with the output at `index` in fp32 when the config splits the head group (it
    then writes partial sums to a workspace: `group_split`)."""
    if not getattr(cfg, "group_split", False):
        return fakes
    return (*fakes[:index], fake_tensor(Float32, 4, 4), *fakes[index + 1:])


@cute.jit
def load_column_stat(tile_n: cutlass.Constexpr, n_block, seqlen_q, mLSE, mDelta, batch, head,
                     tidx, row0):
    """A score warpgroup thread's per-query value of query block n_block when the block's
    columns are queries (one value per thread): LSE of query tidx (threads [0, tile_n)) or,
    with mDelta, Delta of query tidx - tile_n; queries past Nq read +inf / 0. row0: the
    sequence's first query in the packed statistics (`varlen`; else 0)."""
    slot = tidx % tile_n
    i = n_block * tile_n + slot
    v = Float32.inf
    if tidx < tile_n:
        if i < seqlen_q:
            v = mLSE[batch, head, i + row0]
    elif cutlass.const_expr(mDelta is not None):
        v = Float32(0.0)
        if i < seqlen_q:
            v = mDelta[batch, head, i + row0]
    return v


@cute.jit
def stage_column_stat(sColStat: cute.Tensor, tile_n: cutlass.Constexpr, tidx, pre,
                      with_delta: cutlass.Constexpr):
    """`load_column_stat`'s value into the block's column statistics: LSE in log2 units at
    [0, tile_n) (+inf for a query that sees no key or is past Nq, so its P is 0), with_delta
    Delta at [tile_n, 2 tile_n). The caller fences the buffer's reuse (barriers around it)."""
    slot = tidx % tile_n
    if tidx < tile_n:
        v = pre
        if v == -Float32.inf:
            v = Float32.inf
        sColStat[slot] = v * LOG2_E
    elif cutlass.const_expr(with_delta):
        sColStat[tile_n + slot] = pre


class FFPABwdDVSm90(RingSkeletonSm90):
    """dV = P^T dO on the warp-specialised ring.

    Algorithm, per CTA (64-row tile m_block of K of KV head `head`; `o_part` of dV's columns):
      1. Skeleton entry with the roles K (resident rows), Q (streamed columns), dO (B operand),
         dV (output); `_heads` / `_block_range` / `_block`: the query blocks of the G query
         heads of this KV head (heads outer), under causal only those with a query that sees
         a key of the tile.
      2. S warpgroup, per query block n of head g: `_block_prefetch` loads the block's LSE (one
         query per S thread); S^T = K Q[n]^T over D (the C ring); `_score_step`: the LSE
         staged in the factor buffer (log2 units), the transposed mask (query past Nq, key j
         > i + offset under causal, j < i + window_lo under a window), P^T = exp2(S^T * scale_log2 - LSE_i * log2(e)) (bf16) ->
         the P slot.
      3. Accumulator warpgroups (skeleton, no rescale): dV += P^T dO[n] on their halves.
      4. dV stored (keys < Nkv); no LSE, no normalisation.

    Constraints (`config.can_implement_dv`): those of the forward, tile_n 128, no sinks.
    """

    rescale_o = False
    keys_are_rows = True
    # `__call__`'s tensors in the skeleton's roles: K the resident rows, Q the streamed
    # columns, dO the accumulators' B operand, dV the output; `varlen`: the rows' and the
    # columns' cumulative sequence lengths
    OPERANDS = ("k", "q", "do", "dv", "lse", "cu_k", "cu_q")

    @staticmethod
    def fake_inputs(cfg):
        """k, q, do, dv, lse; then `varlen`'s cumulative lengths or None, None."""
        return (*_workspace_out(fake_args(cfg), 3, cfg), *fake_cu(cfg))

    def __init__(self, cfg: BwdDVConfigSm90):
        self._refuse(can_implement_dv(cfg))
        super().__init__(cfg)

    @cute.jit
    def __call__(self, mK: cute.Tensor, mQ: cute.Tensor, mdO: cute.Tensor, mdV: cute.Tensor,
                 mLSE: cute.Tensor, mCuK, mCuQ, softmax_scale: Float32, causal_offset: Int32,
                 window_lo: Int32, stream: cuda.CUstream):
        """k: (B, Hkv, Nkv, D); q: (B, Hq, Nq, D); do: (B, Hq, Nq, Dv); dv: (B, Hkv, Nkv, Dv);
        lse: (B, Hq, Nq) fp32; cu_k, cu_q: `varlen`'s cumulative lengths (else None);
        window_lo read with `window`. Grid = (Nkv tiles * o_split, Hkv, B)."""
        self._launch(Roles(rows=mK, cols=mQ, acc_b=mdO, out=mdV), mLSE, softmax_scale,
                     causal_offset, stream, None, window_lo, cu=(mCuK, mCuQ))

    # ---------------------------------------------------------------- hooks: the block walk
    @cute.jit
    def _heads(self, head, heads_r, heads_c, part):
        """This KV head's query heads are head*G .. head*G+G-1 (G = Hq / Hkv): the blocks walk
        all of them, so dV sums over the group in registers (no atomics); with `group_split`
        (part = (s, S)) the CTA of part s walks G / S of them (head*G + s*G/S ..) and its
        partial sum goes to the fp32 workspace the host adds up in a fixed order (still
        deterministic)."""
        group = heads_c // heads_r
        if cutlass.const_expr(self.group_split):
            index, parts = part
            group = group // parts
            return head * group * parts + index * group, group
        return head * group, group

    @cute.jit
    def _block_range(self, tile: Tile, group, extra):
        """Per query head, the blocks n_top-1 .. n_top-n_per: all of them, under causal those
        holding a query i >= (first key of the tile) - offset, under a window's left edge those
        holding a query i <= (last key of the tile) - window_lo; n_count = group * n_per."""
        n_top, n_low = query_block_range(tile.m_block, tile.seqlen_c, tile.causal_offset,
                                         tile.window_lo, TILE_M, self.tile_n, self.causal)
        return n_top, cutlass.max(n_top - n_low, 0) * group

    @cute.jit
    def _block(self, seq, i):
        """Block i = (query head g, block n): heads outer, blocks highest first."""
        n_per = seq.n_count // seq.group
        return seq.head_kv + i // n_per, seq.n_top - 1 - i % n_per

    def _stats_head(self, head, blk_head):
        """The columns are queries of the block's head: their LSE (and Delta) are that head's."""
        return blk_head

    @cute.jit
    def _col_src(self, loads: ColLoads, head, n_block, c):
        """Q chunk c of query block n_block of query `head` (C's TMA, re-tiled per head)."""
        return self._col_src_at(loads, head, loads.seq.batch, n_block, c)

    @cute.jit
    def _b_src(self, loads: BLoads, head, row_block):
        """dO rows block row_block of query `head`, this warpgroup's columns."""
        return self._b_src_at(loads, head, loads.seq.batch, row_block)

    # ---------------------------------------------------------------- hooks: the score step
    @cute.jit
    def _final_factors(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, n_iter):
        """No normalisation and no LSE output: dV is the sum itself."""
        return None

    @cute.jit
    def _write_factors(self, io: ScoreIO, frags: ScoreFrags, b):
        """No row factors here (rescale_o is False): the buffer holds the block's LSE instead."""
        pass

    @cute.jit
    def _block_prefetch(self, tile: Tile, io: ScoreIO, n_block, head, tScS_mn):
        """The block's per-query values (`_load_columns`) loaded before its WGMMAs, for
        `_stage_columns`."""
        return self._load_columns(n_block, tile.seqlen_c, io.mLSE, tile.batch, head, io.tidx,
                                  self._column_delta(io.extra), tile.row0_c)

    @cute.jit
    def _load_columns(self, n_block, seqlen_q, mLSE, batch, head, tidx, mDelta, row0):
        """This S thread's per-query value of the block: LSE (threads [0, tile_n)) or, with
        Delta, Delta (threads [tile_n, 2 tile_n)); with Delta at tile_n = 128, both values of
        query tidx (a 2-vector). Queries past Nq read as +inf / 0. row0: the sequence's first
        query in the packed statistics (`varlen`; else 0)."""
        if cutlass.const_expr(self._both_per_thread(mDelta)):
            # tile_n = 128 with Delta: one S thread per query, each loads both of its values
            i = n_block * self.tile_n + tidx
            both = cute.make_rmem_tensor((2,), Float32)   # (LSE, Delta)
            both[0] = Float32.inf
            both[1] = Float32(0.0)
            if i < seqlen_q:
                both[0] = mLSE[batch, head, i + row0]
                both[1] = mDelta[batch, head, i + row0]
            return both
        return load_column_stat(self.tile_n, n_block, seqlen_q, mLSE, mDelta, batch, head,
                                tidx, row0)

    def _both_per_thread(self, mDelta) -> bool:
        """Whether each S thread stages both LSE and Delta of one query (tile_n = WG_THREADS,
        the dK `seq_scores` tile) rather than one value (LSE or Delta, tile_n = 64; dV: LSE)."""
        return mDelta is not None and 2 * self.tile_n > WG_THREADS

    def _column_delta(self, extra):
        """Delta for the columns (the dK kernel's), or None (dV needs only LSE)."""
        return None

    @cute.jit
    def _stage_columns(self, sFactor, tidx, mDelta, pre):
        """Stage the block's per-query values `pre` (from `_block_prefetch`) in the (otherwise
        unused) row-factor buffer: LSE in log2 units at [0, tile_n) (+inf for queries past Nq
        or that see no key, so their P is 0), and with mDelta also Delta at [tile_n, 2 tile_n)
        (0 past Nq). One value per S thread, or both of one query's when tile_n = 128; two
        S-warpgroup barriers fence the buffer's reuse."""
        n_vals = self.tile_n * (1 if cutlass.const_expr(mDelta is None) else 2)
        assert n_vals <= self.cfg.factor_floats, "the row-factor buffer is too small"
        sColStat = cute.make_tensor(sFactor.iterator, cute.make_layout(n_vals))  # (n_vals,)
        s_sync = cutlass.pipeline.NamedBarrier(barrier_id=1, num_threads=WG_THREADS)
        s_sync.arrive_and_wait()  # every S thread is done with the previous block's values
        if cutlass.const_expr(self._both_per_thread(mDelta)):
            lse = pre[0]
            if lse == -Float32.inf:  # a query that sees no key: P = 0
                lse = Float32.inf
            sColStat[tidx] = lse * LOG2_E
            sColStat[self.tile_n + tidx] = pre[1]
        else:
            stage_column_stat(sColStat, self.tile_n, tidx, pre, mDelta is not None)
        s_sync.arrive_and_wait()

    @cute.jit
    def _mask_transposed(self, tile: Tile, frags: ScoreFrags, n_block):
        """-inf where query i (column) is past Nq or cannot see key j (row): j > i + offset
        under causal, j < i + window_lo under a window's left edge. Only blocks that cross Nq,
        the diagonal or the edge pay for it (common/mask.py)."""
        if transposed_needs_mask(tile.m_block, n_block, tile.seqlen_c, tile.causal_offset,
                                 TILE_M, self.tile_n, self.causal, tile.window_lo):
            apply_mask_transposed(frags.acc_S_mn, frags.tScS_mn, tile.m_block, n_block,
                                  tile.seqlen_c, tile.causal_offset, TILE_M, self.tile_n,
                                  self.causal, tile.window_lo)

    @cute.jit
    def _score_step(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, step: ScoreStep,
                    n_count):
        """P^T for this block in rP: rows are keys j, columns queries i."""
        self._p_transposed(tile, io, frags, step, None)

    @cute.jit
    def _ds_from_p(self, acc_S_mn, tScS_mn, rP, sFactor, scale_log2):
        """dS^T * scale in acc_S: the bf16 P^T in rP times (dP^T in acc_S - Delta of each
        column's query, staged after the LSE in sFactor)."""
        # (2 tile_n,): the columns' LSE (log2 units), then their Delta
        sColStat = cute.make_tensor(sFactor.iterator, cute.make_layout(2 * self.tile_n))
        scale = scale_log2 * (1.0 / LOG2_E)
        rP_mn = mn_view(rP)   # (rows, cols) of this thread
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            delta = sColStat[self.tile_n + tScS_mn[0, c][1]]
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                acc_S_mn[r, c] = rP_mn[r, c].to(Float32) * (acc_S_mn[r, c] - delta) * scale

    @cute.jit
    def _p_transposed(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, step: ScoreStep,
                      mDelta):
        """Stage the block's column statistics, mask, and P^T = exp2(S^T * scale * log2(e) -
        LSE * log2(e)) into rP (dV's whole score step; dK's first product)."""
        acc_S, acc_S_mn, tScS_mn, rP = frags.acc_S, frags.acc_S_mn, frags.tScS_mn, frags.rP
        softmax, sFactor = frags.softmax, io.sFactor
        self._stage_columns(sFactor, io.tidx, mDelta, step.pre)
        self._mask_transposed(tile, frags, step.n_block)
        sLSE = cute.make_tensor(sFactor.iterator, cute.make_layout(self.tile_n))  # (tile_n,)
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            lse2 = sLSE[tScS_mn[0, c][1]]
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c] * softmax.scale_log2 - lse2,
                                                fastmath=True)
        rP.store(acc_S.load().to(self.dtype))


class TwoProductExtra(NamedTuple):
    """What the two-product kernels add to the skeleton: the second product's row chunks
    (beside the first's in R's ring) and column chunks (beside C's), and Delta =
    rowsum(dO * O) [B, Hq, Nq]."""

    tma_rows2: cute.CopyAtom
    g_rows2: cute.Tensor
    tma_cols2: cute.CopyAtom
    g_cols2: cute.Tensor
    mDelta: cute.Tensor


class _TwoScoreProducts:
    """For kernels whose S warpgroup forms two score products per block on one S ring
    (dQ: S and dP; dK: S^T and dP^T): chunks 0..C-1 feed the first accumulator, C..2C-1 the
    second (`second_score`); inputs q, k, v, do, out, lse, delta."""

    second_score = True

    def _two_products(self, cfg):
        self.c_half = cfg.num_k_chunks        # chunks of the first score product (over D)
        self.c_second = -(-cfg.second_width // cfg.k_chunk)   # of the second (over Dv)
        self.num_chunks = self.c_half + self.c_second
        self.seq_scores = cfg.seq_scores

    @staticmethod
    def fake_inputs(cfg):
        """q, k, v, do, grad; lse, delta; then `varlen`'s cumulative lengths (rows', columns')
        or None, None."""
        return (*_workspace_out(fake_grad_args(cfg), 4, cfg), *fake_cu(cfg))

    def _chunk(self, c: int):
        """Chunks 0..C1-1: the first product (over D); C1..C1+C2-1: the second (over Dv, its
        own accumulator)."""
        cfg, second = self.cfg, c >= self.c_half
        cc, n, width = ((c - self.c_half, self.c_second, cfg.second_width) if second
                        else (c, self.c_half, cfg.head_dim))
        last = -(-(width - (n - 1) * cfg.k_chunk) // 16)
        per = cfg.k_chunk // 16
        return second, cc == 0, last if cc == n - 1 else per, cc * per

    @cute.jit
    def _launch_two(self, roles: Roles, rows2, cols2, mLSE, mDelta, softmax_scale: Float32,
                    causal_offset: Int32, window_lo: Int32, stream: cuda.CUstream, cu):
        """The skeleton's roles; rows2 / cols2 the second product's operands, same boxes; cu:
        `varlen`'s cumulative lengths of the rows' and the columns' sequences."""
        cfg = self.cfg
        layouts = self._smem_layouts()
        t_rows2, t_cols2 = [self._bhnd_to_tma(aligned_bhnd(t, cfg.second_width, self.dtype))
                            for t in (rows2, cols2)]
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        # TMA coordinate tensors (N, Dv, H, B); boxes (TILE_M, k_chunk) and (tile_n, k_chunk)
        tma_rows2, g_rows2 = cpasync.make_tiled_tma_atom(
            g2s, t_rows2, cute.select(layouts.r, mode=[0, 1]), (TILE_M, cfg.k_chunk))
        tma_cols2, g_cols2 = cpasync.make_tiled_tma_atom(
            g2s, t_cols2, cute.select(layouts.c, mode=[0, 1]), (self.tile_n, cfg.k_chunk))
        self._launch(roles, mLSE, softmax_scale, causal_offset, stream,
                     TwoProductExtra(tma_rows2, g_rows2, tma_cols2, g_cols2, mDelta), window_lo,
                     cu=cu)

    @cute.jit
    def _col_src(self, loads: ColLoads, head, n_block, c):
        """The first product's column chunk c (mod C): the base kernel's source."""
        return super(_TwoScoreProducts, self)._col_src(loads, head, n_block, c % self.c_half)

    @cute.jit
    def _copy_stream_chunk(self, loads: ColLoads, s, src, head, n_block, c):
        """Chunk c < C: the first product's column chunk (src) and row chunk c; c >= C: the
        second's, columns of the block's `head`, rows of the tile's head."""
        if c < self.c_half:
            cute.copy(loads.tma_c, src, loads.tCs[None, s], tma_bar_ptr=loads.bar + s)
            cute.copy(loads.tma_r, loads.tRg[None, c], loads.tRs[None, s],
                      tma_bar_ptr=loads.bar + s)
        else:
            ex, one, cc = loads.extra, cute.make_layout(1), c - self.c_half
            # (tile_n, k_chunk, n_blocks, C2): the second product's column chunks
            g_cols = cute.local_tile(
                self._from_row(ex.g_cols2[None, None, head, loads.seq.batch], loads.seq.row0_c),
                (self.tile_n, self.cfg.k_chunk), (None, None))
            # (TMA, k_stages) / (TMA, n_blocks, C2)
            ts, tg = cpasync.tma_partition(ex.tma_cols2, 0, one,
                                           cute.group_modes(loads.sC, 0, 2),
                                           cute.group_modes(g_cols, 0, 2))
            cute.copy(ex.tma_cols2, tg[None, n_block, cc], ts[None, s], tma_bar_ptr=loads.bar + s)
            # (TILE_M, k_chunk, C2): the second product's row chunks of the tile
            g_rows = cute.local_tile(
                self._from_row(ex.g_rows2[None, None, loads.head, loads.seq.batch],
                               loads.seq.row0),
                (TILE_M, self.cfg.k_chunk), (loads.m_block, None))
            # (TMA, k_stages) / (TMA, C2)
            ts, tg = cpasync.tma_partition(ex.tma_rows2, 0, one,
                                           cute.group_modes(loads.sR, 0, 2),
                                           cute.group_modes(g_rows, 0, 2))
            cute.copy(ex.tma_rows2, tg[None, cc], ts[None, s], tma_bar_ptr=loads.bar + s)


class FFPABwdDQSm90(_TwoScoreProducts, RingSkeletonSm90):
    """dQ = scale * dS K, dS = P (dP - Delta), on the warp-specialised ring.

    Algorithm, per CTA (64-row Q tile m_block of query head `head`; `o_part` of dQ's columns):
      1. Skeleton entry with the roles Q then dO (resident rows, streamed in 64-column chunks),
         K then V (streamed columns), K (B operand), dQ (output); the forward's block walk
         (KV blocks of the tile's KV head under the causal bound).
      2. S warpgroup, per KV block n: `_block_prefetch` loads the thread's rows' LSE and Delta;
         chunks 0..C-1 (K with Q) accumulate S = Q K[n]^T, chunks C..2C-1 (V with dO) dP =
         dO V[n]^T into a second accumulator; `_score_step`: the forward's mask on S, P =
         exp2(S * scale_log2 - LSE * log2(e)), dS * scale = P (dP - Delta) * scale (bf16) ->
         the P slot. (`seq_scores`: one accumulator; `_first_scores` turns S into P in the
         bf16 fragment at chunk C, before dP overwrites it.)
      3. Accumulator warpgroups (skeleton, no rescale): dQ += dS K[n] on their halves,
         `publish_hi`: the second half gets each block at another chunk.
      4. dQ stored (rows < Nq).

    Constraints (`config.can_implement_dq`): those of the forward, stream_q, tile_n 64 (128
    with `seq_scores`), Dv == D or `second_dim` (a multiple of 16 in [64, 512]).
    """

    rescale_o = False
    OPERANDS = ("q", "k", "v", "do", "dq", "lse", "delta", "cu_q", "cu_k")

    def __init__(self, cfg: BwdDQConfigSm90):
        self._refuse(can_implement_dq(cfg))
        super().__init__(cfg)
        self._two_products(cfg)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mdQ: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mCuQ, mCuK,
                 softmax_scale: Float32, causal_offset: Int32, window_lo: Int32,
                 stream: cuda.CUstream):
        """q, do, dq: (B, Hq, Nq, D / Dv / D); k, v: (B, Hkv, Nkv, D / Dv); lse, delta:
        (B, Hq, Nq) fp32; cu_q, cu_k: `varlen`'s cumulative lengths (else None)."""
        # rows Q (then dO), columns K (then V), accumulator B = K rows, output dQ
        self._launch_two(Roles(rows=mQ, cols=mK, acc_b=mK, out=mdQ), mdO, mV, mLSE, mDelta,
                         softmax_scale, causal_offset, window_lo, stream, (mCuQ, mCuK))

    # ---------------------------------------------------------------- hooks
    @cute.jit
    def _write_factors(self, io: ScoreIO, frags: ScoreFrags, b):
        """No row factors (rescale_o is False)."""
        pass

    @cute.jit
    def _final_factors(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, n_iter):
        """No normalisation and no LSE output: dQ is the sum itself."""
        return None

    @cute.jit
    def _first_scores(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, step: ScoreStep):
        """`seq_scores`: S is complete in acc_S; P = exp2(S * scale * log2(e) - LSE * log2(e))
        (masked as the forward masks) goes to rP, freeing acc_S for dP."""
        acc_S, acc_S_mn, rP = frags.acc_S, frags.acc_S_mn, frags.rP
        softmax, pre, n_block = frags.softmax, step.pre, step.n_block
        self._mask_block(tile, frags, n_block)
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            lse2 = Float32.inf  # rows past Nq, or that see no key: P = 0
            if pre[r, 0] != -Float32.inf:
                lse2 = pre[r, 0] * LOG2_E
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c] * softmax.scale_log2 - lse2,
                                                fastmath=True)
        rP.store(acc_S.load().to(self.dtype))

    @cute.jit
    def _block_prefetch(self, tile: Tile, io: ScoreIO, n_block, head, tScS_mn):
        """The thread's rows' LSE and Delta (rows past Nq: -inf / 0), loaded before the
        block's WGMMAs (L1 hits after the first block; their latency hides behind them)."""
        m_block, batch, mLSE, extra = tile.m_block, tile.batch, io.mLSE, io.extra
        rows = cute.size(tScS_mn, mode=[0])
        stats = cute.make_rmem_tensor((rows, 2), Float32)   # (rows, LSE / Delta)
        seqlen_q = extra.mDelta.shape[2]
        if cutlass.const_expr(self.cfg.varlen):
            seqlen_q = tile.seqlen_r
        for r in cutlass.range_constexpr(rows):
            row = m_block * TILE_M + tScS_mn[r, 0][0]
            lse, delta = -Float32.inf, Float32(0.0)
            if row < seqlen_q:
                lse = mLSE[batch, head, row + tile.row0]
                delta = extra.mDelta[batch, head, row + tile.row0]
            stats[r, 0] = lse
            stats[r, 1] = delta
        return stats

    @cute.jit
    def _score_step(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, step: ScoreStep,
                    n_count):
        """dS * scale in rP: P = exp2(S * scale * log2(e) - LSE * log2(e)) (masked as the
        forward masks), dS = P (dP - Delta) with dP in the second accumulator; LSE and Delta
        from `_block_prefetch` (rows that see no key, or past Nq: LSE -inf, read as +inf so
        P = 0)."""
        acc_S, acc_S_mn, rP = frags.acc_S, frags.acc_S_mn, frags.rP
        softmax, acc_2, pre, n_block = frags.softmax, frags.acc_2, step.pre, step.n_block
        if cutlass.const_expr(self.seq_scores):  # acc_S holds dP, rP holds P (0 where masked)
            scale = softmax.scale_log2 * (1.0 / LOG2_E)
            rP_mn = mn_view(rP)   # (rows, cols) of this thread
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                delta = pre[r, 1]
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    acc_S_mn[r, c] = (rP_mn[r, c].to(Float32) * (acc_S_mn[r, c] - delta)
                                      * scale)
        else:
            self._mask_block(tile, frags, n_block)
            acc_dP_mn = mn_view(acc_2)   # (rows, cols) of this thread
            scale = softmax.scale_log2 * (1.0 / LOG2_E)
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                lse2 = Float32.inf  # rows past Nq, or that see no key: P = 0
                if pre[r, 0] != -Float32.inf:
                    lse2 = pre[r, 0] * LOG2_E
                delta = pre[r, 1]
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    p = cute.math.exp2(acc_S_mn[r, c] * softmax.scale_log2 - lse2,
                                       fastmath=True)
                    acc_S_mn[r, c] = p * (acc_dP_mn[r, c] - delta) * scale
        rP.store(acc_S.load().to(self.dtype))


# ==================================================================================== dK kernel
class FFPABwdDKSm90(_TwoScoreProducts, FFPABwdDVSm90):
    """dK = scale * dS^T Q, dS^T = P^T (dP^T - Delta[i]), on the warp-specialised ring.

    Algorithm, per CTA (64-row K tile m_block of KV head `head`; `o_part` of dK's columns):
      1. Skeleton entry with the roles K then V (resident rows, streamed in chunks), Q then dO
         (streamed columns), Q (B operand), dK (output); the dV kernel's block walk (the query
         blocks of the G query heads of this KV head).
      2. S warpgroup, per query block n of head g: `_block_prefetch` loads the block's LSE and
         Delta (one value per S thread, both of one query at tile_n 128); chunks 0..C-1 (Q with
         K) accumulate S^T = K Q[n]^T, chunks C..2C-1 (dO with V) dP^T = V dO[n]^T;
         `_score_step`: LSE and Delta staged in the factor buffer, the transposed mask, P^T =
         exp2(S^T * scale_log2 - LSE_i * log2(e)), dS^T * scale = P^T (dP^T - Delta_i) * scale
         (bf16) -> the P slot. (`seq_scores`, D <= 512: tile_n 128 and one accumulator;
         `_first_scores` stages the statistics and turns S^T into P^T in the bf16 fragment at
         chunk C, before dP^T overwrites it.)
      3. Accumulator warpgroups (skeleton, no rescale): dK += dS^T Q[n] on their halves.
      4. dK stored (keys < Nkv).

    Constraints (`config.can_implement_dq`): as dQ's.
    """

    OPERANDS = ("q", "k", "v", "do", "dk", "lse", "delta", "cu_k", "cu_q")

    def __init__(self, cfg: BwdDKConfigSm90):
        reason = can_implement_dq(cfg)
        self._refuse(reason and reason.replace("dQ", "dK"))
        RingSkeletonSm90.__init__(self, cfg)  # not the dV kernel's check (tile_n 64 here)
        self._two_products(cfg)

    def _column_delta(self, extra):
        return extra.mDelta

    @cute.jit
    def _first_scores(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, step: ScoreStep):
        """`seq_scores`: S^T is complete in acc_S; the block's column LSE / Delta are staged and
        P^T (transposed mask) goes to rP, freeing acc_S for dP^T."""
        self._p_transposed(tile, io, frags, step, io.extra.mDelta)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mdK: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mCuK, mCuQ,
                 softmax_scale: Float32, causal_offset: Int32, window_lo: Int32,
                 stream: cuda.CUstream):
        """q, do: (B, Hq, Nq, D / Dv); k, v, dk: (B, Hkv, Nkv, D / Dv / D); lse, delta:
        (B, Hq, Nq) fp32; cu_k, cu_q: `varlen`'s cumulative lengths (else None)."""
        # rows K (then V), columns Q (then dO), accumulator B = Q rows, output dK
        self._launch_two(Roles(rows=mK, cols=mQ, acc_b=mQ, out=mdK), mV, mdO, mLSE, mDelta,
                         softmax_scale, causal_offset, window_lo, stream, (mCuK, mCuQ))

    @cute.jit
    def _score_step(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, step: ScoreStep,
                    n_count):
        """dS^T * scale in rP: P^T as the dV kernel computes it, times (dP^T - Delta[i])."""
        acc_S, acc_S_mn, tScS_mn, rP = frags.acc_S, frags.acc_S_mn, frags.tScS_mn, frags.rP
        softmax, acc_2, sFactor, tidx = frags.softmax, frags.acc_2, io.sFactor, io.tidx
        extra, pre, n_block = io.extra, step.pre, step.n_block
        if cutlass.const_expr(self.seq_scores):  # acc_S holds dP^T, rP holds P^T
            self._ds_from_p(acc_S_mn, tScS_mn, rP, sFactor, softmax.scale_log2)
        else:
            self._stage_columns(sFactor, tidx, extra.mDelta, pre)
            self._mask_transposed(tile, frags, n_block)
            # (2 tile_n,): the columns' LSE (log2 units), then their Delta
            sColStat = cute.make_tensor(sFactor.iterator, cute.make_layout(2 * self.tile_n))
            acc_dP_mn = mn_view(acc_2)   # (rows, cols) of this thread
            scale = softmax.scale_log2 * (1.0 / LOG2_E)
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                col = tScS_mn[0, c][1]
                lse2, delta = sColStat[col], sColStat[self.tile_n + col]
                for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                    p = cute.math.exp2(acc_S_mn[r, c] * softmax.scale_log2 - lse2,
                                       fastmath=True)
                    acc_S_mn[r, c] = p * (acc_dP_mn[r, c] - delta) * scale
        rP.store(acc_S.load().to(self.dtype))


__all__ = ["FFPABwdDKSm90", "FFPABwdDQSm90", "FFPABwdDVSm90", "TwoProductExtra",
           "load_column_stat", "stage_column_stat"]
