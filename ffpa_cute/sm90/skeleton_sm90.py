"""Hopper warp-specialised ring skeleton (placeholder docstring)."""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common.mask import n_block_max
from ..common.softmax import OnlineSoftmax, mn_view
from ..common.tensors import CUTLASS_DTYPES, LOG2_E, KernelEntry, aligned_bhdn, aligned_bhnd
from .config import TILE_M, FwdConfigSm90

WG_THREADS = 128


class BlockSeq(NamedTuple):
    """The tile's sequence of column blocks: n_count of them, block i at `_block(seq, i)`."""

    n_top: Int32
    n_count: Int32
    head_kv: Int32
    group: Int32
    batch: Int32


class KLoads(NamedTuple):
    """What the S warpgroup's loads need: TMA atoms, partitioned sources/stages, and the whole
    TMA tensor + smem ring (for hooks that re-tile per head)."""

    tma_k: cute.CopyAtom
    tKg: cute.Tensor
    tKs: cute.Tensor
    tma_q: cute.CopyAtom
    tQg: cute.Tensor
    tQs: cute.Tensor
    gK_tma: cute.Tensor
    sK: cute.Tensor
    sQ: cute.Tensor
    m_block: Int32
    head: Int32
    extra: object
    rank: object = 0  # `kv_pair`: this CTA's rank in the pair (its own blocks: 2 i + rank)


class VLoads(NamedTuple):
    """What an O warpgroup's loads need (as KLoads), plus its barrier base and first column."""

    tma_v: cute.CopyAtom
    tVg: cute.Tensor
    tVs: cute.Tensor
    bar_v: cute.Pointer
    gV_tma: cute.Tensor
    col0: Int32
    sV: cute.Tensor


class Barriers(NamedTuple):
    """mbarrier pointers: Q loaded; K / V ring stages loaded (TMA transaction bytes); P[b]
    written (128 S threads); P[b] consumed (one arrival per O warp)."""

    q: cute.Pointer
    k: cute.Pointer
    v: cute.Pointer
    p_full: cute.Pointer
    p_empty: cute.Pointer
    x: object = None   # `kv_pair`: peer's row statistics landed (st.async bytes), per buffer
    pp: object = None  # `kv_pair`: peer's P tile landed (bulk-copy bytes), per buffer


class Operands(NamedTuple):
    """The global operands of one role assignment (TMA tensors and atoms): the resident rows
    (Q role), the S ring's column chunks (K role), the accumulators' B operand halves (V role),
    and the output (O role)."""

    mO: cute.Tensor
    gQ_tma: cute.Tensor
    gK_tma: cute.Tensor
    gVlo_tma: cute.Tensor
    gVhi_tma: cute.Tensor
    tma_q: cute.CopyAtom
    tma_k: cute.CopyAtom
    tma_vlo: cute.CopyAtom
    tma_vhi: cute.CopyAtom


class PairSmem(NamedTuple):
    """`kv_pair`: the smem the two CTAs of a pair write into each other's copy of: the peer's
    row statistics ([2 buffers x TILE_M] fp32) and the P slots' base (slot = 2 buffer + rank)."""

    stat: cute.Tensor
    p_base: cute.Pointer


class RingSkeletonSm90(KernelEntry):
    """The skeleton."""

    arch_family = "sm90"
    rescale_o = False  # accumulator warpgroups multiply their rows by the published factors
    second_score = False  # the S warpgroup accumulates one score product (see `_chunk`)
    seq_scores = False    # with two: one accumulator, the first product consumed mid-block

    def __init__(self, cfg: FwdConfigSm90):
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        # 8-bit Q / K / V / P (`FwdFP8ConfigSm90`): both WGMMA operands K-major, so V arrives
        # transposed (Vt, [B, H, Dv, N]); O is written in the config's out_dtype
        self.fp8 = cfg.elem_bytes == 1
        self.out_dtype = CUTLASS_DTYPES[cfg.out_dtype] if self.fp8 else self.dtype
        self.mma_k = cfg.mma_k
        self.tile_n = cfg.tile_n
        self.num_chunks = cfg.num_k_chunks
        self.dv = cfg.dv_halves
        self.v_rows = cfg.v_rows
        self.v_chunks = cfg.tile_n // cfg.v_rows  # V stages per O half per KV block
        self.causal = cfg.causal
        self.kv_pair = cfg.kv_pair
        # the O warpgroups also arrive on the peer CTA's P_empty (the peer writes our P slots)
        self.peer_arrivals = cfg.cluster_pair
        # P_empty[b] arrivals per use: every O thread when the O warpgroups read the row
        # factors (`rescale_o`: plain ld.shared by each lane, so each lane must release its own
        # reads before the S warpgroup rewrites sFactor[:, b]); else one per O warp (its only
        # reads of buffer b are its WGMMAs', complete for the whole warp after wait_group);
        # plus one per peer O warp under `peer_arrivals` (the peer reads our P tile by WGMMA)
        self.empty_arrivals = ((2 * WG_THREADS if self.rescale_o else 8)
                               + (8 if self.peer_arrivals else 0))
        self.num_threads = 3 * WG_THREADS
        # bytes one TMA load brings in (the full box, zero-filled parts included)
        self.stream_q = cfg.stream_q
        eb = cfg.elem_bytes
        self.q_bytes = TILE_M * (cfg.k_chunk if cfg.stream_q else cfg.hdim_q_padded) * eb
        self.k_bytes = cfg.tile_n * cfg.k_chunk * eb
        self.v_bytes = [cfg.v_rows * d * eb for d in self.dv]

    # ---------------------------------------------------------------- layouts and MMAs
    def _smem_layout(self, rows: int, cols: int, stages: int | None = None):
        """Row-major (cols contiguous) WGMMA-compatible layout with the widest swizzle."""
        atom = warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, cols), self.dtype)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, cols), (0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

    def _mma(self, n: int, b_major):
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, b_major, Float32,
            (1, 1, 1), (TILE_M, n))

    def _pv_b_major(self):
        """Major mode of P V's B operand: V's rows (MN-major) at 16 bits; at 8 bits WGMMA takes
        K-major operands only, so Vt's keys (K-major)."""
        return (cute.nvgpu.OperandMajorMode.K if self.fp8
                else cute.nvgpu.OperandMajorMode.MN)

    @staticmethod
    def _bhnd_to_tma(t: cute.Tensor) -> cute.Tensor:
        """(B, H, N, D) -> (N, D, H, B): the row/column modes first, as TMA tiles them."""
        return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))

    # ---------------------------------------------------------------- host side
    def _smem_layouts(self):
        """(sQ, sK, sV_lo, sV_hi, sP): Q resident or a ring, the K ring, the V rings, P x 2."""
        cfg = self.cfg
        dlo, dhi = self.dv
        sQ_layout = (self._smem_layout(TILE_M, cfg.k_chunk, cfg.k_stages) if self.stream_q
                     else self._smem_layout(TILE_M, cfg.hdim_q_padded))
        sK_layout = self._smem_layout(self.tile_n, cfg.k_chunk, cfg.k_stages)
        if const_expr(self.fp8):  # Vt stages [D/2 x v_rows], K (= the keys) contiguous
            sVlo_layout = self._smem_layout(dlo, self.v_rows, cfg.v_stages)
            sVhi_layout = self._smem_layout(dhi, self.v_rows, cfg.v_stages)
        else:  # V stages [v_rows x D/2], read as the MN-major B of P V
            sVlo_layout = self._smem_layout(self.v_rows, dlo, cfg.v_stages)
            sVhi_layout = self._smem_layout(self.v_rows, dhi, cfg.v_stages)
        sP_layout = self._smem_layout(TILE_M, self.tile_n, cfg.p_slots)
        return sQ_layout, sK_layout, sVlo_layout, sVhi_layout, sP_layout

    @cute.jit
    def _launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                mLSE: cute.Tensor, softmax_scale: Float32, causal_offset: Int32,
                stream: cuda.CUstream, extra):
        """Build layouts, TMA atoms and the storage struct; launch. `extra`: what a kernel built
        on this skeleton adds (None here; bwd_sm90.py)."""
        cfg = self.cfg
        ops = self._operands(mQ, mK, mV, mO)
        dlo, dhi = self.dv
        sQ_layout, sK_layout, sVlo_layout, sVhi_layout, sP_layout = self._smem_layouts()
        SharedStorage = _shared_storage(cfg, self.dtype, sQ_layout, sK_layout, sVlo_layout,
                                        sVhi_layout, sP_layout)

        # the planner's budget must be the real one (else a config it accepts fails at launch)
        assert SharedStorage.size_in_bytes() == cfg.smem_bytes(), (
            SharedStorage.size_in_bytes(), cfg.smem_bytes())
        grid = (cute.ceil_div(mQ.shape[2], TILE_M) * cfg.ctas_per_tile, cute.size(mQ.shape[1]),
                cute.size(mQ.shape[0]))
        self.kernel(
            ops.mO, mLSE, ops.gQ_tma, ops.gK_tma, ops.gVlo_tma, ops.gVhi_tma, ops.tma_q,
            ops.tma_k, ops.tma_vlo, ops.tma_vhi, mK.shape[2], mK.shape[1],
            softmax_scale * LOG2_E, causal_offset,
            sQ_layout, sK_layout, sVlo_layout, sVhi_layout, sP_layout,
            self._mma(self.tile_n, cute.nvgpu.OperandMajorMode.K),
            self._mma(dlo, self._pv_b_major()),
            self._mma(dhi, self._pv_b_major()),
            SharedStorage, extra,
        ).launch(grid=grid, block=[self.num_threads, 1, 1],
                 smem=SharedStorage.size_in_bytes(), stream=stream, min_blocks_per_mp=1,
                 **({"cluster": [2, 1, 1]} if cfg.cluster_pair else {}))

    @cute.jit
    def _operands(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                  mO: cute.Tensor):
        """TMA atoms and tensors for (B, H, N, D) tensors in the roles of Q (resident rows or
        their chunks), K (the S ring's column chunks), V (the accumulators' B halves) and O."""
        cfg = self.cfg
        mQ, mK = [aligned_bhnd(t, cfg.head_dim, self.dtype) for t in (mQ, mK)]
        mO = aligned_bhnd(mO, cfg.dv, self.out_dtype)
        if const_expr(self.fp8):  # Vt (B, H, Dv, N): its (Dv, N) modes first for TMA
            mV = aligned_bhdn(mV, cfg.dv, self.dtype)
        else:
            mV = aligned_bhnd(mV, cfg.dv, self.dtype)
        tQ, tK, tV = [self._bhnd_to_tma(t) for t in (mQ, mK, mV)]
        dlo, dhi = self.dv
        sQ_layout, sK_layout, sVlo_layout, sVhi_layout, _ = self._smem_layouts()

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        q_box = (TILE_M, cfg.k_chunk if self.stream_q else cfg.hdim_q_padded)
        tma_q, gQ_tma = cpasync.make_tiled_tma_atom(
            g2s, tQ, cute.select(sQ_layout, mode=[0, 1]), q_box)
        tma_k, gK_tma = cpasync.make_tiled_tma_atom(
            g2s, tK, cute.select(sK_layout, mode=[0, 1]), (self.tile_n, cfg.k_chunk))
        # V boxes are one O warpgroup wide; the kernel offsets them to its columns (Vt: rows)
        vlo_box, vhi_box = (((dlo, self.v_rows), (dhi, self.v_rows)) if const_expr(self.fp8)
                            else ((self.v_rows, dlo), (self.v_rows, dhi)))
        tma_vlo, gVlo_tma = cpasync.make_tiled_tma_atom(
            g2s, tV, cute.select(sVlo_layout, mode=[0, 1]), vlo_box)
        tma_vhi, gVhi_tma = cpasync.make_tiled_tma_atom(
            g2s, tV, cute.select(sVhi_layout, mode=[0, 1]), vhi_box)
        return Operands(mO, gQ_tma, gK_tma, gVlo_tma, gVhi_tma, tma_q, tma_k, tma_vlo, tma_vhi)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mO: cute.Tensor, mLSE: cute.Tensor, gQ_tma: cute.Tensor,
               gK_tma: cute.Tensor, gVlo_tma: cute.Tensor, gVhi_tma: cute.Tensor,
               tma_q: cute.CopyAtom, tma_k: cute.CopyAtom, tma_vlo: cute.CopyAtom,
               tma_vhi: cute.CopyAtom, seqlen_k: Int32, heads_kv: Int32, scale_log2: Float32,
               causal_offset: Int32, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sVlo_layout: cute.ComposedLayout,
               sVhi_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
               mma_qk: cute.TiledMma, mma_pv_lo: cute.TiledMma, mma_pv_hi: cute.TiledMma,
               SharedStorage: cutlass.Constexpr, extra):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, head, batch = cute.arch.block_idx()
        grid_m, _, _ = cute.arch.grid_dim()
        # longest tiles first under causal (bottom-right); the CTAs of a Q tile adjacent
        m_block = grid_m // self.cfg.ctas_per_tile - 1 - bidx // self.cfg.ctas_per_tile
        o_part = bidx % self.cfg.o_split  # which head_dim / o_split columns of O
        wg = cute.arch.make_warp_uniform(tidx // WG_THREADS)
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        head_kv, group = self._heads(head, cute.size(mO.shape[1]), heads_kv)

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        bars = Barriers(storage.bar_q.data_ptr(), storage.bar_k.data_ptr(),
                        storage.bar_v.data_ptr(), storage.bar_p_full.data_ptr(),
                        storage.bar_p_empty.data_ptr())
        if const_expr("bar_x" in self.cfg.pair_barriers):
            bars = bars._replace(x=storage.bar_x.data_ptr())
        if const_expr("bar_pp" in self.cfg.pair_barriers):
            bars = bars._replace(pp=storage.bar_pp.data_ptr())
        if warp_idx == 0:
            for tma in (tma_q, tma_k, tma_vlo, tma_vhi):
                cpasync.prefetch_descriptor(tma)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(bars.q, 1)
                for s in cutlass.range_constexpr(self.cfg.k_stages):
                    cute.arch.mbarrier_init(bars.k + s, 1)
                for s in cutlass.range_constexpr(2 * self.cfg.v_stages):
                    cute.arch.mbarrier_init(bars.v + s, 1)
                for b in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(bars.p_full + b, WG_THREADS)  # every S thread
                    cute.arch.mbarrier_init(bars.p_empty + b, self.empty_arrivals)
                    if const_expr(bars.x is not None):
                        cute.arch.mbarrier_init(bars.x + b, 1)
                    if const_expr(bars.pp is not None):
                        cute.arch.mbarrier_init(bars.pp + b, 1)
                if const_expr(self.cfg.publish_hi is not None):  # the second half's P_full
                    for b in cutlass.range_constexpr(2):
                        cute.arch.mbarrier_init(bars.p_full + 2 + b, WG_THREADS)
                cute.arch.mbarrier_init_fence()
        if const_expr(self.cfg.cluster_pair):  # the peer's barriers exist before anything
            # reaches them
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sVlo = storage.sVlo.get_tensor(sVlo_layout.outer, swizzle=sVlo_layout.inner)
        sVhi = storage.sVhi.get_tensor(sVhi_layout.outer, swizzle=sVhi_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)
        sFactor = storage.row_factor.get_tensor(cute.make_layout((TILE_M, 2)))

        seqlen_q = mO.shape[2]
        # KV blocks n_top-1, n_top-2, ..., n_top-n_count (descending: the masked ones first)
        n_top, n_count = self._block_range(m_block, seqlen_k, causal_offset, group)
        seq = BlockSeq(n_top, n_count, head_kv, group, batch)

        pair = None
        if const_expr(self.kv_pair):
            pair = PairSmem(storage.peer_stat.get_tensor(cute.make_layout((TILE_M, 2))),
                            storage.sP.data_ptr())
        elif const_expr(self.cfg.cluster_pair):
            pair = PairSmem(None, storage.sP.data_ptr())
        ops = Operands(mO, gQ_tma, gK_tma, gVlo_tma, gVhi_tma, tma_q, tma_k, tma_vlo, tma_vhi)
        self._warpgroups(ops, wg, tidx, mma_qk, mma_pv_lo, mma_pv_hi, mLSE, sQ, sK, sVlo, sVhi,
                         sP, sFactor, bars, m_block, o_part, head, head_kv, batch, seq,
                         seqlen_q, seqlen_k, causal_offset, scale_log2, extra, pair)
        if const_expr(self.cfg.cluster_pair):  # the peer may still write our smem until done
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def _warpgroups(self, ops, wg, tidx, mma_qk, mma_pv_lo, mma_pv_hi, mLSE, sQ, sK, sVlo,
                    sVhi, sP, sFactor, bars, m_block, o_part, head, head_kv, batch, seq,
                    seqlen_q, seqlen_k, causal_offset, scale_log2, extra, pair,
                    peer=None):
        """Each warpgroup's role on the operands `ops` (`peer`: as `_o_wg`'s)."""
        if wg == 0:
            self._softmax_wg(mma_qk, mLSE, ops.gQ_tma, ops.gK_tma, ops.tma_q, ops.tma_k, sQ, sK,
                             sP, sFactor, bars, tidx, m_block, o_part, head, head_kv, batch,
                             seq, seqlen_q, seqlen_k, causal_offset, scale_log2, extra, pair)
        elif wg == 1:
            self._o_wg(mma_pv_lo, ops.mO, ops.gVlo_tma, ops.tma_vlo, sP, sVlo, sFactor, bars, 0,
                       tidx - WG_THREADS, m_block, o_part, head, head_kv, batch, seq, seqlen_q,
                       peer)
        else:
            self._o_wg(mma_pv_hi, ops.mO, ops.gVhi_tma, ops.tma_vhi, sP, sVhi, sFactor, bars, 1,
                       tidx - 2 * WG_THREADS, m_block, o_part, head, head_kv, batch, seq,
                       seqlen_q, peer)

    # ---------------------------------------------------------------- hooks
    @cute.jit
    def _heads(self, head, heads_rows, heads_cols):
        """(head of the streamed operands, blocks' head group): K/V head of this query head."""
        return head // (heads_rows // heads_cols), 1

    @cute.jit
    def _block_range(self, m_block, seqlen_k, causal_offset, group):
        """(n_top, n_count): the KV blocks this Q tile visits are n_top-1 down to n_top-n_count."""
        n_max = n_block_max(m_block, seqlen_k, causal_offset, TILE_M, self.tile_n, self.causal)
        return n_max, n_max

    @cute.jit
    def _block(self, seq, i):
        """(head, KV block) of the tile's i-th block: one head, blocks highest first."""
        return seq.head_kv, seq.n_top - 1 - i

    def _chunk(self, c: int):
        """(second accumulator?, first chunk of its accumulator?, WGMMA k steps, first k step of
        Q) for S-ring chunk c (compile time): one product over the D chunks here."""
        cfg = self.cfg
        last = -(-(cfg.head_dim - (self.num_chunks - 1) * cfg.k_chunk) // self.mma_k)
        per = cfg.k_chunk // self.mma_k
        return False, c == 0, last if c == self.num_chunks - 1 else per, c * per

    def _block_prefetch(self, m_block, n_block, seqlen_k, mLSE, batch, head, tidx, tScS_mn,
                        extra):
        """Statistics the score step of block n_block reads from global memory, loaded at the
        block's start (None: the forward reads none)."""
        return None

    @cute.jit
    def _make_softmax(self, num_rows: cutlass.Constexpr, scale_log2, extra, batch, head_kv):
        """The S warpgroup's online-softmax state (the FP8 forward folds its descales in)."""
        return OnlineSoftmax(num_rows, scale_log2)

    def _stats_head(self, head, blk_head):
        """Head whose per-row statistics (LSE, Delta) the score step reads: the tile's query
        head (the rows are queries; the forward reads none)."""
        return head

    @cute.jit
    def _k_src(self, loads, seq, head, n_block, c):
        """Source of K chunk c of block n_block (of `head`: one head here, tKg covers it)."""
        return loads.tKg[None, n_block, c]

    @cute.jit
    def _v_src(self, v_loads, seq, head, row_block, half: cutlass.Constexpr):
        """Source of V rows block row_block (of `head`: one head here, tVg covers it)."""
        return v_loads.tVg[None, row_block]

    @cute.jit
    def _tma_load(self, tma: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor, bar,
                  nbytes: cutlass.Constexpr, tidx):
        """One TMA load by warp 0 of the calling warpgroup, completing on `bar`."""
        if tidx // 32 == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar, nbytes)
            cute.copy(tma, src, dst, tma_bar_ptr=bar)


    def _score_block(self, acc_S, acc_S_mn, tScS_mn, softmax, factor, rP, m_block, n_block,
                     seqlen_k, causal_offset, mLSE, batch, head, sFactor, tidx, acc_2, extra,
                     pre, i, n_count, o_part, bars, pair, lane):
        """Scores of step i -> P in rP (and the rows' factors): each kernel's own."""
        raise NotImplementedError

    def _final_factors(self, softmax, factor, num_rows, n_iter, o_part, bars, pair, tidx,
                       tScS_mn, lane):
        """After the last block: the factors published with no P, and the LSE (or None)."""
        raise NotImplementedError

    def _first_scores(self, acc_S, acc_S_mn, tScS_mn, rP, m_block, n_block, seqlen_k,
                      causal_offset, sFactor, tidx, softmax, extra, pre):
        """`seq_scores`: consume the first score product mid-block (two-product kernels)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- S warpgroup
    @cute.jit
    def _softmax_wg(self, mma_qk: cute.TiledMma, mLSE, gQ_tma, gK_tma, tma_q, tma_k, sQ, sK,
                    sP, sFactor, bars, tidx, m_block, o_part, head, head_kv, batch,
                    seq: BlockSeq, seqlen_q, seqlen_k, causal_offset, scale_log2, extra,
                    pair=None):
        cfg = self.cfg
        C = self.num_chunks
        ks = cfg.k_stages
        lane = cute.arch.lane_idx()
        # ---- TMA views: Q tile (TMA), or Q chunks (TMA, C) / (TMA, k_stages) when Q streams
        #      with K; K chunks (TMA, n_blocks, C) / (TMA, k_stages)
        one = cute.make_layout(1)
        if const_expr(self.stream_q):
            gQ = cute.local_tile(gQ_tma[None, None, head, batch], (TILE_M, cfg.k_chunk),
                                 (m_block, None))
        else:
            gQ = cute.local_tile(gQ_tma[None, None, head, batch], (TILE_M, cfg.hdim_q_padded),
                                 (m_block, 0))
        tQs, tQg = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 2),
                                         cute.group_modes(gQ, 0, 2))
        gK = cute.local_tile(gK_tma[None, None, head_kv, batch], (self.tile_n, cfg.k_chunk),
                             (None, None))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 2),
                                         cute.group_modes(gK, 0, 2))
        # ---- MMA fragments
        thr_mma = mma_qk.get_slice(tidx)
        # (MMA, 1, Dq/16), or (MMA, 1, 4, k_stages) when Q streams
        tSrQ = mma_qk.make_fragment_A(thr_mma.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(thr_mma.partition_B(sK))   # (MMA, 1, 4, k_stages)
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, self.tile_n)), Float32)
        # a second score accumulator for skeletons with two score products (bwd dQ / dK)
        acc_2 = (cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, self.tile_n)), Float32)
                 if const_expr(self.second_score and not self.seq_scores) else None)
        acc_S_mn = mn_view(acc_S)
        tScS_mn = mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_M, self.tile_n))))
        num_rows = cute.size(acc_S_mn, mode=[0])
        softmax = self._make_softmax(num_rows, scale_log2, extra, batch, head_kv)
        factor = cute.make_rmem_tensor(num_rows, Float32)
        rP = cute.make_fragment_like(acc_S, self.dtype)
        # P -> sP in the accumulator's thread layout: stmatrix at 16 bits; at 8 bits each
        # thread's column pairs (2 bytes) by plain stores (stmatrix moves 16-bit elements)
        if const_expr(self.fp8):
            st_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype,
                                          num_bits_per_copy=16)
        else:
            st_atom = cute.make_copy_atom(
                warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
        thr_st = cute.make_tiled_copy_C(st_atom, mma_qk).get_slice(tidx)
        tPsP = thr_st.partition_D(sP)   # (CPY, CPY_M, CPY_N, p_slots)
        tPrP = thr_st.retile(rP)
        n_count = seq.n_count
        n_iter = n_count  # score blocks this warpgroup computes (`kv_pair`: every other one)
        if const_expr(self.kv_pair):
            n_iter = (n_count + 1) // 2
        total = n_iter * C  # K chunks this tile reads, in ring order

        # ---- Q (unless it streams with K), then the first k_stages K chunks
        if const_expr(self.kv_pair):
            loads = KLoads(tma_k, tKg, tKs, tma_q, tQg, tQs, gK_tma, sK, sQ, m_block, head,
                           extra, o_part)
        else:
            loads = KLoads(tma_k, tKg, tKs, tma_q, tQg, tQs, gK_tma, sK, sQ, m_block, head,
                           extra)
        if const_expr(not self.stream_q):
            self._tma_load(tma_q, tQg, tQs, bars.q, self.q_bytes, tidx)
        for x in cutlass.range_constexpr(ks):
            if x < total:
                self._load_k_chunk(loads, bars, x, x, seq, tidx)
        if const_expr(not self.stream_q):
            cute.arch.mbarrier_wait(bars.q, 0)
        x = Int32(0)  # ring position of the next K chunk
        for i in cutlass.range(n_iter, unroll=1):
            blk = i
            if const_expr(self.kv_pair):
                blk = self._own_block(seq, i, o_part)
            blk_head, n_block = self._block(seq, blk)
            stats_head = self._stats_head(head, blk_head)
            # per-row / per-column statistics of the block, loaded before its WGMMAs so that
            # their latency hides behind them (the forward has none)
            pre = self._block_prefetch(m_block, n_block, seqlen_k, mLSE, batch, stats_head,
                                       tidx, tScS_mn, extra)
            # ---- S = Q K[n]^T, streamed over the K ring; each chunk's stage is refilled
            #      with the chunk k_stages ahead as soon as its WGMMAs are done. P[i-1] is
            #      handed over after `publish_after` chunks so that PV[i-1] queues behind them.
            atom = cute.make_mma_atom(mma_qk.op)  # a fresh atom: ACCUMULATE changes below
            for c in cutlass.range_constexpr(C):
                if const_expr(c == cfg.publish_after):
                    if i > 0:
                        cute.arch.mbarrier_arrive(bars.p_full + (i - 1) % 2)
                if const_expr(c == cfg.publish_hi):
                    if i > 0:
                        cute.arch.mbarrier_arrive(bars.p_full + 2 + (i - 1) % 2)
                if const_expr(self.seq_scores and c == self.c_half):
                    # the first product is complete: consume it (into rP) before the second
                    # product overwrites its accumulator
                    warpgroup.wait_group(0)
                    self._first_scores(acc_S, acc_S_mn, tScS_mn, rP, m_block, n_block, seqlen_k,
                                       causal_offset, sFactor, tidx, softmax, extra, pre)
                s = x % ks
                cute.arch.mbarrier_wait(bars.k + s, (x // ks) & 1)
                warpgroup.fence()
                second, first, n_k, q_k0 = self._chunk(c)
                acc = acc_2 if const_expr(second and not self.seq_scores) else acc_S
                for k in cutlass.range_constexpr(n_k):
                    atom.set(warpgroup.Field.ACCUMULATE, not (first and k == 0))
                    rQ = (tSrQ[None, None, k, s] if const_expr(self.stream_q)
                          else tSrQ[None, None, q_k0 + k])
                    cute.gemm(atom, acc, rQ, tSrK[None, None, k, s], acc)
                warpgroup.commit_group()
                if const_expr(c > 0):
                    warpgroup.wait_group(1)  # chunk x-1 has been read: refill its stage
                    self._refill_k(loads, bars, x - 1, total, seq, tidx)
                x += 1
            if const_expr(cfg.publish_after == C):
                if i > 0:
                    cute.arch.mbarrier_arrive(bars.p_full + (i - 1) % 2)
            if const_expr(cfg.publish_hi == C):
                if i > 0:
                    cute.arch.mbarrier_arrive(bars.p_full + 2 + (i - 1) % 2)
            warpgroup.wait_group(0)
            self._refill_k(loads, bars, x - 1, total, seq, tidx)
            # ---- mask, online softmax, P -> smem with the rows' O factors
            self._score_block(acc_S, acc_S_mn, tScS_mn, softmax, factor, rP, m_block, n_block,
                              seqlen_k, causal_offset, mLSE, batch, stats_head, sFactor, tidx,
                              acc_2, extra, pre, i, n_count, o_part, bars, pair, lane)
            b = i % 2
            cute.arch.mbarrier_wait(bars.p_empty + b, ((i // 2) & 1) ^ 1)  # PV[i-2] is done
            if const_expr(self.kv_pair):  # slot 2 b + rank; the peer's tile goes to the other
                cute.copy(thr_st, tPrP, tPsP[None, None, None, 2 * b + o_part])
            else:
                cute.copy(thr_st, tPrP, tPsP[None, None, None, b])
            self._write_factors(sFactor, factor, tScS_mn, b, lane)
            cute.arch.fence_proxy("async.shared", space="cta")  # P is read by WGMMA
            self._after_p_store(pair, bars, b, i, n_count, o_part, tidx, extra)
        # ---- last P, then the final row factors (1 / row_sum) the same way; LSE
        if n_iter > 0:
            cute.arch.mbarrier_arrive(bars.p_full + (n_iter - 1) % 2)
            if const_expr(cfg.publish_hi is not None):
                cute.arch.mbarrier_arrive(bars.p_full + 2 + (n_iter - 1) % 2)
        lse = self._final_factors(softmax, factor, num_rows, n_iter, o_part, bars, pair, tidx,
                                  tScS_mn, lane)
        b = n_iter % 2
        cute.arch.mbarrier_wait(bars.p_empty + b, ((n_iter // 2) & 1) ^ 1)
        self._write_factors(sFactor, factor, tScS_mn, b, lane)
        cute.arch.mbarrier_arrive(bars.p_full + b)
        if const_expr(cfg.publish_hi is not None):
            cute.arch.mbarrier_arrive(bars.p_full + 2 + b)
        if const_expr(lse is not None):
            if lane % 4 == 0 and o_part == 0:
                for r in cutlass.range_constexpr(num_rows):
                    row = m_block * TILE_M + tScS_mn[r, 0][0]
                    if row < seqlen_q:
                        mLSE[batch, head, row] = lse[r]

    @cute.jit
    def _copy_stream_chunk(self, loads, bars, s, k_src, seq, head, n_block, c):
        """Stage s of the S ring when Q streams: the K chunk and Q[:, c], on one barrier."""
        cute.copy(loads.tma_k, k_src, loads.tKs[None, s], tma_bar_ptr=bars.k + s)
        cute.copy(loads.tma_q, loads.tQg[None, c], loads.tQs[None, s], tma_bar_ptr=bars.k + s)

    @cute.jit
    def _refill_k(self, loads, bars, done: Int32, total: Int32, seq, tidx):
        """K chunk `done` was consumed: load chunk done + k_stages into its stage."""
        nxt = done + self.cfg.k_stages
        if nxt < total:
            self._load_k_chunk(loads, bars, nxt, done % self.cfg.k_stages, seq, tidx)

    @cute.jit
    def _load_k_chunk(self, loads, bars, pos, s, seq, tidx):
        """Ring position pos = (block i, chunk c) into stage s: chunk c of block i's K and, when
        Q streams, Q[:, c] with it on the same barrier."""
        C = self.num_chunks
        if const_expr(self.kv_pair):
            head, n_block = self._block(seq, self._own_block(seq, pos // C, loads.rank))
        else:
            head, n_block = self._block(seq, pos // C)
        c = pos % C
        k_src = self._k_src(loads, seq, head, n_block, c)
        if const_expr(self.stream_q):
            if tidx // 32 == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(bars.k + s,
                                                            self.k_bytes + self.q_bytes)
                self._copy_stream_chunk(loads, bars, s, k_src, seq, head, n_block, c)
        else:
            self._tma_load(loads.tma_k, k_src, loads.tKs[None, s], bars.k + s,
                           self.k_bytes, tidx)

    def _after_p_store(self, pair, bars, b, i, n_count, o_part, tidx, extra):
        """After P of step i is in its slot of buffer b and fenced (nothing here; a hook)."""
        pass

    @cute.jit
    def _own_block(self, seq, i, rank):
        """`kv_pair`: the block this CTA scores at step i: 2 i + rank; when the count is odd
        the last block is scored by both (each needs its own P; no exchange then)."""
        return cutlass.min(2 * i + rank, seq.n_count - 1)

    @cute.jit
    def _write_factors(self, sFactor, factor, tScS_mn, b, lane):
        """Each quad shares its rows: one lane per quad writes them."""
        if lane % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(factor)):
                sFactor[tScS_mn[r, 0][0], b] = factor[r]

    # ---------------------------------------------------------------- O warpgroups
    @cute.jit
    def _o_wg(self, mma_pv: cute.TiledMma, mO, gV_tma, tma_v, sP, sV, sFactor, bars,
              half: cutlass.Constexpr, tidx, m_block, o_part, head, head_kv, batch,
              seq: BlockSeq, seqlen_q, peer=None):
        """One O warpgroup (`half` of the columns). `peer`: the CTA whose P_empty it also
        arrives on (`peer_arrivals`; None: the other o_part)."""
        cfg = self.cfg
        vs, vj = cfg.v_stages, self.v_chunks
        dv = self.dv[half]
        lane = cute.arch.lane_idx()
        bar_v = bars.v + half * vs
        bar_full = bars.p_full  # P ready (`publish_hi`: the second half's own barriers)
        if const_expr(half == 1 and cfg.publish_hi is not None):
            bar_full = bars.p_full + 2
        col0 = o_part * cfg.dv_cta + (0 if const_expr(half == 0) else self.dv[0])  # first O column
        # ---- TMA views: V rows of this warpgroup's columns (TMA, v_blocks) / (TMA, v_stages)
        #      (8 bits: Vt's rows col0..col0+dv, its key columns in blocks of v_rows)
        if const_expr(self.fp8):
            gV = cute.local_tile(
                cute.domain_offset((col0, 0), gV_tma[None, None, head_kv, batch]),
                (dv, self.v_rows), (0, None))
        else:
            gV = cute.local_tile(
                cute.domain_offset((0, col0), gV_tma[None, None, head_kv, batch]),
                (self.v_rows, dv), (None, 0))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, cute.make_layout(1),
                                         cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        # ---- MMA fragments: V stage (v_rows, dv) seen as (dv, v_rows), the MN-major B of P V
        #      (8 bits: the Vt stage (dv, v_rows) is the K-major B as it is)
        thr_mma = mma_pv.get_slice(tidx)
        if const_expr(self.fp8):
            sVt = sV
        else:
            sVt = cute.composition(sV, cute.make_ordered_layout((dv, self.v_rows, vs),
                                                                order=(1, 0, 2)))
        tOrP = mma_pv.make_fragment_A(thr_mma.partition_A(sP))    # (MMA, 1, tile_n/16, 2)
        tOrV = mma_pv.make_fragment_B(thr_mma.partition_B(sVt))   # (MMA, 1, v_rows/16, stages)
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, dv)), Float32)
        acc_O.fill(0.0)
        acc_O_mn = mn_view(acc_O)
        tOcO_mn = mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_M, dv))))
        num_rows = cute.size(acc_O_mn, mode=[0])
        n_count = seq.n_count
        total = n_count * vj  # V stages of this half the tile reads, in ring order
        v_loads = VLoads(tma_v, tVg, tVs, bar_v, gV_tma, col0, sV)

        for x in cutlass.range_constexpr(vs):
            if x < total:
                self._load_v(v_loads, x, x, seq, half, tidx)
        n_iter = n_count  # P hand-overs (`kv_pair`: one per pair of blocks)
        if const_expr(self.kv_pair):
            n_iter = (n_count + 1) // 2
        x = Int32(0)
        for i in cutlass.range(n_iter, unroll=1):
            b = i % 2
            cute.arch.mbarrier_wait(bar_full + b, (i // 2) & 1)
            if const_expr(self.rescale_o):
                self._scale_rows(acc_O_mn, tOcO_mn, sFactor, b, num_rows)
            atom = cute.make_mma_atom(mma_pv.op)
            atom.set(warpgroup.Field.ACCUMULATE, True)
            if const_expr(self.kv_pair):
                x = self._pair_pv(atom, acc_O, tOrP, tOrV, v_loads, bars, x, i, b, n_count,
                                  total, seq, half, o_part, tidx)
            else:
                for j in cutlass.range_constexpr(vj):
                    x = self._pv_stage(atom, acc_O, tOrP, tOrV, v_loads, x, j, b, j > 0, total,
                                       seq, half, tidx)
            warpgroup.wait_group(0)
            self._refill_v(v_loads, x - 1, total, seq, half, tidx)
            if const_expr(self.rescale_o):  # every lane read sFactor[:, b]: each releases
                cute.arch.mbarrier_arrive(bars.p_empty + b)
            if lane == 0:
                if const_expr(not self.rescale_o):  # the warp's WGMMAs were its only reads
                    cute.arch.mbarrier_arrive(bars.p_empty + b)
                if const_expr(self.peer_arrivals):  # the peer writes our P slots too
                    cute.arch.mbarrier_arrive(bars.p_empty + b,
                                              1 - o_part if const_expr(peer is None) else peer,
                                              scope=nvvm.MemScopeKind.CLUSTER)
        # ---- 1 / row_sum arrives through the factor buffer; store O (rows < Nq)
        b = n_iter % 2
        cute.arch.mbarrier_wait(bar_full + b, (n_iter // 2) & 1)
        if const_expr(self.rescale_o):
            self._scale_rows(acc_O_mn, tOcO_mn, sFactor, b, num_rows)
        rO = cute.make_fragment_like(acc_O, self.out_dtype)
        rO.store(acc_O.load().to(self.out_dtype))
        gO = cute.local_tile(cute.domain_offset((0, col0), mO[batch, head, None, None]),
                             (TILE_M, dv), (m_block, 0))
        tOgO_mn = mn_view(thr_mma.partition_C(gO))
        rO_mn = mn_view(rO)
        rows_left = seqlen_q - m_block * TILE_M
        for r in cutlass.range_constexpr(num_rows):
            if tOcO_mn[r, 0][0] < rows_left:
                for c in cutlass.range_constexpr(cute.size(rO_mn, mode=[1])):
                    tOgO_mn[r, c] = rO_mn[r, c]

    @cute.jit
    def _pair_pv(self, atom, acc_O, tOrP, tOrV, v_loads, bars, x, i, b, n_count, total, seq,
                 half: cutlass.Constexpr, rank, tidx):
        """`kv_pair` step i: O += P[2i] V[2i] + P[2i+1] V[2i+1] (P tile t in slot 2 b + t, the
        peer's after pp[b]); when the count is odd the last step has one block, scored by both
        CTAs: our own tile (slot 2 b + rank). Returns the V ring position after it."""
        vj = self.v_chunks
        solo = 2 * i + 1 >= n_count
        first = 2 * b
        if solo:
            first = 2 * b + rank
        else:
            cute.arch.mbarrier_wait(bars.pp + b, (i // 2) & 1)
        for jj in cutlass.range_constexpr(2 * vj):
            t, j = jj // vj, jj % vj
            if t == 0 or not solo:
                slot = first if const_expr(t == 0) else 2 * b + 1
                x = self._pv_stage(atom, acc_O, tOrP, tOrV, v_loads, x, j, slot, jj > 0, total,
                                   seq, half, tidx)
        return x

    @cute.jit
    def _pv_stage(self, atom, acc_O, tOrP, tOrV, v_loads, x, j: cutlass.Constexpr, slot,
                  refill: cutlass.Constexpr, total, seq, half: cutlass.Constexpr, tidx):
        """O += P[:, rows of V stage j] (P slot `slot`) times the V stage at ring position x;
        with `refill`, once the previous stage has been read, load its successor. Returns
        x + 1."""
        vs, k_per_v = self.cfg.v_stages, self.v_rows // self.mma_k
        s = x % vs
        cute.arch.mbarrier_wait(v_loads.bar_v + s, (x // vs) & 1)
        warpgroup.fence()
        for k in cutlass.range_constexpr(k_per_v):
            cute.gemm(atom, acc_O, tOrP[None, None, j * k_per_v + k, slot],
                      tOrV[None, None, k, s], acc_O)
        warpgroup.commit_group()
        if const_expr(refill):
            warpgroup.wait_group(1)  # stage x-1 has been read: refill it
            self._refill_v(v_loads, x - 1, total, seq, half, tidx)
        return x + 1

    @cute.jit
    def _refill_v(self, v_loads, done: Int32, total: Int32, seq, half: cutlass.Constexpr,
                  tidx):
        """V stage `done` was consumed: load stage done + v_stages into its slot."""
        nxt = done + self.cfg.v_stages
        if nxt < total:
            self._load_v(v_loads, nxt, done % self.cfg.v_stages, seq, half, tidx)

    @cute.jit
    def _load_v(self, v_loads, pos, s, seq, half: cutlass.Constexpr, tidx):
        """V ring position pos = (block i, row chunk j) into stage s."""
        vj = self.v_chunks
        head, n_block = self._block(seq, pos // vj)
        src = self._v_src(v_loads, seq, head, n_block * vj + pos % vj, half)
        self._tma_load(v_loads.tma_v, src, v_loads.tVs[None, s], v_loads.bar_v + s,
                       self.v_bytes[half], tidx)

    @cute.jit
    def _scale_rows(self, acc_O_mn, tOcO_mn, sFactor, b, num_rows: cutlass.Constexpr):
        for r in cutlass.range_constexpr(num_rows):
            f = sFactor[tOcO_mn[r, 0][0], b]
            acc_O_mn[r, None] = acc_O_mn[r, None].load() * f


def _shared_storage(cfg: FwdConfigSm90, dtype, sQ_layout, sK_layout, sVlo_layout, sVhi_layout,
                    sP_layout):
    """The kernel's shared-memory struct, fields in order (`kv_pair` adds its exchange
    barriers and the peer's row statistics). Built from an annotations dict: the module's
    postponed annotations would reach `cute.struct` as strings."""
    ks, vs, kv = cfg.k_stages, cfg.v_stages, cfg.kv_pair
    mem, align, i64 = cute.struct.MemRange, cute.struct.Align, cutlass.Int64

    def smem(layout):
        return align[mem[dtype, cute.cosize(layout)], 1024]

    fields = {
        "bar_q": mem[i64, 1],
        "bar_k": mem[i64, ks],
        "bar_v": mem[i64, 2 * vs],      # [half * vs + stage]
        "bar_p_full": mem[i64, 2 if cfg.publish_hi is None else 4],  # [half * 2 + buffer]
        "bar_p_empty": mem[i64, 2],
        # kv_pair: bar_x (the peer's row statistics landed) and bar_pp (the peer's P tile
        # landed); the backward's dK + dV pair: bar_pp
        **{name: mem[i64, 2] for name in cfg.pair_barriers},
        "row_factor": align[mem[Float32, cfg.factor_floats], 16],
        **({"peer_stat": align[mem[Float32, 2 * TILE_M], 16]} if kv else {}),
        "sQ": smem(sQ_layout), "sK": smem(sK_layout), "sVlo": smem(sVlo_layout),
        "sVhi": smem(sVhi_layout), "sP": smem(sP_layout),
    }
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


__all__ = ["Barriers", "BlockSeq", "KLoads", "Operands", "PairSmem", "RingSkeletonSm90", "VLoads", "WG_THREADS"]
