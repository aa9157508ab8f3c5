"""Split-D attention backward on mma.sync: dV, dK and dQ as three kernels on the forward's
skeleton (`fwd_sm80.py`, Note [Skeleton roles]); sm_80 / sm_86 / sm_89, also sm_90a and sm_120.

What it computes, for the forward O = softmax(scale * Q K^T [+ causal mask]) V with LSE:

    P   = exp(scale * Q K^T - LSE)               (LSE from the forward: no running max)
    dV  = P^T dO                                  dP = dO V^T
    dS  = P * (dP - Delta),  Delta = rowsum(dO * O)   (fp32, common/delta.py, by the caller)
    dQ  = scale * dS K                            dK = scale * dS^T Q

Each kernel is `FFPAFwdSm80`'s main loop with other tensors in its roles:

    skeleton role                forward   dV kernel      dK kernel            dQ kernel
    resident rows (tile_m)       Q         K tile         K tile               Q tile
    ring phase 0 (scores)        K         Q chunks       Q chunks             K chunks
    ring phase 1 (scores)        -         -              dO chunks (+ V rows) V chunks (+ dO rows)
    last phase (acc. B operand)  V         dO chunks      Q chunks             K chunks
    accumulator (registers)      O         dV             dK                   dQ
    softmax hook                 online    P^T            dS^T                 dS

This kernel works as follows (one CTA = one tile_m-row tile of its rows):
1. cp.async the resident rows [tile_m, D] once (zero-filled past the sequence and past D).
2. For each block (dQ: the forward's KV blocks; dV / dK: the query blocks of every query head of
   the tile's KV head, Note [GQA in registers]) stream the ring phases' [tile_n, 64] chunks; the
   score phases accumulate S (and dP) over the D chunks.
3. The softmax hook turns S into P (dV) or dS (dK, dQ) in fp32 registers, with the mask
   (seqlen residue, causal diagonal; transposed for dV / dK, Note [Transposed mask]); P goes to
   shared memory once (warp_n > 1) and is the A operand of the accumulation phase.
4. Each chunk of the last phase updates its own accumulator chunk: acc[:, c] += P B[:, c].
5. Epilogue: dK and dQ are scaled by `scale` (in fp32: dS goes to bf16 / fp16 unscaled, which
   keeps fp16's small values out of its subnormal range), rounded to the input dtype, staged
   through the resident rows' buffer and stored with 128-bit predicated writes.

Note [Transposed mask]: in dV / dK a fragment row is a key j (of the resident K tile) and a
column a query i of the block: the column is masked when i >= Nq, and under causal when key j
is invisible to query i, i.e. j > i + offset (offset = Nkv - Nq bottom-right, 0 upper-left).
Each column's LSE (and Delta) is read once per block into registers at the block's first ring
step, so the loads' latency hides behind the score chunks. Queries that see no key have
LSE = -inf: they are read as +inf, so P = exp2(finite - inf) = 0 and they contribute nothing
(dQ: the whole row is 0). Under causal, the query blocks with no query that sees a key of the
tile are skipped.

Note [GQA in registers]: a dV / dK CTA owns one KV head's tile and walks the query blocks of all
G = Hq / Hkv query heads of that KV head (heads outer), so the gradient is summed over the group
in registers: no atomics, deterministic, and dK / dV come out [B, Hkv, Nkv, D].

Budget (bf16, tile_n 64, tile_hdim 64, 8 warps; `config.BWD_WARP_LAYOUTS`):
* dV: the forward's (M4N2 to D = 512: K 64 KB + 4 x 8 KB ring + 8 KB P at D = 512; M2N4 above).
* dQ / dK: + a row ring (num_stages x tile_m x 64 x 2 B) for the second product's row operand,
  and a second tile_m x tile_n fp32 fragment (M4N2: 16 registers, M2N4: 8) beside the gradient
  (D / (2 warp_n) registers: 128 at D = 512 M4N2 and D = 1024 M2N4).
ptxas register counts and spills per kernel: tests/test_backward_sm80_compile.py.

Status: compile-verified for sm_80, sm_90a, sm_120a (tests/test_backward_sm80_compile.py);
run and tested on the H200 as sm_90a (tests/test_backward_sm80_gpu.py), where autograd uses it
for the sm80 family (and for the sm90 family's backward wherever the WGMMA kernels would not
build; none of the 16-bit D in [264, 1024] today). Compiled for sm_120a it is
**compile-verified only, never run** (no sm_120 GPU here), and the sm120 family does not route
its backward to it.

Constraints (mirrored by `config.can_implement`): those of `FwdConfigSm80` (dtype bf16 / fp16;
D a multiple of 8 in [264, 1024]; unit stride on D, other strides multiples of 8 elements;
Hq % Hkv == 0); lse and delta are [B, Hq, Nq] fp32 contiguous.
"""

from __future__ import annotations

from types import SimpleNamespace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from ..common.mask import apply_mask, block_needs_mask, query_block_range
from ..common.softmax import mn_view
from ..common.tensors import LOG2_E, fake_args, fake_cu, fake_grad_args
from .config import can_implement
from .fwd_sm80 import BlockSeq, FFPAFwdSm80, features_of


class _BwdSm80(FFPAFwdSm80):
    """What the three backward kernels share: launch, row ring, per-row / per-column LSE and
    Delta, the epilogue. Subclasses set `num_scores`, `transposed` and `scaled`."""

    scaled = False      # the gradient is multiplied by the softmax scale (dK, dQ)

    def __init__(self, cfg):
        self._refuse(can_implement(cfg))
        super().__init__(cfg)

    # ---------------------------------------------------------------- host side
    @staticmethod
    def fake_inputs(cfg):
        """dV's q, k, do, dv, lse (no sinks), then cu_q, cu_k (`varlen`, else None each)."""
        return (*fake_args(cfg), *fake_cu(cfg))

    @cute.jit
    def _launch_bwd(self, mR1: cute.Tensor, mR2: cute.Tensor, mC1: cute.Tensor,
                    mC2: cute.Tensor, mC3: cute.Tensor, mOut: cute.Tensor, mLSE: cute.Tensor,
                    mDelta: cute.Tensor, softmax_scale: Float32, causal_offset: cutlass.Int32,
                    window_lo: cutlass.Int32, stream: cuda.CUstream, mCuQ=None, mCuK=None):
        """rows (mR1 resident, mR2 the second product's streamed rows), ring phases
        (mC1, mC2, mC3; dV uses two), output; grid = (row tiles, heads of mR1, B); cu_q,
        cu_k: with `varlen` the sequences' cumulative lengths (the grid then counts
        common/scheduler.py's ceil(total / tile_m) + B row tiles)."""
        mR1, mR2, mC1, mC2, mC3, mOut = [self._aligned(t)
                                         for t in (mR1, mR2, mC1, mC2, mC3, mOut)]
        sQ_layout, sKV_layout, sP_layout, sStat_layout = self._smem_layouts()
        fields = self._storage_fields(sQ_layout, sKV_layout, sP_layout, sStat_layout)
        fields["sRow2"] = cute.struct.Align[
            cute.struct.MemRange[self.dtype, cute.cosize(self._row_ring_layout())], 1024]
        SharedStorage = self._shared_storage(fields)

        cu = (mCuK, mCuQ) if cutlass.const_expr(self.transposed) else (mCuQ, mCuK)  # R's first
        tiles = cute.ceil_div(mR1.shape[2], self.tile_m)
        if cutlass.const_expr(self.cfg.varlen):
            tiles = tiles + cute.size(cu[0]) - 1
        grid = (tiles, cute.size(mR1.shape[1]), cute.size(mR1.shape[0]))
        self.kernel_bwd(
            mR1, mR2, mC1, mC2, mC3, mOut, mLSE, mDelta, softmax_scale * LOG2_E, causal_offset,
            sQ_layout, sKV_layout, sP_layout, sStat_layout,
            self._gmem_tiled_copy(True), self._gmem_tiled_copy(False), self._tiled_mma(),
            SharedStorage, features_of(self.cfg, window_lo, None, cu),
        ).launch(grid=grid, block=[self.num_threads, 1, 1],
                 smem=SharedStorage.size_in_bytes(), stream=stream)

    def _row_ring_layout(self):
        """(tile_m, tile_hdim, stages) for two score products, else an 8-row stand-in."""
        atom = self._chunk_atom()
        if self.num_scores == 2:
            return cute.tile_to_shape(atom, (self.tile_m, self.tile_hdim, self.num_stages),
                                      (0, 1, 2))
        return cute.tile_to_shape(atom, (8, 64), (0, 1))

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel_bwd(self, mR1: cute.Tensor, mR2: cute.Tensor, mC1: cute.Tensor,
                   mC2: cute.Tensor, mC3: cute.Tensor, mOut: cute.Tensor, mLSE: cute.Tensor,
                   mDelta: cute.Tensor, scale_log2: Float32, causal_offset: cutlass.Int32,
                   sQ_layout: cute.ComposedLayout, sKV_layout: cute.ComposedLayout,
                   sP_layout: cute.ComposedLayout, sStat_layout: cute.Layout,
                   gmem_copy_in: cute.TiledCopy, gmem_copy_out: cute.TiledCopy,
                   tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr, features):
        cols = (mC1, mC2, mC3)[: self.num_scores + 1]
        self._mainloop((mR1, mR2), cols, mOut, (mLSE, mDelta), scale_log2, causal_offset,
                       sQ_layout, sKV_layout, sP_layout, sStat_layout,
                       gmem_copy_in, gmem_copy_out, tiled_mma, SharedStorage, features)

    # ---------------------------------------------------------------- skeleton hooks
    def _row_ring(self, storage):
        if self.num_scores == 2:
            return storage.sRow2.get_tensor(self._row_ring_layout())
        return None

    def _score_rows(self, ctx, j: int, slot):
        """Chunk j < C: the resident rows' chunk; the second product: the row ring's slot."""
        if j < self.num_chunks:
            return ctx.sQ[None, None, j]
        return ctx.sRow2[None, None, slot]

    @cute.jit
    def _load_ring_step(self, ctx, head, n_block: cutlass.Int32, step: cutlass.Constexpr,
                        slot: cutlass.Int32):
        """Chunk `step % C` of phase `step // C` for block (head, n_block); in the second score
        phase also the row operand's chunk (rows of the CTA's own tile) into the row ring."""
        C = self.num_chunks
        phase, chunk = step // C, step % C
        if cutlass.const_expr(ctx.tCg is None):
            g = cute.local_tile(ctx.cols[phase][ctx.batch, head, None, None],
                                (self.tile_n, self.tile_hdim), (n_block, chunk))
            src = ctx.thr_copy.partition_S(g)  # (CPY, CPY_N, CPY_K)
        else:
            src = ctx.tCg[phase][None, None, None, n_block, chunk]
        self._load_tile(ctx.gmem_copy_in, src, ctx.tKVsKV[None, None, None, slot],
                        ctx.tKVcKV[None, None, None, n_block, chunk],
                        ctx.seqlen_k, self.tile_n, n_block * self.tile_n, chunk)
        if cutlass.const_expr(self.num_scores == 2 and phase == 1):
            tile = (self.tile_m, self.tile_hdim)
            g2 = cute.local_tile(ctx.rows[1][ctx.batch, ctx.head, None, None], tile,
                                 (ctx.m_block, chunk))
            c2 = cute.local_tile(cute.make_identity_tensor((ctx.seqlen_q, ctx.hdim)), tile,
                                 (ctx.m_block, chunk))
            self._load_tile(ctx.gmem_copy_in, ctx.thr_copy.partition_S(g2),
                            ctx.thr_copy.partition_D(ctx.sRow2[None, None, slot]),
                            ctx.thr_copy.partition_S(c2), ctx.seqlen_q, self.tile_m,
                            ctx.m_block * self.tile_m, chunk)

    @cute.jit
    def _epilogue(self, ctx):
        """(dK, dQ: times scale,) input dtype, staged in the rows' buffer, predicated stores."""
        ctx.cta_sync.arrive_and_wait()  # every warp is done with the resident rows
        if cutlass.const_expr(self.scaled):
            scale = ctx.scale_log2 * (1.0 / LOG2_E)
            for c in cutlass.range_constexpr(self.num_chunks):
                ctx.acc_O[c].store(ctx.acc_O[c].load() * scale)
        self._store_acc(ctx, ctx.acc_O)

    @cute.jit
    def _read_lse_delta(self, ctx, head, idx, n: cutlass.Constexpr, base, limit, st):
        """st.lse[x] = LSE * log2(e) of query base + idx(x) (+inf past `limit` or for a query
        that sees no key, so its P is 0); with two score products st.delta[x] = Delta (0 past)."""
        mLSE, mDelta = ctx.stats
        for x in cutlass.range_constexpr(n):
            i = base + idx(x)
            v = Float32.inf
            d = Float32(0.0)
            if i < limit:
                at = i
                if cutlass.const_expr(ctx.varlen):  # the sequence's queries in the packed stats
                    at = ctx.stat0 + i
                v = mLSE[ctx.batch, head, at]
                if v == -Float32.inf:
                    v = Float32.inf
                if cutlass.const_expr(self.num_scores == 2):
                    d = mDelta[ctx.batch, head, at]
            st.lse[x] = v * LOG2_E
            if cutlass.const_expr(self.num_scores == 2):
                st.delta[x] = d

    def _stat_regs(self, n: int):
        st = SimpleNamespace(lse=cute.make_rmem_tensor(n, Float32), delta=None)
        if self.num_scores == 2:
            st.delta = cute.make_rmem_tensor(n, Float32)
        return st


class _TransposedSm80(_BwdSm80):
    """dV and dK: rows are a K tile of one KV head, columns the query blocks of its query heads
    (Note [GQA in registers], Note [Transposed mask])."""

    transposed = True

    @cute.jit
    def _tile_index(self, bidx, grid_m):
        """Under causal the first KV tiles see the most query blocks: they go first."""
        return bidx

    @cute.jit
    def _heads(self, head, heads_rows, heads_cols):
        group = heads_cols // heads_rows
        return head * group, group

    @cute.jit
    def _block_range(self, m_block, seqlen_k, causal_offset, head0, group, window_lo):
        """Per query head the blocks n_top-1 .. n_low: all of them, under causal those holding
        a query i >= (first key of the tile) - offset, under a window's left edge those holding
        a query i <= (last key of the tile) - window_lo."""
        n_top, n_low = query_block_range(m_block, seqlen_k, causal_offset, window_lo,
                                         self.tile_m, self.tile_n, self.causal)
        per_head = cutlass.max(n_top - n_low, 0)
        return BlockSeq(n_top, per_head * group, head0, cutlass.max(per_head, 1))

    @cute.jit
    def _block(self, seq, i):
        """Iteration i = (query head head0 + i // per_head, block n_top-1 - i % per_head)."""
        g = i // seq.per_head
        return seq.head0 + g, seq.n_top - 1 - (i - g * seq.per_head)

    def _col_tiles(self, cols, batch, head_kv):
        return None  # the query head changes with the block: `_load_ring_step` tiles per block

    @cute.jit
    def _row_state(self, ctx):
        return self._stat_regs(cute.size(ctx.acc_S_mn, mode=[1]))

    @cute.jit
    def _block_start(self, ctx, head, n_block):
        """The block's queries' LSE (and Delta), one per fragment column."""
        tScS_mn = ctx.tScS_mn
        self._read_lse_delta(ctx, head, lambda c: tScS_mn[0, c][1],
                             cute.size(ctx.acc_S_mn, mode=[1]), n_block * self.tile_n,
                             ctx.seqlen_k, ctx.state)

    @cute.jit
    def _mask_transposed(self, ctx, n_block):
        """-inf where query i (column) is past Nq or cannot see key j (row): j > i + offset
        under causal, j < i + window_lo under a window's left edge. Only blocks that cross Nq,
        the diagonal or the edge pay for it."""
        acc_S_mn, tScS_mn = ctx.acc_S_mn, ctx.tScS_mn
        col0 = n_block * self.tile_n
        row0 = ctx.m_block * self.tile_m
        need = col0 + self.tile_n > ctx.seqlen_k
        if cutlass.const_expr(self.causal):
            need = need | (row0 + self.tile_m - 1 > col0 + ctx.causal_offset)
        if cutlass.const_expr(ctx.window_lo is not None):
            need = need | (row0 < col0 + self.tile_n - 1 + ctx.window_lo)
        if need:
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                col_hi = ctx.seqlen_k - col0  # first tile-local column past Nq
                if cutlass.const_expr(ctx.window_lo is not None):
                    # past the last query that sees key j: i <= j - window_lo
                    col_hi = cutlass.min(col_hi,
                                         row0 + tScS_mn[r, 0][0] - ctx.window_lo + 1 - col0)
                col_lo = 0
                if cutlass.const_expr(self.causal):
                    # first visible column: i >= j - offset
                    col_lo = row0 + tScS_mn[r, 0][0] - ctx.causal_offset - col0
                for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                    col = tScS_mn[0, c][1]
                    if col >= col_hi or col < col_lo:
                        acc_S_mn[r, c] = -Float32.inf


class FFPABwdDVSm80(_TransposedSm80):
    """dV = P^T dO, summed over each KV head's query heads (one config: `BwdDVConfigSm80`)."""

    num_scores = 1
    OPERANDS = ("q", "k", "do", "dv", "lse", "cu_q", "cu_k")

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mdO: cute.Tensor, mdV: cute.Tensor,
                 mLSE: cute.Tensor, mCuQ, mCuK, softmax_scale: Float32,
                 causal_offset: cutlass.Int32, window_lo: cutlass.Int32, stream: cuda.CUstream):
        """q, do [B, Hq, Nq, D]; k, dv [B, Hkv, Nkv, D]; lse [B, Hq, Nq] fp32 (the forward's);
        cu_q, cu_k: with `varlen` the sequences' cumulative lengths, else None; window_lo
        read with `window`."""
        # rows K; ring Q chunks (S^T = K Q^T), then dO chunks (dV += P^T dO)
        self._launch_bwd(mK, mK, mQ, mdO, mdO, mdV, mLSE, mLSE, softmax_scale, causal_offset,
                         window_lo, stream, mCuQ, mCuK)

    @cute.jit
    def _softmax_step(self, ctx, head, n_block):
        """P^T = exp2(S^T * scale * log2(e) - LSE[i] * log2(e)) -> rP (and sP)."""
        self._mask_transposed(ctx, n_block)
        acc_S_mn, lse = ctx.acc_S_mn, ctx.state.lse
        for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
            for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c] * ctx.scale_log2 - lse[c],
                                                fastmath=True)
        self._store_p(ctx)


class _TwoScoresSm80(_BwdSm80):
    """dQ and dK: two score products per block (S and dP), gradient scaled by `scale`; inputs
    q, k, v, do, grad, lse, delta."""

    num_scores = 2
    scaled = True

    @staticmethod
    def fake_inputs(cfg):
        """q, k, v, do, the gradient; lse, delta; then cu_q, cu_k (`varlen`, else None)."""
        return (*fake_grad_args(cfg), *fake_cu(cfg))

    @cute.jit
    def _ds(self, ctx, lse_of, delta_of):
        """acc_S <- dS = P (dP - Delta), P = exp2(S * scale * log2(e) - LSE * log2(e));
        lse_of / delta_of map a fragment (row, column) to its query's value."""
        acc_S_mn, acc_dP_mn = ctx.acc_S_mn, mn_view(ctx.acc_2)
        for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                p = cute.math.exp2(acc_S_mn[r, c] * ctx.scale_log2 - lse_of(r, c), fastmath=True)
                acc_S_mn[r, c] = p * (acc_dP_mn[r, c] - delta_of(r, c))
        self._store_p(ctx)


class FFPABwdDKSm80(_TwoScoresSm80, _TransposedSm80):
    """dK = scale * dS^T Q, dS^T = P^T (dP^T - Delta[i]), summed over each KV head's query heads
    (one config: `BwdDKConfigSm80`)."""

    OPERANDS = ("q", "k", "v", "do", "dk", "lse", "delta", "cu_q", "cu_k")

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mdK: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mCuQ, mCuK,
                 softmax_scale: Float32, causal_offset: cutlass.Int32,
                 window_lo: cutlass.Int32, stream: cuda.CUstream):
        # rows K (resident) and V (row ring); ring Q chunks (S^T), dO chunks (dP^T = V dO^T),
        # then Q chunks again (dK += dS^T Q)
        self._launch_bwd(mK, mV, mQ, mdO, mQ, mdK, mLSE, mDelta, softmax_scale, causal_offset,
                         window_lo, stream, mCuQ, mCuK)

    @cute.jit
    def _softmax_step(self, ctx, head, n_block):
        self._mask_transposed(ctx, n_block)
        st = ctx.state
        self._ds(ctx, lambda r, c: st.lse[c], lambda r, c: st.delta[c])


class FFPABwdDQSm80(_TwoScoresSm80):
    """dQ = scale * dS K, dS = P (dP - Delta): the forward's KV blocks, heads and causal rule
    (one config: `BwdDQConfigSm80`)."""

    OPERANDS = ("q", "k", "v", "do", "dq", "lse", "delta", "cu_q", "cu_k")

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mdQ: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor, mCuQ, mCuK,
                 softmax_scale: Float32, causal_offset: cutlass.Int32,
                 window_lo: cutlass.Int32, stream: cuda.CUstream):
        # rows Q (resident) and dO (row ring); ring K chunks (S), V chunks (dP = dO V^T), then
        # K chunks again (dQ += dS K)
        self._launch_bwd(mQ, mdO, mK, mV, mK, mdQ, mLSE, mDelta, softmax_scale, causal_offset,
                         window_lo, stream, mCuQ, mCuK)

    @cute.jit
    def _row_state(self, ctx):
        """The tile's rows' LSE and Delta, read once."""
        st = self._stat_regs(cute.size(ctx.acc_S_mn, mode=[0]))
        row_idx = ctx.row_idx
        self._read_lse_delta(ctx, ctx.head, lambda r: row_idx[r],
                             cute.size(ctx.acc_S_mn, mode=[0]), ctx.m_block * self.tile_m,
                             ctx.seqlen_q, st)
        return st

    @cute.jit
    def _softmax_step(self, ctx, head, n_block):
        if block_needs_mask(ctx.m_block, n_block, ctx.seqlen_k, ctx.causal_offset, self.tile_m,
                            self.tile_n, self.causal, ctx.window_lo):
            apply_mask(ctx.acc_S_mn, ctx.tScS_mn, ctx.m_block, n_block, ctx.seqlen_k,
                       ctx.causal_offset, self.tile_m, self.tile_n, self.causal, ctx.window_lo)
        st = ctx.state
        self._ds(ctx, lambda r, c: st.lse[r], lambda r, c: st.delta[r])


__all__ = ["FFPABwdDKSm80", "FFPABwdDQSm80", "FFPABwdDVSm80"]
