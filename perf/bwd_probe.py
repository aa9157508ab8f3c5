"""Timing probes for the sm90 backward kernels. GPU only. B=1, H=32, N=8192, non-causal.

    python -m perf.bwd_probe pair 512,320       # the dK + dV pair and its variants
    python -m perf.bwd_probe publish 512,320    # dQ / dK with other P hand-over points

`pair`: what the pair's (ffpa_cute/sm90/bwd_pair_sm90.py) per-block chain costs; the variants'
gradients are wrong by construction (timing only):

  pair     the kernel as built
  noexch   rank 0 sends nothing, rank 1 neither waits for P^T nor reads it (dS^T from stale rP)
  local    noexch, and each CTA's accumulator warps arrive only on their own CTA's P_empty
  nocl     local, and no cluster launch (two independent CTAs per KV tile)
  dv, dk   the separate dV and dK kernels on the same problem
"""

from __future__ import annotations

import dataclasses
import sys

import cutlass.cute as cute
from cutlass import const_expr

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
            self._ds_from_p(acc_S_mn, tScS_mn, rP, sFactor, softmax.scale_log2)
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


PUBLISH = {  # (publish_after, publish_hi) in units of C = ceil(D / 64) S-ring chunks
    "1/-": (1, None), "0.5/1.5": (0.5, 1.5), "1/2": (1, 2), "0.25/1.25": (0.25, 1.25),
    "0.5/1.25": (0.5, 1.25), "0.5/1.75": (0.5, 1.75), "0.375/1.5": (0.375, 1.5),
    "0.625/1.5": (0.625, 1.5), "0.5/2": (0.5, 2), "0/1.5": (0, 1.5), "0.75/1.75": (0.75, 1.75),
    "1/1.5": (1, 1.5), "1/1.75": (1, 1.75), "0.75/1.5": (0.75, 1.5)}


def _inputs(d, n=8192):
    import torch

    from ffpa_cute import dispatch
    from ffpa_cute.problem import AttnProblem

    q, do = (torch.randn(1, 32, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 32, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    problem = AttnProblem.from_tensors(q, k, v, causal=False, causal_offset=0)
    out, lse = dispatch.run_fwd(dispatch.plan_fwd(problem), q, k, v)
    delta = (do.float() * out.float()).sum(-1)
    return q, k, v, do, problem, lse, delta


def _publish_cfgs(problem):
    """{(grad, variant): (kernel class, config)} for the `publish` probe."""
    from ffpa_cute.sm90 import bwd_sm90

    c = -(-problem.head_dim // 64)
    out = {}
    for grad, cls, plan in (("dq", bwd_sm90.FFPABwdDQSm90, bwd_sm90.plan_dq),
                            ("dk", bwd_sm90.FFPABwdDKSm90, bwd_sm90.plan_dk)):
        base = plan(problem)
        for name, (lo, hi) in PUBLISH.items():
            out[grad, name] = (cls, dataclasses.replace(
                base, publish_after=int(lo * c), publish_hi=None if hi is None else int(hi * c)))
    return out


def _compile_one(job):
    from ffpa_cute.cache import jit_cache

    jit_cache().get(*job)
    return True


def publish(ds) -> None:
    """dQ and dK with P handed to the accumulator warpgroups after other S-ring chunks."""
    import multiprocessing as mp

    import torch

    from ffpa_cute.cache import jit_cache
    from perf.smoke import _median_ms

    runs = []
    for d in ds:
        q, k, v, do, problem, lse, delta = _inputs(d)
        runs.append((d, q, k, v, do, problem, lse, delta, _publish_cfgs(problem)))
    jobs = [job for r in runs for job in r[-1].values()]
    with mp.get_context("spawn").Pool(min(len(jobs), 12)) as pool:  # compile in parallel
        pool.map(_compile_one, jobs)
    for d, q, k, v, do, problem, lse, delta, cfgs in runs:
        stream, ms = current_stream(), {}
        for (grad, name), (cls, cfg) in cfgs.items():
            fn = jit_cache().get(cls, cfg)
            out = torch.empty_like(q if grad == "dq" else k)
            ms[f"{grad} {name}"] = round(_median_ms(
                lambda: cls.launch(fn, q, k, v, do, out, lse, delta, problem.softmax_scale, 0,
                                   stream), 10), 3)
        print(f"D={d}: {ms}", flush=True)


def current_stream():
    import torch

    from ffpa_cute.common.tensors import current_stream_handle

    return current_stream_handle(torch.device("cuda", torch.cuda.current_device()))


def main() -> None:
    import torch

    from ffpa_cute.cache import jit_cache
    from ffpa_cute.sm90 import bwd_sm90
    from ffpa_cute.sm90.bwd_pair_sm90 import plan_pair
    from perf.smoke import _median_ms

    mode = sys.argv[1]
    ds = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "512").split(",")]
    if mode == "publish":
        publish(ds)
        return
    for d in ds:
        q, k, v, do, problem, lse, delta = _inputs(d)
        args = (problem.softmax_scale, False, 0)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        stream = current_stream()

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
