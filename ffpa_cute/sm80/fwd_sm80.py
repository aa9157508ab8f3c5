"""Split-D attention forward on mma.sync (sm_80 / sm_86 / sm_89; also runs on sm_90 and sm_120).

What it computes: O = softmax(scale * Q K^T [+ causal mask]) V and LSE, for q [B, Hq, Nq, D],
k/v [B, Hkv, Nkv, D] (any strides, unit stride on D), Hq a multiple of Hkv (GQA/MQA), any Nq, Nkv,
bf16/fp16 in, fp32 accumulation, D from 264 to 1024 in steps of 8.

This kernel works as follows (one CTA = one tile_m-row Q tile of one (batch, head)):
1. cp.async Q[tile_m, D] into shared memory once (it stays resident: tile_m * D <= 32K elements).
2. Stream K and V through one ring of `num_stages` chunk buffers, each [tile_n, tile_hdim]. The
   ring order per KV block is K chunk 0..C-1, then V chunk 0..C-1 (C = ceil(D / tile_hdim)), so the
   shared memory used by K/V does not grow with D (the FFPA "O(1) SRAM" idea).
3. S = Q K^T accumulates over the C head-dim chunks (ldmatrix + mma.sync m16n8k16).
4. Mask (seqlen residue, causal diagonal, a sliding window's left edge: config `window`, its
   blocks left of the edge never visited) only on blocks that need it (common/mask.py); online
   softmax in exp2 form (common/softmax.py). With warp_n > 1 the row max is combined across
   warps through smem.
5. P (bf16/fp16) goes to shared memory once, is loaded back as the A operand of PV, and each V
   chunk updates its own O chunk: O[:, c] += P V[:, c]. O stays in registers as C fragments.
6. Epilogue: O /= row_sum (with `sinks`, the head's sink joins the sum: Note [Sinks] in
   common/softmax.py), LSE, O staged through the (now free) Q buffer and stored with 128-bit
   predicated writes; rows past Nq and columns past D are never written.

Warp layouts (config field `warp_layout`, warps along M x warps along N of every MMA):
M8N1 (FA-2 style, no exchange), M4N2 and M2N4 (O split across warps along D, so each thread
holds D / (2 * warp_n) fp32 of O; the price is one extra CTA barrier per KV block).

Budget (bf16, tile_hdim = 64): smem = Q (tile_m x D) + ring (tile_n x 64 x 2 B per stage) + P
(tile_m x 64 x 2 B, M4N2/M2N4 only) + row stats. D=512, M4N2: Q 64 KB + 4 x 8 KB + 8 KB = 107 KB
(sm_80/sm_90a; sm_120's 99 KB takes 2 stages), O 128 registers/thread. D=1024, M2N4: Q 32 x 1024
= 64 KB, same ring, O 128 registers/thread (3 stages on sm_120). D=320, M8N1 (tile_n 32, P in
registers): Q 80 KB + 4 x 4 KB, O 160 registers/thread. ptxas: 210-254 registers, no spills.

Constraints (mirrored by `config.can_implement`):
* dtype bf16 or fp16; D a multiple of 8 in [264, 1024] (the last chunk is zero-padded in smem);
* the last mode of q, k, v, o has stride 1 and every other stride is a multiple of 8 elements;
* Hq % Hkv == 0.

The quantized forwards are subclasses on the same skeleton (their hooks: operand layouts, the
MMA, the loads, P's rounding): `FFPAFwdSm80FP8` (e4m3, mma.sync m16n8k32; sm_89 / sm_120, run
on the H200 as sm_90a code) and `FFPAFwdSm80FP4` (NVFP4, the block-scaled mma.sync of sm_120a;
compile-verified only, never run).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.utils import blackwell_helpers as bh

from ..common.mask import apply_mask, block_needs_mask, n_block_max, n_block_min
from ..common.scheduler import rows_from, varlen_tile
from ..common.softmax import (FRAME_FLOOR_LOG2, P_BIAS_LOG2, OnlineSoftmax, mn_view,
                              quad_allreduce_max)
from ..common.tensors import (CUTLASS_DTYPES, LOG2_E, KernelEntry, aligned_bhdn, aligned_bhnd,
                              fake_args, fake_cu, fake_fp8_args, fake_tensor)
from .config import FwdConfigSm80, can_implement


class BlockSeq(NamedTuple):
    """A CTA's ring iterations: `num_iters` blocks, `per_head` of them per head from head0 on,
    each head's from block n_top-1 down. The forward walks the KV blocks n_top-1 .. 0 of one
    head; the backward's dV / dK walk query blocks of all the query heads of a KV head."""

    n_top: cutlass.Int32
    num_iters: cutlass.Int32
    head0: cutlass.Int32
    per_head: cutlass.Int32


class Features(NamedTuple):
    """The runtime values of a config's features (None: compiled without it): the window's
    left edge (query i sees key j only if j >= i + window_lo), the [Hq] sink logits, and
    (`varlen`) the int32 cumulative lengths of the rows' and the columns' sequences."""

    window_lo: object
    sinks: object
    cu: object = None


def features_of(cfg, window_lo, mSinks, cu=None):
    """The kernel's `features` argument: None for a config with none of them (its code has
    none)."""
    if not (cfg.window or cfg.sinks or cfg.varlen):
        return None
    return Features(window_lo if cfg.window else None, mSinks if cfg.sinks else None,
                    cu if cfg.varlen else None)


class FFPAFwdSm80(KernelEntry):
    """Split-D forward; one instance per `FwdConfigSm80` (the compile key)."""

    arch_family = "sm80"
    transposed = False  # rows are queries (the gradient kernels dV / dK: keys)
    OPERANDS = ("q", "k", "v", "o", "lse", "sinks", "cu_q", "cu_k")
    SCALARS = ("softmax_scale", "causal_offset", "window_lo")

    @staticmethod
    def fake_inputs(cfg):
        """(q, k, v, o, lse) stand-ins, then sinks: an [Hq] fp32 stand-in with `sinks`, else
        None, then cu_q, cu_k: int32 [B + 1] stand-ins with `varlen`, else None each."""
        return (*fake_args(cfg), fake_tensor(cutlass.Float32, 1, 1) if cfg.sinks else None,
                *fake_cu(cfg))

    def __init__(self, cfg: FwdConfigSm80):
        self._refuse(can_implement(cfg))
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        self.out_dtype = CUTLASS_DTYPES[getattr(cfg, "out_dtype", cfg.dtype)]
        self.tile_m, self.tile_n, self.tile_hdim = cfg.tile_m, cfg.tile_n, cfg.tile_hdim
        self.num_chunks = cfg.num_hdim_chunks
        self.num_stages = cfg.num_stages
        self.warp_m, self.warp_n = cfg.warp_m, cfg.warp_n
        self.num_threads = cfg.num_threads
        self.causal = cfg.causal

    # ---------------------------------------------------------------- layouts, MMA, storage
    def _chunk_atom(self, swizzle=None):
        """8 rows x 64 elements of a [rows x 64] chunk, swizzled (`SMEM_SWIZZLE`, in elements)
        so that ldmatrix's / a warp's 8 rows x 16 bytes and the 16-byte cp.async hit every
        bank once."""
        return cute.make_composed_layout(cute.make_swizzle(*(swizzle or self.SMEM_SWIZZLE)), 0,
                                         cute.make_layout((8, 64), stride=(64, 1)))

    def _smem_layouts(self):
        atom = self._chunk_atom()
        sQ = cute.tile_to_shape(atom, (self.tile_m, self.tile_hdim, self.num_chunks), (0, 1, 2))
        sKV = cute.tile_to_shape(atom, (self.tile_n, self.tile_hdim, self.num_stages), (0, 1, 2))
        # P goes through smem only when warp_n > 1 (else an 8-row stand-in keeps the struct fixed)
        sP = cute.tile_to_shape(atom, (self.tile_m if self.warp_n > 1 else 8, 64), (0, 1))
        sStat = cute.make_layout((self.warp_n, self.tile_m), stride=(self.tile_m, 1))
        return sQ, sKV, sP, sStat

    def _tiled_mma(self):
        # Each warp owns 16 rows and 16 * k columns of every product (permutation N = 16 * warp_n).
        return cute.make_tiled_mma(
            warp.MmaF16BF16Op(self.dtype, cutlass.Float32, (16, 8, 16)),
            (self.warp_m, self.warp_n, 1),
            permutation_mnk=(self.warp_m * 16, self.warp_n * 16, 16),
        )

    def _gmem_tiled_copy(self, async_copy: bool, dtype=None, bits: int = 128):
        """`bits` per thread per copy over [rows, tile_hdim] tiles of `dtype` (the operands' by
        default); below 16 bytes cp.async takes the .ca form (.cg is 16-byte only)."""
        dtype = dtype or self.dtype
        elems = bits // dtype.width
        mode = cpasync.LoadCacheMode.GLOBAL if bits == 128 else cpasync.LoadCacheMode.ALWAYS
        op = cpasync.CopyG2SOp(cache_mode=mode) if async_copy else cute.nvgpu.CopyUniversalOp()
        atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=bits)
        cols = self.tile_hdim // elems
        thr = cute.make_layout((self.num_threads // cols, cols), stride=(cols, 1))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))

    # ---------------------------------------------------------------- host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mSinks, mCuQ, mCuK, softmax_scale: cutlass.Float32,
                 causal_offset: cutlass.Int32, window_lo: cutlass.Int32, stream: cuda.CUstream):
        """q/k/v/o: (B, H, N, D); lse: (B, Hq, Nq) fp32; sinks: (Hq,) fp32 with `sinks`, else
        None; cu_q, cu_k: with `varlen` the sequences' cumulative lengths (int32 [B + 1]; the
        tensors (1, H, total, D), lse (1, Hq, total_q)), else None; window_lo: read with
        `window`. Launch grid = (m_blocks, Hq, B) (`varlen`: (ceil(total_q / tile_m) + B,
        Hq, 1))."""
        mQ, mK, mV, mO = [self._aligned(t) for t in (mQ, mK, mV, mO)]
        self._launch(mQ, mK, mV, mO, mLSE, softmax_scale, causal_offset,
                     self._gmem_tiled_copy(True), stream,
                     features_of(self.cfg, window_lo, mSinks, (mCuQ, mCuK)))

    @cute.jit
    def _launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                stats, softmax_scale: cutlass.Float32, causal_offset: cutlass.Int32,
                copy_in: cute.TiledCopy, stream: cuda.CUstream, features=None):
        """The shared-memory struct (`_storage_fields`), the grid (m_blocks, Hq, B) and the
        launch of `kernel`, for aligned operands in the kernel's dtype and O in out_dtype;
        stats: the LSE (16 bits) or (LSE, the descales[, the block scales]); copy_in: the
        global -> shared copy of the operand chunks; features: the window's left edge and
        sinks (`features_of`), or None."""
        layouts = self._smem_layouts()
        SharedStorage = self._shared_storage(self._storage_fields(*layouts))
        tiles = cute.ceil_div(mQ.shape[2], self.tile_m)
        if cutlass.const_expr(features is not None and features.cu is not None):
            tiles = tiles + cute.size(features.cu[0]) - 1   # common/scheduler.py's bound
        grid = (tiles, cute.size(mQ.shape[1]), cute.size(mQ.shape[0]))
        self.kernel(
            mQ, mK, mV, mO, stats, softmax_scale * LOG2_E, causal_offset, *layouts, copy_in,
            self._gmem_tiled_copy(False, self.out_dtype), self._tiled_mma(), SharedStorage,
            features,
        ).launch(grid=grid, block=[self.num_threads, 1, 1],
                 smem=SharedStorage.size_in_bytes(), stream=stream)

    def _storage_fields(self, sQ_layout, sKV_layout, sP_layout, sStat_layout) -> dict:
        """The shared-memory regions in order: the resident rows (Q), the chunk ring, P, the
        row statistics (each 1 KB aligned, the statistics 16 B)."""
        mem, align = cute.struct.MemRange, cute.struct.Align
        return {"sQ": align[mem[self.dtype, cute.cosize(sQ_layout)], 1024],
                "sKV": align[mem[self.dtype, cute.cosize(sKV_layout)], 1024],
                "sP": align[mem[self.dtype, cute.cosize(sP_layout)], 1024],
                "sStat": align[mem[cutlass.Float32, cute.cosize(sStat_layout)], 16]}

    @staticmethod
    def _shared_storage(fields: dict):
        """The storage struct of `fields` (name -> MemRange type, in order)."""
        return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

    def _aligned(self, t: cute.Tensor) -> cute.Tensor:
        return aligned_bhnd(t, self.cfg.head_dim, self.dtype)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, scale_log2: cutlass.Float32, causal_offset: cutlass.Int32,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, sStat_layout: cute.Layout,
               gmem_copy_in: cute.TiledCopy, gmem_copy_out: cute.TiledCopy,
               tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr, features):
        # resident rows Q; ring phases K (scores) then V (accumulator B operand); output O
        self._mainloop((mQ,), (mK, mV), mO, (mLSE,), scale_log2, causal_offset,
                       sQ_layout, sKV_layout, sP_layout, sStat_layout,
                       gmem_copy_in, gmem_copy_out, tiled_mma, SharedStorage, features)

    # The skeleton below is shared with the backward kernels (bwd_sm80.py), which put other
    # tensors in its roles and replace the hooks that follow it (Note [Skeleton roles]).
    #
    # Note [Skeleton roles]: `rows[0]` is the resident operand (tile_m rows, every head-dim
    # chunk in smem); `cols` holds one tensor per ring phase: phases 0 .. num_scores-1 are the
    # score products (A = resident rows or a hook's row chunks, B = the phase's chunk), the last
    # phase is the accumulator's B operand (transposed chunks, A = P from the softmax hook).
    # The forward is rows (Q,), cols (K, V), num_scores 1.
    num_scores = 1
    # the chunk atom's swizzle: 64 bf16 = 128 B per row, Swizzle<3,3,3>
    SMEM_SWIZZLE = (3, 3, 3)
    # the accumulator's B chunks lie in the ring as [tile_n, tile_hdim] (False: ldmatrix
    # transposes them) or already K-major as [tile_hdim, tile_n] (True: the FP8 forward's Vt)
    B_K_MAJOR = False
    # the operands load from shared memory by ldmatrix (False: the kernel's `_score_mma` /
    # `_pv_mma` load them their own way)
    LDMATRIX = True

    @cute.jit
    def _mainloop(self, rows, cols, mO: cute.Tensor, stats, scale_log2: cutlass.Float32,
                  causal_offset: cutlass.Int32, sQ_layout: cute.ComposedLayout,
                  sKV_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
                  sStat_layout: cute.Layout, gmem_copy_in: cute.TiledCopy,
                  gmem_copy_out: cute.TiledCopy, tiled_mma: cute.TiledMma,
                  SharedStorage: cutlass.Constexpr, features):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, head, batch = cute.arch.block_idx()
        grid_m, _, _ = cute.arch.grid_dim()
        m_block = self._tile_index(bidx, grid_m)
        mQ, mK = rows[0], cols[0]
        seqlen_q, seqlen_k, hdim = mQ.shape[2], mK.shape[2], mQ.shape[3]
        row0 = col0 = stat0 = None  # the first rows of R and C (`varlen`: the sequence's)
        window_lo = None if features is None else features.window_lo
        if cutlass.const_expr(self._varlen(features)):
            # tile bidx of the sequences' row tiles (R's: keys for dV / dK, whose tiles go
            # first first), in its sequence's frame: Nkv - Nq, bottom-right
            keys_rows = self.transposed
            m_block, row0, seqlen_q, col0, seqlen_k, frame = varlen_tile(
                features.cu[0], features.cu[1], bidx, self.tile_m, keys_rows, keys_rows)
            causal_offset = causal_offset + frame
            if cutlass.const_expr(window_lo is not None):
                window_lo = window_lo + frame
            stat0 = col0 if cutlass.const_expr(keys_rows) else row0   # the queries' first row
            rows = tuple(rows_from(m, row0, True, mode=2) for m in rows)   # (B, H, N, D)
            cols = tuple(rows_from(m, col0, True, mode=2) for m in cols)
            mQ = rows[0]
        head_kv, group = self._heads(head, mQ.shape[1], mK.shape[1])
        warp_n_idx = cute.arch.warp_idx() // self.warp_m
        lane = cute.arch.lane_idx()
        cta_sync = pipeline.NamedBarrier(barrier_id=1, num_threads=self.num_threads)
        C = self.num_chunks
        S = self.num_scores

        # ///// shared memory
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sQ = storage.sQ.get_tensor(sQ_layout)        # (tile_m, tile_hdim, C)
        sKV = storage.sKV.get_tensor(sKV_layout)     # (tile_n, tile_hdim, stages)
        sP = storage.sP.get_tensor(sP_layout)        # (tile_m, tile_n)
        sStat = storage.sStat.get_tensor(sStat_layout)  # (warp_n, tile_m)
        sRow2 = self._row_ring(storage)              # (tile_m, tile_hdim, stages) or None

        # ///// global tiles and their coordinates
        # (tile_m, tile_hdim, C)
        gQ = cute.local_tile(mQ[batch, head, None, None], (self.tile_m, self.tile_hdim),
                             (m_block, None))
        # per ring phase (tile_n, tile_hdim, n_blocks, C), or None where the head varies
        gCols = self._col_tiles(cols, batch, head_kv)
        idQ = cute.make_identity_tensor((seqlen_q, hdim))
        idKV = cute.make_identity_tensor((seqlen_k, hdim))
        cQ = cute.local_tile(idQ, (self.tile_m, self.tile_hdim), (m_block, None))
        cKV = cute.local_tile(idKV, (self.tile_n, self.tile_hdim), (None, None))

        thr_copy = gmem_copy_in.get_slice(tidx)
        rows_copy = self._rows_copy(gmem_copy_in)
        thr_rows_copy = rows_copy.get_slice(tidx)
        tQgQ = thr_rows_copy.partition_S(gQ)     # (CPY, CPY_M, CPY_K, C)
        tQsQ = thr_rows_copy.partition_D(sQ)     # (CPY, CPY_M, CPY_K, C)
        tQcQ = thr_rows_copy.partition_S(cQ)
        # per ring phase (CPY, CPY_N, CPY_K, n_blocks, C)
        tCg = None if gCols is None else [thr_copy.partition_S(g) for g in gCols]
        tKVcKV = thr_copy.partition_S(cKV)  # (CPY, CPY_N, CPY_K, n_blocks, C)
        tKVsKV = thr_copy.partition_D(sKV)  # (CPY, CPY_N, CPY_K, stages)

        # ///// MMA partitions and fragments
        thr_mma = tiled_mma.get_slice(tidx)
        sV0t = self._transposed(sKV[None, None, 0])
        tSrQ = thr_mma.make_fragment_A(thr_mma.partition_A(sQ[None, None, 0]))   # (MMA, MMA_M, MMA_K)
        tSrK = thr_mma.make_fragment_B(thr_mma.partition_B(sKV[None, None, 0]))  # (MMA, MMA_N, MMA_K)
        tOrVt = thr_mma.make_fragment_B(thr_mma.partition_B(sV0t))              # (MMA, MMA_N, MMA_K)
        acc_S = cute.make_rmem_tensor(
            thr_mma.partition_shape_C((self.tile_m, self.tile_n)), cutlass.Float32)
        acc_2 = None  # the second score product (num_scores == 2)
        if cutlass.const_expr(S == 2):
            acc_2 = cute.make_rmem_tensor(
                thr_mma.partition_shape_C((self.tile_m, self.tile_n)), cutlass.Float32)
        acc_O = [cute.make_rmem_tensor(
            thr_mma.partition_shape_C((self.tile_m, self.tile_hdim)), cutlass.Float32)
            for _ in range(C)]
        for c in cutlass.range_constexpr(C):
            acc_O[c].fill(0.0)
        acc_S_mn = mn_view(acc_S)
        acc_O_mn = [mn_view(acc_O[c]) for c in range(C)]
        # tile-local (row, col) of each S element, for masking and the row-stat exchange
        tScS_mn = mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n))))
        num_rows = cute.size(acc_S_mn, mode=[0])
        row_idx = cute.make_rmem_tensor(num_rows, cutlass.Int32)
        for r in cutlass.range_constexpr(num_rows):
            row_idx[r] = tScS_mn[r, 0][0]

        # ldmatrix copies smem -> registers (kernels whose operands ldmatrix cannot load,
        # LDMATRIX False, copy in their `_score_mma` / `_pv_mma`)
        s2r_A = s2r_B = s2r_Bt = tSrQ_v = tSrK_v = tOrVt_v = tOrP_v = tOsP = None
        if cutlass.const_expr(self.LDMATRIX):
            ldsm = cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                       self.dtype)
            ldsm_t = cute.make_copy_atom(
                warp.LdMatrix8x8x16bOp(transpose=not self.B_K_MAJOR, num_matrices=4), self.dtype)
            s2r_A = cute.make_tiled_copy_A(ldsm, tiled_mma).get_slice(tidx)
            s2r_B = cute.make_tiled_copy_B(ldsm, tiled_mma).get_slice(tidx)
            s2r_Bt = cute.make_tiled_copy_B(ldsm_t, tiled_mma).get_slice(tidx)
            tSrQ_v, tSrK_v = s2r_A.retile(tSrQ), s2r_B.retile(tSrK)
            tOrVt_v = s2r_B.retile(tOrVt)
        # P in the input dtype. With warp_n == 1 a warp holds whole rows of P, so its C fragment
        # is reused directly as the A operand of P V (FA-2); otherwise P goes through sP.
        rP = cute.make_fragment_like(acc_S, self.dtype)
        if cutlass.const_expr(self.warp_n == 1):
            tOrP = self._c_frag_as_a(rP)                                         # (MMA, MMA_M, MMA_K)
        else:
            tOrP = thr_mma.make_fragment_A(thr_mma.partition_A(sP))              # (MMA, MMA_M, MMA_K)
            if cutlass.const_expr(self.LDMATRIX):
                tOrP_v, tOsP = s2r_A.retile(tOrP), s2r_A.partition_S(sP)

        ctx = SimpleNamespace(
            tidx=tidx, batch=batch, head=head, m_block=m_block, seqlen_q=seqlen_q,
            seqlen_k=seqlen_k, hdim=hdim, warp_n_idx=warp_n_idx, lane=lane, cta_sync=cta_sync,
            rows=rows, cols=cols, mO=mO, stats=stats, scale_log2=scale_log2,
            causal_offset=causal_offset, sQ=sQ, sO=self._staging(storage, sQ), sKV=sKV, sP=sP,
            sStat=sStat, sRow2=sRow2,
            gmem_copy_in=gmem_copy_in, gmem_copy_out=gmem_copy_out, thr_copy=thr_copy, tCg=tCg,
            tKVcKV=tKVcKV, tKVsKV=tKVsKV, thr_mma=thr_mma, acc_S=acc_S, acc_S_mn=acc_S_mn,
            acc_2=acc_2, acc_O=acc_O, acc_O_mn=acc_O_mn, tScS_mn=tScS_mn, row_idx=row_idx,
            rP=rP, window_lo=window_lo, row0=row0, stat0=stat0, varlen=self._varlen(features),
            sinks=None if features is None else features.sinks, storage=storage,
            tiled_mma=tiled_mma, s2r_A=s2r_A, s2r_B=s2r_B, s2r_Bt=s2r_Bt, tSrQ=tSrQ, tSrK=tSrK,
            tSrQ_v=tSrQ_v, tSrK_v=tSrK_v, tOrVt=tOrVt, tOrVt_v=tOrVt_v, tOrP=tOrP,
            tOrP_v=tOrP_v, tOsP=tOsP)
        ctx.state = self._row_state(ctx)  # forward: the online softmax

        # ///// block sequence (forward: KV blocks in reverse, the residue / diagonal one first)
        seq = self._block_range(m_block, seqlen_k, causal_offset, head_kv, group, ctx.window_lo)
        steps = (S + 1) * C  # ring steps per block: the score phases' chunks, then the B chunks

        # ///// prologue: the resident rows (all chunks) join the first ring group
        for c in cutlass.range_constexpr(C):
            self._load_tile(rows_copy, tQgQ[None, None, None, c], tQsQ[None, None, None, c],
                            tQcQ[None, None, None, c], seqlen_q, self.tile_m,
                            m_block * self.tile_m, c)
        self._prologue(ctx)
        for s in cutlass.range_constexpr(self.num_stages - 1):
            if s // steps < seq.num_iters:
                h_p, n_p = self._block(seq, s // steps)
                self._load_ring_step(ctx, h_p, n_p, s % steps, s % self.num_stages)
            cute.arch.cp_async_commit_group()

        # ///// main loop over blocks
        for it in cutlass.range(seq.num_iters, unroll=1):
            blk_head, n_block = self._block(seq, it)
            for j in cutlass.range_constexpr(steps):
                t = it * steps + j
                cute.arch.cp_async_wait_group(self.num_stages - 2)
                cta_sync.arrive_and_wait()
                # prefetch the step num_stages-1 ahead into the slot step t-1 just released
                jp = j + self.num_stages - 1
                it_p = it + jp // steps
                if it_p < seq.num_iters:
                    h_p, n_p = self._block(seq, it_p)
                    self._load_ring_step(ctx, h_p, n_p, jp % steps,
                                         (t + self.num_stages - 1) % self.num_stages)
                cute.arch.cp_async_commit_group()
                slot = t % self.num_stages
                if cutlass.const_expr(j == 0):
                    self._block_start(ctx, blk_head, n_block)
                if cutlass.const_expr(j < S * C):
                    # ---- score product j // C: acc += rows[:, chunk] cols[:, chunk]^T
                    acc = acc_S if j < C else acc_2
                    if cutlass.const_expr(j % C == 0):
                        acc.fill(0.0)
                    self._score_mma(ctx, acc, j, slot)
                    if cutlass.const_expr(j == S * C - 1):
                        self._softmax_step(ctx, blk_head, n_block)
                else:
                    # ---- O[:, chunk] += P B[:, chunk]  (P was written before this step's barrier)
                    self._pv_mma(ctx, acc_O[j - S * C], j == S * C, slot)
        cute.arch.cp_async_wait_group(0)

        # ///// epilogue
        self._epilogue(ctx)

    # ---------------------------------------------------------------- skeleton hooks (forward)
    @cute.jit
    def _score_mma(self, ctx, acc, j: cutlass.Constexpr, slot):
        """acc += score chunk j's rows (`_score_rows`) times the ring slot's chunk^T: ldmatrix
        both, one mma.sync per k step."""
        tSsQ = ctx.s2r_A.partition_S(self._score_rows(ctx, j, slot))
        tSsK = ctx.s2r_B.partition_S(ctx.sKV[None, None, slot])
        for k in cutlass.range_constexpr(cute.size(ctx.tSrQ, mode=[2])):
            cute.copy(ctx.s2r_A, tSsQ[None, None, k], ctx.tSrQ_v[None, None, k])
            cute.copy(ctx.s2r_B, tSsK[None, None, k], ctx.tSrK_v[None, None, k])
            cute.gemm(ctx.tiled_mma, acc, ctx.tSrQ[None, None, k], ctx.tSrK[None, None, k], acc)

    @cute.jit
    def _pv_mma(self, ctx, acc, first: cutlass.Constexpr, slot):
        """acc (an O chunk) += P times the ring slot's B chunk; the block's `first` B chunk
        loads P from sP first (warp_n > 1)."""
        if cutlass.const_expr(first and self.warp_n > 1):
            cute.copy(ctx.s2r_A, ctx.tOsP, ctx.tOrP_v)
        tOsVt = ctx.s2r_Bt.partition_S(self._transposed(ctx.sKV[None, None, slot]))
        for k in cutlass.range_constexpr(cute.size(ctx.tOrP, mode=[2])):
            cute.copy(ctx.s2r_Bt, tOsVt[None, None, k], ctx.tOrVt_v[None, None, k])
            cute.gemm(ctx.tiled_mma, acc, ctx.tOrP[None, None, k], ctx.tOrVt[None, None, k], acc)

    @cute.jit
    def _tile_index(self, bidx, grid_m):
        """Row tile of this CTA: longest tiles first under causal (bottom-right)."""
        return grid_m - 1 - bidx

    @staticmethod
    def _varlen(features) -> bool:
        """Whether the kernel runs over packed sequences (`varlen`: features carry cu)."""
        return features is not None and features.cu is not None

    @cute.jit
    def _heads(self, head, heads_rows, heads_cols):
        """(head of the ring tensors for this CTA's row head, group size): the KV head."""
        return head // (heads_rows // heads_cols), 1

    @cute.jit
    def _block_range(self, m_block, seqlen_k, causal_offset, head_kv, group, window_lo):
        """KV blocks n_max-1 .. 0 (reverse order: the residue / diagonal block comes first),
        down to the first one the tile's first row sees under a window's left edge."""
        n_max = n_block_max(m_block, seqlen_k, causal_offset, self.tile_m, self.tile_n,
                            self.causal)
        if cutlass.const_expr(window_lo is None):
            return BlockSeq(n_max, n_max, head_kv, n_max)
        count = cutlass.max(n_max - n_block_min(m_block, window_lo, self.tile_m, self.tile_n), 0)
        return BlockSeq(n_max, count, head_kv, count)

    @cute.jit
    def _block(self, seq, i):
        """(head, block) of ring iteration i."""
        return seq.head0, seq.n_top - 1 - i

    def _row_ring(self, storage):
        """A second, streamed row operand's smem ring (none in the forward)."""
        return None

    def _col_tiles(self, cols, batch, head_kv):
        """Every ring phase's (tile_n, tile_hdim, n_blocks, C) tiles, or None when the
        phases' head changes from block to block (then `_load_ring_step` tiles per block)."""
        return [cute.local_tile(m[batch, head_kv, None, None], (self.tile_n, self.tile_hdim),
                                (None, None)) for m in cols]

    def _score_rows(self, ctx, j: int, slot):
        """A operand of score chunk j: the resident rows' chunk j."""
        return ctx.sQ[None, None, j]

    @cute.jit
    def _row_state(self, ctx):
        return OnlineSoftmax(cute.size(ctx.acc_S_mn, mode=[0]), ctx.scale_log2)

    @cute.jit
    def _block_start(self, ctx, blk_head, n_block):
        """Per-block setup before the first score chunk (nothing in the forward)."""
        pass

    def _prologue(self, ctx):
        """Loads beside the resident rows' (they join the first cp.async group): none."""
        return None

    def _fill_zero(self, t: cute.Tensor):
        """Zero a vector of shared memory that a predicated load skips."""
        t.fill(0)

    def _rows_copy(self, gmem_copy_in: cute.TiledCopy) -> cute.TiledCopy:
        """The tiled copy of the resident rows' chunks: the ring's."""
        return gmem_copy_in

    def _staging(self, storage, sQ: cute.Tensor) -> cute.Tensor:
        """Where the epilogue stages the accumulator for its stores: the Q buffer."""
        return sQ

    def _transposed(self, sV_chunk: cute.Tensor) -> cute.Tensor:
        """(tile_n, tile_hdim) V chunk seen as (tile_hdim, tile_n): the B operand of P V."""
        return cute.composition(
            sV_chunk, cute.make_layout((self.tile_hdim, self.tile_n), stride=(self.tile_n, 1)))

    @cute.jit
    def _load_tile(self, tiled_copy: cute.TiledCopy, src: cute.Tensor, dst: cute.Tensor,
                   coord: cute.Tensor, row_limit: cutlass.Int32, tile_rows: cutlass.Constexpr,
                   tile_row0: cutlass.Int32, chunk: cutlass.Constexpr):
        """16-byte cp.async of one [rows, tile_hdim] chunk; out-of-range vectors are zero-filled.

        Zero fill matters: padded K columns would add garbage to S, and rows past Nkv of V would
        turn P = 0 into NaN (0 * NaN) in P V. Only the tile that crosses `row_limit` pays for
        row predicates (a runtime branch), and only the last chunk of a D that is not a multiple
        of tile_hdim pays for column predicates (a compile-time one): the steady-state loads are
        plain copies, which keeps predicate and address registers out of the 255-register budget.
        """
        check_cols = chunk == self.num_chunks - 1 and self.cfg.head_dim % self.tile_hdim != 0
        if tile_row0 + tile_rows > row_limit:
            for m in cutlass.range_constexpr(cute.size(src, mode=[1])):
                for k in cutlass.range_constexpr(cute.size(src, mode=[2])):
                    rc = coord[0, m, k]
                    ok = rc[0] < row_limit
                    if cutlass.const_expr(check_cols):
                        ok = ok and rc[1] < self.cfg.head_dim
                    if ok:
                        cute.copy(tiled_copy, src[None, m, k], dst[None, m, k])
                    else:
                        self._fill_zero(dst[None, m, k])
        else:
            for m in cutlass.range_constexpr(cute.size(src, mode=[1])):
                for k in cutlass.range_constexpr(cute.size(src, mode=[2])):
                    if cutlass.const_expr(check_cols):
                        if coord[0, m, k][1] < self.cfg.head_dim:
                            cute.copy(tiled_copy, src[None, m, k], dst[None, m, k])
                        else:
                            self._fill_zero(dst[None, m, k])
                    else:
                        cute.copy(tiled_copy, src[None, m, k], dst[None, m, k])

    @cute.jit
    def _load_ring_step(self, ctx, head, n_block: cutlass.Int32, step: cutlass.Constexpr,
                        slot: cutlass.Int32):
        """Ring step `step` of block n_block: chunk `step % C` of phase `step // C`
        (forward: K chunk `step`, or V chunk `step - C`)."""
        C = self.num_chunks
        chunk = step % C
        src = ctx.tCg[step // C]
        self._load_tile(ctx.gmem_copy_in, src[None, None, None, n_block, chunk],
                        ctx.tKVsKV[None, None, None, slot],
                        ctx.tKVcKV[None, None, None, n_block, chunk],
                        ctx.seqlen_k, self.tile_n, n_block * self.tile_n, chunk)

    @cute.jit
    def _softmax_step(self, ctx, head, n_block):
        """Mask, online softmax, O rescale; P -> rP (and sP when warp_n > 1)."""
        acc_S_mn, softmax = ctx.acc_S_mn, ctx.state
        if block_needs_mask(ctx.m_block, n_block, ctx.seqlen_k, ctx.causal_offset, self.tile_m,
                            self.tile_n, self.causal, ctx.window_lo):
            apply_mask(acc_S_mn, ctx.tScS_mn, ctx.m_block, n_block, ctx.seqlen_k,
                       ctx.causal_offset, self.tile_m, self.tile_n, self.causal, ctx.window_lo)
        blk_max = softmax.block_max(acc_S_mn)
        if cutlass.const_expr(self.warp_n > 1):
            softmax.exchange(blk_max, ctx.sStat, ctx.row_idx, ctx.warp_n_idx, ctx.lane,
                             self.warp_n, True, ctx.cta_sync.arrive_and_wait)
        softmax.update(acc_S_mn, blk_max, ctx.acc_O_mn)
        self._store_p(ctx)

    @cute.jit
    def _store_p(self, ctx):
        """The scores' fragment (now P) -> rP in the input dtype, and sP when warp_n > 1."""
        ctx.rP.store(ctx.acc_S.load().to(self.dtype))
        if cutlass.const_expr(self.warp_n > 1):
            cute.autovec_copy(ctx.rP, ctx.thr_mma.partition_C(ctx.sP))

    def _c_frag_as_a(self, rP: cute.Tensor) -> cute.Tensor:
        """View an m16n8 C fragment ((2,2), MMA_M, MMA_N) as an m16n8k16 A fragment
        ((2,2,2), MMA_M, MMA_N / 2): two adjacent n8 atoms form one k16 step."""
        d = cute.logical_divide(rP.layout, (None, None, 2))
        view = cute.make_layout(
            ((d.shape[0], d.shape[2][0]), d.shape[1], d.shape[2][1]),
            stride=((d.stride[0], d.stride[2][0]), d.stride[1], d.stride[2][1]))
        return cute.make_tensor(rP.iterator, view)

    @cute.jit
    def _epilogue(self, ctx):
        """Normalise, write LSE, stage O in the Q buffer, 128-bit predicated stores."""
        softmax, mLSE = ctx.state, ctx.stats[0]
        softmax.finalize_sum()
        ctx.cta_sync.arrive_and_wait()  # everyone is done with sQ and sStat
        if cutlass.const_expr(self.warp_n > 1):
            softmax.exchange(softmax.row_sum, ctx.sStat, ctx.row_idx, ctx.warp_n_idx, ctx.lane,
                             self.warp_n, False, ctx.cta_sync.arrive_and_wait)
        lse = cute.make_rmem_tensor(softmax.num_rows, cutlass.Float32)
        sink_log2 = None  # the head's sink joins the row sums (Note [Sinks], common/softmax.py)
        if cutlass.const_expr(ctx.sinks is not None):
            sink_log2 = ctx.sinks[ctx.head] * LOG2_E
        softmax.normalize(ctx.acc_O_mn, lse, None, sink_log2)
        if ctx.warp_n_idx == 0 and ctx.lane % 4 == 0:
            for r in cutlass.range_constexpr(softmax.num_rows):
                row = ctx.m_block * self.tile_m + ctx.row_idx[r]
                if row < ctx.seqlen_q:
                    if cutlass.const_expr(ctx.varlen):
                        row = ctx.row0 + row
                    mLSE[ctx.batch, ctx.head, row] = lse[r]
        self._store_acc(ctx, ctx.acc_O)

    @cute.jit
    def _store_acc(self, ctx, acc_O):
        """acc_O (C chunks, fp32) -> out dtype -> the staging buffer (`_staging`: the Q buffer,
        free: the last score step precedes the last barrier) -> 128-bit stores of rows <
        seqlen_q, columns < D."""
        C = self.num_chunks
        sQ, mO, seqlen_q, hdim = ctx.sO, ctx.mO, ctx.seqlen_q, ctx.hdim
        for c in cutlass.range_constexpr(C):
            rO = cute.make_fragment_like(acc_O[c], self.out_dtype)
            rO.store(acc_O[c].load().to(self.out_dtype))
            cute.autovec_copy(rO, ctx.thr_mma.partition_C(sQ[None, None, c]))
        ctx.cta_sync.arrive_and_wait()
        mO_bh = rows_from(mO[ctx.batch, ctx.head, None, None], ctx.row0, ctx.varlen)
        gO = cute.local_tile(mO_bh, (self.tile_m, self.tile_hdim), (ctx.m_block, None))
        cO = cute.local_tile(cute.make_identity_tensor((seqlen_q, hdim)),
                             (self.tile_m, self.tile_hdim), (ctx.m_block, None))
        gmem_copy_out = ctx.gmem_copy_out
        thr_copy = gmem_copy_out.get_slice(ctx.tidx)
        tOsO = thr_copy.partition_S(sQ)   # (CPY, CPY_M, CPY_K, C)
        tOgO = thr_copy.partition_D(gO)
        tOcO = thr_copy.partition_D(cO)
        for c in cutlass.range_constexpr(C):
            for m in cutlass.range_constexpr(cute.size(tOsO, mode=[1])):
                for k in cutlass.range_constexpr(cute.size(tOsO, mode=[2])):
                    rc = tOcO[0, m, k, c]
                    if rc[0] < seqlen_q and rc[1] < hdim:
                        vec = cute.make_fragment_like(tOsO[None, m, k, c])
                        cute.autovec_copy(tOsO[None, m, k, c], vec)
                        cute.copy(gmem_copy_out, vec, tOgO[None, m, k, c])


class FFPAFwdSm80FP8(FFPAFwdSm80):
    """The Split-D forward for e4m3 Q, K, V (`FwdFP8ConfigSm80`): the 16-bit forward's skeleton
    with 8-bit operands, for the GPUs with e4m3 mma.sync and no WGMMA / tcgen05 FP8 of ours
    (sm_89, sm_120 / sm_121; on sm_90a it runs under `Options(family="sm80")`).

    Per CTA, as `FFPAFwdSm80` with these differences:
      1. Q, K, Vt and P in e4m3 in shared memory, [rows x 64] chunks of 64-byte rows
         (Swizzle<2,4,3>: ldmatrix's 8 rows x 16 bytes and the 16-byte cp.async conflict-free);
         every product is mma.sync m16n8k32 e4m3 (fp32 accumulation), its operands loaded by
         ldmatrix unchanged (an 8-bit K-major fragment has the byte layout of a 16-bit one).
      2. V arrives transposed, Vt [B, Hkv, D, N] (the host's one pass: fp8.py), because both
         operands of the 8-bit mma.sync are K-major: a ring chunk of Vt is [64 dims x 64 keys],
         the B operand of P V as it lies. Keys past Nkv are zero: the chunk crossing Nkv is
         loaded with per-vector predicates, and the host zeroes Vt's row padding (N rounded up to
         16) that the last vector may read.
      3. The scores' scale carries q_descale * k_descale (per (batch, KV head)); P = exp2(s *
         scale_log2 - frame + 8) in each block's own frame (at most 256 < 448: no e4m3
         saturation; common/softmax.py, Note [FP8 P: the block's own frame]), rounded to e4m3
         into shared memory (the 8-bit A fragment's k order differs from the C fragment's, so P
         never stays in registers: M4N2 / M2N4 only).
      4. O / row_sum * v_descale in out_dtype, staged in the Q buffer (sized for O); LSE fp32.

    Constraints (`config.can_implement`): sm_89 / sm_90a / sm_120a / sm_121a; e4m3 in, bf16 /
    fp16 out; D a multiple of 16 in [272, 1024]; Dv == D; a sliding window and sinks as in the
    16-bit forward (`features`). Run and tested on an H200 (compiled for sm_90a); sm_89 and
    sm_120 builds are compile-verified only."""

    OPERANDS = ("q", "k", "vt", "o", "lse", "q_descale", "k_descale", "v_descale", "sinks")
    SCALARS = ("softmax_scale", "causal_offset", "window_lo")
    B_K_MAJOR = True
    SMEM_SWIZZLE = (2, 4, 3)  # 64 e4m3 = 64 B per row: 16-byte chunks moved by row bits 1-2

    @staticmethod
    def fake_inputs(cfg):
        """The FP8 stand-ins (`fake_fp8_args`), then sinks: an [Hq] fp32 stand-in with
        `sinks`, else None."""
        return (*fake_fp8_args(cfg),
                fake_tensor(cutlass.Float32, 1, 1) if cfg.sinks else None)

    def _staging_layout(self):
        """O in out_dtype over the Q buffer: the 16-bit forward's Q layout."""
        return cute.tile_to_shape(self._chunk_atom(FFPAFwdSm80.SMEM_SWIZZLE),
                                  (self.tile_m, self.tile_hdim, self.num_chunks), (0, 1, 2))

    def _tiled_mma(self):
        return cute.make_tiled_mma(
            warp.MmaFP8Op(self.dtype, cutlass.Float32, (16, 8, 32)),
            (self.warp_m, self.warp_n, 1),
            permutation_mnk=(self.warp_m * 16, self.warp_n * 16, 32),
        )

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mQd: cute.Tensor, mKd: cute.Tensor, mVd: cute.Tensor,
                 mSinks, softmax_scale: cutlass.Float32, causal_offset: cutlass.Int32,
                 window_lo: cutlass.Int32, stream: cuda.CUstream):
        """q, k: (B, H, N, D) e4m3; vt: (B, Hkv, D, Nkv) e4m3; o: (B, Hq, Nq, D) out_dtype;
        lse: (B, Hq, Nq) fp32; descales: (B, Hkv) fp32; sinks: (Hq,) fp32 with `sinks`, else
        None; window_lo: read with `window`. Grid (m_blocks, Hq, B)."""
        D = self.cfg.head_dim
        mQ, mK = aligned_bhnd(mQ, D, self.dtype), aligned_bhnd(mK, D, self.dtype)
        mVt = aligned_bhdn(mVt, D, self.dtype)
        self._launch_quantized(mQ, mK, mVt, mO, (mLSE, mQd, mKd, mVd), softmax_scale,
                               causal_offset, stream, features_of(self.cfg, window_lo, mSinks))

    @cute.jit
    def _launch_quantized(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor,
                          mO: cute.Tensor, stats, softmax_scale: cutlass.Float32,
                          causal_offset: cutlass.Int32, stream: cuda.CUstream, features=None):
        """`_launch` for q / k / vt already in the kernel's dtype: O aligned in out_dtype, the
        operand chunks copied by `_vector_copy`."""
        mO = aligned_bhnd(mO, self.cfg.head_dim, self.out_dtype)
        self._launch(mQ, mK, mVt, mO, stats, softmax_scale, causal_offset,
                     self._vector_copy(self.tile_n), stream, features)

    def _storage_fields(self, sQ_layout, sKV_layout, sP_layout, sStat_layout) -> dict:
        """The 16-bit forward's regions with the Q buffer sized for O's staging (out_dtype is
        wider than the operands)."""
        fields = super()._storage_fields(sQ_layout, sKV_layout, sP_layout, sStat_layout)
        elems = cute.cosize(self._staging_layout()) * self.out_dtype.width // self.dtype.width
        fields["sQ"] = cute.struct.Align[cute.struct.MemRange[self.dtype, elems], 1024]
        return fields

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor,
               stats, scale_log2: cutlass.Float32, causal_offset: cutlass.Int32,
               sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
               sP_layout: cute.ComposedLayout, sStat_layout: cute.Layout,
               gmem_copy_in: cute.TiledCopy, gmem_copy_out: cute.TiledCopy,
               tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr, features):
        # resident rows Q; ring phases K (scores) then Vt (accumulator B operand); output O;
        # stats (LSE, q / k / v descales[, block scales]); features (window, sinks) or None
        self._mainloop((mQ,), (mK, mVt), mO, stats, scale_log2, causal_offset,
                       sQ_layout, sKV_layout, sP_layout, sStat_layout,
                       gmem_copy_in, gmem_copy_out, tiled_mma, SharedStorage, features)

    def _vector_copy(self, rows: int) -> cute.TiledCopy:
        """cp.async of [rows, tile_hdim] chunks by all threads at once: 16-byte vectors where
        the chunk has num_threads * 16 bytes or more (the 16-bit forward's copy), else as wide
        as the chunk allows (8 or 4 bytes, cp.async.ca): 16-byte vectors of 256 threads cover
        64 rows of 64 bytes, more than M2N4's 32-row Q tile or a 4-bit chunk."""
        bits = min(128, rows * self.tile_hdim * self.dtype.width // self.num_threads)
        return self._gmem_tiled_copy(True, bits=bits)

    def _rows_copy(self, gmem_copy_in: cute.TiledCopy) -> cute.TiledCopy:
        """Q's chunks (`_vector_copy` of tile_m rows)."""
        return self._vector_copy(self.tile_m)

    def _staging(self, storage, sQ: cute.Tensor) -> cute.Tensor:
        """The Q buffer (sized for O) seen as O's out_dtype staging tiles."""
        ptr = cute.recast_ptr(storage.sQ.data_ptr(), dtype=self.out_dtype)
        return cute.make_tensor(ptr, self._staging_layout())

    def _transposed(self, sV_chunk: cute.Tensor) -> cute.Tensor:
        """A Vt chunk is (tile_hdim, tile_n) already: the B operand of P V as it lies."""
        return sV_chunk

    def _col_tiles(self, cols, batch, head_kv):
        """K's (tile_n, tile_hdim, n_blocks, C) tiles and Vt's (tile_hdim, tile_n, n_blocks,
        C) tiles."""
        gK = cute.local_tile(cols[0][batch, head_kv, None, None],
                             (self.tile_n, self.tile_hdim), (None, None))
        gVt = cute.local_tile(cols[1][batch, head_kv, None, None],
                              (self.tile_hdim, self.tile_n), (None, None))
        return [gK, cute.make_tensor(gVt.iterator, cute.select(gVt.layout, mode=[0, 1, 3, 2]))]

    @cute.jit
    def _load_ring_step(self, ctx, head, n_block: cutlass.Int32, step: cutlass.Constexpr,
                        slot: cutlass.Int32):
        """K chunks as the 16-bit forward loads them; Vt chunk `step - C` of block n_block:
        rows (dims) past D and vectors whose first key is past Nkv zero-filled, on the chunk
        that crosses D and the block that crosses Nkv only."""
        C = self.num_chunks
        if cutlass.const_expr(step < C):
            FFPAFwdSm80._load_ring_step(self, ctx, head, n_block, step, slot)
        else:
            chunk = step - C
            src = ctx.tCg[1][None, None, None, n_block, chunk]
            dst = ctx.tKVsKV[None, None, None, slot]
            coord = ctx.thr_copy.partition_S(cute.local_tile(
                cute.make_identity_tensor((ctx.hdim, ctx.seqlen_k)),
                (self.tile_hdim, self.tile_n), (chunk, n_block)))
            edge = n_block * self.tile_n + self.tile_n > ctx.seqlen_k
            if cutlass.const_expr(chunk == C - 1 and self.cfg.head_dim % self.tile_hdim != 0):
                edge = True
            if edge:
                for m in cutlass.range_constexpr(cute.size(src, mode=[1])):
                    for k in cutlass.range_constexpr(cute.size(src, mode=[2])):
                        rc = coord[0, m, k]
                        if rc[0] < ctx.hdim and rc[1] < ctx.seqlen_k:
                            cute.copy(ctx.gmem_copy_in, src[None, m, k], dst[None, m, k])
                        else:
                            self._fill_zero(dst[None, m, k])
            else:
                cute.copy(ctx.gmem_copy_in, src, dst)

    @cute.jit
    def _row_state(self, ctx):
        """The online softmax with P in each block's frame, the scores' scale times q_descale *
        k_descale, and 1 / row_sum times v_descale (this (batch, KV head)'s)."""
        mQd, mKd, mVd = ctx.stats[1], ctx.stats[2], ctx.stats[3]
        head_kv = ctx.head // (ctx.rows[0].shape[1] // ctx.cols[0].shape[1])
        qk = mQd[ctx.batch, head_kv] * mKd[ctx.batch, head_kv]
        return OnlineSoftmax(cute.size(ctx.acc_S_mn, mode=[0]), ctx.scale_log2 * qk,
                             p_bias_log2=P_BIAS_LOG2, frame_floor_log2=FRAME_FLOOR_LOG2,
                             out_scale=mVd[ctx.batch, head_kv])


class FFPAFwdSm80FP4(FFPAFwdSm80FP8):
    """The Split-D forward for NVFP4 Q, K, Vt (`FwdFP4ConfigSm80`, sm_120a / sm_121a): the FP8
    forward's skeleton with the block-scaled mma.sync kind::mxf4nvf4 m16n8k64 (E2M1 operands,
    one unsigned E4M3 scale per 16 elements along K, fp32 accumulation).

    **Compile-verified only, never run** (no sm_120 GPU here): CI compiles it for sm_120a and
    checks its PTX; on such a GPU each configuration first passes selfcheck.py's canary.

    Per CTA, as `FFPAFwdSm80FP8` with these differences:
      1. Operands as ffpa_cute/nvfp4.py encodes them: codes two per byte (uint8 [..., D / 2]),
         block scales one byte per 16 elements (uint8 [..., D / 16]) read as 4-byte words, one
         word per 64-element chunk of a row; V as the NVFP4 of V^T (Vt [B, Hkv, D, Npad], its
         blocks along the keys, P V's contraction; Npad a multiple of 64, zero past Nkv).
      2. Shared memory: Q's codes (tile_m x D / 2 bytes) and scale words (tile_m x D / 64)
         resident; the ring's [64 x 64] code chunks (32-byte rows, Swizzle<1,5,3>: the 8 rows
         a warp reads at one k are conflict-free) beside one scale word per chunk row. The
         operands reach registers by 32-bit shared loads (ldmatrix moves 16-bit pairs; an E2M1
         fragment is 8 codes per register), the scales by the fragment layouts of CUTLASS's
         SM120 block-scaled traits (`cutlass.utils.blackwell_helpers.thrfrg_SFA` / `_SFB`).
      3. The warps tile N by the permutation (8, warp_n, 2):(1, 16, 8), so each warp owns whole
         16-column blocks: P's scale blocks are reduced within a quad, no exchange.
      4. P = exp2(s * scale_log2 - frame + 8) <= 256 (the FP8 frame) is quantised per 16 keys
         as ffpa_cute.nvfp4 does with tensor scale 1: scale = e4m3(amax / 6) (<= 42.7, inside
         E4M3), code = e2m1(p / scale) (satfinite: at most 6; a block whose amax / 6 rounds to
         0 is all zero, i.e. below 2^-10 * 6 of 256). The row sum uses P before rounding.
      5. The descales (q_descale, k_descale, v_descale: NVFP4's per-tensor scales, [B, Hkv]
         fp32) fold into the scores' scale and O's final factor as in the FP8 forward.

    A sliding window and sinks as in the FP8 forward (masked keys give P = 0 before P's
    16-key blocks are scaled).

    Constraints (`config.can_implement`): sm_120a / sm_121a; D a multiple of 64 in [320,
    1024]; Dv == D; bf16 / fp16 out."""

    # v / v_sf: the NVFP4 codes and scales of V^T (nvfp4.py's `prepare_v`)
    OPERANDS = ("q", "q_sf", "k", "k_sf", "v", "v_sf", "o", "lse", "q_descale", "k_descale",
                "v_descale", "sinks")
    LDMATRIX = False
    SMEM_SWIZZLE = (1, 5, 3)  # 64 E2M1 = 32 B per row: each 16-byte half moved by row bit 2

    @staticmethod
    def fake_inputs(cfg):
        """q, q_sf, k, k_sf, v, v_sf (uint8, rows 16-byte aligned for the codes, 4-byte for
        the scales), o (out_dtype), lse, three (B, Hkv) fp32 descales, then sinks: an [Hq]
        fp32 stand-in with `sinks`, else None."""
        u8, f32 = cutlass.Uint8, cutlass.Float32
        ops = [fake_tensor(u8, 4, 16 if i % 2 == 0 else 4) for i in range(6)]
        return (*ops, fake_tensor(CUTLASS_DTYPES[cfg.out_dtype], 4, 8), fake_tensor(f32, 3, 1),
                *(fake_tensor(f32, 2, 1) for _ in range(3)),
                fake_tensor(f32, 1, 1) if cfg.sinks else None)

    def _storage_fields(self, sQ_layout, sKV_layout, sP_layout, sStat_layout) -> dict:
        """The FP8 forward's regions plus the scale words: Q's (tile_m x C), the ring's (tile_n
        x stages) and P's (tile_m, 4 blocks of 16 keys each)."""
        mem, align = cute.struct.MemRange, cute.struct.Align
        fields = super()._storage_fields(sQ_layout, sKV_layout, sP_layout, sStat_layout)
        fields["sSFQ"] = align[mem[cutlass.Int32, self.tile_m * self.num_chunks], 16]
        fields["sSF"] = align[mem[cutlass.Int32, self.tile_n * self.num_stages], 16]
        fields["sSFP"] = align[mem[cutlass.Int32, self.tile_m], 16]
        return fields

    def _tiled_mma(self):
        # N permuted so that warp w owns columns [16w, 16w + 16) of every 16 * warp_n: whole
        # scale blocks of P per warp
        perm_n = cute.make_layout((8, self.warp_n, 2), stride=(1, 16, 8))
        return cute.make_tiled_mma(
            warp.MmaMXF4NVF4Op(self.dtype, cutlass.Float32, cutlass.Float8E4M3FN),
            (self.warp_m, self.warp_n, 1),
            permutation_mnk=(self.warp_m * 16, perm_n, 64),
        )

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mQsf: cute.Tensor, mK: cute.Tensor, mKsf: cute.Tensor,
                 mVt: cute.Tensor, mVtsf: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 mQd: cute.Tensor, mKd: cute.Tensor, mVd: cute.Tensor, mSinks,
                 softmax_scale: cutlass.Float32, causal_offset: cutlass.Int32,
                 window_lo: cutlass.Int32, stream: cuda.CUstream):
        """q, k: (B, H, N, D / 2) uint8 codes, q_sf, k_sf: (B, H, N, D / 16) uint8 scales; v:
        V^T's codes (B, Hkv, D, Npad / 2), v_sf: its scales (B, Hkv, D, Npad / 16); o: (B, Hq,
        Nq, D) out_dtype; lse: (B, Hq, Nq) fp32; descales: (B, Hkv) fp32; sinks: (Hq,) fp32
        with `sinks`, else None; window_lo: read with `window`. Grid (m_blocks, Hq, B)."""
        D = self.cfg.head_dim
        mQ = aligned_bhnd(cute.recast_tensor(mQ, self.dtype), D, self.dtype)
        mK = aligned_bhnd(cute.recast_tensor(mK, self.dtype), D, self.dtype)
        mVt = aligned_bhdn(cute.recast_tensor(mVt, self.dtype), D, self.dtype)
        words = [cute.recast_tensor(t, cutlass.Int32) for t in (mQsf, mKsf, mVtsf)]
        self._launch_quantized(mQ, mK, mVt, mO, (mLSE, mQd, mKd, mVd, *words), softmax_scale,
                               causal_offset, stream, features_of(self.cfg, window_lo, mSinks))

    # ---------------------------------------------------------------- scales
    def _fill_zero(self, t: cute.Tensor):
        """Zero a vector of 4-bit codes (through its bytes: no 4-bit fill)."""
        cute.recast_tensor(t, cutlass.Uint8).fill(0)

    def _sf_view(self, words: cute.Tensor, rows: int, word) -> cute.Tensor:
        """One 64-element chunk's E4M3 scales of `rows` rows, as the MMA partitions them: (rows,
        64) element coordinates, stride 0 within each 16-element block. `words`: the rows'
        scale words (rows, ...), `word` the chunk's column among them."""
        ptr = cute.recast_ptr(words[None, word].iterator, dtype=cutlass.Float8E4M3FN)
        row_stride = words.layout.stride[0] * 4
        return cute.make_tensor(ptr, cute.make_layout((rows, (16, 4)),
                                                      stride=(row_stride, (0, 1))))

    def _sf_partition(self, ctx, view: cute.Tensor, operand: str) -> cute.Tensor:
        """This thread's scales of `view` for `operand` "A" or "B": (V, MMA_M | MMA_N, MMA_K),
        the layouts of CUTLASS's SM120 block-scaled MMA traits."""
        thrfrg = bh.thrfrg_SFA if operand == "A" else bh.thrfrg_SFB
        tiled = cute.make_tensor(view.iterator, thrfrg(view.layout, ctx.tiled_mma))
        v = ctx.tiled_mma.thr_layout_vmnk.get_flat_coord(ctx.tidx)
        mode = (v[1], v[3]) if operand == "A" else (v[2], v[3])
        part = cute.group_modes(cute.flatten(tiled[(v[0], mode), (None, None)]), 0, 2)
        if cutlass.const_expr(cute.rank(part) == 4):  # B's N permuted in two modes: regroup
            part = cute.group_modes(part, 1, 3)
        return part

    @cute.jit
    def _sf_load(self, ctx, view: cute.Tensor, operand: str):
        """This thread's scale registers of `view` (one 32-bit word per atom row / column)."""
        part = self._sf_partition(ctx, view, operand)
        frag = cute.make_fragment_like(part)
        cute.autovec_copy(part, frag)
        return frag

    @cute.jit
    def _cp_word(self, src: cute.Tensor, dst: cute.Tensor, ok):
        """One 4-byte scale word by cp.async (src, dst: 1-element Int32 tensors), 0 if not ok."""
        if ok:
            atom = cute.make_copy_atom(
                cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.ALWAYS), cutlass.Int32,
                num_bits_per_copy=32)
            cute.copy(atom, src, dst)
        else:
            dst.fill(0)

    @cute.jit
    def _prologue(self, ctx):
        """Q's scale words (tile_m x C) join the first cp.async group; P's scale fragment
        registers are allocated."""
        ctx.sfp = cute.make_fragment_like(self._sf_partition(
            ctx, self._sf_view(self._p_scale_words(ctx), self.tile_m, 0), "A"))
        C = self.num_chunks
        mQsf, sSFQ = ctx.stats[4], self._q_scale_words(ctx)
        words = self.tile_m * C
        for i in cutlass.range_constexpr(-(-words // self.num_threads)):
            idx = ctx.tidx + i * self.num_threads
            if idx < words:
                r, c = idx // C, idx % C
                row = ctx.m_block * self.tile_m + r
                src = cute.local_tile(mQsf[ctx.batch, ctx.head, None, None], (1, 1),
                                      (cutlass.min(row, ctx.seqlen_q - 1), c))
                self._cp_word(src, cute.local_tile(sSFQ, (1, 1), (r, c)), row < ctx.seqlen_q)

    @cute.jit
    def _load_ring_step(self, ctx, head, n_block: cutlass.Int32, step: cutlass.Constexpr,
                        slot: cutlass.Int32):
        """The FP8 forward's code chunk, then its rows' scale words (threads 0 .. tile_n-1, one
        word each): K's rows (keys past Nkv: 0), or Vt's rows (dims) at the block's word."""
        FFPAFwdSm80FP8._load_ring_step(self, ctx, head, n_block, step, slot)
        C = self.num_chunks
        dst = cute.local_tile(self._ring_scale_words(ctx), (1, 1), (ctx.tidx, slot))
        if ctx.tidx < self.tile_n:
            if cutlass.const_expr(step < C):
                row = n_block * self.tile_n + ctx.tidx
                src = cute.local_tile(ctx.stats[5][ctx.batch, head, None, None], (1, 1),
                                      (cutlass.min(row, ctx.seqlen_k - 1), step))
                self._cp_word(src, dst, row < ctx.seqlen_k)
            else:
                src = cute.local_tile(ctx.stats[6][ctx.batch, head, None, None], (1, 1),
                                      ((step - C) * self.tile_hdim + ctx.tidx, n_block))
                self._cp_word(src, dst, True)

    def _q_scale_words(self, ctx) -> cute.Tensor:
        """Q's resident scale words: (tile_m, C), one per 64-element chunk of a row."""
        C = self.num_chunks
        return ctx.storage.sSFQ.get_tensor(cute.make_layout((self.tile_m, C), stride=(C, 1)))

    def _ring_scale_words(self, ctx) -> cute.Tensor:
        """The ring's scale words: (tile_n, stages), one per row of a chunk."""
        return ctx.storage.sSF.get_tensor(
            cute.make_layout((self.tile_n, self.num_stages), stride=(1, self.tile_n)))

    def _p_scale_words(self, ctx) -> cute.Tensor:
        """P's scale words: (tile_m, 1), the 4 blocks of 16 keys of a row."""
        return ctx.storage.sSFP.get_tensor(cute.make_layout((self.tile_m, 1), stride=(1, 1)))

    def _slot_scales(self, ctx, slot) -> cute.Tensor:
        """The ring slot's scale words as an E4M3 (tile_n, 64) view."""
        return self._sf_view(self._ring_scale_words(ctx), self.tile_n, slot)

    # ---------------------------------------------------------------- products
    @cute.jit
    def _score_mma(self, ctx, acc, j: cutlass.Constexpr, slot):
        """acc += Q chunk j K_chunk^T, both scaled by their blocks."""
        cute.autovec_copy(ctx.thr_mma.partition_A(self._score_rows(ctx, j, slot)), ctx.tSrQ)
        cute.autovec_copy(ctx.thr_mma.partition_B(ctx.sKV[None, None, slot]), ctx.tSrK)
        sfa = self._sf_load(ctx, self._sf_view(self._q_scale_words(ctx), self.tile_m, j), "A")
        sfb = self._sf_load(ctx, self._slot_scales(ctx, slot), "B")
        cute.gemm(ctx.tiled_mma, acc, (ctx.tSrQ, sfa), (ctx.tSrK, sfb), acc)

    @cute.jit
    def _pv_mma(self, ctx, acc, first: cutlass.Constexpr, slot):
        """acc (an O chunk) += P Vt_chunk^T, both scaled by their blocks; the block's first
        chunk loads P's codes and scales."""
        if cutlass.const_expr(first):
            cute.autovec_copy(ctx.thr_mma.partition_A(ctx.sP), ctx.tOrP)
            cute.autovec_copy(self._sf_partition(
                ctx, self._sf_view(self._p_scale_words(ctx), self.tile_m, 0), "A"), ctx.sfp)
        cute.autovec_copy(ctx.thr_mma.partition_B(ctx.sKV[None, None, slot]), ctx.tOrVt)
        sfb = self._sf_load(ctx, self._slot_scales(ctx, slot), "B")
        cute.gemm(ctx.tiled_mma, acc, (ctx.tOrP, ctx.sfp), (ctx.tOrVt, sfb), acc)

    @cute.jit
    def _store_p(self, ctx):
        """P (fp32, <= 2^8) -> NVFP4 per 16 keys (class docstring, 4.): the scales to sSFP by
        each quad's first thread, the codes to sP."""
        acc = ctx.acc_S_mn
        sSFP = cute.make_tensor(
            cute.recast_ptr(self._p_scale_words(ctx).iterator, dtype=cutlass.Float8E4M3FN),
            cute.make_layout((self.tile_m, 4), stride=(4, 1)))
        rnd = cute.make_rmem_tensor((2,), cutlass.Float32)
        rnd8 = cute.make_rmem_tensor((2,), cutlass.Float8E4M3FN)
        for r in cutlass.range_constexpr(cute.size(acc, mode=[0])):
            for b in cutlass.range_constexpr(cute.size(acc, mode=[1]) // 4):
                amax = acc[r, 4 * b]
                for e in cutlass.range_constexpr(1, 4):
                    amax = cute.arch.fmax(amax, acc[r, 4 * b + e])
                amax = quad_allreduce_max(amax)
                rnd[0] = amax * (1.0 / 6.0)
                rnd[1] = cutlass.Float32(0.0)
                rnd8.store(rnd.load().to(cutlass.Float8E4M3FN))
                rnd.store(rnd8.load().to(cutlass.Float32))
                inv = cutlass.Float32(0.0)
                if rnd[0] > cutlass.Float32(0.0):
                    inv = cute.arch.rcp_approx(rnd[0])
                for e in cutlass.range_constexpr(4):
                    acc[r, 4 * b + e] = acc[r, 4 * b + e] * inv
                if ctx.lane % 4 == 0:
                    sSFP[ctx.row_idx[r], ctx.tScS_mn[r, 4 * b][1] // 16] = rnd8[0]
        ctx.rP.store(ctx.acc_S.load().to(self.dtype))
        cute.autovec_copy(ctx.rP, ctx.thr_mma.partition_C(ctx.sP))


__all__ = ["FFPAFwdSm80", "FFPAFwdSm80FP4", "FFPAFwdSm80FP8"]
