"""Hopper attention forward for large head dims: warp-specialised WGMMA + TMA ("F1").

What it computes: O = softmax(scale * Q K^T [+ causal mask]) V and LSE, for q [B, Hq, Nq, D],
k/v [B, Hkv, Nkv, D] (any strides, unit stride on D), Hq a multiple of Hkv (GQA/MQA), any Nq, Nkv,
bf16/fp16 in, fp32 accumulation, D from 264 to 512 in steps of 8, and from 528 to 1024 in steps
of 16 with O split over two CTAs (`o_split`, below).

One CTA = one 64-row Q tile of one (batch, head), three warpgroups with separate roles
(kernel-design.md §2, design F1 without the producer warpgroup; docs/perf-log.md has the
microbenchmarks that chose it):

  WG0 "S"     S = Q K^T over D in 64-column chunks (m64n128k16 SS WGMMA), mask, online softmax
              (common/softmax.py), P -> smem (stmatrix) with each row's O rescale factor, LSE.
  WG1 "O-lo"  O[:, :D_lo] += P V[:, :D_lo] (SS WGMMA, A = P from smem);
  WG2 "O-hi"  O[:, D_lo:] likewise. Each first rescales its O rows by the factor the S
              warpgroup published with P.

O[64 x 512] fp32 is 128 KB, half the register file: it is split along D between the two O
warpgroups (D_lo = D_hi = D/2 when D % 16 == 0, else D_lo = D_hi + 8: WGMMA N is a multiple of
8). 384 threads give every thread 168 registers; no `setmaxnreg`: ptxas compiles every instruction
against the kernel-wide budget (65536 / threads), so a 4th producer warpgroup (128 registers each)
could not hold an m64n256 accumulator (ptxas asks for 154).

Loads: TMA only, and every ring feeds exactly one warpgroup, which also refills it: the S
warpgroup owns Q and the K ring ([128 x 64] chunks), each O warpgroup its V ring ([v_rows x D_half]
stages). As soon as a stage's WGMMAs are done (wait_group(1) after the next stage's are issued)
the owner issues the TMA for the stage `stages` positions ahead; a stage only has a "full"
mbarrier (TMA transaction bytes), and since its only reader is its only writer, no "empty" one.

D > 512 (config `o_split` = 2): O[64 x D] does not fit two warpgroups' registers, so two
adjacent CTAs take the same Q tile and each computes D/2 columns of O (its O warpgroups D/4
each). Both compute the whole S = Q K^T (QK is recomputed: 2/3 of the tensor work is counted at
D=1024), and Q no longer stays resident (64 x 1024 would be 128 KB): it streams through the K
ring, a [64 x 64] Q chunk beside each [128 x 64] K chunk, on the same barrier. CTA 0 writes LSE.
Run and tested on the H200; the forward's route for D > 512 only with `Options.kv_pair` off (the
backward kernels split their gradient this way above 512).

`kv_pair` (config field, D > 512 with Dv == D; run and tested on the H200, the planner's default:
`Options.kv_pair`): the two CTAs form a cluster and split the KV blocks instead of both
computing S. At step i CTA r scores
block 2i + r; the pair joins its row maxima (st.async into the peer's `peer_stat`, counted on
its `x[b]` mbarrier) so both keep one running max, and each sends its P tile into the same
slot of the peer's four-slot P buffer (one shared::cluster bulk copy, counted on the peer's
`pp[b]`). Each O warpgroup then runs P[2i] V[2i] + P[2i+1] V[2i+1] on its columns; its warps
arrive on both CTAs' `p_empty[b]` (the peer writes our slots). Row sums stay per CTA and are
joined at the end. With an odd block count both score the last block (no exchange; rank 1
leaves it out of its row sum). Per pair of blocks each CTA executes 2 GEMM units for 2 counted.

Shared memory (D = 512): Q [64 x 512] resident 64 KB; K ring 4 x 16 KB; two V rings 2 x 2 x
[32 x 256] = 64 KB; P 2 x [64 x 128] 32 KB; row factors 512 B (`config.smem_bytes`).

Hand-off of P (double-buffered, mbarriers): P_full[b] (128 S-thread arrivals after a proxy fence,
so WGMMA's async proxy sees the stores) and P_empty[b] (an arrival by every O thread once its
PV WGMMAs on buffer b completed). Every thread, not one per warp: each lane reads its rows'
factors from sFactor[:, b] with a plain ld.shared, and only its own arrival (release) orders that
read before the S warpgroup's next write of sFactor[:, b] (acquire by its P_empty wait); one
arrival per warp left the other 31 lanes' reads unordered, which compute-sanitizer's racecheck
reports as write-after-read hazards on the factor buffer. Kernels whose accumulator warpgroups
read no factors (`rescale_o` False: the backward) keep one arrival per warp. After the last block
the S warpgroup publishes 1 / row_sum through the same buffers (no P), so the O warpgroups
normalise with the protocol they already follow.

Tensor-core order: the S warpgroup writes P[n], issues `publish_after` chunks of QK[n+1], then
arrives on P_full[n]; WGMMAs from different warpgroups run in issue order on the H200
(docs/perf-log.md), so PV[n] queues behind the start of QK[n+1] and runs while softmax[n+1] does.

Masking: only blocks that cross Nkv or the causal diagonal (one runtime check per block). TMA
zero-fills rows past Nq / Nkv and columns past D, so no load carries a predicate; O and LSE
stores skip rows past Nq.

`stream_q` is also a config field at D <= 512 (a tuning variant: the 64 KB of resident Q go to
deeper V rings, for L2 re-reads of Q); the planner leaves it off there until it is measured.

Hooks, for the backward kernels (bwd_sm90.py) that reuse this skeleton with the operands in other
roles: `_heads` (which head the streamed operands come from, and the head group a tile walks),
`_block_range` / `_block` (the sequence of column blocks and each one's head), `_k_src` / `_v_src`
(TMA sources of a block), `_stats_head` / `_block_prefetch` (whose per-row statistics a block
reads, loaded before its WGMMAs), `_softmax_block` (scores -> P and row factors),
`_final_factors`, `rescale_o`, for two score products per block `second_score` /
`seq_scores` / `_chunk` / `_first_scores`, and `_operands` / `_warpgroups` (the global
operands of each role, and the warpgroups run on them) and `_after_p_store` (`kv_pair`'s P
exchange). The forward's own versions are the code above.

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

from ..common.mask import apply_mask, block_needs_mask
from ..common.softmax import OnlineSoftmax
from ..common.tensors import CUTLASS_DTYPES
from .config import TILE_M, FwdConfigSm90, can_implement
from .skeleton_sm90 import WG_THREADS, RingSkeletonSm90


class FFPAFwdSm90(RingSkeletonSm90):
    """F1 forward; one instance per `FwdConfigSm90` (the compile key)."""

    rescale_o = True  # O warpgroups multiply O's rows by the published factors

    def __init__(self, cfg: FwdConfigSm90):
        reason = can_implement(cfg)
        if reason:
            raise ValueError(f"{type(self).__name__}: {reason}")
        super().__init__(cfg)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: Float32, causal_offset: Int32,
                 stream: cuda.CUstream):
        """q/k/v/o: (B, H, N, D); lse: (B, Hq, Nq) fp32. Grid = (m_blocks * o_split, Hq, B)."""
        self._launch(mQ, mK, mV, mO, mLSE, softmax_scale, causal_offset, stream, None)

    @cute.jit
    def _score_block(self, acc_S, acc_S_mn, tScS_mn, softmax, factor, rP, m_block, n_block,
                     seqlen_k, causal_offset, mLSE, batch, head, sFactor, tidx, acc_2, extra,
                     pre, i, n_count, o_part, bars, pair, lane):
        """Mask, online softmax, P in rP (`kv_pair`: with the peer's row maxima)."""
        if const_expr(self.kv_pair):
            self._pair_softmax(acc_S, acc_S_mn, tScS_mn, softmax, factor, rP, m_block,
                               n_block, seqlen_k, causal_offset, i, 2 * i + 1 >= n_count,
                               o_part, bars, pair, tidx, lane)
        else:
            self._softmax_block(acc_S, acc_S_mn, tScS_mn, softmax, factor, rP, m_block,
                                n_block, seqlen_k, causal_offset, mLSE, batch, head,
                                sFactor, tidx, acc_2, extra, pre, i)

    @cute.jit
    def _softmax_block(self, acc_S, acc_S_mn, tScS_mn, softmax: OnlineSoftmax, factor, rP,
                       m_block, n_block, seqlen_k, causal_offset, mLSE, batch, head, sFactor,
                       tidx, acc_2, extra, pre, i):
        """Mask (only blocks crossing Nkv or the diagonal), online softmax, P in rP (step i
        of the tile's blocks)."""
        if block_needs_mask(m_block, n_block, seqlen_k, causal_offset, TILE_M, self.tile_n,
                            self.causal):
            apply_mask(acc_S_mn, tScS_mn, m_block, n_block, seqlen_k, causal_offset,
                       TILE_M, self.tile_n, self.causal)
        blk_max = softmax.block_max(acc_S_mn)
        softmax.update(acc_S_mn, blk_max, [], factor)
        rP.store(acc_S.load().to(self.dtype))

    @cute.jit
    def _final_factors(self, softmax, factor, num_rows: cutlass.Constexpr, n_iter, o_part,
                       bars, pair, tidx, tScS_mn, lane):
        """After the last block: factor = 1 / row_sum (0 for empty rows); returns the LSE."""
        if const_expr(self.kv_pair):
            lse = self._final_factors_pair(softmax, factor, num_rows, n_iter, o_part, bars,
                                           pair, tidx, tScS_mn, lane)
        else:
            lse = self._final_factors_one(softmax, factor, num_rows)
        return lse

    @cute.jit
    def _final_factors_one(self, softmax: OnlineSoftmax, factor, num_rows: cutlass.Constexpr):
        """After the last block: factor = 1 / row_sum (0 for empty rows); returns the LSE."""
        softmax.finalize_sum()
        lse = cute.make_rmem_tensor(num_rows, Float32)
        softmax.normalize([], lse, factor)
        return lse

    @cute.jit
    def _after_p_store(self, pair, bars, b, i, n_count, o_part, tidx, extra):
        """After P of step i is in its slot of buffer b and fenced: `kv_pair` sends it to the
        peer when the step has a pair of blocks (nothing else here; a hook)."""
        if const_expr(self.kv_pair):
            if 2 * i + 1 < n_count:  # a pair of blocks: our P tile to the peer too
                self._send_p(pair, bars, b, o_part, tidx)

    # ---------------------------------------------------------------- kv_pair (D > 512)
    @cute.jit
    def _exchange_rows(self, vals, pair, bars, b, phase, rank, tidx, tScS_mn, lane,
                       is_max: cutlass.Constexpr):
        """Combine per-row values with the peer's: each quad's first lane stores its rows'
        values into the peer's `pair.stat[:, b]` (st.async, counted on the peer's x[b]);
        after x[b] completes, vals = max (or sum) of both."""
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
    def _pair_softmax(self, acc_S, acc_S_mn, tScS_mn, softmax: OnlineSoftmax, factor, rP,
                      m_block, n_block, seqlen_k, causal_offset, i, solo, rank, bars, pair,
                      tidx, lane):
        """`kv_pair` step i: mask, the block max joined with the peer's (both CTAs then keep
        the same running max, so one O factor serves both tiles), P in rP. The row sums stay
        per CTA (joined at the end); a block both CTAs scored (`solo`) counts once (rank 0)."""
        if block_needs_mask(m_block, n_block, seqlen_k, causal_offset, TILE_M, self.tile_n,
                            self.causal):
            apply_mask(acc_S_mn, tScS_mn, m_block, n_block, seqlen_k, causal_offset,
                       TILE_M, self.tile_n, self.causal)
        blk_max = softmax.block_max(acc_S_mn)
        if not solo:
            self._exchange_rows(blk_max, pair, bars, i % 2, (i // 2) & 1, rank, tidx, tScS_mn,
                                lane, True)
        row_sum = softmax.row_sum
        prev = cute.make_rmem_tensor(cute.size(blk_max), Float32)
        for r in cutlass.range_constexpr(cute.size(blk_max)):
            prev[r] = row_sum[r]
        softmax.update(acc_S_mn, blk_max, [], factor)
        if solo and rank == 1:
            for r in cutlass.range_constexpr(cute.size(blk_max)):
                row_sum[r] = prev[r] * factor[r]
        rP.store(acc_S.load().to(self.dtype))

    @cute.jit
    def _send_p(self, pair, bars, b, rank, tidx):
        """Our P tile (slot 2 b + rank, written and fenced by all S threads) into the same
        slot of the peer's smem by one bulk copy, counted on the peer's pp[b]; we expect the
        peer's tile on ours."""
        from cutlass.experimental.primitives.nvvm_wrapper import (
            cp_async_bulk_shared_cluster_shared_cta)

        cutlass.pipeline.NamedBarrier(barrier_id=1, num_threads=WG_THREADS).arrive_and_wait()
        if tidx == 0:
            nbytes = TILE_M * self.tile_n * self.cfg.elem_bytes
            cute.arch.mbarrier_arrive_and_expect_tx(bars.pp + b, nbytes)
            src = pair.p_base + (2 * b + rank) * (TILE_M * self.tile_n)
            cp_async_bulk_shared_cluster_shared_cta(
                cute.arch.map_dsmem_ptr(src, 1 - rank), src,
                cute.arch.map_dsmem_ptr(bars.pp + b, 1 - rank), nbytes)

    @cute.jit
    def _final_factors_pair(self, softmax: OnlineSoftmax, factor, num_rows: cutlass.Constexpr,
                            n_iter, rank, bars, pair, tidx, tScS_mn, lane):
        """`kv_pair`: the row sums of both CTAs joined (same running max on both), then
        factor = 1 / row_sum and the LSE as `_final_factors`."""
        softmax.finalize_sum()
        self._exchange_rows(softmax.row_sum, pair, bars, n_iter % 2, (n_iter // 2) & 1, rank,
                            tidx, tScS_mn, lane, False)
        lse = cute.make_rmem_tensor(num_rows, Float32)
        softmax.normalize([], lse, factor)
        return lse



# P of the FP8 forward: each block's probabilities in its own frame, scaled by 2^8 (at most 256,
# under e4m3's 448); the frame at most 2^64 below the row's running max (common/softmax.py,
# Note [FP8 P: the block's own frame])
P_BIAS_LOG2 = 8.0
FRAME_FLOOR_LOG2 = 64.0


class Descales(NamedTuple):
    """The FP8 forward's dequantisation factors, [B, Hkv] fp32 each: x = x_fp8 * descale."""

    q: cute.Tensor
    k: cute.Tensor
    v: cute.Tensor


def fake_fp8_args(cfg) -> tuple:
    """Stand-ins for the FP8 forward's (q, k, vt, o, lse, q_descale, k_descale, v_descale):
    q, k [B, H, N, D] and vt [B, H, D, N] e4m3 (16-byte aligned, unit last stride, outer
    strides multiples of 16 elements), o [B, Hq, Nq, D] in out_dtype, lse [B, Hq, Nq] fp32, the
    descales [B, Hkv] fp32."""
    import cutlass.cute.runtime  # noqa: F401  (make_fake_tensor)

    def fake(dt, rank, div):
        shape = tuple(cute.sym_int() for _ in range(rank))
        stride = tuple(cute.sym_int(64, divisibility=div) for _ in range(rank - 1)) + (1,)
        return cute.runtime.make_fake_tensor(dt, shape, stride=stride, assumed_align=16)

    f8, out = CUTLASS_DTYPES[cfg.dtype], CUTLASS_DTYPES[cfg.out_dtype]
    q, k, vt = (fake(f8, 4, 16) for _ in range(3))
    return (q, k, vt, fake(out, 4, 8), fake(Float32, 3, 1),
            *(fake(Float32, 2, 1) for _ in range(3)))


class FFPAFwdSm90FP8(FFPAFwdSm90):
    """The forward for e4m3 Q, K, V (`FwdFP8ConfigSm90`): the same warp-specialised skeleton
    with 8-bit operands throughout.

    Steps, as the 16-bit forward's, with these differences:
      * S = Q K^T by m64n128k32 e4m3 WGMMAs over 128-column (128-byte) chunks of D;
        softmax_scale * q_descale * k_descale scales the scores (descales per (batch, KV head));
      * P = exp2(s * scale_log2 - frame + 8) in each block's own frame (<= 256: no e4m3
        saturation), rounded to e4m3 and stored to smem by 2-byte stores (stmatrix is 16-bit
        only);
      * O += P Vt^T by m64nNk32 e4m3 WGMMAs: both operands K-major, so V arrives transposed,
        Vt [B, Hkv, D, N] (the host writes it; its rows 16-byte aligned), streamed in
        [D/2 x 64] stages;
      * O = O / row_sum * v_descale, written in out_dtype; LSE in fp32 (natural log).
    Constraints (`config.can_implement`): sm_90a; e4m3 in, bf16 / fp16 out; D a multiple of 16
    in [272, 1024] (264 is not a multiple of 16); Dv == D.
    """

    OPERANDS = ("q", "k", "vt", "o", "lse", "q_descale", "k_descale", "v_descale")
    fake_inputs = staticmethod(fake_fp8_args)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mQd: cute.Tensor, mKd: cute.Tensor, mVd: cute.Tensor,
                 softmax_scale: Float32, causal_offset: Int32, stream: cuda.CUstream):
        """q, k: (B, H, N, D) e4m3; vt: (B, Hkv, D, Nkv) e4m3; o: (B, Hq, Nq, D) out_dtype;
        lse: (B, Hq, Nq) fp32; descales: (B, Hkv) fp32."""
        self._launch(mQ, mK, mVt, mO, mLSE, softmax_scale, causal_offset, stream,
                     Descales(mQd, mKd, mVd))

    @cute.jit
    def _make_softmax(self, num_rows: cutlass.Constexpr, scale_log2, extra, batch, head_kv):
        """Scores dequantised through the scale; P in each block's frame; 1 / row_sum carries
        V's descale."""
        qk = extra.q[batch, head_kv] * extra.k[batch, head_kv]
        return OnlineSoftmax(num_rows, scale_log2 * qk, p_bias_log2=P_BIAS_LOG2,
                             frame_floor_log2=FRAME_FLOOR_LOG2, out_scale=extra.v[batch, head_kv])


__all__ = ["Descales", "FFPAFwdSm90", "FFPAFwdSm90FP8", "fake_fp8_args"]
