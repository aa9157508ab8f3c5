"""Hopper attention forward for large head dims on the warp-specialised ring ("F1").

What it computes: O = softmax(scale * Q K^T [+ causal mask]) V and LSE, for q [B, Hq, Nq, D],
k/v [B, Hkv, Nkv, D] (any strides, unit stride on D), Hq a multiple of Hkv (GQA/MQA), any Nq, Nkv,
bf16/fp16 in, fp32 accumulation, D from 264 to 1024 in steps of 8: O in one CTA up to 576
(above 512 with 288-column O shares, config `wide_o`), split over two CTAs above (`o_split`,
below).

`FFPAFwdSm90` runs on `RingSkeletonSm90` (skeleton_sm90.py: the warpgroups, rings, P hand-over
and tensor-core order) with Q as the resident rows, K as the streamed columns, V as the
accumulators' B operand and O as the output (kernel-design.md §2, design F1 without the producer
warpgroup; docs/perf-log.md has the microbenchmarks that chose it). One CTA = one 64-row Q tile
of one (batch, head):

  WG0 "S"     S = Q K^T over D in 64-column chunks (m64n128k16 SS WGMMA), mask, online softmax
              (common/softmax.py), P -> smem (stmatrix) with each row's O rescale factor, LSE.
  WG1 "O-lo"  O[:, :D_lo] += P V[:, :D_lo] (SS WGMMA, A = P from smem);
  WG2 "O-hi"  O[:, D_lo:] likewise. Each first rescales its O rows by the factor the S
              warpgroup published with P; after the last block the S warpgroup publishes
              1 / row_sum through the same buffers, so the O warpgroups normalise with the
              protocol they already follow.

This module holds what is the forward's own: the score step (mask, online softmax, P), the
final factors and LSE, and `kv_pair`'s exchange between the two CTAs of a pair.

Shared memory (D = 512): Q [64 x 512] resident 64 KB; K ring 4 x 16 KB; two V rings 2 x 2 x
[32 x 256] = 64 KB; P 2 x [64 x 128] 32 KB; row factors 512 B (`config.smem_bytes`).

Masking: only blocks that cross Nkv, the causal diagonal or a sliding window's left edge (one
runtime check per block); blocks left of the window are not visited (common/mask.py; a window's
right edge is the causal rule at offset min(causal, right)). O and LSE stores skip rows past Nq.
Sinks (config `sinks`): the head's sink logit joins each row's denominator and LSE in the final
factors (common/softmax.py, Note [Sinks]).

D > 576, and the FP8 and varlen forwards above 512 (config `o_split` = 2): O[64 x D] does
not fit two warpgroups' registers, so two adjacent CTAs take the same Q tile and each computes
D/2 columns of O (its O warpgroups D/4 each). Both compute the whole S = Q K^T (QK is
recomputed: 2/3 of the tensor work is counted at D=1024), and Q does not stay resident (64 x
1024 would be 128 KB): it streams through the K ring, a [64 x 64] Q chunk beside each [128 x
64] K chunk, on the same barrier. CTA 0 writes LSE.
Run and tested on the H200; the forward's route for D > 512 only with `Options.kv_pair` off (the
backward kernels split their gradient this way above 512).

`kv_pair` (config field, D > 512 with Dv == D; run and tested on the H200, the planner's default:
`Options.kv_pair`): the two CTAs form a cluster and split the KV blocks instead of both
computing S. At step i CTA r scores block 2i + r; the pair joins its row maxima (st.async into
the peer's `peer_stat`, counted on its `x[b]` mbarrier) so both keep one running max, and each
sends its P tile into the same slot of the peer's four-slot P buffer (one shared::cluster bulk
copy, counted on the peer's `pp[b]`). Each O warpgroup then runs P[2i] V[2i] + P[2i+1] V[2i+1]
on its columns; its warps arrive on both CTAs' `p_empty[b]` (the peer writes our slots). Row
sums stay per CTA and are joined at the end. With an odd block count both score the last block
(no exchange; rank 1 leaves it out of its row sum). Per pair of blocks each CTA executes 2 GEMM
units for 2 counted.

`stream_q` is also a config field at D <= 512 (a tuning variant: the 64 KB of resident Q go to
deeper V rings, for L2 re-reads of Q); the planner leaves it off there until it is measured.

`FFPAFwdSm90FP8` (below) is the same kernel with e4m3 operands (docs/design.md section 10).

Constraints (mirrored by `config.can_implement`): sm_90a; bf16/fp16; D a multiple of 8 in
[264, 512] or of 16 in (512, 1024]; last stride 1, 16-byte aligned base, other strides multiples
of 8 elements.
"""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline  # noqa: F401  (NamedBarrier, kv_pair)
from cutlass import Float32, Int32, const_expr

from ..common.softmax import FRAME_FLOOR_LOG2, P_BIAS_LOG2, OnlineSoftmax
from ..common.tensors import LOG2_E, fake_args, fake_cu, fake_fp8_args, fake_tensor
from .config import TILE_M, FwdConfigSm90, can_implement
from .ring_context import Roles, ScoreFrags, ScoreIO, ScoreStep, Tile
from .skeleton_sm90 import RingSkeletonSm90

# `lazy_rescale` (common/softmax.py, Note [Lazy rescaling]): (above, below) in log2 units. 16-bit
# P: a row's max is kept while a block's max exceeds it by <= 8 (P <= 256; a max only grows, so
# no `below`). FP8: the frame is kept while the block's max lies 4 under to 2 over it, P's bias
# 8 - 2 (P <= 256 still)
LAZY_16 = (8.0, None)
LAZY_FP8 = (2.0, 4.0)


class FFPAFwdSm90(RingSkeletonSm90):
    """F1 forward; one instance per `FwdConfigSm90` (the compile key).

    Algorithm, per CTA (64-row Q tile m_block of query head `head`; `o_part` of O's columns):
      1. Skeleton entry (`RingSkeletonSm90.kernel`): K/V head = head // (Hq / Hkv); KV blocks
         n_max-1 down to 0, n_max the causal / Nkv bound of the tile (the masked ones first).
      2. S warpgroup, per block n: S = Q K[n]^T (the skeleton's C ring), then `_score_step`:
         mask if the block crosses Nkv or the diagonal, row max -> running max, factor =
         exp2((m_old - m_new) * scale_log2), P = exp2(S * scale_log2 - m_new * scale_log2)
         (bf16 / fp16) -> smem, the factors beside it.
      3. O warpgroups (skeleton): O = O * factor + P V[n] on their halves of O's columns.
      4. `_final_factors`: row sums joined over the quad, factor = 1 / row_sum (0 for a row
         with no visible key), LSE = (m * scale_log2 + log2(row_sum)) * ln 2 (-inf for such a
         row); O = O * factor stored in the input dtype, LSE by CTA 0 (rows < Nq).
      `kv_pair` (O split, Dv == D): steps 2-4 over pairs of blocks, CTA r scoring block
      2 i + r; the row maxima and P tiles cross to the peer (`_pair_softmax`, the skeleton's
      `_send_p`), the row sums join at the end (`_final_factors_pair`).

    Constraints (`config.can_implement`): sm_90a; bf16 / fp16; D a multiple of 8 in [264, 512]
    or of 16 in (512, 1024] (O split over two CTAs); Dv == D, or a multiple of 16 in [64, 512]
    (then no `kv_pair`); Hq a multiple of Hkv.
    """

    rescale_o = True  # O warpgroups multiply O's rows by the published factors
    OPERANDS = ("q", "k", "v", "o", "lse", "sinks", "cu_q", "cu_k")
    SCALARS = ("softmax_scale", "causal_offset", "window_lo", "num_ctas")

    def __init__(self, cfg: FwdConfigSm90):
        self._refuse(can_implement(cfg))
        super().__init__(cfg)

    @staticmethod
    def fake_inputs(cfg):
        """(q, k, v, o, lse) stand-ins, then sinks: an [Hq] fp32 stand-in with `sinks`, then
        cu_q, cu_k: int32 [B + 1] stand-ins with `varlen` (else None: the compiled function
        then takes None there)."""
        return (*fake_args(cfg), fake_tensor(Float32, 1, 1) if cfg.sinks else None,
                *fake_cu(cfg))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mSinks, mCuQ, mCuK, softmax_scale: Float32,
                 causal_offset: Int32, window_lo: Int32, num_ctas: Int32,
                 stream: cuda.CUstream):
        """q/k/v/o: (B, H, N, D); lse: (B, Hq, Nq) fp32; sinks: (Hq,) fp32 with `sinks`, else
        None; cu_q, cu_k: with `varlen` the sequences' cumulative lengths (int32 [B + 1]; q,
        k, v, o then (1, H, total, D) views of packed tensors, lse (1, Hq, total_q)), else
        None; window_lo: read with `window`; num_ctas: the device's SM count, the grid of a
        `persistent` config. Grid = (m_blocks * o_split, Hq, B), or (`persistent`)
        (min(tiles, num_ctas), 1, 1), or (`varlen`) ((ceil(total_q / 64) + B) * o_split, Hq,
        1)."""
        self._launch(Roles(rows=mQ, cols=mK, acc_b=mV, out=mO), mLSE, softmax_scale,
                     causal_offset, stream, mSinks if const_expr(self.cfg.sinks) else None,
                     window_lo, num_ctas, (mCuQ, mCuK))

    # ---------------------------------------------------------------- the score step
    @cute.jit
    def _make_softmax(self, num_rows: cutlass.Constexpr, tile: Tile, extra):
        """The online softmax at the tile's scale (`lazy_rescale`: Note [Lazy rescaling] in
        common/softmax.py)."""
        lazy = LAZY_16 if const_expr(self.cfg.lazy_rescale) else None
        return OnlineSoftmax(num_rows, tile.scale_log2, lazy=lazy)

    @cute.jit
    def _score_step(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, step: ScoreStep,
                    n_count):
        """Mask, online softmax, P in rP (`kv_pair`: with the peer's row maxima)."""
        if const_expr(self.kv_pair):
            self._pair_softmax(tile, io, frags, step, 2 * step.i + 1 >= n_count)
        else:
            self._softmax_block(tile, frags, step.n_block)

    @cute.jit
    def _softmax_block(self, tile: Tile, frags: ScoreFrags, n_block):
        """Mask (only blocks crossing Nkv or the diagonal), online softmax, P in rP."""
        acc_S_mn = frags.acc_S_mn
        softmax, factor = frags.softmax, frags.factor
        self._mask_block(tile, frags, n_block)
        blk_max = softmax.block_max(acc_S_mn)
        softmax.update(acc_S_mn, blk_max, [], factor)
        self._p_to_regs(frags)

    @cute.jit
    def _final_factors(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, n_iter):
        """After the last block: factor = 1 / row_sum (0 for empty rows; with `sinks` the
        head's sink joins the sum, Note [Sinks] in common/softmax.py); returns the LSE."""
        sink_log2 = None
        if const_expr(self.cfg.sinks):  # the [Hq] sink logits
            sink_log2 = self._sinks(io.extra)[tile.head] * LOG2_E
        if const_expr(self.kv_pair):
            lse = self._final_factors_pair(tile, io, frags, n_iter, sink_log2)
        else:
            lse = self._final_factors_one(frags, sink_log2)
        return lse

    def _sinks(self, extra):
        """The [Hq] sink logits among the kernel's extra operands (the forward's: all of it)."""
        return extra

    @cute.jit
    def _final_factors_one(self, frags: ScoreFrags, sink_log2):
        """One CTA's row sums: factor = 1 / row_sum, and the LSE."""
        softmax, factor = frags.softmax, frags.factor
        num_rows = cute.size(factor)
        softmax.finalize_sum()
        lse = cute.make_rmem_tensor(num_rows, Float32)   # (rows,)
        softmax.normalize([], lse, factor, sink_log2)
        return lse

    # ---------------------------------------------------------------- kv_pair (D > 512)
    @cute.jit
    def _exchange_rows(self, vals, tile: Tile, io: ScoreIO, tScS_mn, b, phase,
                       is_max: cutlass.Constexpr):
        """Combine per-row values with the peer's: each quad's first lane stores its rows'
        values into the peer's `pair.stat[:, b]` (st.async, counted on the peer's x[b]);
        after x[b] completes, vals = max (or sum) of both."""
        rank, pair, bars, tidx, lane = tile.o_part, io.pair, io.bars, io.tidx, io.lane
        peer = 1 - rank
        if lane % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(vals)):
                row = tScS_mn[r, 0][0]
                dst = pair.stat.iterator + (row + b * TILE_M)
                cute.arch.store_async_dsmem(dst, Float32(vals[r]).bitcast(Int32), bars.x + b,
                                            peer)
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bars.x + b, TILE_M * 4)
        cute.arch.mbarrier_wait(bars.x + b, phase)
        for r in cutlass.range_constexpr(cute.size(vals)):
            other = pair.stat[tScS_mn[r, 0][0], b]
            if const_expr(is_max):
                vals[r] = cute.arch.fmax(vals[r], other)
            else:
                vals[r] = vals[r] + other

    @cute.jit
    def _pair_softmax(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, step: ScoreStep,
                      solo):
        """`kv_pair` step i: mask, the block max joined with the peer's (both CTAs then keep
        the same running max, so one O factor serves both tiles), P in rP. The row sums stay
        per CTA (joined at the end); a block both CTAs scored (`solo`) counts once (rank 0)."""
        acc_S_mn, tScS_mn = frags.acc_S_mn, frags.tScS_mn
        softmax, factor = frags.softmax, frags.factor
        rank, i, n_block = tile.o_part, step.i, step.n_block
        self._mask_block(tile, frags, n_block)
        blk_max = softmax.block_max(acc_S_mn)
        if not solo:
            self._exchange_rows(blk_max, tile, io, tScS_mn, i % 2, (i // 2) & 1, True)
        row_sum = softmax.row_sum
        prev = cute.make_rmem_tensor(cute.size(blk_max), Float32)   # (rows,)
        for r in cutlass.range_constexpr(cute.size(blk_max)):
            prev[r] = row_sum[r]
        softmax.update(acc_S_mn, blk_max, [], factor)
        if solo and rank == 1:
            for r in cutlass.range_constexpr(cute.size(blk_max)):
                row_sum[r] = prev[r] * factor[r]
        self._p_to_regs(frags)

    @cute.jit
    def _final_factors_pair(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, n_iter,
                            sink_log2):
        """`kv_pair`: the row sums of both CTAs joined (same running max on both), then
        factor = 1 / row_sum and the LSE as `_final_factors_one`."""
        softmax, factor, tScS_mn = frags.softmax, frags.factor, frags.tScS_mn
        num_rows = cute.size(factor)
        softmax.finalize_sum()
        self._exchange_rows(softmax.row_sum, tile, io, tScS_mn, n_iter % 2, (n_iter // 2) & 1,
                            False)
        lse = cute.make_rmem_tensor(num_rows, Float32)   # (rows,)
        softmax.normalize([], lse, factor, sink_log2)
        return lse


class Descales(NamedTuple):
    """The FP8 forward's dequantisation factors, [B, Hkv] fp32 each: x = x_fp8 * descale; and
    the [Hq] sink logits with `sinks` (else None)."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor
    sinks: object = None


class FFPAFwdSm90FP8(FFPAFwdSm90):
    """The forward for e4m3 Q, K, V (`FwdFP8ConfigSm90`): `FFPAFwdSm90` with 8-bit operands
    throughout (the skeleton's `fp8` paths) and its descales folded into the score state.

    Algorithm, per CTA (as the 16-bit forward's, with these differences):
      1. Skeleton entry with Q (resident rows), K (streamed columns), Vt (B operand, transposed
         by the host: [B, Hkv, D, N'], rows 16-byte aligned, the keys of each 16-key group
         interleaved as P is stored: `VT_INTERLEAVED`), O (output, in out_dtype).
      2. S warpgroup, per KV block: S = Q K^T by m64n128k32 e4m3 WGMMAs over 128-column
         (128-byte) chunks of D; the score state (`_make_softmax`) scales by softmax_scale *
         q_descale * k_descale (per (batch, KV head)); P = exp2(s * scale_log2 - frame + 8) in
         each block's own frame (<= 256: no e4m3 saturation; common/softmax.py, Note [FP8 P:
         the block's own frame]), rounded to e4m3 and stored by stmatrix as byte pairs (the
         skeleton's `_p_to_regs`; common/transpose.py, Note [Interleaved keys]). Unmasked
         problems up to D=384 issue the next block's QK around the score step (config
         `overlap`, `_overlap_blocks` in overlap_ring.py).
      3. O warpgroups: O += P Vt^T by m64nNk32 e4m3 WGMMAs, both operands K-major, Vt streamed
         in [D/2 x 64] stages.
      4. O = O / row_sum * v_descale (the final factors carry V's descale), written in
         out_dtype; LSE in fp32 (natural log).

    Constraints (`config.can_implement`): sm_90a; e4m3 in, bf16 / fp16 out; D a multiple of 16
    in [272, 1024] (264 is not a multiple of 16); Dv == D. A sliding window and sinks as in the
    16-bit forward (the sinks ride in `Descales`).
    """

    OPERANDS = ("q", "k", "vt", "o", "lse", "q_descale", "k_descale", "v_descale", "sinks")
    SCALARS = ("softmax_scale", "causal_offset", "window_lo")
    # Vt's keys interleaved in 16-key groups as P is stored (common/transpose.py, Note
    # [Interleaved keys]; fp8._transposed_v)
    VT_INTERLEAVED = True

    @staticmethod
    def fake_inputs(cfg):
        """The FP8 stand-ins (`fake_fp8_args`), then sinks: an [Hq] fp32 stand-in with
        `sinks`, else None."""
        return (*fake_fp8_args(cfg), fake_tensor(Float32, 1, 1) if cfg.sinks else None)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mQd: cute.Tensor, mKd: cute.Tensor, mVd: cute.Tensor,
                 mSinks, softmax_scale: Float32, causal_offset: Int32, window_lo: Int32,
                 stream: cuda.CUstream):
        """q, k: (B, H, N, D) e4m3; vt: (B, Hkv, D, Nkv) e4m3; o: (B, Hq, Nq, D) out_dtype;
        lse: (B, Hq, Nq) fp32; descales: (B, Hkv) fp32; sinks: (Hq,) fp32 with `sinks`, else
        None; window_lo: read with `window`."""
        self._launch(Roles(rows=mQ, cols=mK, acc_b=mVt, out=mO), mLSE, softmax_scale,
                     causal_offset, stream,
                     Descales(mQd, mKd, mVd, mSinks if const_expr(self.cfg.sinks) else None),
                     window_lo)

    def _sinks(self, extra):
        return extra.sinks

    @cute.jit
    def _make_softmax(self, num_rows: cutlass.Constexpr, tile: Tile, extra: Descales):
        """Scores dequantised through the scale; P in each block's frame; 1 / row_sum carries
        V's descale."""
        batch, head_kv = tile.batch, tile.head_c
        qk = extra.q[batch, head_kv] * extra.k[batch, head_kv]
        lazy = LAZY_FP8 if const_expr(self.cfg.lazy_rescale) else None
        bias = P_BIAS_LOG2 - (LAZY_FP8[0] if const_expr(self.cfg.lazy_rescale) else 0.0)
        return OnlineSoftmax(num_rows, tile.scale_log2 * qk, p_bias_log2=bias,
                             frame_floor_log2=FRAME_FLOOR_LOG2, out_scale=extra.v[batch, head_kv],
                             lazy=lazy)


__all__ = ["Descales", "FFPAFwdSm90", "FFPAFwdSm90FP8"]
