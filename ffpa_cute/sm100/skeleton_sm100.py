"""The tcgen05 ring every sm100 attention kernel runs on: warp roles, rings, TMEM, barriers.

**Compile-verified only, never run** (no sm_100 GPU is available to the project): CI compiles
the kernels for sm_100a and checks their PTX; on a B200 each configuration first passes
selfcheck.py's canary.

One CTA = 128 rows R of one head (TMEM lane = row) and one of `o_split` column slices of the
accumulator; blocks of 128 columns C stream past it. Per block the MMA thread forms the
block's score products (`cfg.products`: S = R C^T over D, and for dK / dQ also dP = R2 C2^T over
Dv) in the TMEM score buffers, the softmax threads turn them into an operand in the kernel's
dtype (P or dS; 16-bit, or e4m3 in the FP8 forward) written back over the first buffer, and the MMA thread accumulates that operand times the
block's rows of the accumulator's B operand (V, dO, Q or K) into TMEM. The kernels differ only
in their operands, block walk, score step and epilogue (the hooks below; fwd_sm100.py,
bwd_sm100.py):

  load (warp 5)     TMA: the block's QK-ring stages ([128 rows x 128 bytes] chunks of R and C
                    per product, over its dim), then the [64 x acc_cta] stages of the B operand for the
                    block whose accumulator MMAs come next. `multicast` (the planners'
                    default): the row tile's o_split CTAs are a cluster and chunk c is loaded
                    once, by CTA c % o_split, into every CTA's stage; each CTA's MMA thread
                    releases a stage on all of them.
  MMA (warp 4)      the score MMAs (tcgen05.mma, both operands from smem, a commit on s_full),
                    and the accumulator MMAs with A (P / dS) read from TMEM once the softmax
                    threads published it (p_full), a commit on o_done. With one product it
                    scores block n+1 before accumulating block n (`lookahead`), so the tensor
                    pipe works while the softmax threads do; tcgen05 ops of one thread run in
                    issue order, so a score MMA that overwrites a buffer runs after the
                    accumulator MMA that read P from it.
  softmax (0 - 3)   thread t owns row t = TMEM lane t: scores -> registers (tcgen05.ld), mask,
                    the kernel's score step, the result back into TMEM (tcgen05.st),
                    after the last block the epilogue (accumulator -> global memory).

TMEM (config.tmem_regions): buffers [0, 128) and [128, 256) (S[0], S[1]; or S, dP), P / dS
over the second half of the first, the accumulator at [256, 256 + acc_cta).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05

from ..common.mask import mask_row, n_block_max, n_block_min, query_block_range
from ..common.scheduler import rows_from, varlen_tile
from ..common.tensors import CUTLASS_DTYPES, KernelEntry, aligned_bhdn, aligned_bhnd
from .config import TILE_M, V_ROWS, FwdConfigSm100, _role, can_implement, num_threads

SOFTMAX_FIRST, SOFTMAX_WARPS, _ = _role("softmax")
MMA_WARP, LOAD_WARP = _role("mma")[0], _role("load")[0]
SOFTMAX_THREADS = 32 * SOFTMAX_WARPS
EPI_COLS = 32  # accumulator columns per tcgen05.ld in the epilogue and the O rescale
COLSTAT_BARRIER = 1  # named barrier of the softmax threads (0 is __syncthreads)


class Roles(NamedTuple):
    """A kernel's (B, H, N, dim) tensors in the skeleton's roles: R and C of the first product
    (its rows and columns), of the second (dK / dQ; else None), the accumulator's B operand
    (rows = C's rows) and the output (rows = R's rows, acc_dim columns)."""

    rows: cute.Tensor
    cols: cute.Tensor
    rows2: object
    cols2: object
    acc_b: cute.Tensor
    out: cute.Tensor


class Ctx(NamedTuple):
    """What the score step and the epilogue of one softmax thread read."""

    bars: dict
    tidx: Int32
    row: Int32          # this thread's row (a query, or a key with `rows_are_keys`)
    m_block: Int32
    o_part: Int32
    head: Int32         # R's head (the output's)
    batch: Int32
    seqlen_r: Int32
    seqlen_c: Int32
    scale_log2: Float32
    softmax_scale: Float32
    causal_offset: Int32
    head_c: Int32       # C's head when one serves the whole tile (rows are queries)
    window_lo: Int32    # a window's left edge: query i sees key j >= i + window_lo (`window`)
    tOtO: cute.Tensor   # the accumulator in TMEM
    mOut: cute.Tensor
    stats: object       # the kernel's statistics tensors (LSE, Delta), or None
    sStat: object       # smem [2, col_stats, tile_n] for per-column statistics, or None
    row0: Int32         # the sequence's first row of R in the packed tensors (`varlen`; else 0)
    row0_c: Int32       # ... and of C (the columns' statistics: LSE, Delta)


class RingSkeletonSm100(KernelEntry):
    """The skeleton; a kernel subclasses it with its OPERANDS, `__call__` and hooks.

    BLOCK_SCALED: the operands carry block scale factors (NVFP4: `FFPAFwdSm100FP4`): the
    load thread copies each stage's scales beside its codes, the MMA thread moves them to TMEM
    (tcgen05.cp) before the MMAs that read them, and P (with its scales) goes through shared
    memory instead of TMEM; the `_scale_*` hooks below do that part. B_K_MAJOR: the
    accumulator's B operand arrives transposed ((B, H, dim, N): V^T), K-major."""

    BLOCK_SCALED = False
    B_K_MAJOR = False

    def __init__(self, cfg: FwdConfigSm100):
        self._refuse(can_implement(cfg))
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]  # the operands' (Q, K, V, P)
        self.out_dtype = CUTLASS_DTYPES[getattr(cfg, "out_dtype", cfg.dtype)]
        self.qk_tiler = (TILE_M, cfg.tile_n, cfg.k_chunk)  # one QK-ring stage
        self.pv_tiler = (TILE_M, cfg.acc_cta, V_ROWS)  # one V-ring stage
        self.p_tiler = (TILE_M, cfg.acc_cta, cfg.tile_n)  # P / dS of one block

    def _tiled_mmas(self):
        """Scores: A = R chunk, B = C chunk, both K-major in smem. Accumulator: A = P / dS from
        TMEM (K-major), B = the B operand N-major (its columns contiguous, as in memory)."""
        major = cute.nvgpu.OperandMajorMode
        one, dt = tcgen05.CtaGroup.ONE, self.dtype
        qk = sm100_utils.make_trivial_tiled_mma(dt, dt, major.K, major.K, Float32, one,
                                                self.qk_tiler[:2])
        pv = sm100_utils.make_trivial_tiled_mma(dt, dt, major.K, major.MN, Float32, one,
                                                self.pv_tiler[:2], tcgen05.OperandSource.TMEM)
        return qk, pv

    # ------------------------------------------------------------------ host side
    @cute.jit
    def _launch(self, roles: Roles, stats, softmax_scale: Float32, causal_offset: Int32,
                stream, window_lo: Int32 = 0, scales=None, cu=None):
        """TMA atoms, the storage struct, the grid (ceil(N_R / 128) * o_split, H_R, B) and the
        launch (clusters of o_split CTAs along x with `multicast`). `stats`: the tensors the
        hooks read (LSE, Delta; the forward's LSE output and sinks), or None. `window_lo`: read
        with `window`. `scales`: with BLOCK_SCALED, the scale tensors of R, C and the B
        operand (`_scale_layouts` says how they are laid out). `cu` (`varlen`): the int32
        cumulative lengths of R's and C's sequences, the tensors [1, H, total, dim]; the grid
        then counts (ceil(total_R / 128) + sequences) row tiles (common/scheduler.py)."""
        cfg = self.cfg
        dims = cfg.products
        r1 = aligned_bhnd(roles.rows, dims[0], self.dtype)
        c1 = aligned_bhnd(roles.cols, dims[0], self.dtype)
        acc_b = (aligned_bhdn if const_expr(self.B_K_MAJOR) else aligned_bhnd)(
            roles.acc_b, cfg.acc_dim, self.dtype)
        out = aligned_bhnd(roles.out, cfg.acc_dim, self.out_dtype)
        qk, pv = self._tiled_mmas()
        sR_l = sm100_utils.make_smem_layout_a(qk, self.qk_tiler, self.dtype, cfg.qk_stages)
        sC_l = sm100_utils.make_smem_layout_b(qk, self.qk_tiler, self.dtype, cfg.qk_stages)
        sB_l = sm100_utils.make_smem_layout_b(pv, self.pv_tiler, self.dtype, cfg.v_stages)
        tP_l = sm100_utils.make_smem_layout_a(pv, self.p_tiler, self.dtype, 2)

        # one CTA's tile per copy: with `multicast` the chunk's owner sends it to the cluster
        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (qk.thr_id.shape,)).shape
        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        g2s_qk = (cpasync.CopyBulkTensorTileG2SMulticastOp(tcgen05.CtaGroup.ONE)
                  if const_expr(cfg.multicast) else g2s)
        sR1 = cute.slice_(sR_l, (None, None, None, 0))  # one stage (both products' chunks)
        sC1 = cute.slice_(sC_l, (None, None, None, 0))
        tma_r1, gR1 = cute.nvgpu.make_tiled_tma_atom_A(g2s_qk, _nd(r1), sR1, self.qk_tiler, qk,
                                                       cluster)
        tma_c1, gC1 = cute.nvgpu.make_tiled_tma_atom_B(g2s_qk, _nd(c1), sC1, self.qk_tiler, qk,
                                                       cluster)
        second = None
        if const_expr(len(dims) == 2):
            r2 = aligned_bhnd(roles.rows2, dims[1], self.dtype)
            c2 = aligned_bhnd(roles.cols2, dims[1], self.dtype)
            tma_r2, gR2 = cute.nvgpu.make_tiled_tma_atom_A(g2s_qk, _nd(r2), sR1, self.qk_tiler,
                                                           qk, cluster)
            tma_c2, gC2 = cute.nvgpu.make_tiled_tma_atom_B(g2s_qk, _nd(c2), sC1, self.qk_tiler,
                                                           qk, cluster)
            second = (tma_r2, gR2, tma_c2, gC2)
        # the B operand as (acc_dim, N, H, B): the accumulator MMA's N = its columns
        tB = _nd(acc_b) if const_expr(self.B_K_MAJOR) else cute.make_tensor(
            acc_b.iterator, cute.select(acc_b.layout, mode=[3, 2, 1, 0]))
        tma_b, gB = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, tB, cute.slice_(sB_l, (None, None, None, 0)), self.pv_tiler, pv, cluster)

        scaled = None
        if const_expr(self.BLOCK_SCALED):
            scaled = (scales, self._scale_layouts(qk, pv))
        Storage = self._storage(sR_l, sC_l, sB_l, tP_l, scaled)
        assert Storage.size_in_bytes() == cfg.smem_bytes(), (Storage.size_in_bytes(),
                                                             cfg.smem_bytes())
        tiles = cute.ceil_div(r1.shape[2], TILE_M)
        if const_expr(cfg.varlen):
            tiles = tiles + cute.size(cu[0]) - 1
        grid = (tiles * cfg.o_split, cute.size(out.shape[1]), cute.size(out.shape[0]))
        self.kernel(qk, pv, (tma_r1, gR1, tma_c1, gC1), second, (tma_b, gB), out, stats,
                    c1.shape[2], c1.shape[1], r1.shape[2], softmax_scale, causal_offset,
                    window_lo, cu, sR_l, sC_l, sB_l, tP_l, scaled, Storage).launch(
            grid=grid, block=[num_threads(), 1, 1], smem=Storage.size_in_bytes(),
            stream=stream, min_blocks_per_mp=1,
            **({"cluster": [cfg.cluster_size, 1, 1]} if const_expr(cfg.multicast) else {}))

    def _storage(self, sR_l, sC_l, sB_l, tP_l, scaled):
        """The shared-memory struct: cfg.barriers() in order, the TMEM address, the column
        statistics (dV / dK), the rings (each 1 KB aligned), then BLOCK_SCALED's regions
        (`_scale_storage_fields`); its size is `cfg.smem_bytes()` (asserted at compile
        time)."""
        mem, align = cute.struct.MemRange, cute.struct.Align
        fields = {name: mem[cutlass.Int64, n] for name, (n, _) in self.cfg.barriers().items()}
        fields["tmem_addr"] = cutlass.Int32
        if self.cfg.col_stats:
            fields["col_stat"] = align[mem[Float32, 2 * self.cfg.col_stats * self.cfg.tile_n],
                                       16]
        for name, lay in (("sR", sR_l), ("sC", sC_l), ("sB", sB_l)):
            fields[name] = align[mem[self.dtype, cute.cosize(lay.outer)], 1024]
        if const_expr(scaled is not None):
            fields.update(self._scale_storage_fields(tP_l, scaled[1]))
        return cute.struct(type("Storage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------ the kernel
    @cute.kernel
    def kernel(self, qk: cute.TiledMma, pv: cute.TiledMma, first, second, acc_b,
               mOut: cute.Tensor, stats, seqlen_c: Int32, heads_c: Int32, seqlen_r: Int32,
               softmax_scale: Float32, causal_offset: Int32, window_lo: Int32, cu,
               sR_l: cute.ComposedLayout,
               sC_l: cute.ComposedLayout, sB_l: cute.ComposedLayout,
               tP_l: cute.ComposedLayout, scaled, Storage: cutlass.Constexpr):
        cfg = self.cfg
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, head, batch = cute.arch.block_idx()
        m_block = bidx // cfg.o_split
        o_part = bidx % cfg.o_split
        rows0 = (Int32(0), Int32(0))  # the first rows of R and C (`varlen`: the sequence's)
        if const_expr(cfg.varlen):  # tile t of the sequences' row tiles, in its own frame
            m_block, row0, seqlen_r, row0_c, seqlen_c, frame = varlen_tile(
                cu[0], cu[1], m_block, TILE_M, cfg.rows_are_keys and cfg.causal,
                cfg.rows_are_keys)
            rows0 = (row0, row0_c)
            causal_offset = causal_offset + frame
            window_lo = window_lo + frame

        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        bars = {name: getattr(storage, name).data_ptr() for name in cfg.barriers()}
        if warp == LOAD_WARP:
            atoms = [first[0], first[2], acc_b[0]]
            if const_expr(second is not None):
                atoms += [second[0], second[2]]
            for tma in atoms:
                cpasync.prefetch_descriptor(tma)
            with cute.arch.elect_one():
                for name, (n, arrivals) in cfg.barriers().items():
                    for i in cutlass.range_constexpr(n):
                        cute.arch.mbarrier_init(bars[name] + i, arrivals)
                cute.arch.mbarrier_init_fence()
        if warp == MMA_WARP:  # the MMA warp owns TMEM: allocates here, frees at the end
            cute.arch.alloc_tmem(cfg.tmem_alloc_columns, storage.tmem_addr.ptr)
            cute.arch.relinquish_tmem_alloc_permit()
        if const_expr(cfg.multicast):  # the peers' barriers exist before anything reaches them
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        tmem = cute.arch.retrieve_tmem_ptr(Float32, 16, storage.tmem_addr.ptr)

        sR = storage.sR.get_tensor(sR_l.outer, swizzle=sR_l.inner)
        sC = storage.sC.get_tensor(sC_l.outer, swizzle=sC_l.inner)
        sB = storage.sB.get_tensor(sB_l.outer, swizzle=sB_l.inner)

        # TMEM tensors (config.tmem_regions): the score buffers (128 x tile_n fp32 each), the
        # accumulator (128 x acc_cta), P / dS (16-bit, the A of the accumulator MMA) over the
        # second half of buffer i's columns
        thr_qk, thr_pv = qk.get_slice(0), pv.get_slice(0)
        s_shape = thr_qk.partition_shape_C(self.qk_tiler[:2])
        tStS = cute.make_tensor(tmem + cfg.s_offset[0],
                                thr_qk.make_fragment_C(cute.append(s_shape, 2)).layout)
        o_shape = thr_pv.partition_shape_C(self.pv_tiler[:2])
        tOtO = cute.make_tensor(tmem + cfg.o_offset, thr_pv.make_fragment_C(o_shape).layout)
        sc = None
        if const_expr(self.BLOCK_SCALED):  # P (two buffers) in shared memory
            sc = self._scale_smem(storage, scaled, tP_l)
            tOrP = pv.make_fragment_A(sc.sP)
        else:
            p_ratio = Float32.width // self.dtype.width  # P elements per TMEM column (2 or 4)
            tOrP = thr_pv.make_fragment_A(
                cute.make_tensor(tmem, tP_l.outer))[None, None, None, 0]
            tOrP = cute.make_tensor(
                tOrP.iterator + cfg.p_offset[0] * p_ratio,
                cute.append(tOrP.layout, cute.make_layout(
                    (2,), stride=((cfg.p_offset[1] - cfg.p_offset[0]) * p_ratio,))))

        # the block walk: the heads of C this row tile meets (G = the GQA group) and its blocks
        group = (heads_c // mOut.shape[1] if const_expr(cfg.rows_are_keys)
                 else mOut.shape[1] // heads_c)
        walk = self._walk(m_block, seqlen_r, seqlen_c, causal_offset, head, group, window_lo)

        if warp == LOAD_WARP:
            self._load(first, second, acc_b, sR, sC, sB, thr_qk, thr_pv, bars, m_block, o_part,
                       head, batch, walk, sc, rows0)
        if warp == MMA_WARP:
            self._mma(qk, pv, sR, sC, sB, tStS, tOtO, tOrP, bars, walk[0], sc, tmem, o_part)
        if warp < SOFTMAX_FIRST + SOFTMAX_WARPS:
            sStat = None
            if const_expr(cfg.col_stats):
                sStat = storage.col_stat.get_tensor(
                    cute.make_layout((cfg.tile_n, cfg.col_stats, 2)))
            self._softmax(tStS, thr_qk, bars, tidx, m_block, o_part, head, batch, seqlen_r,
                          seqlen_c, softmax_scale, causal_offset, tOtO, mOut, stats, sStat,
                          walk, window_lo, sc, rows0)

        # every TMEM read done; with `multicast` also every peer's copies into and commits to
        # this CTA's shared memory (each peer consumed every stage before its epilogue)
        if const_expr(cfg.multicast):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        if warp == MMA_WARP:
            cute.arch.dealloc_tmem(tmem, cfg.tmem_alloc_columns)

    # ------------------------------------------------------------------ the block walk
    @cute.jit
    def _walk(self, m_block, seqlen_r, seqlen_c, causal_offset, head, group, window_lo):
        """(blocks, n_top, n_per, first C head): block i is C block n_top - 1 - i % n_per of C
        head `first + i // n_per`. Rows are queries: one C head (the KV head), the key blocks
        up to the causal bound of the tile, highest first, down to the first one a window's
        left edge lets the tile's first row see (`window`; those below are skipped). Rows are
        keys (dV, dK): each of the group's query heads, the query blocks from the first that
        holds a query seeing a key of the tile (causal: i >= j - offset) to the last (a window:
        the last that holds a query seeing the tile's last key, i <= j - window_lo)."""
        cfg, n = self.cfg, self.cfg.tile_n
        if const_expr(cfg.rows_are_keys):
            n_top, n_low = query_block_range(m_block, seqlen_c, causal_offset,
                                             window_lo if const_expr(cfg.window) else None,
                                             TILE_M, n, cfg.causal)
            n_per = cutlass.max(n_top - n_low, 0)
            return n_per * group, n_top, n_per, head * group
        n_max = n_block_max(m_block, seqlen_c, causal_offset, TILE_M, n, cfg.causal)
        count = n_max
        if const_expr(cfg.window):
            count = cutlass.max(n_max - n_block_min(m_block, window_lo, TILE_M, n), 0)
        return count, n_max, cutlass.max(count, 1), head // group

    @cute.jit
    def _block(self, walk, i):
        """(C head, C block) of block i."""
        _, n_top, n_per, head0 = walk
        return head0 + i // n_per, n_top - 1 - i % n_per

    # ------------------------------------------------------------------ load
    @cute.jit
    def _load(self, first, second, acc_b, sR, sC, sB, thr_qk, thr_pv, bars, m_block, o_part,
              head, batch, walk, sc, rows0):
        """Per block i: its QK-ring stages (each product's chunks), then the B operand's stages
        of block i - lookahead (the one the MMA thread accumulates next); each stage: wait for
        its release (the previous round's phase), expect its bytes, issue the copies (with
        `multicast` only the chunk's owner copies, into every CTA of the cluster; BLOCK_SCALED:
        the stage's scales beside its codes, on the same barrier). `rows0`: the first rows of
        R and C (`varlen`: the sequence's in the packed tensors; TMA coordinates may start
        anywhere, rows past the sequence are masked or not stored)."""
        cfg = self.cfg
        one = cute.make_layout(1)
        n_blocks = walk[0]

        def parts(tma_r, gR, tma_c, gC):
            """TMA partitions of one product's R chunks of this row tile: (smem (TMA, stage),
            gmem (TMA, chunk)); C's are partitioned per block on use (its head may change)."""
            gr = cute.local_tile(rows_from(gR[None, None, head, batch], rows0[0], cfg.varlen),
                                 cute.select(self.qk_tiler, [0, 2]), (m_block, None))
            tRs, tRg = cpasync.tma_partition(tma_r, 0, one, cute.group_modes(sR, 0, 3),
                                             cute.group_modes(thr_qk.partition_A(gr), 0, 3))
            return tRs, tRg

        tRs1, tRg1 = parts(*first)
        tRg2 = None
        if const_expr(second is not None):
            _, tRg2 = parts(*second)
        qk_bytes, v_bytes = cfg.qk_stage_bytes, cfg.v_stage_bytes
        everyone = cutlass.Int16((1 << cfg.cluster_size) - 1)  # `multicast`: the cluster
        qk_i = Int32(0)
        v_i = Int32(0)
        for i in cutlass.range(n_blocks + cfg.lookahead, unroll=1):
            if i < n_blocks:
                c_head, n = self._block(walk, i)
                for p in cutlass.range_constexpr(len(cfg.products)):
                    tma_r, _, tma_c, gC = first if const_expr(p == 0) else second
                    tRg = tRg1 if const_expr(p == 0) else tRg2
                    gc = cute.local_tile(
                        rows_from(gC[None, None, c_head, batch], rows0[1], cfg.varlen),
                        cute.select(self.qk_tiler, [1, 2]), (n, None))
                    tCs, tCg = cpasync.tma_partition(
                        tma_c, 0, one, cute.group_modes(sC, 0, 3),
                        cute.group_modes(thr_qk.partition_B(gc), 0, 3))
                    for c in cutlass.range_constexpr(cfg.product_chunks[p]):
                        s = qk_i % cfg.qk_stages
                        cute.arch.mbarrier_wait(bars["qk_empty"] + s,
                                                ((qk_i // cfg.qk_stages) & 1) ^ 1)
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(bars["qk_full"] + s,
                                                                    qk_bytes)
                        if const_expr(cfg.multicast):
                            if o_part == c % cfg.o_split:  # this CTA owns chunk c
                                cute.copy(tma_r, tRg[None, c], tRs1[None, s],
                                          tma_bar_ptr=bars["qk_full"] + s, mcast_mask=everyone)
                                cute.copy(tma_c, tCg[None, c], tCs[None, s],
                                          tma_bar_ptr=bars["qk_full"] + s, mcast_mask=everyone)
                                if const_expr(sc is not None):
                                    self._scale_load_qk(sc, s, c, batch, head, c_head, m_block,
                                                        n, bars["qk_full"] + s, everyone)
                        else:
                            cute.copy(tma_r, tRg[None, c], tRs1[None, s],
                                      tma_bar_ptr=bars["qk_full"] + s)
                            cute.copy(tma_c, tCg[None, c], tCs[None, s],
                                      tma_bar_ptr=bars["qk_full"] + s)
                            if const_expr(sc is not None):
                                self._scale_load_qk(sc, s, c, batch, head, c_head, m_block, n,
                                                    bars["qk_full"] + s, None)
                        qk_i += 1
            if i >= cfg.lookahead:
                c_head, n = self._block(walk, i - cfg.lookahead)
                tma_b, gB = acc_b
                gb = cute.local_tile(  # (acc_dim, N): the keys second
                    rows_from(gB[None, None, c_head, batch], rows0[1], cfg.varlen, mode=1),
                    cute.select(self.pv_tiler, [1, 2]), (o_part, None))
                tBs, tBg = cpasync.tma_partition(tma_b, 0, one, cute.group_modes(sB, 0, 3),
                                                 cute.group_modes(thr_pv.partition_B(gb), 0, 3))
                for j in cutlass.range_constexpr(cfg.v_blocks_per_tile):
                    s = v_i % cfg.v_stages
                    cute.arch.mbarrier_wait(bars["v_empty"] + s,
                                            ((v_i // cfg.v_stages) & 1) ^ 1)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(bars["v_full"] + s, v_bytes)
                    cute.copy(tma_b, tBg[None, n * cfg.v_blocks_per_tile + j], tBs[None, s],
                              tma_bar_ptr=bars["v_full"] + s)
                    if const_expr(sc is not None):
                        self._scale_load_b(sc, s, batch, c_head, o_part,
                                           n * cfg.v_blocks_per_tile + j, bars["v_full"] + s)
                    v_i += 1

    # ------------------------------------------------------------------ MMA
    @cute.jit
    def _mma(self, qk, pv, sR, sC, sB, tStS, tOtO, tOrP, bars, n_blocks, sc, tmem, o_part):
        """Per block i: the score products into their buffers (one product: buffer i % 2; two:
        S into 0, dP into 1), a commit on s_full; then the accumulator MMAs of block
        i - lookahead once its P / dS is in TMEM (p_full), a commit on o_done. BLOCK_SCALED:
        each stage's (and P's) scales are copied to TMEM before the MMAs that read them
        (tcgen05.cp and tcgen05.mma of one thread run in issue order) and set per MMA."""
        cfg = self.cfg
        sf = None
        if const_expr(sc is not None):
            sf = self._scale_tmem(sc, tmem, qk, pv, o_part)
        tSrR, tSrC = qk.make_fragment_A(sR), qk.make_fragment_B(sC)
        tOrB = pv.make_fragment_B(sB)
        k_blocks = cute.size(tSrR, mode=[2])  # score MMAs per QK stage (128 bytes / 32)
        b_blocks = cute.size(tOrB, mode=[2])  # accumulator MMAs per B stage (64 keys / mma_k)
        nbuf = cfg.score_bufs
        qk_i = Int32(0)
        v_i = Int32(0)
        for i in cutlass.range(n_blocks + cfg.lookahead, unroll=1):
            if i < n_blocks:
                for p in cutlass.range_constexpr(len(cfg.products)):
                    acc = tStS[None, None, None, i % 2 if const_expr(nbuf == 2) else p]
                    if const_expr(sf is not None):  # NVFP4: a dynamic loop (unrolled,
                        # every chunk's per-MMA scale pointers spilled at D = 1024)
                        for c in cutlass.range(cfg.product_chunks[p], unroll=1):
                            qk_i, qk = self._score_stage(qk, acc, tSrR, tSrC, bars, qk_i,
                                                         c > 0, k_blocks, sf)
                    else:
                        for c in cutlass.range_constexpr(cfg.product_chunks[p]):
                            qk_i, qk = self._score_stage(qk, acc, tSrR, tSrC, bars, qk_i,
                                                         c > 0, k_blocks, sf)
                with cute.arch.elect_one():
                    tcgen05.commit(bars["s_full"] + i % nbuf)
            if i >= cfg.lookahead:
                b = i - cfg.lookahead
                cute.arch.mbarrier_wait(bars["p_full"] + b % nbuf, (b // nbuf) & 1)
                if const_expr(sf is not None):
                    self._scale_s2t(sf.p, b % nbuf)
                for j in cutlass.range_constexpr(cfg.v_blocks_per_tile):
                    s = v_i % cfg.v_stages
                    cute.arch.mbarrier_wait(bars["v_full"] + s, (v_i // cfg.v_stages) & 1)
                    if const_expr(sf is not None):
                        self._scale_s2t(sf.b, s)
                    for kb in cutlass.range_constexpr(b_blocks):
                        # the first block's first MMA overwrites the accumulator
                        pv.set(tcgen05.Field.ACCUMULATE, b > 0 if j == 0 and kb == 0 else True)
                        if const_expr(sf is not None):
                            self._scale_set(pv, sf.p, sf.b, j * b_blocks + kb, kb)
                        cute.gemm(pv, tOtO, tOrP[None, None, j * b_blocks + kb, b % nbuf],
                                  tOrB[None, None, kb, s], tOtO)
                    with cute.arch.elect_one():
                        tcgen05.commit(bars["v_empty"] + s)
                    v_i += 1
                with cute.arch.elect_one():
                    tcgen05.commit(bars["o_done"])

    @cute.jit
    def _score_stage(self, qk, acc, tSrR, tSrC, bars, qk_i, accumulate, k_blocks, sf):
        """One QK-ring stage's score MMAs into acc (overwriting it at the product's first
        chunk unless `accumulate`), then the stage's release; returns the next stage count and
        the MMA atom (its fields set here: a loop carries it)."""
        cfg = self.cfg
        s = qk_i % cfg.qk_stages
        cute.arch.mbarrier_wait(bars["qk_full"] + s, (qk_i // cfg.qk_stages) & 1)
        if const_expr(sf is not None):
            self._scale_s2t(sf.qk_rows, s)
            self._scale_s2t(sf.qk_cols, s)
        for kb in cutlass.range_constexpr(k_blocks):
            qk.set(tcgen05.Field.ACCUMULATE, accumulate or kb > 0)
            if const_expr(sf is not None):
                self._scale_set(qk, sf.qk_rows, sf.qk_cols, kb, kb)
            cute.gemm(qk, acc, tSrR[None, None, kb, s], tSrC[None, None, kb, s], acc)
        with cute.arch.elect_one():  # (`multicast`: on every CTA's stage s)
            tcgen05.commit(bars["qk_empty"] + s,
                           (1 << cfg.cluster_size) - 1 if const_expr(cfg.multicast) else None)
        return qk_i + 1, qk

    # ------------------------------------------------------------------ softmax threads
    @cute.jit
    def _softmax(self, tStS, thr_qk, bars, tidx, m_block, o_part, head, batch, seqlen_r,
                 seqlen_c, softmax_scale, causal_offset, tOtO, mOut, stats, sStat, walk,
                 window_lo, sc, rows0):
        """Per block: wait for its scores, load them (two products: S and dP 32 columns at a
        time), mask, the kernel's score step (`_score_step`, which fills the 16-bit operand for
        the columns it is given), store it over buffer 0 / i % 2, publish it; then
        `_epilogue`. Thread tidx = TMEM lane tidx = the row m_block * 128 + (its lane)."""
        cfg = self.cfg
        n = cfg.tile_n
        s0 = tStS[(None, None), 0, 0, 0]  # (128, tile_n) of buffer 0
        ld_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32),
            s0).get_slice(tidx)
        tScS = ld_s.partition_D(thr_qk.partition_C(cute.make_identity_tensor((TILE_M, n)))[
            (None, None), 0, 0])
        p_cols = n * self.dtype.width // 32  # P's TMEM columns (64 at 16 bits, 32 at 8)
        p0 = cute.make_tensor(s0.iterator + (cfg.p_offset[0] - cfg.s_offset[0]),
                              cute.composition(s0.layout, cute.make_layout((TILE_M, p_cols))))
        pieces = cute.size(tScS, mode=[2])  # the 32-column pieces of a row of scores
        st_p = tcgen05.make_tmem_copy(   # one piece's P per store
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(
                tcgen05.copy.Repetition(p_cols // pieces)), Float32), p0).get_slice(tidx)
        tPr_f32 = cute.make_rmem_tensor(
            st_p.partition_S(cute.make_identity_tensor((TILE_M, p_cols))).shape, Float32)
        s_stride = cfg.s_offset[1] - cfg.s_offset[0]
        nbuf = cfg.score_bufs

        ctx = Ctx(bars, tidx, m_block * TILE_M + tScS[0][0], m_block, o_part, head, batch,
                  seqlen_r, seqlen_c, softmax_scale * 1.4426950408889634, softmax_scale,
                  causal_offset, walk[3], window_lo, tOtO, mOut, stats, sStat, *rows0)
        state = self._init_state(ctx)
        n_blocks = walk[0]
        for i in cutlass.range(n_blocks, unroll=1):
            c_head, nb = self._block(walk, i)
            buf = i % nbuf
            if const_expr(cfg.col_stats):  # stage the block's per-query statistics
                self._stage_col_stats(ctx, c_head, nb, i % 2)
            cute.arch.mbarrier_wait(bars["s_full"] + buf, (i // nbuf) & 1)
            tSt = ld_s.partition_S(cute.make_tensor(s0.iterator + buf * s_stride, s0.layout))
            tPt = st_p.partition_D(cute.make_tensor(p0.iterator + buf * s_stride, p0.layout))
            tPr = cute.make_tensor(cute.recast_ptr(tPr_f32.iterator, dtype=self.dtype),
                                   cute.make_layout(tScS.shape))  # element e = column e
            if const_expr(len(cfg.products) == 1):  # the whole row: the forward's max needs it
                tSr = cute.make_rmem_tensor(tScS.shape, Float32)
                cute.copy(ld_s, tSt, tSr)
                cute.arch.fence_view_async_tmem_load()
                self._mask(ctx, tSr, tScS, nb)
                self._score_step(ctx, state, i, tSr, None, tScS, tPr)
                if const_expr(sc is not None):  # P and its scales into shared memory
                    self._scale_store_p(ctx, sc, tSr, buf)
                else:
                    cute.copy(st_p, tPr_f32, tPt)
            else:  # S and dP (buffer 1) 32 columns at a time (both rows would not fit the
                # registers); piece q of the 16-bit result is TMEM columns [16 q, 16 q + 16)
                tDPt = ld_s.partition_S(cute.make_tensor(s0.iterator + s_stride, s0.layout))
                for q in cutlass.range_constexpr(cute.size(tScS, mode=[2])):
                    tSr = cute.make_rmem_tensor(tScS[None, None, q].shape, Float32)
                    tDPr = cute.make_rmem_tensor(tScS[None, None, q].shape, Float32)
                    cute.copy(ld_s, tSt[None, None, q], tSr)
                    cute.copy(ld_s, tDPt[None, None, q], tDPr)
                    cute.arch.fence_view_async_tmem_load()
                    self._mask(ctx, tSr, tScS[None, None, q], nb)
                    self._score_step(ctx, state, i, tSr, tDPr, tScS[None, None, q],
                                     tPr[None, None, q])
                    cute.copy(st_p, tPr_f32[None, None, q], tPt[None, None, q])
            cute.arch.fence_view_async_tmem_store()
            cute.arch.mbarrier_arrive(bars["p_full"] + buf)
        if n_blocks > 0:
            cute.arch.mbarrier_wait(bars["o_done"], (n_blocks - 1) & 1)
        self._epilogue(ctx, state, n_blocks)

    @cute.jit
    def _mask(self, ctx: Ctx, tSr, tScS, nb):
        """-inf on the block's scores this row may not see (common/mask.py's rule: query i
        sees key j iff j <= i + offset under causal and j >= i + window_lo under a window;
        columns past C's length)."""
        cfg, n = self.cfg, self.cfg.tile_n
        col0 = nb * n
        if const_expr(cfg.rows_are_keys):  # row = key j, columns = queries i
            hi = ctx.seqlen_c - col0
            if const_expr(cfg.window):
                hi = cutlass.min(hi, ctx.row - ctx.window_lo + 1 - col0)  # i <= j - window_lo
            lo = Int32(0)
            if const_expr(cfg.causal):
                lo = ctx.row - ctx.causal_offset - col0  # i >= j - offset
            if lo > 0 or hi < n:
                mask_row(tSr, tScS, lo, hi)
        else:  # row = query i, columns = keys j
            hi = ctx.seqlen_c - col0
            if const_expr(cfg.causal):
                hi = cutlass.min(hi, ctx.row + ctx.causal_offset + 1 - col0)
            lo = Int32(0)
            if const_expr(cfg.window):
                lo = ctx.row + ctx.window_lo - col0  # j >= i + window_lo
            if lo > 0 or hi < n:
                mask_row(tSr, tScS, lo, hi)

    # ------------------------------------------------------------------ the epilogue's store
    @cute.jit
    def _acc_chunks(self, tOtO, tidx):
        """(tcgen05.ld copy, tcgen05.st copy for this thread, the accumulator as (128, 32, 1,
        chunks)) in EPI_COLS-column chunks."""
        acc = tOtO[(None, None), 0, 0]  # (128, acc_cta)
        chunks = cute.flat_divide(acc, (TILE_M, EPI_COLS))
        atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(EPI_COLS)),
                                   Float32)
        ld = tcgen05.make_tmem_copy(atom, chunks[None, None, 0, 0]).get_slice(tidx)
        st_atom = cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(EPI_COLS)), Float32)
        st = tcgen05.make_tmem_copy(st_atom, chunks[None, None, 0, 0]).get_slice(tidx)
        return ld, st, chunks

    @cute.jit
    def _store_acc(self, ctx: Ctx, factor, any_block):
        """The accumulator's row times `factor`, in the output dtype, to global memory: 8
        columns per 16-byte store, rows < N_R and columns < acc_dim only (zeros for a tile
        that met no block)."""
        cfg = self.cfg
        ld, _, chunks = self._acc_chunks(ctx.tOtO, ctx.tidx)
        col0 = ctx.o_part * cfg.acc_cta
        vec = 8
        row = ctx.row
        last = cutlass.min(row, ctx.seqlen_r - 1)
        if const_expr(cfg.varlen):  # (an empty tile: no rows, none stored)
            last = ctx.row0 + cutlass.max(last, 0)
        gO = ctx.mOut[ctx.batch, ctx.head, last, None]
        for c in cutlass.range_constexpr(cute.size(chunks, mode=[3])):
            reg = cute.make_rmem_tensor(ld.partition_D(chunks[None, None, 0, c]).shape, Float32)
            if any_block:
                cute.copy(ld, ld.partition_S(chunks[None, None, 0, c]), reg)
                cute.arch.fence_view_async_tmem_load()
            else:
                reg.fill(0.0)
            out = cute.make_rmem_tensor((EPI_COLS,), self.out_dtype)
            out.store((reg.load() * factor).to(self.out_dtype))
            for v8 in cutlass.range_constexpr(EPI_COLS // vec):
                col = col0 + c * EPI_COLS + v8 * vec
                if row < ctx.seqlen_r and col < cfg.acc_dim:
                    dst = cute.local_tile(gO, (vec,), (col // vec,))
                    cute.autovec_copy(cute.local_tile(out, (vec,), (v8,)), dst)

    # ------------------------------------------------------------------ hooks
    @cute.jit
    def _init_state(self, ctx: Ctx):
        """The softmax thread's per-row state across blocks (a register tensor), or None."""
        return None

    @cute.jit
    def _score_step(self, ctx: Ctx, state, i, tSr, tDPr, tScS, tPr):
        raise NotImplementedError

    @cute.jit
    def _epilogue(self, ctx: Ctx, state, n_blocks):
        raise NotImplementedError

    @cute.jit
    def _stage_col_stats(self, ctx: Ctx, c_head, nb, slot):
        raise NotImplementedError

    # BLOCK_SCALED's hooks (FFPAFwdSm100FP4): the scale layouts and storage, their loads, their
    # copies to TMEM and the per-MMA scale pointers, P's store to shared memory
    def _scale_layouts(self, qk, pv):
        raise NotImplementedError

    def _scale_storage_fields(self, tP_l, layouts) -> dict:
        raise NotImplementedError

    def _scale_smem(self, storage, scaled, tP_l):
        raise NotImplementedError

    @cute.jit
    def _scale_load_qk(self, sc, s, c, batch, head, c_head, m_block, n, bar, mcast):
        raise NotImplementedError

    @cute.jit
    def _scale_load_b(self, sc, s, batch, c_head, o_part, kblock, bar):
        raise NotImplementedError

    @cute.jit
    def _scale_tmem(self, sc, tmem, qk, pv, o_part):
        raise NotImplementedError

    @cute.jit
    def _scale_s2t(self, part, stage):
        raise NotImplementedError

    @cute.jit
    def _scale_set(self, mma, sfa, sfb, ka, kb):
        raise NotImplementedError

    @cute.jit
    def _scale_store_p(self, ctx: Ctx, sc, tSr, buf):
        raise NotImplementedError


def _nd(t: cute.Tensor) -> cute.Tensor:
    """(B, H, N, dim) -> (N, dim, H, B): an MMA operand's rows x K-dim, then the batch modes."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))


__all__ = ["Ctx", "EPI_COLS", "RingSkeletonSm100", "Roles"]
