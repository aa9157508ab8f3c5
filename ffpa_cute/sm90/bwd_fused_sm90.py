"""The fused Hopper backward: dQ, dK and dV in one pass, five GEMM units for five counted.

Status: GPU-tested on the H200; its speed beside the atomic-free kernels, shape by shape, and
its phase trace are in docs/design.md section 4, "The fused backward". Planned only under
`Options(deterministic=False)` and only where it measured faster (fused_config.fused_pays), and canaried
before its first use there while its config's VERIFIED is False (selfcheck.py).
Constraints (`can_implement_fused`): D == Dv a multiple of 64 in (256, 576] for the pair (with
`scatter` D up to 1024 over `cluster_d` CTAs, below), bf16 / fp16; causal either alignment, a
sliding window's left edge (config `window`; not at D=576), GQA / MQA; no varlen.
D=576 (`wide`: 288 columns a CTA; GPU-tested and sanitizer-clean on an H100): dK_r
and dV_r (144 fp32 registers a thread each) issued as m64n96 WGMMAs, one Q and one dO stage
(two Q stages would need 245 KB), dQ by the dV warpgroup, setmaxnreg 120 / 192 / 192.
The atomic-free kernels in bwd_sm90.py execute 8 N^2 D units for the 5 a backward counts
(dQ: S, dP, dQ; dK: S^T, dP^T, dK; dV: S^T, dV), which caps them near 350 TFLOPS at D=512 even
at the forward's rate per unit. This kernel forms every product once per (key tile, query
block), as FlashAttention-3 does at head dim 256, by splitting D over a 2-CTA cluster:

    per CTA pair: one 64-key tile j of KV head h; CTA r owns columns [r D/2, (r+1) D/2)
    resident:     K_r, V_r   ([64 x D/2] each: the tile's keys, this CTA's columns)
    per block:    Q_r, dO_r  ([64 x D/2] of the block's 64 queries), LSE and Delta of them

    S^T_r  = K_r Q_r^T,  dP^T_r = V_r dO_r^T        partial products over this CTA's columns
    S^T    = S^T_0 + S^T_1,  dP^T = dP^T_0 + dP^T_1 each CTA sends its partials (fp32) to the
                                                   peer (st.async into its exchange buffer)
    P^T    = exp2(S^T scale log2(e) - LSE_i log2(e)) (the transposed mask first)
    dS^T   = P^T (dP^T - Delta_i) scale
    dV_r  += P^T dO_r,  dK_r += dS^T Q_r              in registers over every block
    dQ_r  += dS K_r                                   fp32, added into dq_acc by TMA

Both CTAs add the same two partials (fp32 addition commutes), so P^T and dS^T are the same bits
on both. Executed tensor work per pair and block: 2 x (S^T_r, dP^T_r, dV_r, dK_r, dQ_r) = 5
units of a full-D product. GQA / MQA: the pair walks the query blocks of all G query heads of
its KV head (heads outer, under causal only the blocks with a query that sees the tile's first
key, under a window's left edge up to the last query that sees its last key), so dK and dV
sum over the group in registers; dQ is a reduction either way, so its bits
depend on the order the reductions reach L2 (not deterministic: `deterministic=True` keeps the
atomic-free kernels).

Row units (`row_units`, causal head groups of 16+): under causal masking a KV head's tiles walk
query ranges of different lengths, so with many query heads per KV head the up-to-128
visits of one (query head, block) come far apart in time and each refetches Q, dO and dq_acc's
lines from DRAM (MQA 64:1 at D=512: 149 KB of DRAM per pair block, L2 hit rate 64%, against
12 KB and 97% for MHA; docs/design.md section 4). There a CTA pair takes one (query block row,
key tile) unit and walks the G query heads of that row, units ordered rows outer (the highest
row first) and tiles inner, so the pairs on the GPU at one time share a row: each unit adds its
dK / dV partial sums (over its G heads) into zeroed fp32 workspaces with
`red.global.add.v2.f32` (column pairs) from registers, which the host casts. Units above the
causal diagonal add nothing.

Warpgroups (384 threads; setmaxnreg per config, `reg_split`: 184 / 160 / 160 as below):
  WG0 "S"   loads K_r, V_r (once per tile) and the tile's first Q / dO stages; per block i,
            pipelined so that the exchange runs under tensor work (32 KB each way, ~2300-3500
            cycles at the DSMEM rate measured, as long as two or three of the block's five
            products):
              dP^T_r(i) (m64n64 SS WGMMA) with dQ(i-1)'s later chunks behind it; dP^T's
              partial sent; those chunks reduced; the peer's partials added (S^T's arrived
              earlier); the score step; P^T and dS^T to smem (stmatrix), published;
              S^T_r(i+1) with dQ(i)'s first chunk; S^T(i+1)'s partial sent; the chunk reduced.
            dQ_r is formed in column chunks (`dq_chunks`: m64n{w} SS WGMMA, A = dS read
            transposed from the dS^T tile, B = K_r read N-major) and reduced through smem
            (below);
  WG1 "dV"  dV_r += P^T dO_r (A = P^T from smem, B = the dO stage read N-major); refills the dO
            ring (it is the stage's last reader: the S warpgroup's dP^T_r is complete before
            P^T is published);
  WG2 "dK"  dK_r += dS^T Q_r; refills the Q ring the same way.

Who forms dQ is a config field (`dq_grads`; the S warpgroup, above, at 0). The S warpgroup's
chain is what every block waits for (the dV / dK warpgroups idle most of a block, per the
phase trace), so with `dq_grads` 1 the dV warpgroup, or with 2 the dV and dK warpgroups each
for a share of the columns, form dQ after their own product (`_grad_dq`): an atom of columns
at a time (m64n{atom} SS WGMMA, A = dS, B = K_r as above), staged and reduced as below, and
release P^T / dS^T once their last dQ WGMMA completed. The S warpgroup then runs S^T, dP^T,
the exchange and the score step only, and gives its registers to them.

Hand-overs (mbarriers): kv (K_r and V_r landed: two arrivals with their bytes), q[s] / do[s]
(TMA bytes), p_full (128 S-thread arrivals after a proxy fence: P^T and dS^T written), p_empty
(one arrival per dV / dK warp once its WGMMAs on them completed), x_full (the peer's 32 KB of
partials landed: st.async bytes, S^T's and dP^T's sent at different times, armed by our
thread 0 each block) and x_empty (the peer has
read what we sent: its thread 0 arrives on ours, cluster scope, after its S warpgroup's
barrier); sm90/fused_protocol.py models them. The exchange buffer is laid out by
fragment position: value v of S-thread t at [v // 4][t][v % 4] (16-byte stores), and the peer's
thread t holds the same (key, query) positions, so no index translation is needed.

The dQ reduction: each dQ chunk is staged in 32-column pieces through 8 KB fp32 smem buffers
(`dq_buffers`: two, or three / four with one barrier a piece; every thread of the forming
warpgroup writes its values, 8-byte stores with `dq_pairs`, a proxy fence, the warpgroup's
barrier) and added into dq_acc by one `cp.reduce.async.bulk.tensor` per piece, so
the forming warpgroup only writes smem and L2 adds asynchronously (`red.global` from registers
held the S warpgroup ~5100 cycles per block at D=512: L2's reduction rate). The S warpgroup's
chunk pieces alternate between the buffers, and a buffer is rewritten once its last bulk
group has read it; `dq_grads` 1: the dV warpgroup's pieces alternate likewise; 2: each
warpgroup has one buffer.

Shared memory at D=512: exchange 32 KB, K_r and V_r 64 KB, Q 2 x 32 KB, dO 1 x 32 KB, P^T and
dS^T 16 KB, dQ staging 16 KB: 230400 B (`BwdFusedConfigSm90.smem_bytes`); D <= 384 keeps two
dO stages.

D over C CTAs (`cluster_d` C = 2-4 with `scatter`; run on an H100, correct and sanitizer clean,
slower than the routed backward above 512, so not planned): the cluster's C CTAs each own D / C
columns, and the partials are summed by a reduce-scatter instead of every CTA receiving them
all. A thread's 8 16-byte groups of each partial are owned round robin (group q by CTA q % C,
the same positions in every CTA), so a CTA sends the C - 1 owners their groups (`_to_peer`:
st.async at `peer_address`, its slot in the owner's exchange buffer (sender - owner - 1) mod C),
adds the peers' slots into the groups it owns, runs the score step, and `_gather` sends its bf16
P^T / dS^T of those groups (4 + 4 values: 16 bytes) back into every peer's exchange buffer,
where its S^T partial lay, and takes theirs into its registers, so every CTA stores the whole
tiles with stmatrix as the pair does. x_full and x_empty then turn two phases per block (the
partials', the groups'); x_empty counts the C - 1 peers. sm90/fused_protocol.py models both
forms. Registers and the rest as at D / C = the pair's half (D=1024 over four CTAs is D=512's
per-CTA work)."""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline  # noqa: F401  (NamedBarrier)
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, warp, warpgroup

from ..common.mask import apply_mask_transposed, query_block_range, transposed_needs_mask
from ..common.softmax import mn_view
from ..common.tensors import (CUTLASS_DTYPES, LOG2_E, KernelEntry, aligned_bhnd, fake_args,
                              fake_tensor, vec4_ptx)
from .config import pv_atom_n
from .fused_config import FUSED_DQ_PIECE, FUSED_TILE, BwdFusedConfigSm90, can_implement_fused
from .bwd_sm90 import load_column_stat, stage_column_stat
from .skeleton_sm90 import WG_THREADS, row_major_layout, set_regs, thread_roles, tma_load

T = FUSED_TILE


_MAPA = "mapa.shared::cluster.u32 {$w0}, {$r0}, {$r1};"
_ST_ASYNC_V4 = vec4_ptx("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 "
                        "[{$r0}], {a, b, c, d}, [{$r5}];")


def peer_address(ptr, rank):
    """The shared::cluster address of our smem pointer `ptr` in cluster CTA `rank`'s smem."""
    return cute.arch.inline_ptx(_MAPA, write_only_types=[Int32],
                                read_only_args=[Int32(ptr.toint()), Int32(rank)])


def st_async_v4(addr, vals, bar_addr):
    """16 bytes into a peer's smem at shared::cluster address addr, counted on its mbarrier at
    bar_addr (both from `peer_address`): the address arithmetic stays ours, so a loop's
    stores to a few peers keep one base register per peer, not one mapped address each."""
    cute.arch.inline_ptx(_ST_ASYNC_V4, read_only_args=[addr, *vals, bar_addr])


def s_barrier():
    """The S warpgroup's own barrier (id 1, its 128 threads): the exchange buffer read, the
    block's statistics staged, a dQ piece staged."""
    return cutlass.pipeline.NamedBarrier(barrier_id=1, num_threads=WG_THREADS)


def grad_barrier(which: int):
    """The dV (which 0) or dK (which 1) warpgroup's own barrier (ids 2, 3), when it forms dQ
    (`dq_grads`): a dQ piece staged."""
    return cutlass.pipeline.NamedBarrier(barrier_id=2 + which, num_threads=WG_THREADS)


class FusedLayouts(NamedTuple):
    """Shared-memory layouts: K_r / V_r (T, half), the Q and dO rings (T, half, stages), the
    P^T and dS^T tiles (T keys, T queries), the dQ staging pieces (T, 32, dq_buffers) fp32."""

    kv: object
    q: object
    do: object
    p: object
    dq: object


class FusedMmas(NamedTuple):
    """S^T_r / dP^T_r (m64n64, both operands K-major), dV_r / dK_r (m64n{half}, B N-major),
    one per dQ_r chunk (m64n{width}, A and B N-major)."""

    s: cute.TiledMma
    acc: cute.TiledMma
    dq: tuple


class FusedOps(NamedTuple):
    """TMA atoms and their (N, D, H, B) coordinate views, then the tensors read or written
    directly: dq_acc (B, Hq, Nq, D) fp32, dK and dV (B, Hkv, Nkv, D), LSE and Delta."""

    tma_k: cute.CopyAtom
    g_k: cute.Tensor
    tma_v: cute.CopyAtom
    g_v: cute.Tensor
    tma_q: cute.CopyAtom
    g_q: cute.Tensor
    tma_do: cute.CopyAtom
    g_do: cute.Tensor
    tma_dq: cute.CopyAtom   # the staged dQ pieces added into dq_acc
    g_dq: cute.Tensor
    mdQ: cute.Tensor
    mdK: cute.Tensor
    mdV: cute.Tensor
    mLSE: cute.Tensor
    mDelta: cute.Tensor


class FusedBars(NamedTuple):
    kv: object
    q: object
    do: object
    p_full: object
    p_empty: object
    x_full: object
    x_empty: object


class FusedSmem(NamedTuple):
    k: cute.Tensor
    v: cute.Tensor
    q: cute.Tensor
    do: cute.Tensor
    pt: cute.Tensor
    dst: cute.Tensor
    stat: cute.Tensor   # (2 T,): the block's LSE (log2 units), then its Delta
    x: cute.Tensor      # (4, WG_THREADS, 2 groups, senders): the peers' partials by position
    dq: cute.Tensor     # (T, 32, dq_buffers) fp32: the dQ staging buffers
    bars: FusedBars


class FusedWork(NamedTuple):
    """The pair's key tile and its walk: block i is query head head_q0 + i // n_per, query
    block n_top - 1 - i % n_per."""

    m_block: Int32
    head: Int32           # of dK / dV (with `group_split`: of the workspace)
    kv_head: Int32        # of K / V
    batch: Int32
    rank: Int32
    head_q0: Int32
    n_top: Int32
    n_per: Int32
    n_count: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    causal_offset: Int32
    window_lo: object     # Int32 with `window`, else None (no code for it)
    scale_log2: Float32


class FFPABwdFusedSm90(KernelEntry):
    """dQ, dK and dV of one backward in one kernel (module docstring). Inputs as the other
    gradient kernels take them, plus dq_acc: a zeroed fp32 [B, Hq, Nq, D] the kernel adds
    scale * dS K into (the host casts it to dQ)."""

    OPERANDS = ("q", "k", "v", "do", "dq_acc", "dk", "dv", "lse", "delta")
    SCALARS = ("softmax_scale", "causal_offset", "window_lo")

    @staticmethod
    def fake_inputs(cfg):
        """q, k, v, do, dq_acc (fp32), dk, dv (fp32 workspaces with `group_split` or
        `row_units`), lse, delta."""
        q, k, v, do, lse = fake_args(cfg)
        dk, dv, _, _, delta = fake_args(cfg)
        if cfg.group_split or cfg.row_units:
            dk, dv = fake_tensor(Float32, 4, 4), fake_tensor(Float32, 4, 4)
        return q, k, v, do, fake_tensor(Float32, 4, 4), dk, dv, lse, delta

    def __init__(self, cfg: BwdFusedConfigSm90):
        self._refuse(can_implement_fused(cfg))
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        self.half = cfg.half
        self.dq_widths = cfg.dq_widths   # the dQ accumulators (`mmas.dq`, one per width)
        self.tile_bytes = T * cfg.half * cfg.elem_bytes
        # dK / dV as stored: partial sums in fp32 with `group_split` or `row_units`, else the
        # input dtype
        self.out_dtype = Float32 if cfg.group_split or cfg.row_units else self.dtype

    # ---------------------------------------------------------------- host side
    def _layouts(self) -> FusedLayouts:
        cfg, h = self.cfg, self.half
        return FusedLayouts(row_major_layout(T, h, self.dtype),
                            row_major_layout(T, h, self.dtype, cfg.q_stages),
                            row_major_layout(T, h, self.dtype, cfg.do_stages),
                            row_major_layout(T, T, self.dtype),
                            row_major_layout(T, FUSED_DQ_PIECE, Float32, cfg.dq_buffers))

    def _mma(self, a_major, b_major, n: int):
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, a_major, b_major,
                                                 Float32, (1, 1, 1), (T, n))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mdQ: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mLSE: cute.Tensor,
                 mDelta: cute.Tensor, softmax_scale: Float32, causal_offset: Int32,
                 window_lo: Int32, stream: cuda.CUstream):
        """q, do: (B, Hq, Nq, D); k, v, dk, dv: (B, Hkv, Nkv, D); dq_acc: (B, Hq, Nq, D) fp32,
        zeroed; lse, delta: (B, Hq, Nq) fp32; window_lo read with `window`. Grid = (2 * key
        tiles, Hkv, B), clusters of 2 along x."""
        self._launch(mQ, mK, mV, mdO, mdQ, mdK, mdV, mLSE, mDelta, softmax_scale,
                     causal_offset, window_lo, stream, None)

    @cute.jit
    def _launch(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                mdQ: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mLSE: cute.Tensor,
                mDelta: cute.Tensor, softmax_scale: Float32, causal_offset: Int32,
                window_lo: Int32, stream: cuda.CUstream, extra):
        """`__call__`'s launch; `extra` reaches every warpgroup's `_trace` hook (None: no
        code; perf/bwd_fused.py passes a clock64 trace tensor)."""
        cfg, d = self.cfg, self.cfg.head_dim
        layouts = self._layouts()
        mQ, mK, mV, mdO = [aligned_bhnd(t, d, self.dtype) for t in (mQ, mK, mV, mdO)]
        mdK, mdV = [aligned_bhnd(t, d, self.out_dtype) for t in (mdK, mdV)]
        mdQ = aligned_bhnd(mdQ, d, Float32)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        box = (T, self.half)
        # TMA coordinate tensors (N, D, H, B); boxes (T, half), offset to the CTA's columns
        tmas = [cpasync.make_tiled_tma_atom(
            g2s, cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0])),
            cute.select(lay, mode=[0, 1]), box)
            for t, lay in ((mK, layouts.kv), (mV, layouts.kv), (mQ, layouts.q),
                           (mdO, layouts.do))]
        # dq_acc (N, D, H, B): staged (T, 32) pieces are added into it
        tma_dq = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(),
            cute.make_tensor(mdQ.iterator, cute.select(mdQ.layout, mode=[2, 3, 1, 0])),
            cute.select(layouts.dq, mode=[0, 1]), (T, FUSED_DQ_PIECE))
        ops = FusedOps(*tmas[0], *tmas[1], *tmas[2], *tmas[3], *tma_dq, mdQ, mdK, mdV, mLSE,
                       mDelta)
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        mmas = FusedMmas(self._mma(K, K, T), self._mma(K, MN, pv_atom_n(self.half)),
                         tuple(self._mma(MN, MN, w) for w in self.dq_widths))
        SharedStorage = _shared_storage(cfg, self.dtype, layouts)
        assert SharedStorage.size_in_bytes() == cfg.smem_bytes(), (
            SharedStorage.size_in_bytes(), cfg.smem_bytes())
        self.kernel(ops, layouts, mmas, softmax_scale * LOG2_E, causal_offset,
                    window_lo if const_expr(cfg.window) else None,
                    SharedStorage, extra).launch(grid=self._grid(mQ, mK, mdK),
                                                 block=[3 * WG_THREADS, 1, 1],
                                          smem=SharedStorage.size_in_bytes(), stream=stream,
                                          min_blocks_per_mp=1,
                                          cluster=[cfg.cluster_d, 1, 1])

    def _grid(self, mQ: cute.Tensor, mK: cute.Tensor, mdK: cute.Tensor):
        """A CTA pair (a cluster along x) per key tile, by KV head (y; with `group_split` the
        workspace's heads: S parts per KV head) and batch (z); with `row_units` per (key tile,
        query block row (y), KV head + Hkv batch (z)), so that the units on the GPU at one
        time share a row (x runs fastest)."""
        tiles = cute.ceil_div(mK.shape[2], T) * self.cfg.cluster_d
        if const_expr(self.cfg.row_units):
            return (tiles, cute.ceil_div(mQ.shape[2], T), mK.shape[1] * mK.shape[0])
        heads = mdK.shape[1] if const_expr(self.cfg.group_split) else mK.shape[1]
        return (tiles, cute.size(heads), cute.size(mK.shape[0]))

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, ops: FusedOps, layouts: FusedLayouts, mmas: FusedMmas,
               scale_log2: Float32, causal_offset: Int32, window_lo,
               SharedStorage: cutlass.Constexpr, extra):
        cfg = self.cfg
        tidx, wg, warp_idx = thread_roles()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        bars = FusedBars(storage.bar_kv.data_ptr(), storage.bar_q.data_ptr(),
                         storage.bar_do.data_ptr(), storage.bar_p_full.data_ptr(),
                         storage.bar_p_empty.data_ptr(), storage.bar_x_full.data_ptr(),
                         storage.bar_x_empty.data_ptr())
        if warp_idx == 0:
            for tma in (ops.tma_k, ops.tma_v, ops.tma_q, ops.tma_do, ops.tma_dq):
                cpasync.prefetch_descriptor(tma)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(bars.kv, 2)             # K_r and V_r
                for s in cutlass.range_constexpr(cfg.q_stages):
                    cute.arch.mbarrier_init(bars.q + s, 1)
                for s in cutlass.range_constexpr(cfg.do_stages):
                    cute.arch.mbarrier_init(bars.do + s, 1)
                cute.arch.mbarrier_init(bars.p_full, WG_THREADS)   # every S thread
                cute.arch.mbarrier_init(bars.p_empty, 8)           # every dV and dK warp
                cute.arch.mbarrier_init(bars.x_full, 1)            # our thread 0 (+ bytes)
                # every peer's thread 0 (the pair: the peer's)
                cute.arch.mbarrier_init(bars.x_empty, cfg.cluster_d - 1)
                cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive()   # the peer's barriers exist before anything reaches them
        cute.arch.cluster_wait()

        smem = FusedSmem(
            storage.sK.get_tensor(layouts.kv.outer, swizzle=layouts.kv.inner),
            storage.sV.get_tensor(layouts.kv.outer, swizzle=layouts.kv.inner),
            storage.sQ.get_tensor(layouts.q.outer, swizzle=layouts.q.inner),
            storage.sdO.get_tensor(layouts.do.outer, swizzle=layouts.do.inner),
            storage.sPt.get_tensor(layouts.p.outer, swizzle=layouts.p.inner),
            storage.sdSt.get_tensor(layouts.p.outer, swizzle=layouts.p.inner),
            storage.stat.get_tensor(cute.make_layout(2 * T)),
            storage.xbuf.get_tensor(cute.make_layout(
                (4, WG_THREADS, 2 * cfg.x_slot_groups, cfg.x_floats // (8 * WG_THREADS
                                                                        * cfg.x_slot_groups)),
                stride=(1, 4, 4 * WG_THREADS, 8 * WG_THREADS * cfg.x_slot_groups))),
            storage.sdQ.get_tensor(layouts.dq.outer, swizzle=layouts.dq.inner),
            bars)

        # under causal the first key tiles see the most queries: first in the grid
        bidx, head, batch = cute.arch.block_idx()
        c = cfg.cluster_d
        m_block = bidx // c
        if const_expr(not cfg.causal):
            grid_x, _, _ = cute.arch.grid_dim()
            m_block = grid_x // c - 1 - bidx // c
        scalars = (causal_offset, window_lo, scale_log2)
        if const_expr(cfg.row_units):   # y: the row from the top, z: KV head + Hkv batch
            heads = ops.mdK.shape[1]
            work = self._row_unit(ops, head, m_block, batch % heads, batch // heads, bidx % c,
                                  scalars)
        else:
            work = self._work(ops, m_block, head, batch, bidx % c, scalars)
        # registers where the dQ accumulators are (`reg_split`)
        regs = cfg.reg_split
        if wg == 0:
            set_regs(regs[0])
            self._score_wg(mmas, ops, smem, work, tidx, extra)
        elif wg == 1:
            set_regs(regs[1])
            self._grad_wg(mmas, ops, smem, work, 0, tidx - WG_THREADS, extra)
        else:
            set_regs(regs[2])
            self._grad_wg(mmas, ops, smem, work, 1, tidx - 2 * WG_THREADS, extra)
        cute.arch.cluster_arrive()   # the peer may still write our smem until it is done
        cute.arch.cluster_wait()

    @cute.jit
    def _work(self, ops: FusedOps, m_block, head, batch, rank, scalars) -> FusedWork:
        """Key tile m_block of dK / dV head `head` (a KV head; with `group_split` head s of
        KV head h's S parts, h S + s, S = the workspace's heads / Hkv), batch `batch`, and
        its walk over the query blocks of the head's query heads: the G of its KV head, or
        with `group_split` the G / S of part s (h G + s G / S ..). scalars: (causal offset,
        window_lo, scale_log2)."""
        causal_offset, window_lo, scale_log2 = scalars
        seqlen_q = ops.mdQ.shape[2]
        group = ops.mdQ.shape[1] // ops.mdK.shape[1]   # G, or G / S
        kv_head = head
        if const_expr(self.cfg.group_split):
            kv_head = head // (ops.mdK.shape[1] // ops.g_k.shape[2])
        n_top, n_low = query_block_range(m_block, seqlen_q, causal_offset, window_lo, T, T,
                                         self.cfg.causal)
        n_per = cutlass.max(n_top - n_low, 0)
        return FusedWork(m_block, head, kv_head, batch, rank, head * group, n_top, n_per,
                         n_per * group, seqlen_q, ops.mdK.shape[2], causal_offset, window_lo,
                         scale_log2)

    @cute.jit
    def _row_unit(self, ops: FusedOps, y, m_block, head, batch, rank, scalars) -> FusedWork:
        """`row_units`' unit (query block row R - 1 - y of R, key tile m_block) of KV head
        `head`, walking the row's block in each of the head's G query heads (a walk of one
        block per head: n_per 1). A unit whose tile the row's queries do not see (causal, a
        window) walks nothing and adds nothing (n_count 0: `_grad_wg` passes no rows left)."""
        causal_offset, window_lo, scale_log2 = scalars
        seqlen_q = ops.mdQ.shape[2]
        row = (seqlen_q + T - 1) // T - 1 - y
        group = ops.mdQ.shape[1] // ops.mdK.shape[1]
        n_top, n_low = query_block_range(m_block, seqlen_q, causal_offset, window_lo, T, T,
                                         self.cfg.causal)
        # 1 where n_low <= row < n_top, else 0
        n_per = cutlass.max(cutlass.min(n_top, row + 1) - cutlass.max(n_low, row), 0)
        return FusedWork(m_block, head, head, batch, rank, head * group, row + 1, n_per,
                         n_per * group, seqlen_q, ops.mdK.shape[2], causal_offset, window_lo,
                         scale_log2)

    @cute.jit
    def _trace(self, extra, event: cutlass.Constexpr, i):
        """A phase boundary of block i (perf/bwd_fused.py's traced kernel stamps clock64
        here; no code otherwise)."""
        pass

    # ---------------------------------------------------------------- loads
    @cute.jit
    def _block(self, work: FusedWork, i):
        """(query head, query block) of block i: heads outer, blocks highest first (block 0
        of a tile without blocks: the first head's block n_top - 1, read and dropped)."""
        n_per = cutlass.max(work.n_per, 1)
        return work.head_q0 + i // n_per, work.n_top - 1 - i % n_per

    @cute.jit
    def _load(self, tma: cute.CopyAtom, g: cute.Tensor, s_ring: cute.Tensor, head, batch,
              row_block, col0, stage, bar, tidx):
        """Rows row_block * T .. + T, columns col0 .. col0 + half of (head, batch) of the TMA
        view g into stage `stage` of s_ring (or s_ring itself when stage is None), completing
        on bar; by warp 0 of the calling warpgroup."""
        rows = cute.local_tile(cute.domain_offset((0, col0), g[None, None, head, batch]),
                               (T, self.half), (None, 0))   # (T, half, row blocks)
        ts, tg = cpasync.tma_partition(tma, 0, cute.make_layout(1),
                                       cute.group_modes(s_ring, 0, 2),
                                       cute.group_modes(rows, 0, 2))
        dst = ts if const_expr(stage is None) else ts[None, stage]
        tma_load(tma, tg[None, row_block], dst, bar, self.tile_bytes, tidx)

    @cute.jit
    def _load_block(self, ops: FusedOps, smem: FusedSmem, work: FusedWork, i, pos,
                    which: cutlass.Constexpr, tidx):
        """Block i's Q (which 0) or dO (which 1) slice into the stage of ring position pos."""
        head_q, n_block = self._block(work, i)
        col0 = work.rank * self.half
        if const_expr(which == 0):
            s = pos % self.cfg.q_stages
            self._load(ops.tma_q, ops.g_q, smem.q, head_q, work.batch, n_block, col0, s,
                       smem.bars.q + s, tidx)
        else:
            s = pos % self.cfg.do_stages
            self._load(ops.tma_do, ops.g_do, smem.do, head_q, work.batch, n_block, col0, s,
                       smem.bars.do + s, tidx)

    # ---------------------------------------------------------------- S warpgroup
    @cute.jit
    def _score_wg(self, mmas: FusedMmas, ops: FusedOps, smem: FusedSmem, work: FusedWork,
                  tidx, extra):
        """WG0 on one tile, software-pipelined so that the exchange runs under tensor work.
        Block i: dP^T_r(i) with dQ(i-1)'s later chunks, dP^T's partial sent, those chunks
        reduced, the peer's partials added, the score step, P^T and dS^T published; then
        S^T_r(i+1) with dQ(i)'s first chunk, S^T's partial sent, that chunk reduced. (At block
        0 the later chunks of "block -1" read a stale dS^T tile and are dropped, as is the
        last block's S^T(i+1): no WGMMA is issued under a runtime condition.)"""
        cfg, bars = self.cfg, smem.bars
        qs, ds = cfg.q_stages, cfg.do_stages
        n_count, rank = work.n_count, work.rank
        chunks = self.dq_widths
        own_dq = cfg.dq_grads == 0   # dQ formed here (else by the dV / dK warpgroups)
        later = range(1, len(chunks)) if own_dq else range(0)
        mma_s = mmas.s
        thr = mma_s.get_slice(tidx)
        tSrK = mma_s.make_fragment_A(thr.partition_A(smem.k))      # (MMA, 1, half / 16)
        tSrV = mma_s.make_fragment_A(thr.partition_A(smem.v))
        tSrQ = mma_s.make_fragment_B(thr.partition_B(smem.q))      # (MMA, 1, half / 16, qs)
        tSrdO = mma_s.make_fragment_B(thr.partition_B(smem.do))    # (MMA, 1, half / 16, ds)
        acc_S = cute.make_rmem_tensor(thr.partition_shape_C((T, T)), Float32)
        acc_dP = cute.make_rmem_tensor(thr.partition_shape_C((T, T)), Float32)
        acc_S_mn, acc_dP_mn = mn_view(acc_S), mn_view(acc_dP)      # (2, T / 4): keys, queries
        tScS_mn = mn_view(thr.partition_C(cute.make_identity_tensor((T, T))))
        rP = cute.make_fragment_like(acc_S, self.dtype)
        rdS = cute.make_fragment_like(acc_S, self.dtype)
        st_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                      self.dtype)
        thr_st = cute.make_tiled_copy_C(st_atom, mma_s).get_slice(tidx)
        tPsP, tPsdS = thr_st.partition_D(smem.pt), thr_st.partition_D(smem.dst)
        tPrP, tPrdS = thr_st.retile(rP), thr_st.retile(rdS)
        # dQ_r = dS K_r: A = dS (queries, keys), the dS^T tile read transposed; B = K_r as
        # (columns, keys), read N-major, in chunks (`dq_chunks`)
        sdS = cute.composition(smem.dst, cute.make_ordered_layout((T, T), order=(1, 0)))
        sKt = cute.composition(smem.k, cute.make_ordered_layout((self.half, T), order=(1, 0)))
        col0 = rank * self.half
        x_sync = s_barrier()

        # ---- K_r, V_r, the first Q and dO stages
        for tma, g, dst in ((ops.tma_k, ops.g_k, smem.k), (ops.tma_v, ops.g_v, smem.v)):
            self._load(tma, g, dst, work.kv_head, work.batch, work.m_block, col0, None, bars.kv,
                       tidx)
        # Q of block 0 even when the tile has no block (its S^T_r is computed and dropped)
        for j in cutlass.range_constexpr(qs):
            if j < cutlass.max(n_count, 1):
                self._load_block(ops, smem, work, j, j, 0, tidx)
        for j in cutlass.range_constexpr(ds):
            if j < n_count:
                self._load_block(ops, smem, work, j, j, 1, tidx)
        cute.arch.mbarrier_wait(bars.kv, 0)
        self._scores(mma_s, acc_S, tSrK, tSrQ, bars.q, 0, qs)
        warpgroup.wait_group(0)   # none in flight into the loop
        if n_count > 0:
            self._send(acc_S, smem, 0, rank, tidx)
        for i in cutlass.range(n_count, unroll=1):
            head_q, n_block = self._block(work, i)
            self._trace(extra, 0, i)
            # this thread's LSE or Delta of the block, loaded before the block's WGMMAs
            pre = load_column_stat(T, n_block, work.seqlen_q, ops.mLSE, ops.mDelta,
                                   work.batch, head_q, tidx, 0)
            # ---- dP^T_r(i), and under it dQ(i-1)'s later chunks (stale at i == 0: dropped)
            self._scores(mma_s, acc_dP, tSrV, tSrdO, bars.do, i, ds)
            accs = [self._dq_issue(mmas.dq[j], sdS, sKt, sum(chunks[:j]), chunks[j], tidx)
                    for j in later]
            warpgroup.wait_group(len(accs))
            self._trace(extra, 1, i)
            self._send(acc_dP, smem, 1, rank, tidx)
            self._arm_exchange(smem, rank, tidx)
            warpgroup.wait_group(0)
            if const_expr(own_dq):
                if i > 0:
                    self._dq_reduce_rest(mmas, accs, ops, smem, work, i - 1, col0, tidx)
            self._trace(extra, 2, i)
            # ---- the peer's partials added to ours
            self._stage_stat(smem.stat, pre, tidx)
            # (`scatter`: two phases per block, the partials' then the gathered values')
            cute.arch.mbarrier_wait(bars.x_full, 0 if const_expr(cfg.scatter) else i & 1)
            self._trace(extra, 3, i)
            self._receive(acc_S, acc_dP, smem, rank, tidx)
            x_sync.arrive_and_wait()
            if tidx == 0:   # every S thread has read the buffer: the peer may send again
                if const_expr(cfg.cluster_d == 2):
                    cute.arch.mbarrier_arrive(bars.x_empty, 1 - rank,
                                              scope=nvvm.MemScopeKind.CLUSTER)
                else:
                    for k in cutlass.range_constexpr(1, cfg.cluster_d):   # each peer
                        cute.arch.mbarrier_arrive(bars.x_empty, (rank + k) % cfg.cluster_d,
                                                  scope=nvvm.MemScopeKind.CLUSTER)
            # ---- P^T and dS^T * scale
            if transposed_needs_mask(work.m_block, n_block, work.seqlen_q, work.causal_offset,
                                     T, T, cfg.causal, work.window_lo):
                apply_mask_transposed(acc_S_mn, tScS_mn, work.m_block, n_block, work.seqlen_q,
                                      work.causal_offset, T, T, cfg.causal, work.window_lo)
            scale = work.scale_log2 * (1.0 / LOG2_E)
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                col = tScS_mn[0, c][1]
                lse2, delta = smem.stat[col], smem.stat[T + col]
                for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                    p = cute.math.exp2(acc_S_mn[r, c] * work.scale_log2 - lse2, fastmath=True)
                    acc_S_mn[r, c] = p
                    acc_dP_mn[r, c] = p * (acc_dP_mn[r, c] - delta) * scale
            rP.store(acc_S.load().to(self.dtype))
            rdS.store(acc_dP.load().to(self.dtype))
            if const_expr(cfg.scatter):   # the peers' groups of P^T / dS^T into ours
                self._gather(rP, rdS, smem, rank, tidx)
            cute.arch.mbarrier_wait(bars.p_empty, (i & 1) ^ 1)   # dV / dK done with the last
            cute.copy(thr_st, tPrP, tPsP)
            cute.copy(thr_st, tPrdS, tPsdS)
            cute.arch.fence_proxy("async.shared", space="cta")   # read by WGMMA
            # ---- P^T / dS^T published; then S^T_r(i+1) (after the last block its own stage
            #      again: dropped) and dQ(i)'s first chunk; S^T's partial sent, the chunk
            #      reduced
            nxt = cutlass.min(i + 1, n_count - 1)
            cute.arch.mbarrier_arrive(bars.p_full)
            self._trace(extra, 4, i)
            self._scores(mma_s, acc_S, tSrK, tSrQ, bars.q, nxt, qs)
            acc0 = None
            if const_expr(own_dq):
                acc0 = self._dq_issue(mmas.dq[0], sdS, sKt, 0, chunks[0], tidx)
            warpgroup.wait_group(0)
            self._trace(extra, 5, i)
            if i + 1 < n_count:
                cute.arch.mbarrier_wait(bars.x_empty,
                                        1 if const_expr(cfg.scatter) else ((i + 1) & 1) ^ 1)
                self._send(acc_S, smem, 0, rank, tidx)
            if const_expr(own_dq):
                self._dq_reduce(mmas.dq[0], acc0, ops, smem, work, head_q, n_block, col0,
                                chunks[0], tidx)
            self._trace(extra, 6, i)
        if const_expr(own_dq):
            # ---- the last block's later dQ chunks
            tail = [self._dq_issue(mmas.dq[j], sdS, sKt, sum(chunks[:j]), chunks[j], tidx)
                    for j in later]
            warpgroup.wait_group(0)
            if n_count > 0:
                self._dq_reduce_rest(mmas, tail, ops, smem, work, n_count - 1, col0, tidx)
            if tidx // 32 == 0:   # every staged piece read before the CTA's smem goes
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _scores(self, mma_s: cute.TiledMma, acc, tA, tB, bar, pos, stages: cutlass.Constexpr):
        """acc = A B^T over this CTA's columns (S^T_r or dP^T_r) with B the block at ring
        position pos, once its stage has landed; issued and committed, not waited."""
        s = pos % stages
        cute.arch.mbarrier_wait(bar + s, (pos // stages) & 1)
        atom = cute.make_mma_atom(mma_s.op)
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.half // 16):
            atom.set(warpgroup.Field.ACCUMULATE, k > 0)
            cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k, s], acc)
        warpgroup.commit_group()

    @cute.jit
    def _stage_stat(self, sStat: cute.Tensor, pre, tidx):
        """The block's LSE (log2 units) and Delta (`stage_column_stat`, as the dK kernel stages
        them) between two barriers: every S thread is done with the last block's before."""
        sync = s_barrier()
        sync.arrive_and_wait()
        stage_column_stat(sStat, T, tidx, pre, True)
        sync.arrive_and_wait()

    @cute.jit
    def _send(self, acc, smem: FusedSmem, part: cutlass.Constexpr, rank, tidx):
        """Our partial (part 0: S^T, 1: dP^T) into the peers' exchange buffers, 16 bytes per
        st.async, each counted on the receiver's x_full. Pair: all of it to the peer (value v
        of part p at [v % 4, tidx, p n / 4 + v // 4, 0], n the values per thread); `scatter`:
        group q (values 4q .. 4q + 3) to its owner o = q % C only, into the owner's slot of
        this sender ((rank - o - 1) mod C) at [.., tidx, p g + q // C, slot], g the slot's
        groups per part."""
        c, n4 = self.cfg.cluster_d, cute.size(acc) // 4
        per = self.cfg.x_slot_groups
        for q in cutlass.range_constexpr(n4):
            vals = tuple(Float32(acc[4 * q + e]).bitcast(Int32) for e in range(4))
            if const_expr(not self.cfg.scatter):
                dst = smem.x[None, tidx, part * n4 + q, 0].iterator
                cute.arch.store_async_dsmem(dst, vals, smem.bars.x_full, 1 - rank)
            else:
                owner = q % c
                if owner != rank:
                    slot = (rank - owner - 1 + c) % c
                    self._to_peer(smem, owner, slot, part * per + q // c, vals, tidx)

    @cute.jit
    def _to_peer(self, smem: FusedSmem, peer, slot, idx, vals, tidx):
        """`scatter`: 16 bytes into cluster CTA `peer`'s exchange buffer at [.., tidx, idx,
        slot], counted on its x_full (`st_async_v4`: the mapped base plus our offset)."""
        off = (((slot * 2 * self.cfg.x_slot_groups + idx) * WG_THREADS + tidx) * 16)
        st_async_v4(peer_address(smem.x.iterator, peer) + off, vals,
                    peer_address(smem.bars.x_full, peer))

    @cute.jit
    def _arm_exchange(self, smem: FusedSmem, rank, tidx):
        """Thread 0 arms this block's x_full: one arrival and the bytes the peers send us (the
        peer's whole partials; `scatter`: each peer's values of the groups we own)."""
        if tidx == 0:
            if const_expr(not self.cfg.scatter):
                cute.arch.mbarrier_arrive_and_expect_tx(smem.bars.x_full,
                                                        self.cfg.x_floats * 4)
            else:
                cute.arch.mbarrier_arrive_and_expect_tx(
                    smem.bars.x_full,
                    (self.cfg.cluster_d - 1) * self.cfg.owned_groups(rank) * 2 * 16 * WG_THREADS)

    @cute.jit
    def _receive(self, acc_S, acc_dP, smem: FusedSmem, rank, tidx):
        """acc += the peers' partials (same positions): S^T_0 + S^T_1 on both CTAs of a pair;
        `scatter`: only the groups this CTA owns, summed over every peer's slot (the others
        keep our partial alone and are not used)."""
        c, n4 = self.cfg.cluster_d, cute.size(acc_S) // 4
        per = self.cfg.x_slot_groups
        for acc, part in ((acc_S, 0), (acc_dP, 1)):
            for q in cutlass.range_constexpr(n4):
                if const_expr(not self.cfg.scatter):
                    for e in cutlass.range_constexpr(4):
                        acc[4 * q + e] = acc[4 * q + e] + smem.x[e, tidx, part * n4 + q, 0]
                elif q % c == rank:
                    for slot in cutlass.range_constexpr(c - 1):
                        for e in cutlass.range_constexpr(4):
                            acc[4 * q + e] = (acc[4 * q + e]
                                              + smem.x[e, tidx, part * per + q // c, slot])

    @cute.jit
    def _gather(self, rP, rdS, smem: FusedSmem, rank, tidx):
        """`scatter`: our bf16 P^T / dS^T values of the fragment groups we own (4 of each: 16
        bytes per group) sent into every peer's exchange buffer, and theirs received into the
        groups we do not own, so that every CTA stores the whole tiles. Per block the
        exchange buffer then takes a second phase: our thread 0 arms x_full for the peers'
        groups; we wait until every peer has read our partials (x_empty, its first phase of
        the block), send ours to group q's slot at [.., tidx, q // C, slot]; wait for theirs
        (x_full's second phase), read them, the S warpgroup's barrier, and thread 0 tells
        each peer it may send again (their x_empty's second phase)."""
        c, n4 = self.cfg.cluster_d, cute.size(rP) // 4
        bars = smem.bars
        if tidx == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(
                bars.x_full, (self.cfg.x_groups - self.cfg.owned_groups(rank)) * 16 * WG_THREADS)
        cute.arch.mbarrier_wait(bars.x_empty, 0)   # every peer read our partials
        wP, wdS = cute.recast_tensor(rP, Int32), cute.recast_tensor(rdS, Int32)
        for q in cutlass.range_constexpr(n4):
            if q % c == rank:
                vals = (wP[2 * q], wP[2 * q + 1], wdS[2 * q], wdS[2 * q + 1])
                for k in cutlass.range_constexpr(1, c):
                    # peer rank + k: our slot there is c - 1 - k
                    self._to_peer(smem, (rank + k) % c, c - 1 - k, q // c, vals, tidx)
        cute.arch.mbarrier_wait(bars.x_full, 1)
        for q in cutlass.range_constexpr(n4):
            owner = q % c
            if owner != rank:
                slot = (owner - rank - 1 + c) % c
                src = cute.recast_tensor(smem.x[None, tidx, q // c, slot], Int32)
                wP[2 * q], wP[2 * q + 1] = src[0], src[1]
                wdS[2 * q], wdS[2 * q + 1] = src[2], src[3]
        s_barrier().arrive_and_wait()
        if tidx == 0:
            for k in cutlass.range_constexpr(1, c):
                cute.arch.mbarrier_arrive(bars.x_empty, (rank + k) % c,
                                          scope=nvvm.MemScopeKind.CLUSTER)

    @cute.jit
    def _dq_issue(self, mma: cute.TiledMma, sdS: cute.Tensor, sKt: cute.Tensor,
                  c0: cutlass.Constexpr, width: cutlass.Constexpr, tidx):
        """Columns c0 .. c0 + width of this CTA's dQ share of the block whose dS^T is in smem:
        dS K_r[:, c0 ..], issued and committed (the accumulator returned, not waited)."""
        thr = mma.get_slice(tidx)
        tQrdS = mma.make_fragment_A(thr.partition_A(sdS))   # (MMA, 1, T / 16)
        # (MMA, 1, T / 16): K_r's columns c0 .. c0 + width as (columns, keys)
        tQrK = mma.make_fragment_B(thr.partition_B(
            cute.local_tile(cute.domain_offset((c0, 0), sKt), (width, T), (0, 0))))
        acc = cute.make_rmem_tensor(thr.partition_shape_C((T, width)), Float32)
        atom = cute.make_mma_atom(mma.op)
        warpgroup.fence()
        for k in cutlass.range_constexpr(T // 16):
            atom.set(warpgroup.Field.ACCUMULATE, k > 0)
            cute.gemm(atom, acc, tQrdS[None, None, k], tQrK[None, None, k], acc)
        warpgroup.commit_group()
        return acc

    @cute.jit
    def _dq_reduce_rest(self, mmas: FusedMmas, accs, ops: FusedOps, smem: FusedSmem,
                        work: FusedWork, i, col0, tidx):
        """Block i's completed dQ chunks after the first (`accs`) added into dq_acc."""
        chunks = self.dq_widths
        head_q, n_block = self._block(work, i)
        for j in cutlass.range_constexpr(1, len(chunks)):
            self._dq_reduce(mmas.dq[j], accs[j - 1], ops, smem, work, head_q, n_block,
                            col0 + sum(chunks[:j]), chunks[j], tidx)

    @cute.jit
    def _dq_reduce(self, mma: cute.TiledMma, acc, ops: FusedOps, smem: FusedSmem,
                   work: FusedWork, head_q, n_block, col, width: cutlass.Constexpr, tidx):
        """A completed `_dq_issue` accumulator (queries of block n_block of head head_q,
        columns col .. col + width of dq_acc) added into dq_acc in 32-column pieces, piece p
        through staging buffer p % 2: warp 0 waits until the buffer's last bulk group has been
        read (a chunk's first piece: every earlier group, the others: all but the last), the
        warpgroup's barrier, every S thread writes its values of the piece, a proxy fence and
        the barrier, then one elected thread of warp 0 adds the (T, 32) piece into dq_acc with
        one `cp.reduce.async.bulk.tensor` (rows past Nq are clipped by TMA). The copy is issued
        by the whole warp: the TMA atom's `cute.copy` elects its thread with `elect.sync` over
        the full warp, which a single thread must not reach alone."""
        thr = mma.get_slice(tidx)
        tQcQ_mn = mn_view(thr.partition_C(cute.make_identity_tensor((T, width))))
        sync = s_barrier()
        acc_mn = mn_view(acc)   # (2, width / 4): queries, columns
        ts, tg = self._dq_pieces(ops, smem, work, head_q)
        for p in cutlass.range_constexpr(width // FUSED_DQ_PIECE):
            buf, unread = self._piece_buffer(work, head_q, n_block, col, p)
            if tidx // 32 == 0:
                cute.arch.cp_async_bulk_wait_group(unread, read=True)
            self._put_piece(ops, smem, sync, acc_mn, tQcQ_mn, ts, tg, buf, p, n_block,
                            col // FUSED_DQ_PIECE + p, tidx)

    @cute.jit
    def _dq_pieces(self, ops: FusedOps, smem: FusedSmem, work: FusedWork, head_q):
        """TMA's views of the dQ staging buffers (.., buffer) and of query head head_q's
        dq_acc in (T, 32) pieces (.., query block, 32-column block)."""
        g = cute.local_tile(ops.g_dq[None, None, head_q, work.batch], (T, FUSED_DQ_PIECE),
                            (None, None))
        return cpasync.tma_partition(ops.tma_dq, 0, cute.make_layout(1),
                                     cute.group_modes(smem.dq, 0, 2), cute.group_modes(g, 0, 2))

    @cute.jit
    def _put_piece(self, ops: FusedOps, smem: FusedSmem, sync, acc_mn, tQcQ_mn, ts, tg, buf,
                   p: cutlass.Constexpr, n_block, piece, tidx, unread: cutlass.Constexpr = -1):
        """Piece p of a completed dQ accumulator into dq_acc's piece (n_block, piece) through
        staging buffer buf (`_dq_pieces`' views ts, tg; the caller's warp 0 has waited until
        the buffer may be rewritten): the forming warpgroup's barrier `sync`, its values
        staged, a proxy fence, the barrier, then one TMA reduction by warp 0. With `unread`
        >= 0 (a warpgroup's buffers taken in turn, `dq_buffers` above 2) the first barrier
        goes: warp 0 waits until at most `unread` of its bulk groups are unread before the
        barrier after the stores, so past it the buffer the next piece takes is free (the one
        this piece takes was freed so by the piece before)."""
        if const_expr(unread < 0):
            sync.arrive_and_wait()
        self._stage_piece(acc_mn, tQcQ_mn, smem.dq, buf, p)
        cute.arch.fence_proxy("async.shared", space="cta")   # read by TMA
        if const_expr(unread >= 0):
            if tidx // 32 == 0:
                cute.arch.cp_async_bulk_wait_group(unread, read=True)
        sync.arrive_and_wait()
        if tidx // 32 == 0:
            self._add_piece(ops.tma_dq, ts[None, buf], tg[None, n_block, piece])

    @cute.jit
    def _stage_piece(self, acc_mn, tQcQ_mn, sdq: cute.Tensor, buf, p: cutlass.Constexpr):
        """This thread's values of piece p (columns 32 p .. 32 p + 31 of the chunk; acc_mn
        holds 8-column groups of 2 adjacent columns) into staging buffer buf of sdq (T, 32,
        dq_buffers): one st.shared each, or with `dq_pairs` a column pair per 8-byte st.shared
        (the 128-byte swizzle moves 16-byte spans, so an even column's pair stays
        contiguous)."""
        per = FUSED_DQ_PIECE // 4   # a piece's columns of acc_mn (8-column groups x 2)
        if const_expr(not self.cfg.dq_pairs):
            for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
                for c in cutlass.range_constexpr(p * per, (p + 1) * per):
                    row, cc = tQcQ_mn[r, c]
                    sdq[row, cc - p * FUSED_DQ_PIECE, buf] = acc_mn[r, c]
        else:
            dst = sdq[None, None, buf]
            for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
                for c2 in cutlass.range_constexpr(p * per // 2, (p + 1) * per // 2):
                    row, cc = tQcQ_mn[r, 2 * c2]
                    pair = cute.make_rmem_tensor(cute.make_layout(2), Float32)
                    pair[0] = acc_mn[r, 2 * c2]
                    pair[1] = acc_mn[r, 2 * c2 + 1]
                    cute.autovec_copy(pair, cute.flatten(cute.local_tile(
                        dst, (1, 2), (row, (cc - p * FUSED_DQ_PIECE) // 2))))

    def _piece_buffer(self, work: FusedWork, head_q, n_block, col, p: int):
        """(staging buffer, bulk groups that may stay unread before it is rewritten) of piece
        p of the dQ chunk at columns col of block (head_q, n_block): a chunk's pieces
        alternate between the two buffers from buffer 0, so its first piece waits for every
        earlier group and the others for all but the last."""
        return p % 2, (0 if p == 0 else 1)

    @cute.jit
    def _add_piece(self, tma: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor):
        """One staged piece added into dq_acc by the calling warp (the copy elects its
        thread) and its bulk group committed."""
        cute.copy(tma, src, dst)
        cute.arch.cp_async_bulk_commit_group()

    # ---------------------------------------------------------------- dV / dK warpgroups
    @cute.jit
    def _grad_wg(self, mmas: FusedMmas, ops: FusedOps, smem: FusedSmem, work: FusedWork,
                 which: cutlass.Constexpr, tidx, extra):
        """WG1 (which 0): dV_r += P^T dO_r, refilling the dO ring; WG2 (which 1): dK_r +=
        dS^T Q_r, refilling the Q ring; over one tile's blocks. With `dq_grads` it then forms
        its share of the block's dQ columns, if any (`_grad_dq`), before it releases P^T /
        dS^T. Then the rows < Nkv of this CTA's columns stored."""
        cfg, bars, h = self.cfg, smem.bars, self.half
        mma = mmas.acc
        forms_dq = cfg.dq_grads > 0 and cfg.dq_shares[which][1] > 0
        stages = cfg.do_stages if const_expr(which == 0) else cfg.q_stages
        ring = smem.do if const_expr(which == 0) else smem.q
        ring_bar = bars.do if const_expr(which == 0) else bars.q
        sA = smem.pt if const_expr(which == 0) else smem.dst
        thr = mma.get_slice(tidx)
        tArA = mma.make_fragment_A(thr.partition_A(sA))   # (MMA, 1, T / 16)
        # the ring's (T, half) stages read as (half, T): the N-major B
        ring_t = cute.composition(ring, cute.make_ordered_layout((h, T, stages),
                                                                 order=(1, 0, 2)))
        tArB = mma.make_fragment_B(thr.partition_B(ring_t))   # (MMA, 1, T / 16, stages)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((T, h)), Float32)
        acc.fill(0.0)
        lane = cute.arch.lane_idx()
        for i in cutlass.range(work.n_count, unroll=1):
            s = i % stages
            self._trace(extra, 0, i)
            cute.arch.mbarrier_wait(bars.p_full, i & 1)
            self._trace(extra, 1, i)
            cute.arch.mbarrier_wait(ring_bar + s, (i // stages) & 1)
            self._trace(extra, 2, i)
            atom = cute.make_mma_atom(mma.op)
            atom.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.fence()
            for k in cutlass.range_constexpr(T // 16):
                cute.gemm(atom, acc, tArA[None, None, k], tArB[None, None, k, s], acc)
            warpgroup.commit_group()
            if const_expr(forms_dq):
                self._grad_dq(mmas.dq[0], ops, smem, work, i, which, tidx, extra)
            else:
                warpgroup.wait_group(0)
                self._trace(extra, 3, i)
                if lane == 0:
                    cute.arch.mbarrier_arrive(bars.p_empty)
                self._refill(ops, smem, work, i, which, tidx)
        if const_expr(forms_dq):
            if tidx // 32 == 0:   # every staged piece read before the CTA's smem goes
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # ---- rows < Nkv of this CTA's columns
        out = ops.mdV if const_expr(which == 0) else ops.mdK
        gO = cute.local_tile(
            cute.domain_offset((0, work.rank * h), out[work.batch, work.head, None, None]),
            (T, h), (work.m_block, 0))
        tOgO_mn = mn_view(thr.partition_C(gO))
        tOcO_mn = mn_view(thr.partition_C(cute.make_identity_tensor((T, h))))
        acc_mn = mn_view(acc)
        rows_left = work.seqlen_k - work.m_block * T
        if const_expr(self.cfg.row_units):   # a unit that walked nothing adds nothing
            if work.n_count == 0:
                rows_left = Int32(0)
        self._store_grad(acc_mn, tOgO_mn, tOcO_mn, rows_left)

    @cute.jit
    def _store_grad(self, acc_mn, tOgO_mn, tOcO_mn, rows_left):
        """A gradient warpgroup's dK or dV accumulators (rows, columns view) into its rows <
        rows_left of gmem, converted to the stored dtype, or with `row_units` added into the
        fp32 workspace (`red.global.add.v2.f32` per column pair: other units add to the same
        rows)."""
        ncols = cute.size(acc_mn, mode=[1])
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            if tOcO_mn[r, 0][0] < rows_left:
                if const_expr(self.cfg.row_units):
                    for c in cutlass.range_constexpr(0, ncols, 2):   # adjacent column pairs
                        pair = cute.make_rmem_tensor(2, Float32)
                        pair[0] = acc_mn[r, c]
                        pair[1] = acc_mn[r, c + 1]
                        cute.arch.red(tOgO_mn.iterator + cute.crd2idx((r, c), tOgO_mn.layout),
                                      pair.load(), op="add", dtype="f32", sem="relaxed",
                                      scope="gpu")
                else:
                    rO = cute.make_rmem_tensor(ncols, self.out_dtype)
                    rO.store(acc_mn[r, None].load().to(self.out_dtype))
                    for c in cutlass.range_constexpr(ncols):
                        tOgO_mn[r, c] = rO[c]

    @cute.jit
    def _refill(self, ops: FusedOps, smem: FusedSmem, work: FusedWork, i, which: cutlass.Constexpr,
                tidx):
        """This warpgroup read block i's ring stage last (the S warpgroup's product on it
        completed before P^T / dS^T were published): refill it with block i + stages."""
        stages = self.cfg.do_stages if const_expr(which == 0) else self.cfg.q_stages
        if i + stages < work.n_count:
            self._load_block(ops, smem, work, i + stages, i + stages, which ^ 1, tidx)

    @cute.jit
    def _grad_dq(self, mma: cute.TiledMma, ops: FusedOps, smem: FusedSmem, work: FusedWork, i,
                 which: cutlass.Constexpr, tidx, extra):
        """With `dq_grads`, after this warpgroup's product of block i was issued: its share of
        dQ_r (`dq_shares`) formed a swizzle atom at a time (dS K_r, as `_dq_issue`) and added
        into dq_acc 32 columns a piece. Per atom: its WGMMA issued and completed (the first
        time: the product too, so the ring stage is refilled; the last time: every read of
        P^T / dS^T done, so they are released: neither waits behind a staging buffer), then
        per piece warp 0 waits until the piece's staging buffer may be rewritten, the
        warpgroup's barrier, its values staged, a proxy fence, the barrier, and one TMA
        reduction issued by warp 0 (`_add_piece`). With `dq_grads` 1 the pieces take the
        `dq_buffers` buffers in turn (block i's piece k: buffer (i * pieces + k) % dq_buffers):
        two, each rewritten once the group before the newest has read it; three, one barrier a
        piece (`_put_piece`'s `unread`: every group but the newest read before the barrier
        after the stores). With 2 each warpgroup has half the buffers: one (buffer `which`,
        rewritten once its last group has read it), or two in turn (buffers 2 which and 2
        which + 1) with one barrier a piece, every group read before the barrier after the
        stores. Where the config's `dq_ahead`, atom a + 1 is issued before
        atom a's pieces are staged (the wait then leaves that newest group in flight)."""
        c0, width = self.cfg.dq_shares[which]
        atom_w = self.dq_widths[0]
        per_atom = atom_w // FUSED_DQ_PIECE
        pieces = width // FUSED_DQ_PIECE
        both = self.cfg.dq_grads == 1
        nbuf = self.cfg.dq_buffers
        own = nbuf // 2 if self.cfg.dq_grads == 2 else nbuf   # this warpgroup's buffers
        single = nbuf > 2   # one barrier per piece (`_put_piece`'s `unread`)
        head_q, n_block = self._block(work, i)
        sdS = cute.composition(smem.dst, cute.make_ordered_layout((T, T), order=(1, 0)))
        sKt = cute.composition(smem.k, cute.make_ordered_layout((self.half, T), order=(1, 0)))
        thr = mma.get_slice(tidx)
        tQcQ_mn = mn_view(thr.partition_C(cute.make_identity_tensor((T, atom_w))))
        sync = grad_barrier(which)
        ts, tg = self._dq_pieces(ops, smem, work, head_q)
        piece0 = (work.rank * self.half + c0) // FUSED_DQ_PIECE
        atoms = width // atom_w
        pipelined = self.cfg.dq_ahead
        accs = [self._dq_issue(mma, sdS, sKt, c0, atom_w, tidx)]
        for a in cutlass.range_constexpr(atoms):
            ahead = pipelined and a + 1 < atoms
            if const_expr(a > 0 and not pipelined):
                accs.append(self._dq_issue(mma, sdS, sKt, c0 + a * atom_w, atom_w, tidx))
            if const_expr(ahead):
                accs.append(self._dq_issue(mma, sdS, sKt, c0 + (a + 1) * atom_w, atom_w, tidx))
            acc_mn = mn_view(accs[a])
            for p in cutlass.range_constexpr(per_atom):
                k = a * per_atom + p
                if const_expr(both):
                    buf = (i * pieces + k) % nbuf
                elif const_expr(own == 1):
                    buf = which
                else:
                    buf = which * own + (i * pieces + k) % own
                if const_expr(p == 0):
                    warpgroup.wait_group(1 if const_expr(ahead) else 0)
                    if const_expr(a == 0):
                        self._trace(extra, 3, i)
                        self._refill(ops, smem, work, i, which, tidx)
                    if const_expr(a == atoms - 1):
                        if cute.arch.lane_idx() == 0:
                            cute.arch.mbarrier_arrive(smem.bars.p_empty)
                if const_expr(single):
                    self._put_piece(ops, smem, sync, acc_mn, tQcQ_mn, ts, tg, buf, p, n_block,
                                    piece0 + k, tidx, unread=own - 2)
                else:
                    if tidx // 32 == 0:
                        cute.arch.cp_async_bulk_wait_group(1 if const_expr(both) else 0,
                                                           read=True)
                    self._put_piece(ops, smem, sync, acc_mn, tQcQ_mn, ts, tg, buf, p, n_block,
                                    piece0 + k, tidx)
        self._trace(extra, 4, i)

def _shared_storage(cfg: BwdFusedConfigSm90, dtype, layouts: FusedLayouts):
    """The storage struct (`BwdFusedConfigSm90.smem_bytes` models it): barriers, the column
    statistics, then 1 KB aligned the exchange buffer, K_r, V_r, the Q and dO rings, P^T, dS^T,
    the dQ staging buffers."""
    mem, align, i64 = cute.struct.MemRange, cute.struct.Align, cutlass.Int64

    def smem(layout, elem=dtype):
        return align[mem[elem, cute.cosize(layout)], 1024]

    return cute.struct(type("SharedStorage", (), {"__annotations__": {
        "bar_kv": mem[i64, 1], "bar_q": mem[i64, cfg.q_stages],
        "bar_do": mem[i64, cfg.do_stages], "bar_p_full": mem[i64, 1],
        "bar_p_empty": mem[i64, 1], "bar_x_full": mem[i64, 1], "bar_x_empty": mem[i64, 1],
        "stat": align[mem[Float32, 2 * T], 16],
        "xbuf": align[mem[Float32, cfg.x_floats], 1024],
        "sK": smem(layouts.kv), "sV": smem(layouts.kv), "sQ": smem(layouts.q),
        "sdO": smem(layouts.do), "sPt": smem(layouts.p), "sdSt": smem(layouts.p),
        "sdQ": smem(layouts.dq, Float32),
    }}))


__all__ = ["FFPABwdFusedSm90"]
