"""What the kernel experiments share (perf.fp8_limits, perf.decode_limits, perf.half_align,
perf.half_align_bwd, perf.row_stride, perf.lazy_rescale, perf.split_align, perf.cta_align,
perf.pad_d): the command line, which compiles the variants into a cache on the CPU box
(`--precompile DIR`) or times them on the GPU and
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


def time_grad_jobs(jobs, inputs: dict, scalars: dict, dev, flush) -> tuple[dict, tuple]:
    """Each gradient kernel of `jobs` ([(kernel class, config)]) timed alone
    (`launch.run_grad_job`, called once before, `median_ms`) on `inputs` (q, k, v, do, o, lse,
    delta) with fresh dq, dk, dv: ({kernel class name: ms}, (dq, dk, dv))."""
    import torch

    from ffpa_cute import launch

    t = dict(inputs, dq=torch.empty_like(inputs["q"]), dk=torch.empty_like(inputs["k"]),
             dv=torch.empty_like(inputs["v"]))
    times = {}
    for cls, cfg in jobs:
        fn = lambda c=cls, g=cfg: launch.run_grad_job(c, g, t, scalars)  # noqa: E731
        fn()
        times[cls.__name__] = median_ms(fn, dev, flush)
    return times, (t["dq"], t["dk"], t["dv"])


def _distinct(pairs) -> list:
    """`pairs` without repeats, in order (a list: configs hash, kernel classes compare)."""
    out = []
    for pair in pairs:
        if pair not in out:
            out.append(pair)
    return out


def forward_jobs(plans) -> list:
    """The distinct (kernel class, config) pairs of forward plans, in order (an experiment's
    `jobs()`)."""
    return _distinct((plan.kernel_cls, plan.cfg) for plan in plans)


def bench_jobs(cls, configs) -> list:
    """The distinct (cls, config) pairs of a microbenchmark's configs, in order (its `jobs()`;
    several variants share a config and differ in their launch)."""
    return _distinct((cls, cfg) for cfg in configs)


def self_problem(d: int, heads: int = 32, n: int = 8192):
    """The forward experiments' problem: bf16 self-attention, B=1, `heads` heads, N=`n`, D=d,
    not causal."""
    from ffpa_cute.problem import AttnProblem

    return AttnProblem(dtype="bf16", batch=1, heads_q=heads, heads_kv=heads, seqlen_q=n,
                       seqlen_kv=n, head_dim=d, head_dim_v=d, causal=False)


def routed_fwd(problem):
    """The sm_90a forward plan the router picks for `problem` (default options)."""
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options

    return dispatch.plan_fwd(problem, target="sm_90a", opts=Options())


def refit(plan, **fields):
    """`plan` with its config's `fields` replaced and the deepest rings that then fit
    (`deepest_rings`); raises ValueError when none does."""
    import dataclasses

    from ffpa_cute.common.config import deepest_rings
    from ffpa_cute.sm90 import config as sm90_config

    cfg = deepest_rings(lambda k, v: dataclasses.replace(plan.cfg, **fields, k_stages=k,
                                                         v_stages=v), sm90_config.can_implement)
    return dataclasses.replace(plan, cfg=cfg)


def time_forward_variants(head_dims, variants, dev, flush, heads: int = 32, n: int = 8192,
                          shape=lambda cfg: cfg.dv_halves) -> dict:
    """Time each D's forward plans `variants(d)` ({name: plan}, the first the reference) on
    the same random bf16 q, k, v ([1, heads, n, d]; `launch.run_fwd`, `interleaved_ms`),
    check each one's out / lse against the reference's bits, print a line per D and return
    {D: {ms, tflops, same_bits, configs}}. `shape(cfg)`: what the line shows of a config."""
    import torch

    from ffpa_cute import launch

    res = {}
    for d in head_dims:
        plans = variants(d)
        q, k, v = (torch.randn(1, heads, n, d, device=dev, dtype=torch.bfloat16)
                   for _ in range(3))
        fns = {name: (lambda p=p: launch.run_fwd(p, q, k, v)) for name, p in plans.items()}
        first, *others = fns
        ref = fns[first]()
        same = {name: all(map(torch.equal, fns[name](), ref)) for name in others}
        ms = interleaved_ms(fns, dev, flush)
        tf = {name: 4 * heads * n * n * d / t / 1e9 for name, t in ms.items()}
        shapes = {name: shape(p.cfg) for name, p in plans.items()}
        print(f"D={d:4d} " + "  ".join(f"{m} {ms[m]:6.3f} ms {tf[m]:5.0f}" for m in ms)
              + f"  same bits as {first}: {same}  {shapes}", flush=True)
        res[str(d)] = dict(ms=ms, tflops=tf, same_bits=same,
                           configs={name: repr(p.cfg) for name, p in plans.items()})
    return res


def ptxas_summary(ptx: str) -> str:
    """ptxas -v's verdict on sm_90a PTX for a CPU probe: registers, spill stores and the
    distinct WGMMA shapes ("?" without ptxas)."""
    import re

    from tests.test_kernels_compile import _ptxas_log

    log = _ptxas_log(ptx, "sm_90a") or ""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    atoms = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx)))
    return (f"{regs.group(1) if regs else '?'} registers, "
            f"{spills.group(1) if spills else '?'} B of spill stores, WGMMAs {atoms}")


def probe_main(prog: str, doc: str, jobs, run, probe_lines, argv=None) -> int:
    """The command line of an experiment whose bare form is a CPU probe: with --time or
    --precompile `main` (--time dropped), else each line of `probe_lines()` printed as it
    comes."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    if "--time" in argv or "--precompile" in argv:
        return main(prog, doc, jobs, run, [a for a in argv if a != "--time"])
    for line in probe_lines():
        print(line, flush=True)
    return 0


def main(prog: str, doc: str, jobs, run, argv=None) -> int:
    """Parse argv; compile `jobs()` into --precompile DIR, or `run(dev, flush) -> dict`
    (written to --out)."""
    ap = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precompile", metavar="DIR")
    ap.add_argument("--shard", metavar="I/N", default="0/1",
                    help="with --precompile: compile only jobs I, I + N, I + 2N, ... (N "
                         "processes, each in its own working directory, fill one cache)")
    ap.add_argument("--out", metavar="FILE", help="write the numbers as JSON")
    a = ap.parse_args(argv)
    if a.precompile:
        from ffpa_cute.cache import JitCache

        i, n = (int(x) for x in a.shard.split("/"))
        cache = JitCache(a.precompile, disk=True, jit="allow")
        for cls, cfg in jobs()[i::n]:
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


__all__ = ["bench_jobs", "forward_jobs", "main", "median_ms", "probe_main", "ptxas_summary",
           "refit", "routed_fwd", "self_problem", "time_forward_variants", "time_grad_jobs"]
