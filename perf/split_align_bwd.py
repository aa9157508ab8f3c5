"""The gradient kernels with the hi share from a 128-byte line (`split_align` 64), as the
forward measured it (perf.split_align).

    python -m perf.split_align_bwd --precompile DIR     # CPU: compile the variants into DIR
    python -m perf.split_align_bwd [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

The dQ, dK and dV kernels accumulate their gradient in two warpgroup shares of D, each reading
its B operand (K, Q, dO) in [v_rows x share] stages. With even shares dV follows the forward's
shares as the forward had them before `split_align` (both rounded up to 64: 192 + 192 at
D=320) and dQ / dK keep exact shares (160 + 160: the hi one from byte 320 of a row, mid-line).
The forward measured 5-24% from starting the hi share on a line (perf.split_align, H100).
Variants per D (B=1, H=32, N=8K, bf16, not causal; each kernel alone, `launch.run_grad_job`,
L2 flushed, median of 3 benches; TFLOPS of the whole backward, 2.5 x the forward's FLOPs, from
the sum):
  planned   `plan_bwd(lines=False)`: the even shares (the route until the run below);
  split     the route, `line_shares_bwd`: dV with `split_align` 64, dQ / dK with `half_align`
            and `split_align` 64 (shares computed 64-wide, the padding in the hi one), each
            with its rings refitted;
and whether each gradient is the same bits under both. First run (H100, 2026-12-05): D=272
159 -> 183 TFLOPS, 320 205 -> 216, 328 138 -> 155, 336 168 -> 189, 400 168 -> 196, 448 223 ->
225, the same bits.
"""

from __future__ import annotations

from perf import experiment

HEAD_DIMS = (272, 320, 328, 336, 400, 448)
HEADS, N = 32, 8192


def _problem(d: int):
    return experiment.self_problem(d, HEADS, N)


def variants(d: int) -> dict:
    """{name: [(kernel class, cfg)] of dQ, dK, dV} at D=d."""
    from ffpa_cute import dispatch
    from ffpa_cute.sm90 import config as sm90_config

    planned = sm90_config.plan_bwd(_problem(d), lines=False)
    split = sm90_config.line_shares_bwd(_problem(d), planned)
    return {name: [(dispatch.kernel_class(c), c) for c in cfgs]
            for name, cfgs in (("planned", planned), ("split", split))}


def jobs() -> list:
    fwd = experiment.forward_jobs(experiment.routed_fwd(_problem(d))
                                  for d in HEAD_DIMS)   # the forward that makes out and lse
    return fwd + [job for d in HEAD_DIMS for kernels in variants(d).values() for job in kernels]


def run(dev, flush) -> dict:
    import torch

    import ffpa_cute
    from ffpa_cute import launch

    res = {}
    for d in HEAD_DIMS:
        q, k, v, do = (torch.randn(1, HEADS, N, d, device=dev, dtype=torch.bfloat16)
                       for _ in range(4))
        out, lse = ffpa_cute.attention(q, k, v, return_lse=True)
        scalars = launch.kernel_scalars(_problem(d), 0)
        times, grads = {}, {}
        inputs = dict(q=q, k=k, v=v, do=do, o=out, lse=lse, delta=torch.zeros_like(lse))
        for name, kernels in variants(d).items():
            times[name], grads[name] = experiment.time_grad_jobs(kernels, inputs, scalars, dev,
                                                                 flush)
        same = [torch.equal(a, b) for a, b in zip(grads["planned"], grads["split"])]
        line = []
        for name, ms in times.items():
            total = sum(ms.values())
            tf = 2.5 * 4 * HEADS * N * N * d / total / 1e9
            line.append(f"{name} " + " ".join(f"{n[8:10]} {t:.2f}" for n, t in ms.items())
                        + f" = {total:.2f} ms {tf:.0f}")
            res[f"{d}-{name}"] = dict(times_ms=ms, total_ms=total, tflops=tf)
        res[f"{d}-same_bits"] = same
        print(f"D={d:4d} " + " | ".join(line) + f" | same dq/dk/dv {same}", flush=True)
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.split_align_bwd", __doc__, jobs, run))
