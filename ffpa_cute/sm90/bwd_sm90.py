"""Hopper backward on the forward's skeleton: dV, then dQ and dK below (docs/design.md).

    dV[j, :] = sum_i P[i, j] dO[i, :],   P = exp(scale * Q K^T - LSE)   (LSE from the forward)

`FFPABwdDVSm90` is `FFPAFwdSm90` (fwd_sm90.py: S warpgroup + two accumulator warpgroups,
self-fed TMA rings, P handed over through smem) with the operands in other roles:

    forward role             dV kernel
    resident rows (Q)        a 64-row tile of K
    S-ring chunks (K)        Q, 128 query rows per block
    accumulator B (V)        dO
    accumulator (O)          dV (fp32 in registers, split along D between two warpgroups)

and the skeleton's hooks replaced:
  * `_heads`, `_block_range`, `_block`: a KV tile walks the query blocks of all G = Hq / Hkv
    query heads of its KV head (heads outer; per head, the blocks that see some key of the
    tile: under causal those with i >= j - offset, highest first), so dV is summed over the
    group in registers: GQA / MQA without atomics, deterministic;
  * `_k_src`, `_v_src`: Q chunks and dO rows of the block's query head (TMA re-tiled per head);
  * `_softmax_block`: P^T = exp2(S^T * scale * log2(e) - LSE[i] * log2(e)) with the transposed
    mask (i < Nq, and j <= i + offset under causal); no running max: the forward's LSE already
    normalises, so there are no row factors and the accumulator warpgroups skip the rescale
    (`rescale_o = False`; `_write_factors` does nothing, and the factor buffer stages each
    block's 128 LSE values instead);
  * `_final_factors`: none (dV needs no normalisation) and no LSE output.

Queries whose LSE is -inf (they see no key) contribute nothing: their LSE is read as +inf, so
P = exp2(finite - inf) = 0.

Every kernel loads the per-row / per-column statistics (LSE, Delta) a block's score step reads
before the block's WGMMAs (`_block_prefetch`), so their latency hides behind them.

Status (all three kernels, D up to 1024 with the gradient split over two CTAs above 512, dK's
sequential score products at D <= 512, Dv != D): run and tested on the H200 against float64
(tests/test_backward_sm90_gpu.py; docs/verification.md). Constraints: those of `FwdConfigSm90`
without `kv_pair`; configs and planners in config.py.
"""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline  # noqa: F401  (NamedBarrier)
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync

from ..common.mask import apply_mask, block_needs_mask
from ..common.softmax import mn_view
from ..common.tensors import LOG2_E, fake_grad_args
from .config import (TILE_M, BwdDKConfigSm90, BwdDQConfigSm90, BwdDVConfigSm90,
                     can_implement_dq, can_implement_dv)
from .skeleton_sm90 import WG_THREADS, RingSkeletonSm90


class FFPABwdDVSm90(RingSkeletonSm90):
    """dV = P^T dO on the forward's warp-specialised skeleton."""

    rescale_o = False
    # `__call__`'s tensors in the skeleton's roles: K the resident rows, Q the streamed
    # columns, dO the accumulators' B operand, dV the output
    OPERANDS = ("k", "q", "do", "dv", "lse")

    def __init__(self, cfg: BwdDVConfigSm90):
        reason = can_implement_dv(cfg)
        if reason:
            raise ValueError(f"{type(self).__name__}: {reason}")
        super().__init__(cfg)

    @cute.jit
    def __call__(self, mK: cute.Tensor, mQ: cute.Tensor, mdO: cute.Tensor, mdV: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: Float32, causal_offset: Int32,
                 stream: cuda.CUstream):
        # rows K, columns Q, accumulator B = dO rows, output dV
        self._launch(mK, mQ, mdO, mdV, mLSE, softmax_scale, causal_offset, stream, None)

    # ---------------------------------------------------------------- hooks
    @cute.jit
    def _heads(self, head, heads_rows, heads_cols):
        """This KV head's query heads are head*G .. head*G+G-1 (G = Hq / Hkv): the blocks walk
        all of them, so dV sums over the group in registers (no atomics)."""
        group = heads_cols // heads_rows
        return head * group, group

    @cute.jit
    def _block_range(self, m_block, seqlen_q, causal_offset, group):
        """Per query head, the blocks n_top-1 .. n_top-n_per: all of them, or under causal those
        holding a query i >= (first key of the tile) - offset; n_count = group * n_per."""
        n_top = (seqlen_q + self.tile_n - 1) // self.tile_n
        n_low = 0
        if cutlass.const_expr(self.causal):
            n_low = cutlass.max(m_block * TILE_M - causal_offset, 0) // self.tile_n
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
    def _k_src(self, loads, seq, head, n_block, c):
        """Q chunk c of query block n_block of query `head` (the K role's TMA, re-tiled per head)."""
        g = cute.local_tile(loads.gK_tma[None, None, head, seq.batch],
                            (self.tile_n, self.cfg.k_chunk), (None, None))
        _, tg = cpasync.tma_partition(loads.tma_k, 0, cute.make_layout(1),
                                      cute.group_modes(loads.sK, 0, 2), cute.group_modes(g, 0, 2))
        return tg[None, n_block, c]

    @cute.jit
    def _v_src(self, v_loads, seq, head, row_block, half: cutlass.Constexpr):
        """dO rows block row_block of query `head`, this warpgroup's columns."""
        rows = v_loads.gV_tma[None, None, head, seq.batch]
        g = cute.local_tile(cute.domain_offset((0, v_loads.col0), rows),
                            (self.v_rows, self.dv[half]), (None, 0))
        _, tg = cpasync.tma_partition(v_loads.tma_v, 0, cute.make_layout(1),
                                      cute.group_modes(v_loads.sV, 0, 2),
                                      cute.group_modes(g, 0, 2))
        return tg[None, row_block]

    @cute.jit
    def _final_factors(self, softmax, factor, num_rows: cutlass.Constexpr, n_iter, o_part,
                       bars, pair, tidx, tScS_mn, lane):
        """No normalisation and no LSE output: dV is the sum itself."""
        return None

    @cute.jit
    def _write_factors(self, sFactor, factor, tScS_mn, b, lane):
        """No row factors here (rescale_o is False): the buffer holds the block's LSE instead."""
        pass

    @cute.jit
    def _block_prefetch(self, m_block, n_block, seqlen_q, mLSE, batch, head, tidx, tScS_mn,
                        extra):
        """The block's per-query values (`_load_columns`) loaded before its WGMMAs, for
        `_stage_columns`."""
        return self._load_columns(n_block, seqlen_q, mLSE, batch, head, tidx,
                                  self._column_delta(extra))

    @cute.jit
    def _load_columns(self, n_block, seqlen_q, mLSE, batch, head, tidx, mDelta):
        """This S thread's per-query value of the block: LSE (threads [0, tile_n)) or, with
        Delta, Delta (threads [tile_n, 2 tile_n)); with Delta at tile_n = 128, both values of
        query tidx (a 2-vector). Queries past Nq read as +inf / 0."""
        if cutlass.const_expr(self._both_per_thread(mDelta)):
            # tile_n = 128 with Delta: one S thread per query, each loads both of its values
            i = n_block * self.tile_n + tidx
            both = cute.make_rmem_tensor((2,), Float32)
            both[0] = Float32.inf
            both[1] = Float32(0.0)
            if i < seqlen_q:
                both[0] = mLSE[batch, head, i]
                both[1] = mDelta[batch, head, i]
            return both
        slot = tidx % self.tile_n
        i = n_block * self.tile_n + slot
        v = Float32.inf
        if tidx < self.tile_n:
            if i < seqlen_q:
                v = mLSE[batch, head, i]
        elif cutlass.const_expr(mDelta is not None):
            v = Float32(0.0)
            if i < seqlen_q:
                v = mDelta[batch, head, i]
        return v

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
        sCol = cute.make_tensor(sFactor.iterator, cute.make_layout(n_vals))
        s_sync = cutlass.pipeline.NamedBarrier(barrier_id=1, num_threads=WG_THREADS)
        s_sync.arrive_and_wait()  # every S thread is done with the previous block's values
        if cutlass.const_expr(self._both_per_thread(mDelta)):
            lse = pre[0]
            if lse == -Float32.inf:  # a query that sees no key: P = 0
                lse = Float32.inf
            sCol[tidx] = lse * LOG2_E
            sCol[self.tile_n + tidx] = pre[1]
        else:
            slot = tidx % self.tile_n
            if tidx < self.tile_n:
                v = pre
                if v == -Float32.inf:
                    v = Float32.inf
                sCol[slot] = v * LOG2_E
            elif cutlass.const_expr(mDelta is not None):
                sCol[self.tile_n + slot] = pre
        s_sync.arrive_and_wait()

    @cute.jit
    def _mask_transposed(self, acc_S_mn, tScS_mn, m_block, n_block, seqlen_q, causal_offset):
        """-inf where query i (column) is past Nq or, under causal, cannot see key j (row):
        j > i + offset. Only blocks that cross Nq or the diagonal pay for it."""
        col0 = n_block * self.tile_n
        need = col0 + self.tile_n > seqlen_q
        if cutlass.const_expr(self.causal):
            need = need | (m_block * TILE_M + TILE_M - 1 > col0 + causal_offset)
        if need:
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                j = m_block * TILE_M + tScS_mn[r, 0][0]
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    q = col0 + tScS_mn[0, c][1]
                    bad = q >= seqlen_q
                    if cutlass.const_expr(self.causal):
                        bad = bad | (j > q + causal_offset)
                    if bad:
                        acc_S_mn[r, c] = -Float32.inf

    @cute.jit
    def _score_block(self, acc_S, acc_S_mn, tScS_mn, softmax, factor, rP, m_block, n_block,
                     seqlen_q, causal_offset, mLSE, batch, head, sFactor, tidx, acc_2, extra,
                     pre, i, n_count, o_part, bars, pair, lane):
        """P^T for this block in rP: rows are keys j, columns queries i."""
        self._p_transposed(acc_S, acc_S_mn, tScS_mn, rP, softmax, m_block, n_block, seqlen_q,
                           causal_offset, sFactor, tidx, None, pre)

    @cute.jit
    def _ds_from_p(self, acc_S_mn, tScS_mn, rP, sFactor, scale_log2):
        """dS^T * scale in acc_S: the bf16 P^T in rP times (dP^T in acc_S - Delta of each
        column's query, staged after the LSE in sFactor)."""
        sCol = cute.make_tensor(sFactor.iterator, cute.make_layout(2 * self.tile_n))
        scale = scale_log2 * (1.0 / LOG2_E)
        rP_mn = mn_view(rP)
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            delta = sCol[self.tile_n + tScS_mn[0, c][1]]
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                acc_S_mn[r, c] = rP_mn[r, c].to(Float32) * (acc_S_mn[r, c] - delta) * scale

    @cute.jit
    def _p_transposed(self, acc_S, acc_S_mn, tScS_mn, rP, softmax, m_block, n_block, seqlen_q,
                      causal_offset, sFactor, tidx, mDelta, pre):
        """Stage the block's column statistics, mask, and P^T = exp2(S^T * scale * log2(e) -
        LSE * log2(e)) into rP (dV's whole score step; dK's first product)."""
        self._stage_columns(sFactor, tidx, mDelta, pre)
        self._mask_transposed(acc_S_mn, tScS_mn, m_block, n_block, seqlen_q, causal_offset)
        sLSE = cute.make_tensor(sFactor.iterator, cute.make_layout(self.tile_n))
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            lse2 = sLSE[tScS_mn[0, c][1]]
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c] * softmax.scale_log2 - lse2,
                                                fastmath=True)
        rP.store(acc_S.load().to(self.dtype))


class TwoProductExtra(NamedTuple):
    """What the two-product kernels add to the skeleton: the second product's row chunks
    (beside the first's in the Q role's ring) and column chunks (beside the K role's), and
    Delta = rowsum(dO * O) [B, Hq, Nq]."""

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

    fake_inputs = staticmethod(fake_grad_args)  # q, k, v, do, grad; lse, delta

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
    def _launch_two(self, rows, cols, acc_b, out, rows2, cols2, mLSE, mDelta,
                    softmax_scale: Float32, causal_offset: Int32, stream: cuda.CUstream):
        """The skeleton's roles: rows (resident role, streamed), cols (K role), acc_b (V role),
        out (O role); rows2 / cols2 the second product's operands, same boxes."""
        from ..common.tensors import aligned_bhnd

        cfg = self.cfg
        sQ_layout, sK_layout, _, _, _ = self._smem_layouts()
        t_rows2, t_cols2 = [self._bhnd_to_tma(aligned_bhnd(t, cfg.second_width, self.dtype))
                            for t in (rows2, cols2)]
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_rows2, g_rows2 = cpasync.make_tiled_tma_atom(
            g2s, t_rows2, cute.select(sQ_layout, mode=[0, 1]), (TILE_M, cfg.k_chunk))
        tma_cols2, g_cols2 = cpasync.make_tiled_tma_atom(
            g2s, t_cols2, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, cfg.k_chunk))
        self._launch(rows, cols, acc_b, out, mLSE, softmax_scale, causal_offset, stream,
                     TwoProductExtra(tma_rows2, g_rows2, tma_cols2, g_cols2, mDelta))

    @cute.jit
    def _k_src(self, loads, seq, head, n_block, c):
        """The first product's column chunk c (mod C): the base kernel's source."""
        return super(_TwoScoreProducts, self)._k_src(loads, seq, head, n_block,
                                                     c % self.c_half)

    @cute.jit
    def _copy_stream_chunk(self, loads, bars, s, k_src, seq, head, n_block, c):
        """Chunk c < C: the first product's column chunk (k_src) and row chunk c; c >= C: the
        second's, columns of the block's `head`, rows of the tile's head."""
        if c < self.c_half:
            cute.copy(loads.tma_k, k_src, loads.tKs[None, s], tma_bar_ptr=bars.k + s)
            cute.copy(loads.tma_q, loads.tQg[None, c], loads.tQs[None, s],
                      tma_bar_ptr=bars.k + s)
        else:
            ex, one, cc = loads.extra, cute.make_layout(1), c - self.c_half
            g_cols = cute.local_tile(ex.g_cols2[None, None, head, seq.batch],
                                     (self.tile_n, self.cfg.k_chunk), (None, None))
            ts, tg = cpasync.tma_partition(ex.tma_cols2, 0, one,
                                           cute.group_modes(loads.sK, 0, 2),
                                           cute.group_modes(g_cols, 0, 2))
            cute.copy(ex.tma_cols2, tg[None, n_block, cc], ts[None, s], tma_bar_ptr=bars.k + s)
            g_rows = cute.local_tile(ex.g_rows2[None, None, loads.head, seq.batch],
                                     (TILE_M, self.cfg.k_chunk), (loads.m_block, None))
            ts, tg = cpasync.tma_partition(ex.tma_rows2, 0, one,
                                           cute.group_modes(loads.sQ, 0, 2),
                                           cute.group_modes(g_rows, 0, 2))
            cute.copy(ex.tma_rows2, tg[None, cc], ts[None, s], tma_bar_ptr=bars.k + s)


class FFPABwdDQSm90(_TwoScoreProducts, RingSkeletonSm90):
    """dQ = scale * dS K, dS = P (dP - Delta), on the forward's skeleton.

    Roles: resident rows = the Q tile (streamed in 64-column chunks), S ring = K chunks then V
    chunks (2 x ceil(D/64) chunks per block: S = Q K^T into the first accumulator, dP = dO V^T
    into the second; dO chunks ride with V's), accumulator B operand = K rows, output = dQ.
    Same KV blocks, heads and causal rule as the forward (its `_heads` / `_block_range`).
    """

    rescale_o = False
    OPERANDS = ("q", "k", "v", "do", "dq", "lse", "delta")

    def __init__(self, cfg: BwdDQConfigSm90):
        reason = can_implement_dq(cfg)
        if reason:
            raise ValueError(f"{type(self).__name__}: {reason}")
        super().__init__(cfg)
        self._two_products(cfg)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mdQ: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
                 softmax_scale: Float32, causal_offset: Int32, stream: cuda.CUstream):
        # rows Q (then dO), columns K (then V), accumulator B = K rows, output dQ
        self._launch_two(mQ, mK, mK, mdQ, mdO, mV, mLSE, mDelta, softmax_scale, causal_offset,
                         stream)

    # ---------------------------------------------------------------- hooks
    @cute.jit
    def _write_factors(self, sFactor, factor, tScS_mn, b, lane):
        """No row factors (rescale_o is False)."""
        pass

    @cute.jit
    def _final_factors(self, softmax, factor, num_rows: cutlass.Constexpr, n_iter, o_part,
                       bars, pair, tidx, tScS_mn, lane):
        """No normalisation and no LSE output: dQ is the sum itself."""
        return None

    @cute.jit
    def _first_scores(self, acc_S, acc_S_mn, tScS_mn, rP, m_block, n_block, seqlen_k,
                      causal_offset, sFactor, tidx, softmax, extra, pre):
        """`seq_scores`: S is complete in acc_S; P = exp2(S * scale * log2(e) - LSE * log2(e))
        (masked as the forward masks) goes to rP, freeing acc_S for dP."""
        if block_needs_mask(m_block, n_block, seqlen_k, causal_offset, TILE_M, self.tile_n,
                            self.causal):
            apply_mask(acc_S_mn, tScS_mn, m_block, n_block, seqlen_k, causal_offset,
                       TILE_M, self.tile_n, self.causal)
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            lse2 = Float32.inf  # rows past Nq, or that see no key: P = 0
            if pre[r, 0] != -Float32.inf:
                lse2 = pre[r, 0] * LOG2_E
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c] * softmax.scale_log2 - lse2,
                                                fastmath=True)
        rP.store(acc_S.load().to(self.dtype))

    @cute.jit
    def _block_prefetch(self, m_block, n_block, seqlen_k, mLSE, batch, head, tidx, tScS_mn,
                        extra):
        """The thread's rows' LSE and Delta (rows past Nq: -inf / 0), loaded before the
        block's WGMMAs (L1 hits after the first block; their latency hides behind them)."""
        rows = cute.size(tScS_mn, mode=[0])
        stats = cute.make_rmem_tensor((rows, 2), Float32)
        seqlen_q = extra.mDelta.shape[2]
        for r in cutlass.range_constexpr(rows):
            row = m_block * TILE_M + tScS_mn[r, 0][0]
            lse, delta = -Float32.inf, Float32(0.0)
            if row < seqlen_q:
                lse = mLSE[batch, head, row]
                delta = extra.mDelta[batch, head, row]
            stats[r, 0] = lse
            stats[r, 1] = delta
        return stats

    @cute.jit
    def _score_block(self, acc_S, acc_S_mn, tScS_mn, softmax, factor, rP, m_block, n_block,
                     seqlen_k, causal_offset, mLSE, batch, head, sFactor, tidx, acc_2, extra,
                     pre, i, n_count, o_part, bars, pair, lane):
        """dS * scale in rP: P = exp2(S * scale * log2(e) - LSE * log2(e)) (masked as the
        forward masks), dS = P (dP - Delta) with dP in the second accumulator; LSE and Delta
        from `_block_prefetch` (rows that see no key, or past Nq: LSE -inf, read as +inf so
        P = 0)."""
        if cutlass.const_expr(self.seq_scores):  # acc_S holds dP, rP holds P (0 where masked)
            scale = softmax.scale_log2 * (1.0 / LOG2_E)
            rP_mn = mn_view(rP)
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                delta = pre[r, 1]
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    acc_S_mn[r, c] = (rP_mn[r, c].to(Float32) * (acc_S_mn[r, c] - delta)
                                      * scale)
        else:
            if block_needs_mask(m_block, n_block, seqlen_k, causal_offset, TILE_M, self.tile_n,
                                self.causal):
                apply_mask(acc_S_mn, tScS_mn, m_block, n_block, seqlen_k, causal_offset,
                           TILE_M, self.tile_n, self.causal)
            acc_dP_mn = mn_view(acc_2)
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
    """dK = scale * dS^T Q, dS^T = P^T (dP^T - Delta[i]), on the skeleton.

    The dV kernel's tile and block sequence (K rows resident-by-chunk, the query blocks of every
    query head of the KV head, transposed mask, per-column LSE) plus dQ's two score products on
    one S ring: chunks 0..C-1 hold K (rows) and Q (columns) for S^T = K Q^T, chunks C..2C-1 V and
    dO for dP^T = V dO^T. The accumulator warpgroups' B operand is Q (rows of the query block).
    """

    OPERANDS = ("q", "k", "v", "do", "dk", "lse", "delta")

    def __init__(self, cfg: BwdDKConfigSm90):
        reason = can_implement_dq(cfg)
        if reason:
            raise ValueError(f"{type(self).__name__}: {reason.replace('dQ', 'dK')}")
        RingSkeletonSm90.__init__(self, cfg)  # not the dV kernel's check (tile_n 64 here)
        self._two_products(cfg)

    def _column_delta(self, extra):
        return extra.mDelta

    @cute.jit
    def _first_scores(self, acc_S, acc_S_mn, tScS_mn, rP, m_block, n_block, seqlen_q,
                      causal_offset, sFactor, tidx, softmax, extra, pre):
        """`seq_scores`: S^T is complete in acc_S; the block's column LSE / Delta are staged and
        P^T (transposed mask) goes to rP, freeing acc_S for dP^T."""
        self._p_transposed(acc_S, acc_S_mn, tScS_mn, rP, softmax, m_block, n_block, seqlen_q,
                           causal_offset, sFactor, tidx, extra.mDelta, pre)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mdK: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
                 softmax_scale: Float32, causal_offset: Int32, stream: cuda.CUstream):
        # rows K (then V), columns Q (then dO), accumulator B = Q rows, output dK
        self._launch_two(mK, mQ, mQ, mdK, mV, mdO, mLSE, mDelta, softmax_scale, causal_offset,
                         stream)

    @cute.jit
    def _score_block(self, acc_S, acc_S_mn, tScS_mn, softmax, factor, rP, m_block, n_block,
                     seqlen_q, causal_offset, mLSE, batch, head, sFactor, tidx, acc_2, extra,
                     pre, i, n_count, o_part, bars, pair, lane):
        """dS^T * scale in rP: P^T as the dV kernel computes it, times (dP^T - Delta[i])."""
        if cutlass.const_expr(self.seq_scores):  # acc_S holds dP^T, rP holds P^T
            self._ds_from_p(acc_S_mn, tScS_mn, rP, sFactor, softmax.scale_log2)
        else:
            self._stage_columns(sFactor, tidx, extra.mDelta, pre)
            self._mask_transposed(acc_S_mn, tScS_mn, m_block, n_block, seqlen_q, causal_offset)
            sCol = cute.make_tensor(sFactor.iterator, cute.make_layout(2 * self.tile_n))
            acc_dP_mn = mn_view(acc_2)
            scale = softmax.scale_log2 * (1.0 / LOG2_E)
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                col = tScS_mn[0, c][1]
                lse2, delta = sCol[col], sCol[self.tile_n + col]
                for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                    p = cute.math.exp2(acc_S_mn[r, c] * softmax.scale_log2 - lse2,
                                       fastmath=True)
                    acc_S_mn[r, c] = p * (acc_dP_mn[r, c] - delta) * scale
        rP.store(acc_S.load().to(self.dtype))


__all__ = ["FFPABwdDKSm90", "FFPABwdDQSm90", "FFPABwdDVSm90", "TwoProductExtra"]
