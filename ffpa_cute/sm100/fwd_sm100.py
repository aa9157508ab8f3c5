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

Quantised forms: `FFPAFwdSm100FP8` (e4m3, kind::f8f6f4) and `FFPAFwdSm100FP4` (NVFP4,
kind::mxf4nvf4 with block scales in TMEM, P through shared memory), same skeleton.

The running max moves only when a row's max grows by more than RESCALE_THRESHOLD (log2 units):
P <= 2^8 then, and O is rescaled in TMEM (ld, multiply, st) only on such steps, by warps where
some row needs it, after PV[n-1] completed (o_done) and before P[n] is published.
"""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
import cutlass.utils.blockscaled_layout as blockscaled
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import tcgen05

from ..common.tensors import CUTLASS_DTYPES, LOG2_E, fake_args, fake_cu, fake_tensor
from .config import FP4_MMA_K, RESCALE_THRESHOLD, SF_ATOM_BYTES, SF_ATOM_ROWS, SF_VEC
from .skeleton_sm100 import Ctx, RingSkeletonSm100, Roles


class FFPAFwdSm100(RingSkeletonSm100):
    """The tcgen05 forward; one instance per `FwdConfigSm100` (the compile key).

    Per CTA (row tile m_block, O column slice o_part): the KV blocks n_max - 1 down to 0 (the
    causal / Nkv bound of the tile first), each as QK[n] -> softmax[n] -> PV[n] on the
    skeleton's roles. Constraints: `config.can_implement`."""

    OPERANDS = ("q", "k", "v", "o", "lse", "sinks", "cu_q", "cu_k")
    SCALARS = ("softmax_scale", "causal_offset", "window_lo")

    @staticmethod
    def fake_inputs(cfg):
        """(q, k, v, o, lse) stand-ins, then sinks: an [Hq] fp32 stand-in with `sinks`, else
        None, then cu_q, cu_k: int32 [B + 1] stand-ins with `varlen`, else None each."""
        return (*fake_args(cfg), fake_tensor(Float32, 1, 1) if cfg.sinks else None,
                *fake_cu(cfg))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mSinks, mCuQ, mCuK, softmax_scale: Float32,
                 causal_offset: Int32, window_lo: Int32, stream: cuda.CUstream):
        """q/k/v/o: (B, H, N, D); lse: (B, Hq, Nq) fp32 (written); sinks: (Hq,) fp32 with
        `sinks`, else None; cu_q, cu_k: with `varlen` the sequences' cumulative lengths
        (int32 [B + 1]; q, k, v, o then (1, H, total, D), lse (1, Hq, total_q)), else None;
        window_lo: read with `window`. Grid (ceil(Nq / 128) * o_split, Hq, B) (`varlen`:
        ((ceil(total_q / 128) + B) * o_split, Hq, 1)), 192 threads; clusters of o_split CTAs
        along x with `multicast`."""
        self._launch(Roles(rows=mQ, cols=mK, rows2=None, cols2=None, acc_b=mV, out=mO),
                     (mLSE, mSinks) if const_expr(self.cfg.sinks) else (mLSE,), softmax_scale,
                     causal_offset, stream, window_lo,
                     cu=(mCuQ, mCuK) if const_expr(self.cfg.varlen) else None)

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
            else:  # e4m3 converts in pairs: P in place of S, converted below (NVFP4: per
                # 16-key block with its scale, by `_scale_store_p`)
                tSr[e] = p
        if const_expr(self.dtype.width != 16 and not self.BLOCK_SCALED):
            tPr.store(tSr.load().to(self.dtype))
        state[0] = m_run
        state[1] = state[1] * factor + row_sum

    def _sinks(self, ctx: Ctx):
        """The [Hq] sink logits among the statistics tensors (after the LSE)."""
        return ctx.stats[1]

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
            sink_log2 = self._sinks(ctx)[ctx.head] * LOG2_E
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
            ctx.stats[0][ctx.batch, ctx.head, ctx.row0 + ctx.row] = lse


class FFPAFwdSm100FP8(FFPAFwdSm100):
    """The forward for e4m3 Q, K, V (`FwdFP8ConfigSm100`): tcgen05.mma kind::f8f6f4 (K = 32)
    on 128-column chunks of D, P in e4m3 in TMEM (32 columns per buffer), V read as it lies
    ([N, Dv], the N-major B operand: no transpose). The descales (per (batch, KV head), fp32)
    fold into the scores' scale (q_descale * k_descale) and O's final factor (v_descale); the
    frame rule keeps P <= 2^8 = 256 < 448, e4m3's largest finite value. O in out_dtype, LSE
    fp32 of the dequantised scores. A sliding window and sinks as in the 16-bit forward (the
    skeleton's walk and masks; the sink, in units of the dequantised scaled scores, joins the
    final factors, whose frame already carries the descales)."""

    OPERANDS = ("q", "k", "v", "o", "lse", "q_descale", "k_descale", "v_descale", "sinks")
    SCALARS = ("softmax_scale", "causal_offset", "window_lo")

    @staticmethod
    def fake_inputs(cfg):
        """q, k, v (e4m3), o (out_dtype), lse, three (B, Hkv) fp32 descales, then sinks: an
        [Hq] fp32 stand-in with `sinks`, else None."""
        e4m3, out = CUTLASS_DTYPES[cfg.dtype], CUTLASS_DTYPES[cfg.out_dtype]
        qkv = [fake_tensor(e4m3, 4, 16) for _ in range(3)]
        return (*qkv, fake_tensor(out, 4, 8), fake_tensor(Float32, 3, 1),
                *(fake_tensor(Float32, 2, 1) for _ in range(3)),
                fake_tensor(Float32, 1, 1) if cfg.sinks else None)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mQd: cute.Tensor, mKd: cute.Tensor, mVd: cute.Tensor,
                 mSinks, softmax_scale: Float32, causal_offset: Int32, window_lo: Int32,
                 stream: cuda.CUstream):
        """q, k, v: (B, H, N, D) e4m3; o: (B, Hq, Nq, Dv) out_dtype; lse: (B, Hq, Nq) fp32;
        descales: (B, Hkv) fp32; sinks: (Hq,) fp32 with `sinks`, else None; window_lo: read
        with `window`."""
        self._launch(Roles(rows=mQ, cols=mK, rows2=None, cols2=None, acc_b=mV, out=mO),
                     self._stats(mLSE, mQd, mKd, mVd, mSinks), softmax_scale, causal_offset,
                     stream, window_lo)

    def _stats(self, mLSE, mQd, mKd, mVd, mSinks) -> tuple:
        """The statistics tensors the hooks read: the LSE, the three descales, and with
        `sinks` the sink logits (index 4, `_sinks`)."""
        return (mLSE, mQd, mKd, mVd, *((mSinks,) if self.cfg.sinks else ()))

    def _sinks(self, ctx: Ctx):
        return ctx.stats[4]

    @cute.jit
    def _init_state(self, ctx: Ctx):
        """The forward's state with the descales of this (batch, KV head) folded in."""
        state = FFPAFwdSm100._init_state(self, ctx)
        mQd, mKd, mVd = ctx.stats[1:4]
        state[2] = ctx.scale_log2 * mQd[ctx.batch, ctx.head_c] * mKd[ctx.batch, ctx.head_c]
        state[3] = mVd[ctx.batch, ctx.head_c]
        return state


class ScaleSmem(NamedTuple):
    """The NVFP4 forward's scale tensors: the global ones ((B, H, row atoms, bytes) uint8, the
    host's blocked layout) and the shared-memory regions (their stage layouts from
    cutlass.utils.blockscaled_layout; P's codes in the PV MMA's A layout)."""

    g_rows: cute.Tensor
    g_cols: cute.Tensor
    g_b: cute.Tensor
    s_rows: cute.Tensor
    s_cols: cute.Tensor
    s_b: cute.Tensor
    sP: cute.Tensor
    s_p: cute.Tensor
    p_words: cute.Tensor


class ScaleCopy(NamedTuple):
    """One operand's scales on the MMA thread: the tcgen05.cp (smem -> TMEM) copy, its staged
    source and its destination, and the TMEM tensor the MMAs point into per K-block."""

    copy: object
    src: cute.Tensor
    dst: cute.Tensor
    tmem: cute.Tensor


class ScaleTmem(NamedTuple):
    qk_rows: ScaleCopy
    qk_cols: ScaleCopy
    p: ScaleCopy
    b: ScaleCopy


class FFPAFwdSm100FP4(FFPAFwdSm100FP8):
    """The forward for NVFP4 Q, K, V^T (`FwdFP4ConfigSm100`): tcgen05.mma kind::mxf4nvf4
    (E2M1 operands, one E4M3 scale per 16 elements along K, K = 64, fp32 accumulation) for
    both products.

    **Compile-verified only, never run** (no sm_100 GPU here): CI compiles it for sm_100a and
    checks its PTX; on a B200 each configuration first passes nvfp4.canary.

    As the e4m3 forward, with these differences (the plan: config.FwdFP4ConfigSm100):
      1. Operands as ffpa_cute/nvfp4.py encodes them (codes two per byte), V as the NVFP4 of
         V^T ([B, Hkv, D, Npad], both PV operands K-major as kind::mxf4nvf4 requires); the
         scales in the kernels' blocked layout (`nvfp4.blocked_scales`: per 128-row atom and
         64-element K-block, 512 contiguous bytes), so each stage's scales are one or two
         bulk copies (cp.async.bulk, multicast with the codes) on the stage's barrier.
      2. Before a stage's MMAs the MMA thread copies its scales to TMEM (tcgen05.cp
         32x128b.warpx4, CUTLASS's S2T layout) and points each MMA's SFA / SFB at its
         K-block; V^T's 192-row slice starts 0 or 64 rows into its first atom, so its scale
         pointer moves by 0 or 2 columns.
      3. P goes through shared memory: each softmax thread rounds its row's P (<= 2^8, the
         frame rule) per 16 keys as nvfp4.py does with tensor scale 1 (scale = e4m3(amax / 6)
         <= 42.7, code = e2m1(p / scale), satfinite), writes the codes in the PV MMA's
         A layout and the scales as one 32-bit word per 64 keys, then fences them for the
         async proxy before p_full. The row sum uses P before rounding.
      4. Dv == D, a multiple of 64 (config.can_implement); a sliding window and sinks as in
         the e4m3 forward (masked keys give P = 0, so their 16-key blocks round as usual)."""

    OPERANDS = ("q", "q_sf", "k", "k_sf", "v", "v_sf", "o", "lse", "q_descale", "k_descale",
                "v_descale", "sinks")
    BLOCK_SCALED = True
    B_K_MAJOR = True

    @staticmethod
    def fake_inputs(cfg):
        """q, q_sf, k, k_sf, v (V^T), v_sf (uint8: codes, blocked scales), o (out_dtype),
        lse, three (B, Hkv) fp32 descales, then sinks: an [Hq] fp32 stand-in with `sinks`,
        else None."""
        u8, f32 = cutlass.Uint8, Float32
        ops = [fake_tensor(u8, 4, 16) for _ in range(6)]
        return (*ops, fake_tensor(CUTLASS_DTYPES[cfg.out_dtype], 4, 8), fake_tensor(f32, 3, 1),
                *(fake_tensor(f32, 2, 1) for _ in range(3)),
                fake_tensor(f32, 1, 1) if cfg.sinks else None)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mQsf: cute.Tensor, mK: cute.Tensor, mKsf: cute.Tensor,
                 mVt: cute.Tensor, mVtsf: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mQd: cute.Tensor, mKd: cute.Tensor, mVd: cute.Tensor, mSinks,
                 softmax_scale: Float32, causal_offset: Int32, window_lo: Int32,
                 stream: cuda.CUstream):
        """q, k: (B, H, N, D / 2) uint8 codes; v: V^T's codes (B, Hkv, D, Npad / 2); q_sf,
        k_sf, v_sf: their blocked scales (B, H, row atoms, K-blocks * 512) uint8; o: (B, Hq,
        Nq, D) out_dtype; lse: (B, Hq, Nq) fp32; descales: (B, Hkv) fp32; sinks: (Hq,) fp32
        with `sinks`, else None; window_lo: read with `window`."""
        f4 = self.dtype
        q, k, vt = (cute.recast_tensor(t, f4) for t in (mQ, mK, mVt))
        self._launch(Roles(rows=q, cols=k, rows2=None, cols2=None, acc_b=vt, out=mO),
                     self._stats(mLSE, mQd, mKd, mVd, mSinks), softmax_scale, causal_offset,
                     stream, window_lo, scales=(mQsf, mKsf, mVtsf))

    def _tiled_mmas(self):
        """Both products kind::mxf4nvf4 with K-major operands from shared memory (P too)."""
        major = cute.nvgpu.OperandMajorMode.K
        args = (self.dtype, self.dtype, major, major, cutlass.Float8E4M3FN, SF_VEC,
                tcgen05.CtaGroup.ONE)
        return (sm100_utils.make_blockscaled_trivial_tiled_mma(*args, self.qk_tiler[:2]),
                sm100_utils.make_blockscaled_trivial_tiled_mma(*args, self.pv_tiler[:2]))

    # ------------------------------------------------------------------ layouts and storage
    def _scale_layouts(self, qk, pv):
        """Shared-memory layouts of the scales: R's and C's per QK stage (4 K-blocks of one
        atom), V^T's per V stage (one K-block of two atoms: N = 192 rounded to 256), P's per
        buffer (two K-blocks of one atom)."""
        cfg = self.cfg
        return (blockscaled.make_smem_layout_sfa(qk, self.qk_tiler, SF_VEC, cfg.qk_stages),
                blockscaled.make_smem_layout_sfb(qk, self.qk_tiler, SF_VEC, cfg.qk_stages),
                blockscaled.make_smem_layout_sfb(pv, self.pv_tiler, SF_VEC, cfg.v_stages),
                blockscaled.make_smem_layout_sfa(pv, self.p_tiler, SF_VEC, 2))

    def _scale_storage_fields(self, tP_l, layouts) -> dict:
        """config.FwdFP4ConfigSm100.smem_regions' scale and P regions, in order."""
        mem, align, e4m3 = cute.struct.MemRange, cute.struct.Align, cutlass.Float8E4M3FN
        sf_r, sf_c, sf_b, sf_p = layouts
        return {"sf_rows": align[mem[e4m3, cute.cosize(sf_r)], 1024],
                "sf_cols": align[mem[e4m3, cute.cosize(sf_c)], 1024],
                "sf_b": align[mem[e4m3, cute.cosize(sf_b)], 1024],
                "p": align[mem[self.dtype, cute.cosize(tP_l.outer)], 1024],
                "sf_p": align[mem[e4m3, cute.cosize(sf_p)], 1024]}

    def _scale_smem(self, storage, scaled, tP_l):
        (g_rows, g_cols, g_b), (sf_r, sf_c, sf_b, sf_p) = scaled
        s_p = storage.sf_p.get_tensor(sf_p)
        # P's scale words: row m's word for K-block kb of buffer b at 4 (m % 32) + m // 32
        # (the atom's byte 16 (m % 32) + 4 (m // 32)), kb * 128, b * (K-blocks * 128)
        kbs, atom_words = self.cfg.tile_n // FP4_MMA_K, SF_ATOM_BYTES // 4
        words = cute.make_tensor(
            cute.recast_ptr(s_p.iterator, dtype=Int32),
            cute.make_layout(((32, 4), kbs, 2), stride=((4, 1), atom_words, kbs * atom_words)))
        return ScaleSmem(g_rows, g_cols, g_b, storage.sf_rows.get_tensor(sf_r),
                         storage.sf_cols.get_tensor(sf_c), storage.sf_b.get_tensor(sf_b),
                         storage.p.get_tensor(tP_l.outer, swizzle=tP_l.inner), s_p, words)

    # ------------------------------------------------------------------ loads
    @cute.jit
    def _bulk(self, dst, src, nbytes: int, bar, mcast):
        """One bulk copy of nbytes (16-byte aligned) into this CTA's (mcast: the cluster's)
        shared memory, completing on bar."""
        from cutlass.experimental.primitives.nvvm_wrapper import (
            cp_async_bulk_shared_cluster_global)

        with cute.arch.elect_one():
            cp_async_bulk_shared_cluster_global(dst, src, bar, nbytes, multicast_mask=mcast)

    @cute.jit
    def _scale_load_qk(self, sc, s, c, batch, head, c_head, m_block, n, bar, mcast):
        """Chunk c's scales of the row tile (Q) and of key block n (K): K-blocks 4c .. 4c + 3
        of one atom each, contiguous in the blocked layout."""
        nbytes = self.cfg.sf_stage_bytes
        for g, sdst, h, atom in ((sc.g_rows, sc.s_rows, head, m_block),
                                 (sc.g_cols, sc.s_cols, c_head, n)):
            src = cute.local_tile(g[batch, h, atom, None], (nbytes,), (c,))
            self._bulk(sdst[None, None, None, s].iterator, src.iterator, nbytes, bar, mcast)

    @cute.jit
    def _scale_load_b(self, sc, s, batch, c_head, o_part, kblock, bar):
        """V^T's scales of this CTA's 192 rows at one K-block of 64 keys: the two atoms from
        the one holding its first row."""
        atom0 = o_part * self.cfg.acc_cta // SF_ATOM_ROWS
        dst = sc.s_b[None, None, None, s].iterator
        for t in cutlass.range_constexpr(2):
            src = cute.local_tile(sc.g_b[batch, c_head, atom0 + t, None], (SF_ATOM_BYTES,),
                                  (kblock,))
            self._bulk(dst + t * SF_ATOM_BYTES, src.iterator, SF_ATOM_BYTES, bar, None)

    # ------------------------------------------------------------------ MMA thread
    @cute.jit
    def _scale_copy(self, smem: cute.Tensor, tmem_t: cute.Tensor) -> ScaleCopy:
        """The tcgen05.cp (32x128b, warpx4) of a staged scale region into tmem_t."""
        atom = cute.make_copy_atom(tcgen05.Cp4x32x128bOp(tcgen05.CtaGroup.ONE),
                                   cutlass.Float8E4M3FN)
        dst_c = cute.filter_zeros(tmem_t)
        tiled = tcgen05.make_s2t_copy(atom, dst_c)
        thr = tiled.get_slice(0)
        src = tcgen05.get_s2t_smem_desc_tensor(tiled, thr.partition_S(cute.filter_zeros(smem)))
        return ScaleCopy(tiled, src, thr.partition_D(dst_c), tmem_t)

    @cute.jit
    def _scale_tmem(self, sc, tmem, qk, pv, o_part):
        """The TMEM scale regions (config.FwdFP4ConfigSm100.tmem_regions) and their copies.
        V^T's MMA pointer starts (o_part * 192) % 128 / 32 columns into its region (the slice's
        first row inside its first atom)."""
        cfg, e4m3 = self.cfg, cutlass.Float8E4M3FN

        def region(col, lay):
            return cute.make_tensor(cute.recast_ptr(tmem + col, dtype=e4m3), lay)

        def stage0(t):
            return cute.slice_(t.layout, (None, None, None, 0))

        sf_qk, sf_pv = cfg.sf_qk_offset, cfg.sf_pv_offset
        t_rows = region(sf_qk, blockscaled.make_tmem_layout_sfa(qk, self.qk_tiler, SF_VEC,
                                                                stage0(sc.s_rows)))
        t_cols = region(sf_qk + 4 * cute.size(t_rows, mode=[2]),
                        blockscaled.make_tmem_layout_sfb(qk, self.qk_tiler, SF_VEC,
                                                         stage0(sc.s_cols)))
        t_p = region(sf_pv, blockscaled.make_tmem_layout_sfa(pv, self.p_tiler, SF_VEC,
                                                             stage0(sc.s_p)))
        b_col = sf_pv + 4 * cute.size(t_p, mode=[2])
        b_lay = blockscaled.make_tmem_layout_sfb(pv, self.pv_tiler, SF_VEC, stage0(sc.s_b))
        shift = (o_part * cfg.acc_cta) % SF_ATOM_ROWS // 32
        b_copy = self._scale_copy(sc.s_b, region(b_col, b_lay))
        return ScaleTmem(self._scale_copy(sc.s_rows, t_rows),
                         self._scale_copy(sc.s_cols, t_cols),
                         self._scale_copy(sc.s_p, t_p),
                         ScaleCopy(b_copy.copy, b_copy.src, b_copy.dst,
                                   region(b_col + shift, b_lay)))

    @cute.jit
    def _scale_s2t(self, part: ScaleCopy, stage):
        cute.copy(part.copy, part.src[None, None, None, None, stage], part.dst)

    @cute.jit
    def _scale_set(self, mma, sfa: ScaleCopy, sfb: ScaleCopy, ka, kb):
        """The next MMA's scale pointers: A's K-block ka, B's K-block kb."""
        mma.set(tcgen05.Field.SFA, sfa.tmem[None, None, ka].iterator)
        mma.set(tcgen05.Field.SFB, sfb.tmem[None, None, kb].iterator)

    # ------------------------------------------------------------------ softmax threads
    @cute.jit
    def _scale_store_p(self, ctx: Ctx, sc, tSr, buf):
        """This row's P (fp32 in tSr, column e = element e, <= 2^8) to NVFP4 in shared memory
        (class docstring, 3.), fenced for the MMA's async reads."""
        tSr = cute.make_tensor(tSr.iterator, cute.make_layout(cute.size(tSr)))  # compact
        blocks = cute.size(tSr) // SF_VEC
        amax = cute.make_rmem_tensor((blocks,), Float32)
        for b in cutlass.range_constexpr(blocks):
            a = tSr[b * SF_VEC]
            for e in cutlass.range_constexpr(1, SF_VEC):
                a = cute.arch.fmax(a, tSr[b * SF_VEC + e])
            amax[b] = a * (1.0 / 6.0)
        scale8 = cute.make_rmem_tensor((blocks,), cutlass.Float8E4M3FN)
        scale8.store(amax.load().to(cutlass.Float8E4M3FN))
        amax.store(scale8.load().to(Float32))  # the scales as rounded
        for b in cutlass.range_constexpr(blocks):
            inv = Float32(0.0)
            if amax[b] > Float32(0.0):
                inv = cute.arch.rcp_approx(amax[b])
            for e in cutlass.range_constexpr(SF_VEC):
                tSr[b * SF_VEC + e] = tSr[b * SF_VEC + e] * inv
        codes = cute.make_rmem_tensor((cute.size(tSr),), self.dtype)
        codes.store(tSr.load().to(self.dtype))
        row = ctx.tidx
        words = cute.recast_tensor(scale8, Int32)
        for kb in cutlass.range_constexpr(cute.size(tSr) // FP4_MMA_K):
            cute.autovec_copy(cute.local_tile(codes, (FP4_MMA_K,), (kb,)),
                              sc.sP[(row, None), 0, kb, buf])
            sc.p_words[row, kb, buf] = words[kb]
        cute.arch.fence_proxy("async.shared", space="cta")


__all__ = ["FFPAFwdSm100", "FFPAFwdSm100FP4", "FFPAFwdSm100FP8"]
