"""Blackwell attention backward for large head dims: dV, dK and dQ on the tcgen05 ring.

**Compile-verified only, never run** (no sm_100 GPU is available to the project): CI compiles
them for sm_100a and checks their PTX; on a B200 each backward configuration first passes
selfcheck.py's backward canary (dq, dk, dv against float32) and otherwise recomputes through
SDPA.

Each gradient is its own kernel on `RingSkeletonSm100`, atomic-free (every output element is
written by one CTA: the same bits every run), reading the forward's LSE and Delta = rowsum(dO
* O) (common/delta.py, run first):

  dV[j] = sum_i P[i, j] dO[i]              rows = keys j, blocks = queries i; one product
                                           S^T = K Q^T, P^T = exp2(S^T scale_log2 - LSE_i log2 e)
  dK[j] = scale sum_i dS[i, j] Q[i]        rows = keys, blocks = queries; products S^T and
                                           dP^T = V dO^T, dS^T = P^T (dP^T - Delta_i)
  dQ[i] = scale sum_j dS[i, j] K[j]        rows = queries, blocks = keys (as the forward's);
                                           products S = Q K^T and dP = dO V^T, LSE_i and
                                           Delta_i per row

With keys as rows the blocks walk every query head of the KV head's group (GQA / MQA: dK and dV
sum over the group in TMEM, no atomics), and each block's per-query LSE (and Delta) are staged
in shared memory by the softmax threads (one value each, then a named barrier; two slots so one
barrier per block suffices). A query with LSE = -inf (it sees no key) contributes nothing: its
LSE reads as +inf, so P = 0 (as queries past Nq).

The two-product kernels fill both TMEM score buffers with one block's S and dP, so their score
MMAs do not overlap the previous block's accumulator MMAs (`lookahead` 0, config.py); dV keeps
the forward's overlap.

One launch over packed sequences (config `varlen`): the skeleton finds the tile's sequence and
frame; the column statistics are read at the sequence's query rows (`Ctx.row0_c`), dQ's row
statistics at its own (`Ctx.row0`).

A sliding window (config `window`): dQ walks the forward's key blocks (from the first its tile's
first row sees); dK and dV walk the query blocks up to the last query that sees the tile's last
key (i <= j - window_lo) and mask the crossing ones (the skeleton's `_walk` and `_mask`). Sinks
need nothing here: they are in the LSE, so P = exp(S - LSE) is already the sink-aware softmax
(the sinks' own gradient is the host's, ops.feature_backward).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.tensors import LOG2_E, fake_args, fake_cu, fake_grad_args
from .skeleton_sm100 import COLSTAT_BARRIER, SOFTMAX_THREADS, Ctx, RingSkeletonSm100, Roles


class _BwdSm100(RingSkeletonSm100):
    """What the three gradient kernels share: staged column statistics, P from the LSE, dS,
    the epilogue."""

    SCALARS = ("softmax_scale", "causal_offset", "window_lo")
    OUT_SCALE = True  # the output is scale * the accumulator (dK, dQ); dV: False

    @cute.jit
    def _stage_col_stats(self, ctx: Ctx, c_head, nb, slot):
        """Block nb's LSE (log2 units; +inf for queries past Nq or that see no key) and, with
        Delta, Delta of its 128 queries into smem slot `slot`: one value per softmax thread,
        then a named barrier. Two slots: a slot is rewritten two blocks later, after every
        thread passed the next block's barrier (so it is done reading this one)."""
        i = nb * self.cfg.tile_n + ctx.tidx
        lse = Float32.inf
        delta = Float32(0.0)
        if i < ctx.seqlen_c:
            lse = ctx.stats[0][ctx.batch, c_head, ctx.row0_c + i]
            if lse == -Float32.inf:
                lse = Float32.inf
            if const_expr(self.cfg.col_stats == 2):
                delta = ctx.stats[1][ctx.batch, c_head, ctx.row0_c + i]
        ctx.sStat[ctx.tidx, 0, slot] = lse * LOG2_E
        if const_expr(self.cfg.col_stats == 2):
            ctx.sStat[ctx.tidx, 1, slot] = delta
        cute.arch.barrier(barrier_id=COLSTAT_BARRIER, number_of_threads=SOFTMAX_THREADS)

    @cute.jit
    def _epilogue(self, ctx: Ctx, state, n_blocks):
        """The gradient (times the softmax scale for dK, dQ) to global memory."""
        self._store_acc(ctx, ctx.softmax_scale if const_expr(self.OUT_SCALE) else Float32(1.0),
                        n_blocks > 0)

    @cute.jit
    def _p_col(self, ctx: Ctx, tSr, tScS, slot, e):
        """P^T of score element e against its column's (query's) staged LSE: exp2(S^T
        scale_log2 - LSE_c log2 e)."""
        return cute.math.exp2(tSr[e] * ctx.scale_log2 - ctx.sStat[tScS[e][1], 0, slot],
                              fastmath=True)


class FFPABwdDVSm100(_BwdSm100):
    """dV: K the rows, Q the blocks, dO the accumulator's B operand, dV the output."""

    OPERANDS = ("k", "q", "do", "dv", "lse", "cu_q", "cu_k")
    OUT_SCALE = False

    @staticmethod
    def fake_inputs(cfg):
        """(k, q, do, dv) [B, H, N, D] and lse stand-ins, then cu_q, cu_k (`varlen`, else
        None each)."""
        return (*fake_args(cfg), *fake_cu(cfg))

    @cute.jit
    def __call__(self, mK: cute.Tensor, mQ: cute.Tensor, mdO: cute.Tensor, mdV: cute.Tensor,
                 mLSE: cute.Tensor, mCuQ, mCuK, softmax_scale: Float32, causal_offset: Int32,
                 window_lo: Int32, stream: cuda.CUstream):
        """k: (B, Hkv, Nkv, D); q: (B, Hq, Nq, D); do: (B, Hq, Nq, Dv); dv: (B, Hkv, Nkv, Dv);
        lse: (B, Hq, Nq) fp32; cu_q, cu_k: with `varlen` the sequences' cumulative lengths
        (the tensors (1, H, total, .)), else None; window_lo: read with `window`. Grid
        (ceil(Nkv / 128) * o_split, Hkv, B)."""
        self._launch(Roles(rows=mK, cols=mQ, rows2=None, cols2=None, acc_b=mdO, out=mdV),
                     (mLSE,), softmax_scale, causal_offset, stream, window_lo,
                     cu=(mCuK, mCuQ) if const_expr(self.cfg.varlen) else None)

    @cute.jit
    def _score_step(self, ctx: Ctx, state, i, tSr, tDPr, tScS, tPr):
        """P^T from the columns' LSE."""
        for e in cutlass.range_constexpr(cute.size(tSr)):
            tPr[e] = self._p_col(ctx, tSr, tScS, i % 2, e).to(self.dtype)


class _TwoProductBwd(_BwdSm100):
    """dK and dQ: one entry (q, k, v, do, the gradient, lse, Delta), their operands in the
    skeleton's roles given by `_roles` (the subclass's OPERANDS name the gradient)."""

    @staticmethod
    def fake_inputs(cfg):
        """(q, k, v, do, the gradient, lse, delta) stand-ins, then cu_q, cu_k (`varlen`, else
        None each)."""
        return (*fake_grad_args(cfg), *fake_cu(cfg))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mGrad: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mCuQ, mCuK,
                 softmax_scale: Float32, causal_offset: Int32, window_lo: Int32,
                 stream: cuda.CUstream):
        """q, do: (B, Hq, Nq, D | Dv); k, v: (B, Hkv, Nkv, D | Dv); the gradient: dK (B, Hkv,
        Nkv, D) or dQ (B, Hq, Nq, D); lse, delta: (B, Hq, Nq) fp32; cu_q, cu_k: with `varlen`
        the sequences' cumulative lengths (the tensors (1, H, total, .)), else None;
        window_lo: read with `window`. Grid (ceil(N_rows / 128) * o_split, H_rows, B)."""
        cu = None
        if const_expr(self.cfg.varlen):  # R's sequences first: keys for dK
            cu = (mCuK, mCuQ) if const_expr(self.cfg.rows_are_keys) else (mCuQ, mCuK)
        self._launch(self._roles(mQ, mK, mV, mdO, mGrad), (mLSE, mDelta), softmax_scale,
                     causal_offset, stream, window_lo, cu=cu)


class FFPABwdDKSm100(_TwoProductBwd):
    """dK: K the rows, Q the blocks (S^T = K Q^T), V and dO the second product (dP^T =
    V dO^T), Q the accumulator's B operand, dK the output."""

    OPERANDS = ("q", "k", "v", "do", "dk", "lse", "delta", "cu_q", "cu_k")

    @staticmethod
    def _roles(q, k, v, do, dk):
        return Roles(rows=k, cols=q, rows2=v, cols2=do, acc_b=q, out=dk)

    @cute.jit
    def _score_step(self, ctx: Ctx, state, i, tSr, tDPr, tScS, tPr):
        """dS^T[j, c] = P^T (dP^T - Delta_c), P^T from LSE_c."""
        slot = i % 2
        for e in cutlass.range_constexpr(cute.size(tSr)):
            delta = ctx.sStat[tScS[e][1], 1, slot]
            tPr[e] = (self._p_col(ctx, tSr, tScS, slot, e) * (tDPr[e] - delta)).to(self.dtype)


class FFPABwdDQSm100(_TwoProductBwd):
    """dQ: Q the rows, K the blocks (S = Q K^T), dO and V the second product (dP = dO V^T),
    K the accumulator's B operand, dQ the output; the row's LSE and Delta in registers."""

    OPERANDS = ("q", "k", "v", "do", "dq", "lse", "delta", "cu_q", "cu_k")

    @staticmethod
    def _roles(q, k, v, do, dq):
        return Roles(rows=q, cols=k, rows2=do, cols2=v, acc_b=k, out=dq)

    @cute.jit
    def _init_state(self, ctx: Ctx):
        """(this row's LSE in log2 units: +inf past Nq or when it sees no key, its Delta)."""
        state = cute.make_rmem_tensor((2,), Float32)
        state[0] = Float32.inf
        state[1] = Float32(0.0)
        if ctx.row < ctx.seqlen_r:
            lse = ctx.stats[0][ctx.batch, ctx.head, ctx.row0 + ctx.row]
            if lse != -Float32.inf:
                state[0] = lse * LOG2_E
            state[1] = ctx.stats[1][ctx.batch, ctx.head, ctx.row0 + ctx.row]
        return state

    @cute.jit
    def _score_step(self, ctx: Ctx, state, i, tSr, tDPr, tScS, tPr):
        """dS[i, c] = P (dP - Delta_i), P from LSE_i."""
        lse2, delta = state[0], state[1]
        for e in cutlass.range_constexpr(cute.size(tSr)):
            p = cute.math.exp2(tSr[e] * ctx.scale_log2 - lse2, fastmath=True)
            tPr[e] = (p * (tDPr[e] - delta)).to(self.dtype)


__all__ = ["FFPABwdDKSm100", "FFPABwdDQSm100", "FFPABwdDVSm100"]
