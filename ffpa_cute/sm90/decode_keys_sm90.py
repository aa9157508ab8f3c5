"""Hopper split-KV decode over an FP8 (e4m3) cache with the keys as the WGMMA's rows: the
serving case of bf16 / fp16 queries with few query rows per KV head (GQA decode, G * Nq <= 32).

Why another decode kernel (docs/design.md section 11): the row-tiled decode (decode_sm90.py)
puts a KV head's G * Nq query rows into WGMMA's 64-row M, so GQA 8:1 decode fills 8 of 64
rows and does 8x the tensor work, and it converts both K and V to 16 bits in shared memory;
on an e4m3 cache, where the bytes halve, those two costs became the bound (H200, B=8, Hq 32 /
Hkv 4, D=512: 1.65 TB/s of e4m3 K / V, slower in time than a bf16 cache). Here the 64 keys of
a block are M and the query rows are N (8 to 32), so the tensor work is what the rows need, K
is never converted and V only on its way into registers:

  S^T = K Q^T   e4m3 WGMMA m64n(3N)k32, both operands K-major as they arrive: K's stage from the
                TMA, and Q written per row as s (Q_0 + Q_1 + Q_2) (s = amax / 448, each term
                the e4m3 rounding of what the previous ones left: ~11 significant bits), the
                terms as column groups of one product, added in registers. Exact products,
                fp32 accumulation (at Hopper's reduced e4m3 accumulation precision).
  softmax       per query row = per column: max and sum over the block's 64 keys (two keys per
                thread, a butterfly over the 8 lanes sharing a column, the 4 warps through
                shared memory), online over the blocks, P in fp16 (10-bit mantissa) to shared
                memory as the [N x 64] K-major B operand.
  O^T += V^T P^T   fp16 WGMMA m64nNk16 over 64-row M tiles with V^T as the register A operand
                (`_v_operand`): e4m3 WGMMA takes K-major operands only and V's keys are its
                rows, so V is loaded by 2-byte shared loads, its bytes paired per column by a
                permute and converted exactly (common/convert.py) into the fragment; the M rows
                are permuted so that a thread's two rows are adjacent Dv columns (`_dv_of`).

Per CTA: two warpgroups, one per half of Dv; both compute the same S^T and softmax (no
exchange), each loads (its own TMA stages) and converts its half of V and accumulates its half
of O^T. A ring of `stages` blocks (64 keys of K; each warpgroup's half of V), each on its own
TMA barrier; K's stage is refilled once both warpgroups have read it (an empty barrier of two
arrivals). Block i: wait K, S^T (its WGMMAs also retire the previous block's P V), the column
maxima (one named barrier per warpgroup), refill K's stage with block i + stages, the softmax,
wait V, build V^T's fragments, fence P and meet (named barrier), refill V's stage, then the P V
WGMMAs, left running under the next block's K wait. The grid is the row-tiled decode's with
one row tile: (1, Hkv * S, B), head h = kv_head * S + split, the same fp32 partials [B, Hkv *
S, M, Dv] and LSE [B, Hkv * S, M] for the combine kernel, the same block split and pages
(decode_sm90.py's docstring). K's descale joins the scores' scale, V's the final 1 / row_sum.

Constraints (`config.can_implement_decode_keys`): sm_90a; 16-bit q, e4m3 K / V; D a multiple
of 32 in [64, 1024], Dv a multiple of 128; rows (G * Nq padded to 8) <= 32; no mask (not
causal, no window or sinks); pages of a multiple of 64 rows; stages >= 2 within shared memory.
Status: compile-verified on CPU (tests/test_decode_keys.py); run on the H200 by
tests/test_features_gpu.py (test_decode_fp8_cache, the CUDA-graph and split tests) and under
compute-sanitizer (tests/sanitize.py); docs/verification.md says which run.
"""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float16, Float32, Int32, Uint16, Uint32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from ..common.convert import e4m3x4_to_16bit
from ..common.softmax import mn_view
from ..common.tensors import CUTLASS_DTYPES, LOG2_E, KernelEntry, aligned_bhnd
from .config import KEYS_TILE, DecodeKeysConfigSm90, can_implement_decode_keys
from .decode_sm90 import FFPADecodeSm90, fake_decode_args
from .skeleton_sm90 import RingSkeletonSm90, row_major_layout

WG_THREADS = 128
THREADS = 2 * WG_THREADS   # two warpgroups, one per half of Dv
WARPS = WG_THREADS // 32   # warps of a warpgroup
Q_TERMS = 3                # e4m3 terms of Q: s (Q_0 + Q_1 + Q_2), ~11 significant bits
E4M3_MAX = 448.0
LN2 = 0.6931471805599453
KMAJOR = cute.nvgpu.OperandMajorMode.K


class FFPADecodeKeysSm90(KernelEntry):
    """The keys-as-rows FP8-cache decode (module docstring); one instance per
    `DecodeKeysConfigSm90`. The row-tiled decode's operands and scalars (`decode.kernel_operands`
    serves both)."""

    arch_family = "sm90"
    OPERANDS = FFPADecodeSm90.OPERANDS
    SCALARS = FFPADecodeSm90.SCALARS
    fake_inputs = staticmethod(fake_decode_args)

    def __init__(self, cfg: DecodeKeysConfigSm90):
        self._refuse(can_implement_decode_keys(cfg))
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        self.kv = CUTLASS_DTYPES[cfg.kv_dtype]
        self.d, self.dv, self.n = cfg.head_dim, cfg.dv, cfg.rows
        self.half = cfg.dv // 2   # Dv columns of each warpgroup
        self.k_bytes, self.v_bytes = KEYS_TILE * cfg.head_dim, KEYS_TILE * self.half

    # ---------------------------------------------------------------- host side
    def _layouts(self):
        """K stages (64, D, stages), the warpgroups' V stages (64, Dv / 2, 2 stages) in e4m3,
        Q's terms (3N, D) e4m3 (row r of term t at t N + r), the warpgroups' P (N, 64, 2)
        fp16: row-major, the widest swizzle."""
        t, st = KEYS_TILE, self.cfg.stages
        return (row_major_layout(t, self.d, self.kv, st),
                row_major_layout(t, self.half, self.kv, 2 * st),   # [wg * stages + s]
                row_major_layout(Q_TERMS * self.n, self.d, self.kv),
                row_major_layout(self.n, t, Float16, 2))           # [wg]

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mSeqlens: cute.Tensor, mTable, mKd: cute.Tensor,
                 mVd: cute.Tensor, softmax_scale: Float32, num_splits: Int32, nq: Int32,
                 stream: cuda.CUstream):
        """q: (B, Hkv * S, M, D) 16-bit (M <= rows); k, v: (B or pages, Hkv, cache rows, D /
        Dv) e4m3; o: (B, Hkv * S, M, Dv) fp32; lse: (B, Hkv * S, M) fp32; seqlens_k: (B,)
        int32; block_table: (B, pages) int32 with `page_rows`, else None; k_descale,
        v_descale: (B, Hkv) fp32. nq is not read (the rows see every key). Grid (1, Hkv * S,
        B)."""
        t = KEYS_TILE
        sK_l, sV8_l, sQ_l, sP_l = self._layouts()
        tK = RingSkeletonSm90._bhnd_to_tma(aligned_bhnd(mK, self.d, self.kv))
        tV = RingSkeletonSm90._bhnd_to_tma(aligned_bhnd(mV, self.dv, self.kv))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_k, gK = cpasync.make_tiled_tma_atom(g2s, tK, cute.select(sK_l, mode=[0, 1]),
                                                (t, self.d))
        tma_v, gV = cpasync.make_tiled_tma_atom(g2s, tV, cute.select(sV8_l, mode=[0, 1]),
                                                (t, self.half))
        # S^T = K [Q_0; Q_1; Q_2]^T: (64 keys, 3N), both K-major e4m3
        mma_s = sm90_utils.make_trivial_tiled_mma(self.kv, self.kv, KMAJOR, KMAJOR, Float32,
                                                  (1, 1, 1), (t, Q_TERMS * self.n))
        # O^T = V^T P^T: (Dv / 2, N) per warpgroup in 64-row M tiles; V^T from registers
        # (converted there), P^T K-major from smem
        mma_o = sm90_utils.make_trivial_tiled_mma(Float16, Float16, KMAJOR, KMAJOR, Float32,
                                                  (1, 1, 1), (t, self.n),
                                                  a_source=warpgroup.OperandSource.RMEM)
        st, mem, align = self.cfg.stages, cute.struct.MemRange, cute.struct.Align

        def smem(layout, elem):
            return align[mem[elem, cute.cosize(layout)], 1024]

        fields = {
            # K full (one arrival + bytes), K empty (one per warpgroup), V full per warpgroup
            "bar_k": mem[cutlass.Int64, st], "bar_k_empty": mem[cutlass.Int64, st],
            "bar_v": mem[cutlass.Int64, 2 * st],
            "q_scale": align[mem[Float32, self.n], 16],          # s of each query row
            "red": align[mem[Float32, 2 * WARPS * self.n], 16],  # per-warp column partials
            "sK": smem(sK_l, self.kv), "sV8": smem(sV8_l, self.kv), "sQ": smem(sQ_l, self.kv),
            "sP": smem(sP_l, Float16),
        }
        storage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        assert storage.size_in_bytes() <= self.cfg.smem_bytes(), (
            storage.size_in_bytes(), self.cfg.smem_bytes())
        self.kernel(mQ, mO, mLSE, mSeqlens, mTable, mKd, mVd, gK, gV, tma_k, tma_v, mma_s, mma_o,
                    softmax_scale * LOG2_E, num_splits, storage).launch(
            grid=(1, cute.size(mQ.shape[1]), cute.size(mQ.shape[0])), block=[THREADS, 1, 1],
            smem=storage.size_in_bytes(), stream=stream, min_blocks_per_mp=1)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, mSeqlens: cute.Tensor,
               mTable, mKd: cute.Tensor, mVd: cute.Tensor, gK: cute.Tensor, gV: cute.Tensor,
               tma_k: cute.CopyAtom, tma_v: cute.CopyAtom, mma_s: cute.TiledMma,
               mma_o: cute.TiledMma, scale_log2: Float32, num_splits: Int32,
               Storage: cutlass.Constexpr):
        t, st = KEYS_TILE, self.cfg.stages
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg = warp // WARPS
        _, head, batch = cute.arch.block_idx()
        kv_head, split = head // num_splits, head % num_splits
        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        bars = (storage.bar_k.data_ptr(), storage.bar_k_empty.data_ptr(),
                storage.bar_v.data_ptr())
        sK_l, sV8_l, sQ_l, sP_l = self._layouts()
        sK = storage.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)      # (64, D, stages)
        sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)      # (3N, D)
        sScale = storage.q_scale.get_tensor(cute.make_layout(self.n))
        if warp == 0:
            cpasync.prefetch_descriptor(tma_k)
            cpasync.prefetch_descriptor(tma_v)
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(st):
                    cute.arch.mbarrier_init(bars[0] + s, 1)
                    cute.arch.mbarrier_init(bars[1] + s, 2)
                    cute.arch.mbarrier_init(bars[2] + s, 1)
                    cute.arch.mbarrier_init(bars[2] + st + s, 1)
                cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # ---- this split's blocks of the batch row: [lo, lo + count)
        seqlen = mSeqlens[batch]
        n_blocks = (seqlen + t - 1) // t
        per = (n_blocks + num_splits - 1) // num_splits
        lo = split * per
        count = cutlass.max(cutlass.min(lo + per, n_blocks) - lo, 0)
        # the V stages (64, Dv / 2, 2 stages: [wg * stages + s]); this warpgroup's P (N, 64)
        # and column partials (4 warps, N)
        sV8 = storage.sV8.get_tensor(sV8_l.outer, swizzle=sV8_l.inner)
        sP = storage.sP.get_tensor(sP_l.outer, swizzle=sP_l.inner)[None, None, wg]
        sRed = storage.red.get_tensor(cute.make_layout((WARPS, self.n), stride=(self.n, 1)))
        sRed = cute.make_tensor(sRed.iterator + wg * WARPS * self.n, sRed.layout)
        loads = Loads(gK, gV, tma_k, tma_v, sK, sV8, bars, mTable, kv_head, batch, warp, wg)
        for j in cutlass.range_constexpr(st):
            if j < count:
                if wg == 0:
                    self._load_k(loads, lo + j, j)
                self._load_v(loads, lo + j, j)

        # ---- Q's e4m3 terms and row scales (the first warpgroup), under the first loads
        if wg == 0:
            self._split_q(mQ[batch, head, None, None], sQ, sScale, tidx)
        cute.arch.fence_proxy("async.shared", space="cta")   # sQ is read by WGMMA
        cute.arch.sync_threads()
        self._consume(mO, mLSE, mKd, mVd, mma_s, mma_o, sK, sQ, sScale, sV8, sP, sRed, loads,
                      scale_log2, head, lo, count, seqlen, tidx % WG_THREADS)

    @cute.jit
    def _consume(self, mO, mLSE, mKd, mVd, mma_s, mma_o, sK, sQ, sScale, sV8, sP, sRed, loads,
                 scale_log2, head, lo, count, seqlen, wtid):
        """One warpgroup's walk over the split's blocks: S^T and the softmax (both warpgroups
        compute the same ones), then its half of Dv's O^T; finally O / sum and (the first) the
        LSE."""
        t, n, st = KEYS_TILE, self.n, self.cfg.stages
        wg, batch, kv_head = loads.wg, loads.batch, loads.kv_head
        warp, lane = loads.warp % WARPS, cute.arch.lane_idx()
        bar_k, bar_k_empty, bar_v = loads.bars
        bar_id = 1 + wg   # the warpgroup's named barrier
        # ---- fragments
        thr_s = mma_s.get_slice(wtid)
        tSrK = mma_s.make_fragment_A(thr_s.partition_A(sK))   # (MMA, 1, D / 32, stages)
        tSrQ = mma_s.make_fragment_B(thr_s.partition_B(sQ))   # (MMA, 1, D / 32)
        acc_S = cute.make_rmem_tensor(thr_s.partition_shape_C((t, Q_TERMS * n)), Float32)
        acc_S_mn = mn_view(acc_S)   # (2 keys, 3N / 4 columns): term q's column c at c + q N / 4
        # (keys, cols) -> (key, column) of the 64 x 3N tile
        tScS_mn = mn_view(thr_s.partition_C(cute.make_identity_tensor((t, Q_TERMS * n))))
        thr_o = mma_o.get_slice(wtid)
        # V^T's fp16 A fragments of the whole block: ((2, 2, 2), Dv / 128, 64 / 16); M row
        # 16 w + r of an M tile is Dv column 16 w + 2 (r % 8) + r // 8 (`_v_operand`)
        tOrV = cute.make_rmem_tensor(thr_o.partition_shape_A((self.half, t)), Float16)
        tOrP = mma_o.make_fragment_B(thr_o.partition_B(sP))   # (MMA, 1, 64 / 16)
        acc_O = cute.make_rmem_tensor(thr_o.partition_shape_C((self.half, n)), Float32)
        acc_O.fill(0.0)
        acc_O_mn = mn_view(acc_O)   # (Dv / 64 rows, N / 4 columns): term 0's column set
        # (rows, cols) -> (M row, query row) of the Dv / 2 x N tile (M row -> Dv column:
        # `_dv_of`)
        tOcO_mn = mn_view(thr_o.partition_C(cute.make_identity_tensor((self.half, n))))
        atom_o = cute.make_mma_atom(mma_o.op)
        atom_o.set(warpgroup.Field.ACCUMULATE, True)
        cols = cute.size(acc_O_mn, mode=[1])
        # each of this thread's columns: its query row, its scores' scale (log2 units)
        col = [tScS_mn[0, c][1] for c in range(cols)]
        kd = mKd[batch, kv_head]
        col_scale = cute.make_rmem_tensor(cols, Float32)
        row_max = cute.make_rmem_tensor(cols, Float32)
        row_sum = cute.make_rmem_tensor(cols, Float32)   # this thread's keys only
        for c in cutlass.range_constexpr(cols):
            col_scale[c] = sScale[col[c]] * kd * scale_log2
            row_max[c] = -Float32.inf
            row_sum[c] = 0.0

        for i in cutlass.range(count, unroll=1):
            s = i % st
            phase = (i // st) & 1
            blk = lo + i
            # ---- S^T = K Q^T (its WGMMAs retire after the last block's P V)
            cute.arch.mbarrier_wait(bar_k + s, phase)
            atom = cute.make_mma_atom(mma_s.op)
            warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                atom.set(warpgroup.Field.ACCUMULATE, k > 0)
                cute.gemm(atom, acc_S, tSrK[None, None, k, s], tSrQ[None, None, k], acc_S)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            # ---- scores (log2 units): the terms' columns added, scaled; keys past the row
            #      masked; each column's block maximum over the warpgroup
            for c in cutlass.range_constexpr(cols):
                m = -Float32.inf
                for r in cutlass.range_constexpr(2):
                    v = acc_S_mn[r, c]
                    for q in cutlass.range_constexpr(1, Q_TERMS):
                        v = v + acc_S_mn[r, c + q * cols]
                    v = v * col_scale[c]
                    if blk * t + tScS_mn[r, c][0] >= seqlen:
                        v = -Float32.inf
                    acc_S_mn[r, c] = v
                    m = cute.arch.fmax(m, v)
                for off in cutlass.range_constexpr(3):   # the 8 lanes of a column
                    m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=4 << off))
                if lane < 4:
                    sRed[warp, col[c]] = m
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=WG_THREADS)
            # this warpgroup's K WGMMAs are done: once both are, refill the stage
            if wtid == 0:
                cute.arch.mbarrier_arrive(bar_k_empty + s)
            if wg == 0 and i + st < count:
                if warp == 0:
                    cute.arch.mbarrier_wait(bar_k_empty + s, phase)
                self._load_k(loads, blk + st, s)
            for c in cutlass.range_constexpr(cols):
                m_new = row_max[c]
                for w in cutlass.range_constexpr(WARPS):
                    m_new = cute.arch.fmax(m_new, sRed[w, col[c]])
                alpha = cute.math.exp2(row_max[c] - m_new, fastmath=True)
                row_max[c] = m_new
                total = row_sum[c] * alpha
                for r in cutlass.range_constexpr(2):
                    p = cute.math.exp2(acc_S_mn[r, c] - m_new, fastmath=True)
                    total = total + p
                    sP[col[c], tScS_mn[r, c][0]] = Float16(p)
                row_sum[c] = total
                for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
                    acc_O_mn[r, c] = acc_O_mn[r, c] * alpha
            # ---- V: this half's e4m3 stage -> V^T's fp16 register fragments (the last P V,
            #      which read them, is done: wait_group above)
            cute.arch.mbarrier_wait(bar_v + wg * st + s, phase)
            self._v_operand(sV8[None, None, wg * st + s], tOrV, warp, lane)
            cute.arch.fence_proxy("async.shared", space="cta")   # sP is read by WGMMA
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=WG_THREADS)
            if i + st < count:
                self._load_v(loads, blk + st, s)
            # ---- O^T += V^T P^T, left running
            warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                cute.gemm(atom_o, acc_O, tOrV[None, None, k], tOrP[None, None, k], acc_O)
            warpgroup.commit_group()
        warpgroup.wait_group(0)

        # ---- the row sums over all keys, then O / sum and the LSE
        for c in cutlass.range_constexpr(cols):
            total = row_sum[c]
            for off in cutlass.range_constexpr(3):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=4 << off)
            if lane < 4:
                sRed[warp, col[c]] = total
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=WG_THREADS)
        rows_q = mO.shape[2]
        vd = mVd[batch, kv_head]
        col0 = wg * self.half
        for c in cutlass.range_constexpr(cols):
            total = Float32(0.0)
            for w in cutlass.range_constexpr(WARPS):
                total = total + sRed[w, col[c]]
            inv = Float32(0.0)
            lse = -Float32.inf
            if total > Float32(0.0):
                inv = cute.arch.rcp_approx(total) * vd
                lse = (row_max[c] + cute.math.log2(total, fastmath=True)) * LN2
            if col[c] < rows_q:
                for r in cutlass.range_constexpr(cute.size(acc_O_mn, mode=[0])):
                    mO[batch, head, col[c], col0 + self._dv_of(tOcO_mn[r, c][0])] = (
                        acc_O_mn[r, c] * inv)
                if wg == 0 and warp == 0 and lane < 4:
                    mLSE[batch, head, col[c]] = lse

    @cute.jit
    def _v_operand(self, sv: cute.Tensor, tOrV: cute.Tensor, warp, lane):
        """This warpgroup's e4m3 V stage (64 keys, Dv / 2) as the fp16 A fragments of V^T
        (M = Dv, K = keys), exactly (common/convert.py). The M rows of an M tile are permuted so
        that a thread's two rows g, g + 8 (g = lane / 4) are the adjacent Dv columns 2 g, 2 g + 1
        of its warp's 16: one 2-byte load per key gives both, and a byte permute pairs two
        keys' bytes per column ([k, d], [k + 1, d], [k, d + 1], [k + 1, d + 1]) into the word
        the conversion turns into the fragment's (row g: keys k, k + 1) and (row g + 8: keys
        k, k + 1) registers. A fragment word j of (M tile mt, k step ks) is row g + 8 (j % 2),
        keys 16 ks + 2 (lane % 4) + 8 (j // 2) + {0, 1} (the WGMMA register layout)."""
        # (64, Dv / 4) column pairs; the swizzle (in bytes) kept on the 16-bit pointer, which
        # recast_tensor would drop
        swizzle = self._layouts()[1].inner
        v16 = cute.make_tensor(cute.recast_ptr(sv.iterator, swizzle, dtype=Uint16),
                               cute.recast_layout(16, 8, sv.layout))
        words = cute.recast_tensor(tOrV, Uint32)        # ((1, 2, 2), Dv / 128, 4)
        pair = warp * 8 + lane // 4                     # the column pair of rows g, g + 8
        q = lane % 4
        for mt in cutlass.range_constexpr(cute.size(tOrV, mode=[1])):
            for ks in cutlass.range_constexpr(cute.size(tOrV, mode=[2])):
                for c in cutlass.range_constexpr(2):
                    k = ks * 16 + 2 * q + 8 * c
                    x = Uint32(v16[k, mt * 32 + pair])
                    y = Uint32(v16[k + 1, mt * 32 + pair])
                    lo, hi = e4m3x4_to_16bit(cute.arch.prmt(x, y, 0x5140), "fp16")
                    words[2 * c, mt, ks] = lo
                    words[2 * c + 1, mt, ks] = hi

    def _dv_of(self, m):
        """The Dv column (in the warpgroup's half) of O^T's M row m (`_v_operand`'s order)."""
        r = m % 16
        return m - r + 2 * (r % 8) + r // 8

    @cute.jit
    def _split_q(self, mQh: cute.Tensor, sQ: cute.Tensor, sScale: cute.Tensor, tidx):
        """Q's rows (M, D) of this head -> sQ rows t N + r (term t) in e4m3 and sScale[r] = s,
        with Q[r] ~ s (Q_0[r] + Q_1[r] + Q_2[r]) (each term the e4m3 rounding of what the
        previous ones left); rows M..N-1 zero. 128 threads, 16 per row, D / 16 contiguous
        columns each, 8 rows per pass."""
        w = self.d // 16
        seg, sub = tidx % 16, tidx // 16
        rows_q = mQh.shape[0]
        x = cute.make_rmem_tensor(w, Float32)
        term = cute.make_rmem_tensor(w, self.kv)
        for p in cutlass.range_constexpr(self.n // 8):
            row = p * 8 + sub
            amax = Float32(0.0)
            for j in cutlass.range_constexpr(w):
                v = Float32(0.0)
                if row < rows_q:
                    v = Float32(mQh[row, seg * w + j])
                x[j] = v
                amax = cute.arch.fmax(amax, cute.arch.fmax(v, -v))
            for off in cutlass.range_constexpr(4):   # the row's 16 threads
                amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1 << off))
            inv = Float32(0.0)
            if amax > Float32(0.0):
                inv = E4M3_MAX / amax
            x.store(x.load() * inv)
            for q in cutlass.range_constexpr(Q_TERMS):
                term.store(x.load().to(self.kv))
                x.store(x.load() - term.load().to(Float32))
                for j in cutlass.range_constexpr(w):
                    sQ[q * self.n + row, seg * w + j] = term[j]
            if seg == 0:
                sScale[row] = amax / E4M3_MAX

    @cute.jit
    def _page(self, loads, blk):
        """(batch or page index, 64-key block within it) of the row's block blk."""
        if const_expr(self.cfg.page_rows is None):
            return loads.batch, blk
        per_page = self.cfg.page_rows // KEYS_TILE
        return loads.table[loads.batch, blk // per_page], blk % per_page

    @cute.jit
    def _load_k(self, loads, blk, s):
        """K of the row's block blk into stage s (warp 0 of the first warpgroup)."""
        if loads.warp == 0:
            page, b = self._page(loads, blk)
            g = cute.local_tile(loads.gK[None, None, loads.kv_head, page], (KEYS_TILE, self.d),
                                (None, 0))
            ts, tg = cpasync.tma_partition(loads.tma_k, 0, cute.make_layout(1),
                                           cute.group_modes(loads.sK, 0, 2),
                                           cute.group_modes(g, 0, 2))
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(loads.bars[0] + s, self.k_bytes)
            cute.copy(loads.tma_k, tg[None, b], ts[None, s], tma_bar_ptr=loads.bars[0] + s)

    @cute.jit
    def _load_v(self, loads, blk, s):
        """This warpgroup's half of V's block blk into its stage s (its first warp)."""
        if loads.warp % WARPS == 0:
            page, b = self._page(loads, blk)
            g = cute.local_tile(loads.gV[None, None, loads.kv_head, page], (KEYS_TILE, self.half),
                                (None, None))
            ts, tg = cpasync.tma_partition(loads.tma_v, 0, cute.make_layout(1),
                                           cute.group_modes(loads.sV8, 0, 2),
                                           cute.group_modes(g, 0, 2))
            bar = loads.bars[2] + loads.wg * self.cfg.stages + s
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar, self.v_bytes)
            cute.copy(loads.tma_v, tg[None, b, loads.wg], ts[None, loads.wg * self.cfg.stages + s],
                      tma_bar_ptr=bar)


class Loads(NamedTuple):
    """What the TMA loads of a block need: the TMA views of K and V, their atoms, the K ring
    and the V rings, the barriers (K full, K empty, V full), the page table (None:
    contiguous), the (KV head, batch row), the warp and the warpgroup."""

    gK: cute.Tensor
    gV: cute.Tensor
    tma_k: cute.CopyAtom
    tma_v: cute.CopyAtom
    sK: cute.Tensor
    sV8: cute.Tensor
    bars: tuple
    table: object
    kv_head: Int32
    batch: Int32
    warp: Int32
    wg: Int32


__all__ = ["FFPADecodeKeysSm90"]
