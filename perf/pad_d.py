"""What holds the forward's D % 64 != 0 sizes below their neighbours? (issue 20's cliffs)

    python -m perf.pad_d --precompile DIR     # CPU: compile the planned configs into DIR
    python -m perf.pad_d [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

The curve across D (perf.sweep --head-dims all, H100, a7bd98b) reads the D % 64 != 0 sizes
13-50% below the multiples of 64 next to them (D=504 11.4 ms against D=512's 7.3 with the same
O halves and the same WGMMA work). The first version of this experiment (dadbe0f, six D)
found the rows' alignment to be most of it on the H100: the same kernel on rows padded to 128
bytes ran D=504 11.37 -> 8.86 ms, 312 8.10 -> 6.42, 376 8.68 -> 7.06, 264 6.85 -> 6.03, while
zero-padding D to the next multiple of 64 (its kernel plus the copies) was slower than that.
This version times, at every D % 64 != 0 in [264, 504] (B=1, H=32, N=8K, bf16, not causal; L2
flushed; `interleaved_ms`):
  contig   the planned kernel on contiguous inputs, as they are;
  repack   `launch.row_aligned` copies of q, k, v, then the same kernel (the copies counted:
           what `launch.repack_rows` does inside `run_fwd`);
  kv       only k and v copied: the forward streams K and V through every row tile but reads
           each Q tile once, so Q's split sectors should cost ~1 / (2 N / 128) of the stream
           and its copy a third of repack's (prediction: kv 3-4% faster than repack at N=8K);
  rows     the same kernel on rows padded beforehand (repack - rows: the copies' cost);
  tile     at TILE_HEAD_DIMS, the planned kernel with one CTA per row tile instead of
           persistent CTAs, on the padded rows (and whether its out and lse are the same bits
           as the planned kernel's). (The measurement that routed persistent CTAs at these D
           timed the opposite way round, when one CTA per tile was planned.);
and the routed (deterministic) backward at BWD_HEAD_DIMS as contig and repack (q, k, v and
dout copied; `launch.run_bwd`'s kernels, Delta included).
"""

from __future__ import annotations

from perf import experiment

HEAD_DIMS = tuple(d for d in range(264, 512, 8) if d % 64)
TILE_HEAD_DIMS = (264, 328, 376, 400, 440, 504)
BWD_HEAD_DIMS = (312, 440, 504)
HEADS, N = 32, 8192


def _plan(d: int):
    return experiment.routed_fwd(experiment.self_problem(d, HEADS, N))


def _bwd_plan(d: int):
    from ffpa_cute import dispatch

    return dispatch.plan_bwd(experiment.self_problem(d, HEADS, N), target="sm_90a")


def _one_cta_per_tile(d: int):
    import dataclasses

    plan = _plan(d)
    return dataclasses.replace(plan, cfg=dataclasses.replace(plan.cfg, persistent=False))


def jobs() -> list:
    bwd = [job for d in BWD_HEAD_DIMS for job in _bwd_plan(d).jobs]
    return (experiment.forward_jobs([*map(_plan, HEAD_DIMS),
                                     *map(_one_cta_per_tile, TILE_HEAD_DIMS)])
            + list(dict.fromkeys(bwd)))


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch

    own = launch.repack_rows   # the variants make their own copies (run_fwd's rule off)
    launch.repack_rows = lambda *a: False
    try:
        return _run(dev, flush, torch, launch)
    finally:
        launch.repack_rows = own


def _run(dev, flush, torch, launch) -> dict:
    res = {}
    for d in HEAD_DIMS:
        plan = _plan(d)
        qkv = [torch.randn(1, HEADS, N, d, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        rows = [launch.row_aligned(t) for t in qkv]
        q, k, v = qkv
        fns = {"contig": lambda: launch.run_fwd(plan, *qkv),
               "repack": lambda: launch.run_fwd(plan, *map(launch.row_aligned, qkv)),
               "kv": lambda: launch.run_fwd(plan, q, launch.row_aligned(k),
                                            launch.row_aligned(v)),
               "rows": lambda rows=rows: launch.run_fwd(plan, *rows)}
        if d in TILE_HEAD_DIMS:
            fns["tile"] = lambda rows=rows, pt=_one_cta_per_tile(d): launch.run_fwd(pt, *rows)
            same = all(map(torch.equal, fns["tile"](), fns["rows"]()))
            print(f"D={d:4d} one CTA per tile: the same out and lse as planned: {same}")
        for fn in fns.values():
            fn()
        ms = experiment.interleaved_ms(fns, dev, flush)
        tf = {n: 4 * HEADS * N * N * d / t / 1e9 for n, t in ms.items()}
        print(f"D={d:4d} " + "  ".join(f"{n} {ms[n]:6.3f} ms {tf[n]:5.0f}" for n in ms),
              flush=True)
        res[str(d)] = dict(ms=ms, tflops=tf)
    for d in BWD_HEAD_DIMS:
        plan, fwd = _bwd_plan(d), _plan(d)
        q, k, v, do = (torch.randn(1, HEADS, N, d, device=dev, dtype=torch.bfloat16)
                       for _ in range(4))
        out, lse = launch.run_fwd(fwd, q, k, v)
        fns = {"contig": lambda: launch.run_bwd(plan, q, k, v, out, lse, do),
               "repack": lambda: launch.run_bwd(plan, *map(launch.row_aligned, (q, k, v)),
                                                out, lse, launch.row_aligned(do))}
        for fn in fns.values():
            fn()
        ms = experiment.interleaved_ms(fns, dev, flush)
        tf = {n: 2.5 * 4 * HEADS * N * N * d / t / 1e9 for n, t in ms.items()}
        print(f"bwd D={d:4d} " + "  ".join(f"{n} {ms[n]:6.3f} ms {tf[n]:5.0f}" for n in ms),
              flush=True)
        res[f"bwd-{d}"] = dict(ms=ms, tflops=tf)
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.pad_d", __doc__, jobs, run))
