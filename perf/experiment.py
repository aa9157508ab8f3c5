"""What the kernel experiments share (perf.fp8_limits, perf.decode_limits, perf.half_align,
perf.half_align_bwd, perf.row_stride, perf.lazy_rescale): the command line, which compiles the
variants into a cache on the CPU box (`--precompile DIR`) or times them on the GPU and
optionally writes the numbers as JSON (`--out FILE`); and their timing (`median_ms`, and
`interleaved_ms` for variants compared with each other). An experiment gives `jobs()`,
the (kernel class, config) pairs it times, and `run(dev, flush)`, which times them on the CUDA
device `dev` with `flush` (perf.timing.L2Flusher) and returns its numbers."""

from __future__ import annotations

import argparse
import json


def median_ms(fn, dev, flush, rounds: int = 3) -> float:
    """fn's time in ms: the median of `rounds` benches (perf.timing.bench, L2 flushed before
    each call by `flush`), each itself a median of many calls."""
    import statistics

    from perf.timing import bench

    return statistics.median(bench(fn, dev, flush=flush).median_ms for _ in range(rounds))


def interleaved_ms(fns: dict, dev, flush, rounds: int = 5) -> dict:
    """{name: ms} of the callables `fns`: each benched once per round (perf.timing.bench, L2
    flushed by `flush`), the variants in an order rotated by one each round, and the median over
    the rounds. A drift of the GPU's speed over a run then reaches every variant alike: timed
    one after the other, the first variant of a run read up to 11% higher than the same kernel
    timed later (perf.fp8_limits, docs/perf-log.md 2026-12-05, session 25). Call each fn once
    before (the first call is not timed)."""
    import statistics

    from perf.timing import bench

    names = list(fns)
    times = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(bench(fns[n], dev, flush=flush).median_ms)
    return {n: statistics.median(t) for n, t in times.items()}


def stamped_rate(fn, clk, per_cta: int, dev, flush) -> dict:
    """A microbenchmark whose CTAs stamp clock64 before and after their work into clk [CTAs,
    2] (perf.reduce_limits, perf.dsmem_limits), each moving per_cta bytes: {ms (median_ms of
    fn, called once before), bytes_per_clock_sm (per_cta over the median CTA's cycles),
    tb_per_s (all CTAs' bytes over the wall time)}."""
    import statistics

    fn()   # warm
    ms = median_ms(fn, dev, flush)
    cyc = (clk[:, 1] - clk[:, 0]).double().cpu().tolist()
    return dict(ms=ms, bytes_per_clock_sm=per_cta / statistics.median(cyc),
                tb_per_s=clk.shape[0] * per_cta / ms / 1e9)


def forward_jobs(plans) -> list:
    """The distinct (kernel class, config) pairs of forward plans, in order (an experiment's
    `jobs()`)."""
    out = []
    for plan in plans:
        if (plan.kernel_cls, plan.cfg) not in out:
            out.append((plan.kernel_cls, plan.cfg))
    return out


def main(prog: str, doc: str, jobs, run, argv=None) -> int:
    """Parse argv; compile `jobs()` into --precompile DIR, or `run(dev, flush) -> dict`
    (written to --out)."""
    ap = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precompile", metavar="DIR")
    ap.add_argument("--out", metavar="FILE", help="write the numbers as JSON")
    a = ap.parse_args(argv)
    if a.precompile:
        from ffpa_cute.cache import JitCache

        cache = JitCache(a.precompile, disk=True)
        for cls, cfg in jobs():
            cache.get(cls, cfg)
        print(f"{prog}: {cache.stats.compiles} compiled into {a.precompile}")
        return 0
    import torch

    from perf.timing import L2Flusher

    dev = torch.device("cuda")
    res = run(dev, L2Flusher(dev))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


__all__ = ["forward_jobs", "main", "median_ms"]
