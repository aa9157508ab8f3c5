"""Blackwell attention forward for large head dims: tcgen05.mma with the accumulators in TMEM.

**Compile-verified only, never run** (no sm_100 GPU is available to the project): CI compiles it
for sm_100a and checks its PTX; on a B200 each configuration first passes selfcheck.py's canary.

What it computes: O = softmax(scale * Q K^T [+ causal mask]) V and LSE for q [B, Hq, Nq, D],
k / v [B, Hkv, Nkv, D | Dv] (Hq a multiple of Hkv), any Nq and Nkv, bf16 / fp16 in, fp32
accumulation, D a multiple of 8 in [264, 1024], Dv == D or a multiple of 8 in [64, 1024].

One CTA = 128 query rows of one (batch, head) and one of `o_split` column slices of O (the
TMEM plan in config.py: S[0], S[1] and O[128 x dv_cta] fill the 512 columns), with three warp
roles that meet only through mbarriers (config `barriers()`; protocol.py models them):

  load (warp 5)     TMA: per KV block n, its QK-ring stages ([128 x 64] chunks of Q and of K
                    over D), then the two [64 x dv_cta] V stages of the block before it.
                    `multicast` (the default): the row tile's o_split CTAs are a cluster and
                    chunk c is loaded once, by CTA c % o_split, into every CTA's stage; each
                    CTA's MMA thread releases a stage on all of them.
  MMA (warp 4)      QK[n] = Q K[n]^T into S[n % 2] (tcgen05.mma, both operands from smem, a
                    commit on s_full); then PV[n-1]: O += P[n-1] V[n-1] with P read from TMEM
                    (the "TS" form) once the softmax published it (p_full), a commit on o_done.
                    Ring stages are released by tcgen05.commit once the MMAs reading them ran.
  softmax (0 - 3)   thread t owns query row t = TMEM lane t: S[n] -> registers (tcgen05.ld),
                    mask, row max, P = exp2(S * scale_log2 - m * scale_log2) in 16 bits back
                    into TMEM over the second half of S[n]'s columns (tcgen05.st), row sums;
                    after the last block O / row_sum -> global memory, and LSE.

The running max moves only when a row's max grows by more than RESCALE_THRESHOLD (log2 units):
P <= 2^8 then, and O is rescaled in TMEM (ld, multiply, st) only on such steps, by warps where
some row needs it, after PV[n-1] completed (o_done) and before P[n] is published. The MMA
thread issues QK[n+1] before PV[n], so the tensor pipe computes the next scores while the
softmax threads work; tcgen05 ops of one thread execute in issue order, so QK[n+2] (which
overwrites S[n % 2]) runs after PV[n] has read P[n] there.

Masking: only blocks crossing Nkv or the causal diagonal (common/mask.py, per element from the
(row, column) of its TMEM lane and column); KV blocks past the diagonal are not visited. Rows
past Nq are computed from TMA's zeros and not stored.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05

from ..common.mask import block_needs_mask, n_block_max
from ..common.tensors import CUTLASS_DTYPES, LOG2_E, KernelEntry, aligned_bhnd
from .config import (K_CHUNK, RESCALE_THRESHOLD, TILE_M, V_ROWS, FwdConfigSm100, _role,
                     can_implement, num_threads)

SOFTMAX_WARPS = _role("softmax")
MMA_WARP, LOAD_WARP = _role("mma")[0], _role("load")[0]
EPI_COLS = 32  # O columns per tcgen05.ld in the epilogue and the rescale


class FFPAFwdSm100(KernelEntry):
    """The tcgen05 forward; one instance per `FwdConfigSm100` (the compile key).

    Per CTA (row tile m_block, O column slice o_part): the KV blocks n_max - 1 down to 0 (the
    causal / Nkv bound of the tile first), each as QK[n] -> softmax[n] -> PV[n] on the roles
    above. Constraints: `config.can_implement`."""

    OPERANDS = ("q", "k", "v", "o", "lse")
    SCALARS = ("softmax_scale", "causal_offset")

    def __init__(self, cfg: FwdConfigSm100):
        reason = can_implement(cfg)
        if reason:
            raise ValueError(f"{type(self).__name__}: {reason}")
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        self.qk_tiler = (TILE_M, cfg.tile_n, K_CHUNK)  # one QK-ring stage
        self.pv_tiler = (TILE_M, cfg.dv_cta, V_ROWS)  # one V-ring stage
        self.p_tiler = (TILE_M, cfg.dv_cta, cfg.tile_n)  # P of one block (the A of PV)

    def _tiled_mmas(self):
        """QK: A = Q chunk (K-major), B = K chunk (K-major), both smem. PV: A = P from TMEM
        (K-major), B = V (N-major: Dv contiguous, as V lies in memory)."""
        major = cute.nvgpu.OperandMajorMode
        one = tcgen05.CtaGroup.ONE
        dt = self.dtype
        qk = sm100_utils.make_trivial_tiled_mma(dt, dt, major.K, major.K, Float32, one,
                                                self.qk_tiler[:2])
        pv = sm100_utils.make_trivial_tiled_mma(dt, dt, major.K, major.MN, Float32, one,
                                                self.pv_tiler[:2], tcgen05.OperandSource.TMEM)
        return qk, pv

    def _smem_layouts(self, qk, pv):
        cfg = self.cfg
        return (sm100_utils.make_smem_layout_a(qk, self.qk_tiler, self.dtype, cfg.qk_stages),
                sm100_utils.make_smem_layout_b(qk, self.qk_tiler, self.dtype, cfg.qk_stages),
                sm100_utils.make_smem_layout_b(pv, self.pv_tiler, self.dtype, cfg.v_stages),
                sm100_utils.make_smem_layout_a(pv, self.p_tiler, self.dtype, 2))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale: Float32, causal_offset: Int32,
                 stream: cuda.CUstream):
        """q/k/v/o: (B, H, N, D); lse: (B, Hq, Nq) fp32. Grid (ceil(Nq / 128) * o_split, Hq,
        B), 192 threads; clusters of o_split CTAs along x with `multicast`."""
        cfg = self.cfg
        q = aligned_bhnd(mQ, cfg.head_dim, self.dtype)
        k = aligned_bhnd(mK, cfg.head_dim, self.dtype)
        v = aligned_bhnd(mV, cfg.dv, self.dtype)
        o = aligned_bhnd(mO, cfg.dv, self.dtype)
        qk, pv = self._tiled_mmas()
        sQ_l, sK_l, sV_l, tP_l = self._smem_layouts(qk, pv)

        # TMA views: Q and K (N, D, H, B) (the A and B of QK: rows x K-dim), V (Dv, N, H, B)
        # (the B of PV: its N = Dv, its K = the keys)
        tQ = cute.make_tensor(q.iterator, cute.select(q.layout, mode=[2, 3, 1, 0]))
        tK = cute.make_tensor(k.iterator, cute.select(k.layout, mode=[2, 3, 1, 0]))
        tV = cute.make_tensor(v.iterator, cute.select(v.layout, mode=[3, 2, 1, 0]))
        # one CTA's tile per copy: with `multicast` the chunk's owner sends it to the cluster
        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (qk.thr_id.shape,)).shape
        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.ONE)
        g2s_qk = (cpasync.CopyBulkTensorTileG2SMulticastOp(tcgen05.CtaGroup.ONE)
                  if const_expr(cfg.multicast) else g2s)
        tma_q, gQ = cute.nvgpu.make_tiled_tma_atom_A(
            g2s_qk, tQ, cute.slice_(sQ_l, (None, None, None, 0)), self.qk_tiler, qk, cluster)
        tma_k, gK = cute.nvgpu.make_tiled_tma_atom_B(
            g2s_qk, tK, cute.slice_(sK_l, (None, None, None, 0)), self.qk_tiler, qk, cluster)
        tma_v, gV = cute.nvgpu.make_tiled_tma_atom_B(
            g2s, tV, cute.slice_(sV_l, (None, None, None, 0)), self.pv_tiler, pv, cluster)

        Storage = self._storage(sQ_l, sK_l, sV_l)
        assert Storage.size_in_bytes() == cfg.smem_bytes(), (Storage.size_in_bytes(),
                                                             cfg.smem_bytes())
        grid = (cute.ceil_div(q.shape[2], TILE_M) * cfg.o_split, cute.size(q.shape[1]),
                cute.size(q.shape[0]))
        self.kernel(qk, pv, tma_q, gQ, tma_k, gK, tma_v, gV, o, mLSE, k.shape[2], k.shape[1],
                    softmax_scale * LOG2_E, causal_offset, sQ_l, sK_l, sV_l, tP_l,
                    Storage).launch(grid=grid, block=[num_threads(), 1, 1],
                                    smem=Storage.size_in_bytes(), stream=stream,
                                    min_blocks_per_mp=1,
                                    **({"cluster": [cfg.cluster_size, 1, 1]}
                                       if const_expr(cfg.multicast) else {}))

    def _storage(self, sQ_l, sK_l, sV_l):
        """The shared-memory struct: cfg.barriers() in order, the TMEM address, the rings
        (each 1 KB aligned); its size is `cfg.smem_bytes()` (asserted at compile time)."""
        mem, align = cute.struct.MemRange, cute.struct.Align
        fields = {name: mem[cutlass.Int64, n] for name, (n, _) in self.cfg.barriers().items()}
        fields["tmem_addr"] = cutlass.Int32
        for name, lay in (("sQ", sQ_l), ("sK", sK_l), ("sV", sV_l)):
            fields[name] = align[mem[self.dtype, cute.cosize(lay.outer)], 1024]
        return cute.struct(type("Storage", (), {"__annotations__": fields}))

    # ------------------------------------------------------------------ the kernel
    @cute.kernel
    def kernel(self, qk: cute.TiledMma, pv: cute.TiledMma, tma_q: cute.CopyAtom,
               gQ: cute.Tensor, tma_k: cute.CopyAtom, gK: cute.Tensor, tma_v: cute.CopyAtom,
               gV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, seqlen_k: Int32,
               heads_kv: Int32, scale_log2: Float32, causal_offset: Int32,
               sQ_l: cute.ComposedLayout, sK_l: cute.ComposedLayout, sV_l: cute.ComposedLayout,
               tP_l: cute.ComposedLayout, Storage: cutlass.Constexpr):
        cfg = self.cfg
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        bidx, head, batch = cute.arch.block_idx()
        m_block = bidx // cfg.o_split
        o_part = bidx % cfg.o_split
        head_kv = head // (mO.shape[1] // heads_kv)
        seqlen_q = mO.shape[2]

        storage = cutlass.memory.SmemAllocator().allocate(Storage)
        bars = {name: getattr(storage, name).data_ptr() for name in cfg.barriers()}
        if warp == LOAD_WARP:
            for tma in (tma_q, tma_k, tma_v):
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

        sQ = storage.sQ.get_tensor(sQ_l.outer, swizzle=sQ_l.inner)
        sK = storage.sK.get_tensor(sK_l.outer, swizzle=sK_l.inner)
        sV = storage.sV.get_tensor(sV_l.outer, swizzle=sV_l.inner)

        # TMEM tensors (config.tmem_regions): S[2] (128 x tile_n fp32 each), O (128 x dv_cta),
        # P[i] (16-bit, the A of PV) over the second half of S[i]'s columns
        thr_qk, thr_pv = qk.get_slice(0), pv.get_slice(0)
        s_shape = thr_qk.partition_shape_C(self.qk_tiler[:2])
        tStS = cute.make_tensor(tmem + cfg.s_offset[0],
                                thr_qk.make_fragment_C(cute.append(s_shape, 2)).layout)
        o_shape = thr_pv.partition_shape_C(self.pv_tiler[:2])
        tOtO = cute.make_tensor(tmem + cfg.o_offset, thr_pv.make_fragment_C(o_shape).layout)
        p_ratio = Float32.width // self.dtype.width  # 16-bit P elements per TMEM column
        tOrP = thr_pv.make_fragment_A(cute.make_tensor(tmem, tP_l.outer))[None, None, None, 0]
        tOrP = cute.make_tensor(
            tOrP.iterator + cfg.p_offset[0] * p_ratio,
            cute.append(tOrP.layout, cute.make_layout(
                (2,), stride=((cfg.p_offset[1] - cfg.p_offset[0]) * p_ratio,))))

        n_max = n_block_max(m_block, seqlen_k, causal_offset, TILE_M, cfg.tile_n, cfg.causal)

        if warp == LOAD_WARP:
            self._load(tma_q, gQ, tma_k, gK, tma_v, gV, sQ, sK, sV, thr_qk, thr_pv, bars,
                       m_block, o_part, head, head_kv, batch, n_max)
        if warp == MMA_WARP:
            self._mma(qk, pv, sQ, sK, sV, tStS, tOtO, tOrP, bars, n_max)
        if warp < SOFTMAX_WARPS[1]:
            self._softmax(tStS, tOtO, thr_qk, mO, mLSE, bars, tidx, m_block, o_part, head,
                          batch, seqlen_q, seqlen_k, scale_log2, causal_offset, n_max)

        # every TMEM read done; with `multicast` also every peer's copies into and commits to
        # this CTA's shared memory (each peer consumed every stage before its epilogue)
        if const_expr(cfg.multicast):
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        if warp == MMA_WARP:
            cute.arch.dealloc_tmem(tmem, cfg.tmem_alloc_columns)

    # ------------------------------------------------------------------ load
    @cute.jit
    def _load(self, tma_q, gQ, tma_k, gK, tma_v, gV, sQ, sK, sV, thr_qk, thr_pv, bars,
              m_block, o_part, head, head_kv, batch, n_max):
        """QK[n]'s stages, then V[n+1]'s (the block the MMA thread runs PV on after QK[n]);
        each stage: wait for its release (the previous round's phase), expect its bytes,
        issue the TMA copies."""
        cfg = self.cfg
        one = cute.make_layout(1)
        gq = cute.local_tile(gQ[None, None, head, batch], cute.select(self.qk_tiler, [0, 2]),
                             (m_block, None))  # (128, 64, k chunks)
        gk = cute.local_tile(gK[None, None, head_kv, batch], cute.select(self.qk_tiler, [1, 2]),
                             (None, None))  # (128, 64, blocks, k chunks)
        gv = cute.local_tile(gV[None, None, head_kv, batch], cute.select(self.pv_tiler, [1, 2]),
                             (o_part, None))  # (dv_cta, 64, V stages of keys)
        tQs, tQg = cpasync.tma_partition(tma_q, 0, one, cute.group_modes(sQ, 0, 3),
                                         cute.group_modes(thr_qk.partition_A(gq), 0, 3))
        tKs, tKg = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sK, 0, 3),
                                         cute.group_modes(thr_qk.partition_B(gk), 0, 3))
        tVs, tVg = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sV, 0, 3),
                                         cute.group_modes(thr_pv.partition_B(gv), 0, 3))
        qk_bytes, v_bytes = cfg.qk_stage_bytes, cfg.v_stage_bytes
        everyone = cutlass.Int16((1 << cfg.cluster_size) - 1)  # `multicast`: the cluster
        qk_i = Int32(0)
        v_i = Int32(0)
        for i in cutlass.range(n_max + 1, unroll=1):
            if i < n_max:
                n = n_max - 1 - i
                for c in cutlass.range_constexpr(cfg.num_k_chunks):
                    s = qk_i % cfg.qk_stages
                    cute.arch.mbarrier_wait(bars["qk_empty"] + s,
                                            ((qk_i // cfg.qk_stages) & 1) ^ 1)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(bars["qk_full"] + s, qk_bytes)
                    if const_expr(cfg.multicast):
                        if o_part == c % cfg.o_split:  # this CTA owns chunk c
                            cute.copy(tma_q, tQg[None, c], tQs[None, s],
                                      tma_bar_ptr=bars["qk_full"] + s, mcast_mask=everyone)
                            cute.copy(tma_k, tKg[None, n, c], tKs[None, s],
                                      tma_bar_ptr=bars["qk_full"] + s, mcast_mask=everyone)
                    else:
                        cute.copy(tma_q, tQg[None, c], tQs[None, s],
                                  tma_bar_ptr=bars["qk_full"] + s)
                        cute.copy(tma_k, tKg[None, n, c], tKs[None, s],
                                  tma_bar_ptr=bars["qk_full"] + s)
                    qk_i += 1
            if i > 0:
                n = n_max - i  # the block of PV[i - 1]
                for j in cutlass.range_constexpr(cfg.v_blocks_per_tile):
                    s = v_i % cfg.v_stages
                    cute.arch.mbarrier_wait(bars["v_empty"] + s,
                                            ((v_i // cfg.v_stages) & 1) ^ 1)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(bars["v_full"] + s, v_bytes)
                    cute.copy(tma_v, tVg[None, n * cfg.v_blocks_per_tile + j], tVs[None, s],
                              tma_bar_ptr=bars["v_full"] + s)
                    v_i += 1

    # ------------------------------------------------------------------ MMA
    @cute.jit
    def _mma(self, qk, pv, sQ, sK, sV, tStS, tOtO, tOrP, bars, n_max):
        """QK[i] into S[i % 2] (s_full), then PV[i - 1] once P[i - 1] is in TMEM (o_done)."""
        cfg = self.cfg
        tSrQ, tSrK = qk.make_fragment_A(sQ), qk.make_fragment_B(sK)
        tOrV = pv.make_fragment_B(sV)
        k_blocks = cute.size(tSrQ, mode=[2])  # MMA instructions per ring stage (64 / 16)
        qk_i = Int32(0)
        v_i = Int32(0)
        for i in cutlass.range(n_max + 1, unroll=1):
            if i < n_max:
                acc = tStS[None, None, None, i % 2]
                for c in cutlass.range_constexpr(cfg.num_k_chunks):
                    s = qk_i % cfg.qk_stages
                    cute.arch.mbarrier_wait(bars["qk_full"] + s, (qk_i // cfg.qk_stages) & 1)
                    for kb in cutlass.range_constexpr(k_blocks):
                        qk.set(tcgen05.Field.ACCUMULATE, c > 0 or kb > 0)
                        cute.gemm(qk, acc, tSrQ[None, None, kb, s], tSrK[None, None, kb, s],
                                  acc)
                    with cute.arch.elect_one():  # (`multicast`: on every CTA's stage s)
                        tcgen05.commit(bars["qk_empty"] + s,
                                       (1 << cfg.cluster_size) - 1
                                       if const_expr(cfg.multicast) else None)
                    qk_i += 1
                with cute.arch.elect_one():
                    tcgen05.commit(bars["s_full"] + i % 2)
            if i > 0:
                b = i - 1
                cute.arch.mbarrier_wait(bars["p_full"] + b % 2, (b // 2) & 1)
                for j in cutlass.range_constexpr(cfg.v_blocks_per_tile):
                    s = v_i % cfg.v_stages
                    cute.arch.mbarrier_wait(bars["v_full"] + s, (v_i // cfg.v_stages) & 1)
                    for kb in cutlass.range_constexpr(k_blocks):
                        # the block's first MMA overwrites O on the first block
                        pv.set(tcgen05.Field.ACCUMULATE, b > 0 if j == 0 and kb == 0 else True)
                        cute.gemm(pv, tOtO, tOrP[None, None, j * k_blocks + kb, b % 2],
                                  tOrV[None, None, kb, s], tOtO)
                    with cute.arch.elect_one():
                        tcgen05.commit(bars["v_empty"] + s)
                    v_i += 1
                with cute.arch.elect_one():
                    tcgen05.commit(bars["o_done"])

    # ------------------------------------------------------------------ softmax, epilogue
    @cute.jit
    def _softmax(self, tStS, tOtO, thr_qk, mO, mLSE, bars, tidx, m_block, o_part, head, batch,
                 seqlen_q, seqlen_k, scale_log2, causal_offset, n_max):
        """Thread tidx = row m_block * 128 + tidx (TMEM lane tidx)."""
        cfg = self.cfg
        n = cfg.tile_n
        # S -> registers: 32 columns per tcgen05.ld, the row's 128 in 4
        s0 = tStS[(None, None), 0, 0, 0]  # (128, tile_n) of S[0]
        ld_s = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32),
            s0).get_slice(tidx)
        tScS = ld_s.partition_D(thr_qk.partition_C(cute.make_identity_tensor((TILE_M, n)))[
            (None, None), 0, 0])
        p_cols = n * self.dtype.width // 32  # P's TMEM columns
        p0 = cute.make_tensor(s0.iterator + (cfg.p_offset[0] - cfg.s_offset[0]),
                              cute.composition(s0.layout, cute.make_layout((TILE_M, p_cols))))
        st_p = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(16)), Float32),
            p0).get_slice(tidx)
        tPr_f32 = cute.make_rmem_tensor(
            st_p.partition_S(cute.make_identity_tensor((TILE_M, p_cols))).shape, Float32)
        s_stride = cfg.s_offset[1] - cfg.s_offset[0]

        row = m_block * TILE_M + tScS[0][0]  # this thread's TMEM lane
        m_run = -Float32.inf  # the running max of raw scores (the frame P is taken in)
        l_run = Float32(0.0)
        for i in cutlass.range(n_max, unroll=1):
            nb = n_max - 1 - i
            buf = i % 2
            cute.arch.mbarrier_wait(bars["s_full"] + buf, (i // 2) & 1)
            tSt = ld_s.partition_S(cute.make_tensor(s0.iterator + buf * s_stride, s0.layout))
            tSr = cute.make_rmem_tensor(tScS.shape, Float32)
            cute.copy(ld_s, tSt, tSr)
            cute.arch.fence_view_async_tmem_load()
            if block_needs_mask(m_block, nb, seqlen_k, causal_offset, TILE_M, n, cfg.causal):
                col_limit = seqlen_k - nb * n
                if const_expr(cfg.causal):
                    col_limit = cutlass.min(col_limit, row + causal_offset + 1 - nb * n)
                for e in cutlass.range_constexpr(cute.size(tSr)):
                    if tScS[e][1] >= col_limit:
                        tSr[e] = -Float32.inf
            blk_max = tSr[0]
            for e in cutlass.range_constexpr(1, cute.size(tSr)):
                blk_max = cute.arch.fmax(blk_max, tSr[e])
            m_new = cute.arch.fmax(m_run, blk_max)
            # move the frame only when the max grew by more than the threshold (or on the
            # first visible key): then O (and the row sum) are rescaled
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
                    cute.arch.mbarrier_wait(bars["o_done"], (i - 1) & 1)
                    self._scale_o(tOtO, tidx, factor)
            row_sum = Float32(0.0)
            tPr = cute.make_tensor(cute.recast_ptr(tPr_f32.iterator, dtype=self.dtype),
                                   tSr.layout)
            for e in cutlass.range_constexpr(cute.size(tSr)):
                p = cute.math.exp2(tSr[e] * scale_log2 - m_scaled, fastmath=True)
                row_sum += p
                tPr[e] = p.to(self.dtype)
            l_run = l_run * factor + row_sum
            tPt = st_p.partition_D(cute.make_tensor(p0.iterator + buf * s_stride, p0.layout))
            cute.copy(st_p, tPr_f32, tPt)
            cute.arch.fence_view_async_tmem_store()
            cute.arch.mbarrier_arrive(bars["p_full"] + buf)

        # epilogue: O / row_sum (0 for a row that saw no key), LSE (natural log, -inf there)
        inv = Float32(0.0)
        if l_run > Float32(0.0):
            inv = cute.arch.rcp_approx(l_run)
        if n_max > 0:
            cute.arch.mbarrier_wait(bars["o_done"], (n_max - 1) & 1)
        self._store_o(tOtO, mO, tidx, row, o_part, head, batch, seqlen_q, inv, n_max > 0)
        if o_part == 0 and row < seqlen_q:
            lse = -Float32.inf
            if l_run > Float32(0.0):
                lse = (m_run * scale_log2 + cute.math.log2(l_run, fastmath=True)) * (1.0 / LOG2_E)
            mLSE[batch, head, row] = lse

    @cute.jit
    def _o_chunks(self, tOtO, tidx):
        """(tcgen05.ld copy for this thread, O's TMEM as (thread's chunk, chunk index)) in
        EPI_COLS-column chunks."""
        acc = tOtO[(None, None), 0, 0]  # (128, dv_cta)
        chunks = cute.flat_divide(acc, (TILE_M, EPI_COLS))  # (128, 32, 1, dv_cta / 32)
        atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(EPI_COLS)),
                                   Float32)
        ld = tcgen05.make_tmem_copy(atom, chunks[None, None, 0, 0]).get_slice(tidx)
        st_atom = cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(EPI_COLS)), Float32)
        st = tcgen05.make_tmem_copy(st_atom, chunks[None, None, 0, 0]).get_slice(tidx)
        return ld, st, chunks

    @cute.jit
    def _scale_o(self, tOtO, tidx, factor):
        """O's row (this thread's lane) times factor, in TMEM."""
        ld, st, chunks = self._o_chunks(tOtO, tidx)
        for c in cutlass.range_constexpr(cute.size(chunks, mode=[3])):
            src = ld.partition_S(chunks[None, None, 0, c])
            reg = cute.make_rmem_tensor(ld.partition_D(chunks[None, None, 0, c]).shape, Float32)
            cute.copy(ld, src, reg)
            cute.arch.fence_view_async_tmem_load()
            reg.store(reg.load() * factor)
            cute.copy(st, reg, st.partition_D(chunks[None, None, 0, c]))
        cute.arch.fence_view_async_tmem_store()

    @cute.jit
    def _store_o(self, tOtO, mO, tidx, row, o_part, head, batch, seqlen_q, inv, any_key):
        """O's row times inv, in the output dtype, to global memory: 8 columns per 16-byte
        store, rows < Nq and columns < Dv only (zeros for a tile that saw no key)."""
        cfg = self.cfg
        ld, _, chunks = self._o_chunks(tOtO, tidx)
        col0 = o_part * cfg.dv_cta
        vec = 8
        gO = mO[batch, head, cutlass.min(row, seqlen_q - 1), None]  # stored for rows < Nq
        for c in cutlass.range_constexpr(cute.size(chunks, mode=[3])):
            reg = cute.make_rmem_tensor(ld.partition_D(chunks[None, None, 0, c]).shape, Float32)
            if any_key:
                cute.copy(ld, ld.partition_S(chunks[None, None, 0, c]), reg)
                cute.arch.fence_view_async_tmem_load()
            else:
                reg.fill(0.0)
            out = cute.make_rmem_tensor((EPI_COLS,), self.dtype)
            out.store((reg.load() * inv).to(self.dtype))
            for v8 in cutlass.range_constexpr(EPI_COLS // vec):
                col = col0 + c * EPI_COLS + v8 * vec
                if row < seqlen_q and col < cfg.dv:
                    dst = cute.local_tile(gO, (vec,), (col // vec,))
                    cute.autovec_copy(cute.local_tile(out, (vec,), (v8,)), dst)


__all__ = ["FFPAFwdSm100"]
