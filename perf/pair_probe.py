"""Timing probes for the dK + dV pair (ffpa_cute/sm90/bwd_pair_sm90.py): what its per-block
chain costs. GPU only; the variants' gradients are wrong by construction (timing only).

    python -m perf.pair_probe 512,320      # D list; B=1, H=32, N=8192, non-causal

  pair     the kernel as built
  noexch   rank 0 sends nothing, rank 1 neither waits for P^T nor reads it (dS^T from stale rP)
  local    noexch, and each CTA's accumulator warps arrive only on their own CTA's P_empty
  nocl     local, and no cluster launch (two independent CTAs per KV tile)
  dv, dk   the separate dV and dK kernels on the same problem
"""

from __future__ import annotations

import dataclasses
import sys

import cutlass
import cutlass.cute as cute
from cutlass import const_expr

from ffpa_cute.common.softmax import mn_view
from ffpa_cute.sm90.bwd_pair_sm90 import BwdPairConfigSm90, FFPABwdPairSm90
from ffpa_cute.sm90.fwd_sm90 import PairSmem


class _NoExchange(FFPABwdPairSm90):
    @cute.jit
    def _softmax_block(self, acc_S, acc_S_mn, tScS_mn, softmax, factor, rP, m_block, n_block,
                       seqlen_q, causal_offset, mLSE, batch, head, sFactor, tidx, acc_2,
                       extra, pre, i):
        if const_expr(extra.rank == 0):
            self._p_transposed(acc_S, acc_S_mn, tScS_mn, rP, softmax, m_block, n_block,
                               seqlen_q, causal_offset, sFactor, tidx, mLSE, batch, head, None,
                               pre)
        else:
            self._stage_columns(sFactor, tidx, n_block, seqlen_q, mLSE, batch, head,
                                extra.mDelta, pre)
            sCol = cute.make_tensor(sFactor.iterator, cute.make_layout(2 * self.tile_n))
            rP_mn = mn_view(rP)
            for c in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[1])):
                delta = sCol[self.tile_n + tScS_mn[0, c][1]]
                for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                    acc_S_mn[r, c] = rP_mn[r, c].to(cute.Float32) * (acc_S_mn[r, c] - delta)
            rP.store(acc_S.load().to(self.dtype))

    @cute.jit
    def _after_p_store(self, pair, bars, b, i, n_count, o_part, tidx, extra):
        pass


class _Local(_NoExchange):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.peer_arrivals = False


@dataclasses.dataclass(frozen=True)
class _NoClusterConfig(BwdPairConfigSm90):
    @property
    def cluster_pair(self) -> bool:
        return False


class _NoCluster(_Local):
    @cute.jit
    def _warpgroups(self, ops, wg, tidx, mma_qk, mma_pv_lo, mma_pv_hi, mLSE, sQ, sK, sVlo,
                    sVhi, sP, sFactor, bars, m_block, o_part, head, head_kv, batch, seq,
                    seqlen_q, seqlen_k, causal_offset, scale_log2, extra, pair, peer=None):
        FFPABwdPairSm90._warpgroups(self, ops, wg, tidx, mma_qk, mma_pv_lo, mma_pv_hi, mLSE, sQ,
                                    sK, sVlo, sVhi, sP, sFactor, bars, m_block, o_part, head,
                                    head_kv, batch, seq, seqlen_q, seqlen_k, causal_offset,
                                    scale_log2, extra, PairSmem(None, None), peer)


def main() -> None:
    import torch

    from ffpa_cute import dispatch
    from ffpa_cute.cache import jit_cache
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.sm90 import bwd_sm90
    from ffpa_cute.sm90.bwd_pair_sm90 import plan_pair
    from ffpa_cute.common.tensors import current_stream_handle
    from perf.smoke import _median_ms

    for d in [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "512").split(",")]:
        n = 8192
        q, do = (torch.randn(1, 32, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(1, 32, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        problem = AttnProblem.from_tensors(q, k, v, causal=False, causal_offset=0)
        out, lse = dispatch.run_fwd(dispatch.plan_fwd(problem), q, k, v)
        delta = (do.float() * out.float()).sum(-1)
        args = (problem.softmax_scale, False, 0)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        stream = current_stream_handle(q.device)

        def pair_job(cls):
            cfg = plan_pair(problem)
            if cls is _NoCluster:
                cfg = _NoClusterConfig(**dataclasses.asdict(cfg))
            fn = jit_cache().get(cls, cfg)
            return lambda: cls.launch(fn, q, k, v, do, dk, dv, lse, delta, *args[:1], 0,
                                      stream)

        jobs = {"pair": pair_job(FFPABwdPairSm90), "noexch": pair_job(_NoExchange),
                "local": pair_job(_Local), "nocl": pair_job(_NoCluster),
                "dv": lambda: bwd_sm90.run_dv(q, k, do, lse, *args),
                "dk": lambda: bwd_sm90.run_dk(q, k, v, do, lse, delta, *args)}
        ms = {name: round(_median_ms(fn, 10), 3) for name, fn in jobs.items()}
        print(f"D={d}: {ms}", flush=True)


if __name__ == "__main__":
    main()
