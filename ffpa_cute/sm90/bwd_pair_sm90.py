"""dK and dV in one 2-CTA cluster: the score product S^T is computed once per block, not twice.

The separate dK kernel (bwd_sm90.py) recomputes S^T = K Q^T that the dV kernel already formed:
3 GEMM units (S^T, dP^T, dK) beside dV's 2. Here the two CTAs of a cluster take the same
64-row KV tile and walk the same query blocks (every query head of the KV head, the dV kernel's
`_block_range` / `_block`), on the dV kernel's skeleton with the operands of their rank:

    rank   resident rows   S-ring columns   score step                     accumulates
    0      K               Q chunks         P^T (column LSE, mask)         dV += P^T dO
    1      V               dO chunks        dP^T, then dS^T = P^T (dP^T -  dK += dS^T Q
                                            Delta) * scale, P^T from rank 0

Rank 0 writes its P^T tile into its P slot (stmatrix, as the dV kernel) and sends the same
swizzled tile into the same slot of rank 1's smem with one shared::cluster bulk copy, counted
on rank 1's `pp[b]` mbarrier. Rank 1 reads it back into the accumulator layout (ldmatrix
through the tiled copy that stmatrix wrote it with: each warp its own 16 rows), forms dS^T in
registers and overwrites the same slot with it for its dK warpgroups. The slot is free for the
next tile of buffer b once both CTAs' accumulator warps arrived on both CTAs' P_empty[b] (16
arrivals, the forward `kv_pair`'s protocol), which rank 0 waits for before it writes or sends.

Per block each CTA executes 2 units (as the dV kernel): 4 for the pair where the dK and dV
kernels execute 5, and the pair's two ranks are balanced. dS^T is formed from the bf16 P^T, as
the dK `seq_scores` kernel forms it (same precision). 16 KB cross the cluster per block.

Constraints: those of the dV kernel, plus Dv == D <= 512 (O in one CTA) and tile_n 128.
Status: run and tested on the H200 at 09dade8 (tests/test_backward_sm90_gpu.py::test_dkdv_pair,
test_autograd_through_the_pair) but not faster, so off (`dispatch.DKDV_PAIR`): 25.5 ms against
26.1 for the dK + dV kernels at D=512, 22.9 against 19.9 at D=320 (perf/NOTES.md session 6:
the cluster launch costs 4-5 ms, and rank 1's dK-type work runs slower per unit than rank 0's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline  # noqa: F401  (NamedBarrier)
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warp

from ..common.tensors import current_stream_handle, fake_args
from ..problem import AttnProblem
from .bwd_sm90 import (PREFETCH_STATS, BwdDVConfigSm90, FFPABwdDVSm90, _check_head_dim,
                       can_implement_dv)
from .config import MAX_SINGLE_CTA_HEAD_DIM, TILE_M, deepest_rings
from .fwd_sm90 import WG_THREADS, FFPAFwdSm90, Operands


@dataclass(frozen=True)
class BwdPairConfigSm90(BwdDVConfigSm90):
    """Compile key of the dK + dV pair: the dV kernel's fields; two CTAs per KV tile in a
    cluster, the P tile's landing barrier, and a staging buffer for the columns' LSE and
    Delta."""

    @property
    def ctas_per_tile(self) -> int:
        return 2

    @property
    def cluster_pair(self) -> bool:
        return True

    @property
    def pair_barriers(self) -> tuple[str, ...]:
        return ("bar_pp",)

    @property
    def factor_floats(self) -> int:
        return 2 * max(TILE_M, self.tile_n)


def can_implement_pair(cfg: BwdPairConfigSm90) -> str | None:
    reason = can_implement_dv(cfg)
    if reason is None and (cfg.head_dim_v is not None or cfg.o_split != 1
                           or cfg.tile_n != 128 or cfg.stream_q):
        reason = (f"the dK + dV pair needs head_dim_v == head_dim <= {MAX_SINGLE_CTA_HEAD_DIM}, "
                  "tile_n 128 and resident rows (no stream_q)")
    return reason


def plan_pair(problem: AttnProblem, arch: str = "sm_90a") -> BwdPairConfigSm90:
    """The forward's tile (64 KV rows resident, 128 query columns) with a 4-deep S ring, the
    deepest accumulator-operand rings that fit, then any room left to the S ring."""
    _check_head_dim(problem)
    base = dict(arch=arch, dtype=problem.dtype, head_dim=problem.head_dim,
                causal=problem.causal, tile_n=128, publish_after=-(-problem.head_dim // 64),
                head_dim_v=(None if problem.head_dim_v == problem.head_dim
                            else problem.head_dim_v),
                prefetch_stats=PREFETCH_STATS)
    return deepest_rings(lambda k, v: BwdPairConfigSm90(**base, k_stages=k, v_stages=v),
                         can_implement_pair)


def fake_pair_args(cfg) -> tuple:
    """Stand-ins for the pair's (q, k, v, do, dk, dv, lse, delta)."""
    q, k, v, do, lse = fake_args(cfg)
    dk, dv, _, _, delta = fake_args(cfg)
    return q, k, v, do, dk, dv, lse, delta


def run_dkdv(q, k, v, do, lse, delta, softmax_scale: float, causal: bool, causal_offset: int):
    """(dK, dV) [B, Hkv, Nkv, D] (summed over each KV head's query heads) for torch tensors
    q, k, v, do [B, H, N, D], the forward's lse and delta = rowsum(dO * O) [B, Hq, Nq] fp32."""
    import torch

    from ..cache import jit_cache
    from ..dispatch import _kernel_ready

    problem = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=causal_offset)
    fn = jit_cache().get(FFPABwdPairSm90, plan_pair(problem))
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    stream = current_stream_handle(q.device)
    FFPABwdPairSm90.launch(fn, *(_kernel_ready(t) for t in (q, k, v, do)), dk, dv,
                           lse.contiguous(), delta.contiguous(), softmax_scale, causal_offset,
                           stream)
    return dk, dv


class PairExtra(NamedTuple):
    """Kernel arguments the pair adds: rank 1's operands and Delta [B, Hq, Nq]."""

    ops1: Operands
    mDelta: cute.Tensor


class _Rank:
    """A CTA's rank inside one trace of the warpgroups (a Python int: each rank's code is
    generated separately), with what its score step reads beyond the skeleton's arguments."""

    def __init__(self, rank: int, mDelta, bars, sP, mma_qk, p_base):
        self.rank, self.mDelta, self.bars = rank, mDelta, bars
        self.sP, self.mma_qk, self.p_base = sP, mma_qk, p_base


class FFPABwdPairSm90(FFPABwdDVSm90):
    """dK and dV of a KV tile by a 2-CTA cluster (module docstring)."""

    fake_inputs = staticmethod(fake_pair_args)

    def __init__(self, cfg: BwdPairConfigSm90):
        reason = can_implement_pair(cfg)
        if reason:
            raise ValueError(f"{type(self).__name__}: {reason}")
        super().__init__(cfg)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mdK: cute.Tensor, mdV: cute.Tensor, mLSE: cute.Tensor, mDelta: cute.Tensor,
                 softmax_scale: Float32, causal_offset: Int32, stream: cuda.CUstream):
        # rank 0: rows K, columns Q, accumulator B = dO, output dV (the dV kernel's roles);
        # rank 1: rows V, columns dO, accumulator B = Q, output dK
        ops1 = self._operands(mV, mdO, mQ, mdK)
        self._launch(mK, mQ, mdO, mdV, mLSE, softmax_scale, causal_offset, stream,
                     PairExtra(ops1, mDelta))

    @cute.jit
    def _warpgroups(self, ops, wg, tidx, mma_qk, mma_pv_lo, mma_pv_hi, mLSE, sQ, sK, sVlo,
                    sVhi, sP, sFactor, bars, m_block, o_part, head, head_kv, batch, seq,
                    seqlen_q, seqlen_k, causal_offset, scale_log2, extra, pair, peer=None):
        """The skeleton's warpgroups on rank 0's operands or on rank 1's (`extra.ops1`)."""
        bidx, _, _ = cute.arch.block_idx()
        rank = cute.arch.make_warp_uniform(bidx % 2)
        if rank == 0:
            FFPAFwdSm90._warpgroups(
                self, ops, wg, tidx, mma_qk, mma_pv_lo, mma_pv_hi, mLSE, sQ, sK, sVlo, sVhi, sP,
                sFactor, bars, m_block, o_part, head, head_kv, batch, seq, seqlen_q, seqlen_k,
                causal_offset, scale_log2, _Rank(0, extra.mDelta, bars, sP, mma_qk, pair.p_base),
                pair, 1)
        else:
            FFPAFwdSm90._warpgroups(
                self, extra.ops1, wg, tidx, mma_qk, mma_pv_lo, mma_pv_hi, mLSE, sQ, sK, sVlo,
                sVhi, sP, sFactor, bars, m_block, o_part, head, head_kv, batch, seq, seqlen_q,
                seqlen_k, causal_offset, scale_log2,
                _Rank(1, extra.mDelta, bars, sP, mma_qk, pair.p_base), pair, 0)

    # ---------------------------------------------------------------- hooks
    def _column_delta(self, extra):
        """Rank 1 stages Delta beside the LSE; rank 0 (P^T only) the LSE."""
        return extra.mDelta if extra.rank == 1 else None

    @cute.jit
    def _softmax_block(self, acc_S, acc_S_mn, tScS_mn, softmax, factor, rP, m_block, n_block,
                       seqlen_q, causal_offset, mLSE, batch, head, sFactor, tidx, acc_2,
                       extra, pre, i):
        """Rank 0: P^T in rP (the dV kernel's step). Rank 1: acc_S holds dP^T; with P^T from
        rank 0 (slot i % 2), dS^T * scale in rP."""
        if const_expr(extra.rank == 0):
            self._p_transposed(acc_S, acc_S_mn, tScS_mn, rP, softmax, m_block, n_block,
                               seqlen_q, causal_offset, sFactor, tidx, mLSE, batch, head, None,
                               pre)
        else:
            self._stage_columns(sFactor, tidx, n_block, seqlen_q, mLSE, batch, head,
                                extra.mDelta, pre)
            b = i % 2
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(extra.bars.pp + b,
                                                        TILE_M * self.tile_n * 2)
            cute.arch.mbarrier_wait(extra.bars.pp + b, (i // 2) & 1)
            # P^T back into the accumulator's thread layout (the inverse of the stmatrix copy)
            ld_atom = cute.make_copy_atom(
                warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype)
            thr_ld = cute.make_tiled_copy_C(ld_atom, extra.mma_qk).get_slice(tidx)
            cute.copy(thr_ld, thr_ld.partition_S(extra.sP)[None, None, None, b],
                      thr_ld.retile(rP))
            self._ds_from_p(acc_S_mn, tScS_mn, rP, sFactor, softmax.scale_log2)
            rP.store(acc_S.load().to(self.dtype))

    @cute.jit
    def _after_p_store(self, pair, bars, b, i, n_count, o_part, tidx, extra):
        """Rank 0: its P^T tile (slot b, written and fenced by every S thread) into slot b of
        rank 1's smem by one bulk copy, counted on rank 1's pp[b]."""
        if const_expr(extra.rank == 0):
            from cutlass.experimental.primitives.nvvm_wrapper import (
                cp_async_bulk_shared_cluster_shared_cta)

            cutlass.pipeline.NamedBarrier(barrier_id=1,
                                          num_threads=WG_THREADS).arrive_and_wait()
            if tidx == 0:
                src = extra.p_base + b * (TILE_M * self.tile_n)
                cp_async_bulk_shared_cluster_shared_cta(
                    cute.arch.map_dsmem_ptr(src, 1), src,
                    cute.arch.map_dsmem_ptr(bars.pp + b, 1), TILE_M * self.tile_n * 2)


__all__ = ["BwdPairConfigSm90", "FFPABwdPairSm90", "can_implement_pair", "plan_pair",
           "run_dkdv"]
