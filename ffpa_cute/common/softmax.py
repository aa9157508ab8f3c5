"""Online softmax on mma.sync accumulator fragments (row max / row sum / O rescale, exp2 form).

Works on the (MMA=(2,2), MMA_M, MMA_N) fragments of an m16n8 tiled MMA: `mn_view` re-indexes a
fragment as (rows, cols) of this thread, where each row is shared by the 4 threads of a quad.
When the warp layout splits N across `warp_n` warps, a row's max is also combined across warps
through shared memory (`OnlineSoftmax.exchange`); the row sum is a linear quantity, so each
thread keeps a partial and the reduction happens once, at the end (`finalize_sum`, then
`exchange`).

Note [exp2 scaling]: scores are kept unscaled; p = exp2(s * scale_log2 - m * scale_log2) with
scale_log2 = scale * log2(e), and LSE = (m * scale_log2 + log2(sum)) * ln(2). A row with no
visible key keeps m = -inf; its "safe" max is 0 so that exp2 gives exactly 0 (never NaN), its sum
stays 0, its output is 0 and its LSE is -inf.

Note [FP8 P: the block's own frame]: when P is rounded to e4m3 for the P V product (448 at most,
subnormals down to 2^-9), each block's P is taken relative to that block's own row max, scaled
by 2^bias: p = exp2(s * scale_log2 - frame + bias) <= 2^bias (bias 8: 256 < 448, so P never
saturates, whatever the scores). O and the row sum are kept in the current frame (the factor
exp2(frame_old - frame_new) may exceed 1), so a block never loses its small probabilities to a
large score elsewhere in the row (an attention sink): underflow is only relative to its own
max. The frame never drops more than 2^floor below the row's running max, so O stays far
inside fp32 (a block whose scores all lie below that floor contributes exactly what it would
against the running max).

Note [Lazy rescaling] (FlashAttention-4's conditional rescaling): a row's O and sum are rescaled
by exp2(old max - new max) every block whose max grows; with `lazy` (above) the row keeps its
max while a block's max exceeds it by at most `above` (log2 units), so P = exp2(s - kept max)
reaches 2^above at most and the factor is exactly 1, which the accumulator warpgroups see
and skip. The final 1 / row_sum and the LSE use the kept max, so the result is the same
softmax. 16-bit P: above 8 (P <= 256, far inside bf16 / fp16 and fp32 sums). FP8 P, framed:
the frame is kept while the block's max lies in [frame - below, frame + above]; P's bias
drops to 8 - above so that P <= 2^8 still (FlashAttention #2716's saturation cannot happen),
and a block whose max lies `below` under the frame still has its largest P at 2^(bias -
below) (2^2 with the FP8 forward's 6 and 4), so its values keep e4m3's three mantissa bits
(normal down to 2^-6) over the 2^(bias - below + 6) below its largest.

Note [Sinks]: a learned per-head logit (GPT-OSS) joins each row's softmax denominator as one more
"key" with no value: O = sum_j exp(s_j) v_j / (sum_j exp(s_j) + exp(sink)), and the LSE includes
it, so the backward's P = exp(s - LSE) is already the sink-aware softmax and its kernels need no
change (the sink's own gradient, -sum_i exp(sink - LSE_i) Delta_i, is a host-side reduction).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

LN2 = math.log(2.0)
# P of the FP8 forwards: each block's probabilities in its own frame, scaled by 2^8 (at most 256,
# under e4m3's 448); the frame at most 2^64 below the row's running max (Note [FP8 P: the
# block's own frame])
P_BIAS_LOG2 = 8.0
FRAME_FLOOR_LOG2 = 64.0

def mn_view(acc: cute.Tensor) -> cute.Tensor:
    """View an accumulator fragment as (rows, cols) of this thread.

    mma.sync m16n8 fragments are ((2,2), MMA_M, MMA_N); WGMMA m64nN fragments are
    ((2,2,N/8), MMA_M, MMA_N). Mode 0 is (column pair, row +8[, column group of 8]) in both, so
    rows = (mode0[1], MMA_M) and cols = (mode0[0], [mode0[2],] MMA_N).
    """
    lay = cute.make_layout(acc.layout.shape)
    s0, d0 = lay.shape[0], lay.stride[0]
    col_shape = (s0[0], *s0[2:], lay.shape[2])
    col_stride = (d0[0], *d0[2:], lay.stride[2])
    mn = cute.make_layout(((s0[1], lay.shape[1]), col_shape),
                          stride=((d0[1], lay.stride[1]), col_stride))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, mn))


@cute.jit
def quad_allreduce_max(val: cutlass.Float32) -> cutlass.Float32:
    val = cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=2))
    return cute.arch.fmax(val, cute.arch.shuffle_sync_bfly(val, offset=1))


@cute.jit
def quad_allreduce_sum(val: cutlass.Float32) -> cutlass.Float32:
    val = val + cute.arch.shuffle_sync_bfly(val, offset=2)
    return val + cute.arch.shuffle_sync_bfly(val, offset=1)


class OnlineSoftmax:
    """Per-thread online-softmax state for `num_rows` fragment rows.

    row_max holds the running max of raw (unscaled) scores; row_sum this thread's partial sum of
    exp2 terms over its own columns (reduced across the quad by `finalize_sum`, across warps by
    `exchange`).
    """

    def __init__(self, num_rows: int, scale_log2: cutlass.Float32,
                 p_bias_log2: float | None = None, frame_floor_log2: float = 64.0,
                 out_scale: cutlass.Float32 | None = None,
                 lazy: tuple[float, float | None] | None = None):
        """p_bias_log2 (not None): P in each block's own frame, scaled by 2^bias (Note [FP8 P:
        the block's own frame]); then row_max holds the frame (scaled units) and run_max the
        row's raw running max. out_scale multiplies the final 1 / row_sum (FP8's V descale).
        lazy (above, below), in log2 units: a row keeps its max (or frame) while the block's
        max is at most `above` over it (and, framed, at most `below` under it; the unframed
        update reads no `below`), so its factor is exactly 1 (Note [Lazy rescaling])."""
        self.num_rows = num_rows
        self.scale_log2 = scale_log2
        self.framed = p_bias_log2 is not None
        self.p_bias_log2 = p_bias_log2
        self.frame_floor_log2 = frame_floor_log2
        self.out_scale = out_scale
        self.lazy = lazy
        self.row_max = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, cutlass.Float32)
        self.row_max.fill(-cutlass.Float32.inf)
        self.row_sum.fill(0.0)
        if self.framed:
            self.run_max = cute.make_rmem_tensor(num_rows, cutlass.Float32)
            self.run_max.fill(-cutlass.Float32.inf)

    @cute.jit
    def block_max(self, acc_S_mn: cute.Tensor) -> cute.Tensor:
        """Row max of this block over the quad (this warp's columns)."""
        mx = cute.make_rmem_tensor(self.num_rows, cutlass.Float32)
        for r in cutlass.range_constexpr(self.num_rows):
            v = acc_S_mn[r, None].load().reduce(cute.ReductionOp.MAX, -cutlass.Float32.inf, 0)
            mx[r] = quad_allreduce_max(v)
        return mx

    @cute.jit
    def exchange(self, vals: cute.Tensor, sStat: cute.Tensor, row_idx: cute.Tensor,
                 warp_n_idx: cutlass.Int32, lane: cutlass.Int32, warp_n: cutlass.Constexpr,
                 is_max: cutlass.Constexpr, barrier):
        """Combine per-row values across the `warp_n` warps that share rows, through smem.

        sStat: (warp_n, tile_m) fp32; row_idx[r] = tile-local row of fragment row r.
        Leaves the combined value in vals. Costs one CTA barrier.
        """
        if lane % 4 == 0:
            for r in cutlass.range_constexpr(self.num_rows):
                sStat[warp_n_idx, row_idx[r]] = vals[r]
        barrier()
        for r in cutlass.range_constexpr(self.num_rows):
            acc = sStat[0, row_idx[r]]
            for w in cutlass.range_constexpr(1, warp_n):
                if cutlass.const_expr(is_max):
                    acc = cute.arch.fmax(acc, sStat[w, row_idx[r]])
                else:
                    acc = acc + sStat[w, row_idx[r]]
            vals[r] = acc

    @cute.jit
    def update(self, acc_S_mn: cute.Tensor, blk_max: cute.Tensor, acc_O_mns: list,
               alpha_out: cute.Tensor | None = None):
        """New max, P = exp2 in place of S, rescale every O chunk, accumulate partial row sums.

        alpha_out (optional, num_rows fp32) receives each row's O rescale factor, for kernels
        whose O lives in other threads (sm90: the O warpgroups rescale from shared memory).
        """
        if cutlass.const_expr(self.framed):
            self._update_framed(acc_S_mn, blk_max, acc_O_mns, alpha_out)
            return
        for r in cutlass.range_constexpr(self.num_rows):
            prev = self.row_max[r]
            cur = cute.arch.fmax(prev, blk_max[r])
            if cutlass.const_expr(self.lazy is not None):   # NaN / inf growth: a new max
                grow = (cur - prev) * self.scale_log2
                cur = prev if grow <= self.lazy[0] else cur
            safe = cutlass.Float32(0.0) if cur == -cutlass.Float32.inf else cur
            max_scaled = safe * self.scale_log2
            alpha = cute.math.exp2(prev * self.scale_log2 - max_scaled, fastmath=True)
            if cutlass.const_expr(self.lazy is not None):
                alpha = cutlass.Float32(1.0) if cur == prev else alpha
            p = cute.math.exp2(acc_S_mn[r, None].load() * self.scale_log2 - max_scaled,
                               fastmath=True)
            acc_S_mn[r, None] = p
            self.row_sum[r] = self.row_sum[r] * alpha + p.reduce(cute.ReductionOp.ADD, 0.0, 0)
            self.row_max[r] = cur
            if cutlass.const_expr(alpha_out is not None):
                alpha_out[r] = alpha
            for c in cutlass.range_constexpr(len(acc_O_mns)):
                acc_O_mns[c][r, None] = acc_O_mns[c][r, None].load() * alpha

    @cute.jit
    def _update_framed(self, acc_S_mn: cute.Tensor, blk_max: cute.Tensor, acc_O_mns: list,
                       alpha_out: cute.Tensor | None):
        """`update` with P in the block's own frame (Note [FP8 P: the block's own frame])."""
        for r in cutlass.range_constexpr(self.num_rows):
            run = cute.arch.fmax(self.run_max[r], blk_max[r])
            frame = cute.arch.fmax(blk_max[r] * self.scale_log2,
                                   run * self.scale_log2 - self.frame_floor_log2)
            old = self.row_max[r]
            if cutlass.const_expr(self.lazy is not None):   # keep the frame if the block's
                d = blk_max[r] * self.scale_log2 - old       # max lies in [-below, above]
                keep = cute.arch.fmax(d - self.lazy[0], -d - self.lazy[1]) <= 0.0
                frame = old if keep else frame
            safe = cutlass.Float32(0.0) if frame == -cutlass.Float32.inf else frame
            alpha = cute.math.exp2(old - safe, fastmath=True)
            if cutlass.const_expr(self.lazy is not None):
                alpha = cutlass.Float32(1.0) if frame == old else alpha
            x = acc_S_mn[r, None].load() * self.scale_log2 - (safe - self.p_bias_log2)
            p = cute.math.exp2(x, fastmath=True)
            acc_S_mn[r, None] = p
            self.row_sum[r] = self.row_sum[r] * alpha + p.reduce(cute.ReductionOp.ADD, 0.0, 0)
            self.row_max[r] = frame
            self.run_max[r] = run
            if cutlass.const_expr(alpha_out is not None):
                alpha_out[r] = alpha
            for c in cutlass.range_constexpr(len(acc_O_mns)):
                acc_O_mns[c][r, None] = acc_O_mns[c][r, None].load() * alpha

    @cute.jit
    def finalize_sum(self):
        """Reduce partial row sums over the quad (call `exchange` after for warp_n > 1)."""
        for r in cutlass.range_constexpr(self.num_rows):
            self.row_sum[r] = quad_allreduce_sum(self.row_sum[r])

    @cute.jit
    def normalize(self, acc_O_mns: list, lse: cute.Tensor, inv_out: cute.Tensor | None = None,
                  sink_log2: cutlass.Float32 | None = None):
        """O /= row_sum (0 for empty rows); lse[r] = natural-log logsumexp of scaled scores.

        inv_out (optional) receives each row's 1 / row_sum (0 for empty rows). sink_log2 (not
        None): the row's sink logit in log2 units joins its denominator (Note [Sinks]).
        """
        if cutlass.const_expr(sink_log2 is not None):
            self._normalize_sink(acc_O_mns, lse, inv_out, sink_log2)
            return
        for r in cutlass.range_constexpr(self.num_rows):
            s = self.row_sum[r]
            inv = cutlass.Float32(0.0)
            lse[r] = -cutlass.Float32.inf
            if s > 0.0:
                inv = cute.arch.rcp_approx(s)
                if cutlass.const_expr(self.framed):  # the frame is in scaled units; P had 2^bias
                    lse[r] = (self.row_max[r] + cute.math.log2(s, fastmath=True)
                              - self.p_bias_log2) * LN2
                else:
                    lse[r] = (self.row_max[r] * self.scale_log2
                              + cute.math.log2(s, fastmath=True)) * LN2
                if cutlass.const_expr(self.out_scale is not None):
                    inv = inv * self.out_scale
            self._scale_row(acc_O_mns, inv_out, r, inv)

    @cute.jit
    def _normalize_sink(self, acc_O_mns: list, lse: cute.Tensor, inv_out, sink_log2):
        """`normalize` with a sink term exp2(sink_log2) in each row's denominator, taken in the
        frame top = max(row max, sink) so that neither a sink far above the scores nor a row
        with no key overflows: sum' = sum * 2^(m - top) + 2^(sink - top) (>= 1 unless both are
        -inf), O *= 2^(m - top) / sum', LSE = (top + log2(sum')) ln 2. A row with no key: O 0,
        LSE = the sink."""
        for r in cutlass.range_constexpr(self.num_rows):
            if cutlass.const_expr(self.framed):  # the sum's frame: P carried 2^bias
                m = self.row_max[r] - self.p_bias_log2
            else:
                m = self.row_max[r] * self.scale_log2
            top = cute.arch.fmax(m, sink_log2)
            inv = cutlass.Float32(0.0)
            lse[r] = -cutlass.Float32.inf
            if top != -cutlass.Float32.inf:
                a = cute.math.exp2(m - top, fastmath=True)
                s = self.row_sum[r] * a + cute.math.exp2(sink_log2 - top, fastmath=True)
                inv = a * cute.arch.rcp_approx(s)
                lse[r] = (top + cute.math.log2(s, fastmath=True)) * LN2
                if cutlass.const_expr(self.out_scale is not None):
                    inv = inv * self.out_scale
            self._scale_row(acc_O_mns, inv_out, r, inv)

    @cute.jit
    def _scale_row(self, acc_O_mns: list, inv_out, r: cutlass.Constexpr, inv):
        """Row r of every O chunk times inv (and inv into inv_out[r] when asked): the last
        step of `normalize`, with or without a sink."""
        if cutlass.const_expr(inv_out is not None):
            inv_out[r] = inv
        for c in cutlass.range_constexpr(len(acc_O_mns)):
            acc_O_mns[c][r, None] = acc_O_mns[c][r, None].load() * inv
