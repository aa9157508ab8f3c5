"""Blackwell attention forward for large head dims: tcgen05.mma with the accumulators in TMEM.

**Compile-verified only, never run** (no sm_100 GPU is available to the project): CI compiles it
for sm_100a and checks its PTX; on a B200 each configuration first passes selfcheck.py's canary.

What it computes: O = softmax(scale * Q K^T [+ causal mask]) V and LSE for q [B, Hq, Nq, D],
k / v [B, Hkv, Nkv, D | Dv] (Hq a multiple of Hkv), any Nq and Nkv, bf16 / fp16 in, fp32
accumulation, D a multiple of 8 in [264, 1024], Dv == D or a multiple of 8 in [64, 1024].

`FFPAFwdSm100` runs on `RingSkeletonSm100` (skeleton_sm100.py: warp roles, rings, TMEM, barriers)
with Q as the rows, K as the columns, V as the accumulator's B operand and O as the output: one
CTA = 128 query rows of one (batch, head) and one of `o_split` column slices of O (the TMEM plan
in config.py: S[0], S[1] and O[128 x acc_cta] fill the 512 columns), S double-buffered so QK[n+1]
runs while the softmax threads work on S[n]. This module holds the forward's own: the online
softmax of the score step and the epilogue (O / row sum, LSE).

The running max moves only when a row's max grows by more than RESCALE_THRESHOLD (log2 units):
P <= 2^8 then, and O is rescaled in TMEM (ld, multiply, st) only on such steps, by warps where
some row needs it, after PV[n-1] completed (o_done) and before P[n] is published.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.tensors import CUTLASS_DTYPES, LOG2_E, fake_args, fake_tensor
from .config import RESCALE_THRESHOLD
from .skeleton_sm100 import Ctx, RingSkeletonSm100, Roles


class FFPAFwdSm100(RingSkeletonSm100):
    """The tcgen05 forward; one instance per `FwdConfigSm100` (the compile key).

    Per CTA (row tile m_block, O column slice o_part): the KV blocks n_max - 1 down to 0 (the
    causal / Nkv bound of the tile first), each as QK[n] -> softmax[n] -> PV[n] on the
    skeleton's roles. Constraints: `config.can_implement`."""

    OPERANDS = ("q", "k", "v", "o", "lse", "sinks")
    SCALARS = ("softmax_scale", "causal_offset", "window_lo")

    @staticmethod
    def fake_inputs(cfg):
        """(q, k, v, o, lse) stand-ins, then sinks: an [Hq] fp32 stand-in with `sinks`, else
        None."""
        return (*fake_args(cfg), fake_tensor(Float32, 1, 1) if cfg.sinks else None)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mSinks, softmax_scale: Float32, causal_offset: Int32,
                 window_lo: Int32, stream: cuda.CUstream):
        """q/k/v/o: (B, H, N, D); lse: (B, Hq, Nq) fp32 (written); sinks: (Hq,) fp32 with
        `sinks`, else None; window_lo: read with `window`. Grid (ceil(Nq / 128) * o_split,
        Hq, B), 192 threads; clusters of o_split CTAs along x with `multicast`."""
        self._launch(Roles(rows=mQ, cols=mK, rows2=None, cols2=None, acc_b=mV, out=mO),
                     (mLSE, mSinks) if const_expr(self.cfg.sinks) else (mLSE,), softmax_scale,
                     causal_offset, stream, window_lo)

    @cute.jit
    def _init_state(self, ctx: Ctx):
        """(running max of the raw scores: the frame P is taken in, row sum, the scores'
        scale in log2 units, O's final factor): the last two carry the FP8 descales."""
        state = cute.make_rmem_tensor((4,), Float32)
        state[0] = -Float32.inf
        state[1] = Float32(0.0)
        state[2] = ctx.scale_log2
        state[3] = Float32(1.0)
        return state

    @cute.jit
    def _score_step(self, ctx: Ctx, state, i, tSr, tDPr, tScS, tPr):
        """Row max, the frame move (and O rescale) past the threshold, P = exp2 in the operand
        dtype (<= 2^RESCALE_THRESHOLD), row sum."""
        scale_log2 = state[2]
        m_run = state[0]
        blk_max = tSr[0]
        for e in cutlass.range_constexpr(1, cute.size(tSr)):
            blk_max = cute.arch.fmax(blk_max, tSr[e])
        m_new = cute.arch.fmax(m_run, blk_max)
        # move the frame only when the max grew by more than the threshold (or on the first
        # visible key): then O (and the row sum) are rescaled
        grow = (m_new - m_run) * scale_log2 > RESCALE_THRESHOLD
        factor = Float32(1.0)
        if grow:
            factor = cute.math.exp2((m_run - m_new) * scale_log2, fastmath=True)
            m_run = m_new
        m_scaled = m_run * scale_log2
        if m_run == -Float32.inf:  # no visible key yet: P = exp2(-inf) = 0
            m_scaled = Float32(0.0)
        if i > 0:
            if cute.arch.vote_any_sync(grow):
                # O holds PV[i - 1]: wait for it, then rescale the warp's rows in place
                # (factor 1 on the rows that did not grow)
                cute.arch.mbarrier_wait(ctx.bars["o_done"], (i - 1) & 1)
                self._scale_o(ctx, factor)
        row_sum = Float32(0.0)
        for e in cutlass.range_constexpr(cute.size(tSr)):
            p = cute.math.exp2(tSr[e] * scale_log2 - m_scaled, fastmath=True)
            row_sum += p
            if const_expr(self.dtype.width == 16):
                tPr[e] = p.to(self.dtype)
            else:  # e4m3 converts in pairs: P in place of S, converted below
                tSr[e] = p
        if const_expr(self.dtype.width != 16):
            tPr.store(tSr.load().to(self.dtype))
        state[0] = m_run
        state[1] = state[1] * factor + row_sum

    @cute.jit
    def _scale_o(self, ctx: Ctx, factor):
        """O's row (this thread's lane) times factor, in TMEM."""
        ld, st, chunks = self._acc_chunks(ctx.tOtO, ctx.tidx)
        for c in cutlass.range_constexpr(cute.size(chunks, mode=[3])):
            reg = cute.make_rmem_tensor(ld.partition_D(chunks[None, None, 0, c]).shape, Float32)
            cute.copy(ld, ld.partition_S(chunks[None, None, 0, c]), reg)
            cute.arch.fence_view_async_tmem_load()
            reg.store(reg.load() * factor)
            cute.copy(st, reg, st.partition_D(chunks[None, None, 0, c]))
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def _epilogue(self, ctx: Ctx, state, n_blocks):
        """O / row_sum (0 for a row that saw no key), LSE (natural log; -inf there) by the
        first column slice's CTA. With `sinks` the head's sink joins the sum in the frame
        top = max(row frame, sink) (Note [Sinks] in common/softmax.py): a row with no key
        gives O = 0 and LSE = the sink."""
        m_run, l_run = state[0], state[1]
        inv = Float32(0.0)
        lse = -Float32.inf
        if const_expr(self.cfg.sinks):
            sink_log2 = ctx.stats[1][ctx.head] * LOG2_E
            m = m_run * state[2]  # -inf for a row that saw no key
            top = cute.arch.fmax(m, sink_log2)
            if top != -Float32.inf:
                a = cute.math.exp2(m - top, fastmath=True)
                s = l_run * a + cute.math.exp2(sink_log2 - top, fastmath=True)
                inv = a * cute.arch.rcp_approx(s) * state[3]
                lse = (top + cute.math.log2(s, fastmath=True)) * (1.0 / LOG2_E)
        else:
            if l_run > Float32(0.0):
                inv = cute.arch.rcp_approx(l_run) * state[3]
                lse = (m_run * state[2]
                       + cute.math.log2(l_run, fastmath=True)) * (1.0 / LOG2_E)
        self._store_acc(ctx, inv, n_blocks > 0)
        if ctx.o_part == 0 and ctx.row < ctx.seqlen_r:
            ctx.stats[0][ctx.batch, ctx.head, ctx.row] = lse


class FFPAFwdSm100FP8(FFPAFwdSm100):
    """The forward for e4m3 Q, K, V (`FwdFP8ConfigSm100`): tcgen05.mma kind::f8f6f4 (K = 32)
    on 128-column chunks of D, P in e4m3 in TMEM (32 columns per buffer), V read as it lies
    ([N, Dv], the N-major B operand: no transpose). The descales (per (batch, KV head), fp32)
    fold into the scores' scale (q_descale * k_descale) and O's final factor (v_descale); the
    frame rule keeps P <= 2^8 = 256 < 448, e4m3's largest finite value. O in out_dtype, LSE
    fp32 of the dequantised scores."""

    OPERANDS = ("q", "k", "v", "o", "lse", "q_descale", "k_descale", "v_descale")
    SCALARS = ("softmax_scale", "causal_offset")

    @staticmethod
    def fake_inputs(cfg):
        """q, k, v (e4m3), o (out_dtype), lse, then three (B, Hkv) fp32 descales."""
        e4m3, out = CUTLASS_DTYPES[cfg.dtype], CUTLASS_DTYPES[cfg.out_dtype]
        qkv = [fake_tensor(e4m3, 4, 16) for _ in range(3)]
        return (*qkv, fake_tensor(out, 4, 8), fake_tensor(Float32, 3, 1),
                *(fake_tensor(Float32, 2, 1) for _ in range(3)))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mQd: cute.Tensor, mKd: cute.Tensor, mVd: cute.Tensor,
                 softmax_scale: Float32, causal_offset: Int32, stream: cuda.CUstream):
        """q, k, v: (B, H, N, D) e4m3; o: (B, Hq, Nq, Dv) out_dtype; lse: (B, Hq, Nq) fp32;
        descales: (B, Hkv) fp32."""
        self._launch(Roles(rows=mQ, cols=mK, rows2=None, cols2=None, acc_b=mV, out=mO),
                     (mLSE, mQd, mKd, mVd), softmax_scale, causal_offset, stream)

    @cute.jit
    def _init_state(self, ctx: Ctx):
        """The forward's state with the descales of this (batch, KV head) folded in."""
        state = super()._init_state(ctx)
        _, mQd, mKd, mVd = ctx.stats
        state[2] = ctx.scale_log2 * mQd[ctx.batch, ctx.head_c] * mKd[ctx.batch, ctx.head_c]
        state[3] = mVd[ctx.batch, ctx.head_c]
        return state


__all__ = ["FFPAFwdSm100", "FFPAFwdSm100FP8"]
