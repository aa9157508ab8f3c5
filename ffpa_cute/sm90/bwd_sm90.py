"""Hopper backward on the forward's skeleton, first kernel: dV (plan: perf/NOTES.md, issue 5).

    dV[j, :] = sum_i P[i, j] dO[i, :],   P = exp(scale * Q K^T - LSE)   (LSE from the forward)

`FFPABwdDVSm90` is `FFPAFwdSm90` (fwd_sm90.py: S warpgroup + two accumulator warpgroups,
self-fed TMA rings, P handed over through smem) with the operands in other roles:

    forward role             dV kernel
    resident rows (Q)        a 64-row tile of K
    S-ring chunks (K)        Q, 128 query rows per block
    accumulator B (V)        dO
    accumulator (O)          dV (fp32 in registers, split along D between two warpgroups)

and the skeleton's hooks replaced:
  * `_heads`, `_block_range`, `_block`: a KV tile walks the query blocks of all G = Hq / Hkv
    query heads of its KV head (heads outer; per head, the blocks that see some key of the
    tile: under causal those with i >= j - offset, highest first), so dV is summed over the
    group in registers: GQA / MQA without atomics, deterministic;
  * `_k_src`, `_v_src`: Q chunks and dO rows of the block's query head (TMA re-tiled per head);
  * `_softmax_block`: P^T = exp2(S^T * scale * log2(e) - LSE[i] * log2(e)) with the transposed
    mask (i < Nq, and j <= i + offset under causal); no running max: the forward's LSE already
    normalises, so there are no row factors and the accumulator warpgroups skip the rescale
    (`rescale_o = False`; `_write_factors` does nothing, and the factor buffer stages each
    block's 128 LSE values instead);
  * `_final_factors`: none (dV needs no normalisation) and no LSE output.

Queries whose LSE is -inf (they see no key) contribute nothing: their LSE is read as +inf, so
P = exp2(finite - inf) = 0.

Status: **compile-verified only** (tests/test_kernels_compile.py); not yet run on a GPU and not
wired into autograd (the backward still recomputes through torch SDPA).
Constraints: those of `FwdConfigSm90`, and D <= 512.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline  # noqa: F401  (NamedBarrier)
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync

from ..common.tensors import LOG2_E, launch_args
from ..problem import AttnProblem
from .config import TILE_M, FwdConfigSm90
from .config import can_implement as _can_implement_fwd
from .config import plan_fwd as _plan_fwd
from .fwd_sm90 import FFPAFwdSm90


@dataclass(frozen=True)
class BwdDVConfigSm90(FwdConfigSm90):
    """Compile key of the dV kernel: the forward's fields, read with K as the resident rows."""


def can_implement_dv(cfg: BwdDVConfigSm90) -> str | None:
    reason = _can_implement_fwd(cfg)
    if reason is None and cfg.o_split > 1:
        reason = "the dV kernel covers D <= 512"
    return reason


def plan_dv(problem: AttnProblem, arch: str = "sm_90a") -> BwdDVConfigSm90:
    """The dV kernel's config: the forward's plan for the same problem (same ring budget)."""
    cfg = BwdDVConfigSm90(**dataclasses.asdict(_plan_fwd(problem, arch)))
    reason = can_implement_dv(cfg)
    if reason:
        raise ValueError(reason)
    return cfg


def run_dv(q, k, do, lse, softmax_scale: float, causal: bool, causal_offset: int):
    """dV for torch tensors q, k, do [B, H, N, D] (bf16/fp16) and the forward's lse [B, H, Nq]
    fp32 (compile-verified only: see the module docstring)."""
    import torch

    from ..cache import jit_cache
    from ..dispatch import _kernel_ready

    problem = AttnProblem.from_tensors(q, k, k, causal=causal, causal_offset=causal_offset)
    cfg = plan_dv(problem)
    dv = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    fn = jit_cache().get(FFPABwdDVSm90, cfg)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    FFPABwdDVSm90.launch_dv(fn, _kernel_ready(q), _kernel_ready(k), _kernel_ready(do), dv,
                            lse.contiguous(), softmax_scale, causal_offset, stream)
    return dv


class FFPABwdDVSm90(FFPAFwdSm90):
    """dV = P^T dO on the forward's warp-specialised skeleton (compile-verified only)."""

    rescale_o = False

    def __init__(self, cfg: BwdDVConfigSm90):
        reason = can_implement_dv(cfg)
        if reason:
            raise ValueError(f"{type(self).__name__}: {reason}")
        super().__init__(cfg)

    @staticmethod
    def launch_dv(fn, q, k, do, dv, lse, softmax_scale: float, causal_offset: int,
                  stream) -> None:
        """dv [B, H, Nkv, D] from q [B, H, Nq, D], k, do, lse [B, H, Nq] (the forward's)."""
        fn(*launch_args(k, q, do, dv, lse), softmax_scale, causal_offset, cuda.CUstream(stream))

    # ---------------------------------------------------------------- hooks
    @cute.jit
    def _heads(self, head, heads_rows, heads_cols):
        """This KV head's query heads are head*G .. head*G+G-1 (G = Hq / Hkv): the blocks walk
        all of them, so dV sums over the group in registers (no atomics)."""
        group = heads_cols // heads_rows
        return head * group, group

    @cute.jit
    def _block_range(self, m_block, seqlen_q, causal_offset, group):
        """Per query head, the blocks n_top-1 .. n_top-n_per: all of them, or under causal those
        holding a query i >= (first key of the tile) - offset; n_count = group * n_per."""
        n_top = (seqlen_q + self.tile_n - 1) // self.tile_n
        n_low = 0
        if cutlass.const_expr(self.causal):
            n_low = cutlass.max(m_block * TILE_M - causal_offset, 0) // self.tile_n
        return n_top, cutlass.max(n_top - n_low, 0) * group

    @cute.jit
    def _block(self, seq, i):
        """Block i = (query head g, block n): heads outer, blocks highest first."""
        n_per = seq.n_count // seq.group
        return seq.head_kv + i // n_per, seq.n_top - 1 - i % n_per

    @cute.jit
    def _k_src(self, loads, seq, head, n_block, c):
        """Q chunk c of query block n_block of query `head` (the K role's TMA, re-tiled per head)."""
        g = cute.local_tile(loads.gK_tma[None, None, head, seq.batch],
                            (self.tile_n, self.cfg.k_chunk), (None, None))
        _, tg = cpasync.tma_partition(loads.tma_k, 0, cute.make_layout(1),
                                      cute.group_modes(loads.sK, 0, 2), cute.group_modes(g, 0, 2))
        return tg[None, n_block, c]

    @cute.jit
    def _v_src(self, v_loads, seq, head, row_block, half: cutlass.Constexpr):
        """dO rows block row_block of query `head`, this warpgroup's columns."""
        rows = v_loads.gV_tma[None, None, head, seq.batch]
        g = cute.local_tile(cute.domain_offset((0, v_loads.col0), rows),
                            (self.v_rows, self.dv[half]), (None, 0))
        _, tg = cpasync.tma_partition(v_loads.tma_v, 0, cute.make_layout(1),
                                      cute.group_modes(v_loads.sV, 0, 2),
                                      cute.group_modes(g, 0, 2))
        return tg[None, row_block]

    @cute.jit
    def _final_factors(self, softmax, factor, num_rows: cutlass.Constexpr):
        """No normalisation and no LSE output: dV is the sum itself."""
        return None

    @cute.jit
    def _write_factors(self, sFactor, factor, tScS_mn, b, lane):
        """No row factors here (rescale_o is False): the buffer holds the block's LSE instead."""
        pass

    @cute.jit
    def _softmax_block(self, acc_S, acc_S_mn, tScS_mn, softmax, factor, rP, m_block, n_block,
                       seqlen_q, causal_offset, mLSE, batch, head, sFactor, tidx, acc_2,
                       extra):
        """P^T for this block in rP: rows are keys j, columns queries i."""
        rows, cols = cute.size(acc_S_mn, mode=[0]), cute.size(acc_S_mn, mode=[1])
        col0 = n_block * self.tile_n
        # the block's LSE in log2 units, one query per S thread, staged in the (otherwise
        # unused) row-factor buffer; +inf for queries past Nq or that see no key
        sLSE = cute.make_tensor(sFactor.iterator, cute.make_layout(self.tile_n))
        s_sync = cutlass.pipeline.NamedBarrier(barrier_id=1, num_threads=TILE_M * 2)
        s_sync.arrive_and_wait()  # every S thread is done with the previous block's values
        i = col0 + tidx
        v = Float32.inf
        if i < seqlen_q:
            v = mLSE[batch, head, i]
            if v == -Float32.inf:
                v = Float32.inf
        sLSE[tidx] = v * LOG2_E
        s_sync.arrive_and_wait()
        # mask only where the block crosses Nq or the diagonal (j > i + offset)
        need = col0 + self.tile_n > seqlen_q
        if cutlass.const_expr(self.causal):
            need = need | (m_block * TILE_M + TILE_M - 1 > col0 + causal_offset)
        if need:
            for r in cutlass.range_constexpr(rows):
                j = m_block * TILE_M + tScS_mn[r, 0][0]
                for c in cutlass.range_constexpr(cols):
                    q = col0 + tScS_mn[0, c][1]
                    bad = q >= seqlen_q
                    if cutlass.const_expr(self.causal):
                        bad = bad | (j > q + causal_offset)
                    if bad:
                        acc_S_mn[r, c] = -Float32.inf
        for c in cutlass.range_constexpr(cols):
            lse2 = sLSE[tScS_mn[0, c][1]]
            for r in cutlass.range_constexpr(rows):
                acc_S_mn[r, c] = cute.math.exp2(acc_S_mn[r, c] * softmax.scale_log2 - lse2,
                                                fastmath=True)
        rP.store(acc_S.load().to(self.dtype))


__all__ = ["BwdDVConfigSm90", "FFPABwdDVSm90", "can_implement_dv", "plan_dv", "run_dv"]
