"""The backward's gradient kernels with exact or widened accumulator shares (`half_align`).

    python -m perf.half_align_bwd --precompile DIR     # CPU: compile the variants into a cache
    python -m perf.half_align_bwd [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

The dQ, dK and dV kernels accumulate their gradient in two warpgroup shares of D (Dv for dV),
each reading its B operand (K, Q, dO) in [v_rows x share] stages, as the forward reads V: the
same swizzle cliffs (perf.half_align). For each D, each kernel of the planned backward timed at
half_align 8 (exact shares) and widened (64 with one CTA per tile, 32 when the gradient is
split over two CTAs), each variant's ring depths re-planned. B=1, H=32, N=8K, bf16, not causal;
kernel alone (launch.run_job), L2 flushed, median of 3 benches; TFLOPS of the whole backward
(2.5 x the forward's FLOPs) from the sum of the three kernels' times.
"""

from __future__ import annotations

import dataclasses

from perf import experiment

HEAD_DIMS = (320, 336, 448, 576, 704)
HEADS, N = 32, 8192


def _problem(d: int):
    from ffpa_cute.problem import AttnProblem

    return AttnProblem(dtype="bf16", batch=1, heads_q=HEADS, heads_kv=HEADS, seqlen_q=N,
                       seqlen_kv=N, head_dim=d, head_dim_v=d, causal=False)


def _refit(cfg, reason_of):
    """cfg with the deepest V ring (<= its own) that its can_implement accepts, or None."""
    for v in range(cfg.v_stages, 1, -1):
        c = dataclasses.replace(cfg, v_stages=v)
        if reason_of(c) is None:
            return c
    return None


def variants():
    """(D, label, [(kernel class, cfg)] of dQ, dK, dV) per D and alignment."""
    from ffpa_cute import dispatch
    from ffpa_cute.sm90 import config as sm90_config

    out = []
    for d in HEAD_DIMS:
        planned = sm90_config.plan_bwd(_problem(d))  # dQ, dK, dV
        wide = 32 if d > sm90_config.MAX_SINGLE_CTA_HEAD_DIM else 64
        for a in (8, wide):
            jobs = []
            for cfg in planned:
                check = (sm90_config.can_implement_dv
                         if isinstance(cfg, sm90_config.BwdDVConfigSm90)
                         else sm90_config.can_implement_dq)
                c = _refit(dataclasses.replace(cfg, half_align=a,
                                               v_stages=max(cfg.v_stages, 4)), check)
                if c is not None:
                    jobs.append((dispatch.kernel_class(c), c))
            if len(jobs) == 3:
                out.append((d, f"half_align={a}", jobs))
    return out


def jobs() -> list:
    return [job for _, _, kernels in variants() for job in kernels]


def run(dev, flush) -> dict:
    import torch

    import ffpa_cute
    from ffpa_cute import launch

    res = {}
    for d, label, jobs in variants():
        q, k, v, do = (torch.randn(1, HEADS, N, d, device=dev, dtype=torch.bfloat16)
                       for _ in range(4))
        out, lse = ffpa_cute.attention(q, k, v, return_lse=True)
        inputs = dict(q=q, k=k, v=v, do=do, o=out, lse=lse, delta=torch.zeros_like(lse))
        scalars = launch.kernel_scalars(_problem(d), 0)
        times, _ = experiment.time_grad_jobs(jobs, inputs, scalars, dev, flush)
        total = sum(times.values())
        tf = 2.5 * 4 * HEADS * N * N * d / total / 1e9
        shares = " ".join(f"{type(c).__name__[:-9]} {c.dv_halves} v{c.v_stages}"
                          for _, c in jobs)
        print(f"D={d:4d} {label}: " + " ".join(f"{n} {ms:.2f}" for n, ms in times.items())
              + f" ms = {total:.2f} ms, {tf:.1f} TFLOPS ({shares})", flush=True)
        res[f"{d}-{label}"] = dict(d=d, times_ms=times, total_ms=total, tflops=tf)
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.half_align_bwd", __doc__, jobs, run))
