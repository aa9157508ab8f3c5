"""Quick kernel smoke test for a new kernel on the GPU: each case in its own subprocess with a
timeout (a deadlocked pipeline shows up as TIMEOUT instead of hanging the device call), error vs
a float64 reference, and forward TFLOPS for the larger shapes.

    python -m perf.smoke --family sm90 --cases "512:1000:1000:0,320:129:7:1" --timeout 60
    python -m perf.smoke --family sm90 --bench "512:8192:0,512:8192:1,320:8192:0"
    python -m perf.smoke --family sm90 --first-call 512,320 --overhead 512
    python -m perf.smoke --family sm90 --bench-bwd "512:8192:0,512:8192:1,512:8192:0:8"
    python -m perf.smoke --family sm90 --bench-bwd "512:8192:0:32:noseq"  # dK variant
    python -m perf.smoke --family sm90 --decode "512:8192:32:8:8,576:4096:128:1:4:512"

--first-call D,...: wall time of the first `attention()` call per head dim in a fresh process with
an empty ffpa_cute cache and the DSL's file cache off (what a user's first call pays; issue 4
asks for <= 10 s). --overhead D: a cached call's wall time on a tiny shape (B=1, H=1, N=1) minus
the kernel time of the same call (CUDA events), i.e. the host overhead (issue 4: < 20 µs).

--family picks the kernel family (`Options.family`, through FFPA_CUTE_ARCH in each job's
subprocess).

A case is D:Nq:Nkv:causal[:ratio[:fp16]][:overrides] (causal 1 = bottom-right); a bench is
D:N:causal[:field=value;field=value], timed at B=1, H=32 with CUDA events (no L2 flush: compare
variants with each other, report with perf.sweep). Fields override the planned config, e.g.
"512:8192:0:publish_after=2;k_stages=3" (with --family sm80: "512:8192:0:warp_layout=m2n4").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _override(plan, text: str):
    """plan with config fields replaced: text = "field=int;field=int" ("" = unchanged)."""
    import dataclasses

    if not text:
        return plan
    over = dict(kv.split("=") for kv in text.split(";"))

    def value(field, text):  # int/bool fields from integers, str fields (warp_layout) as is
        kind = type(getattr(plan.cfg, field))
        return text if kind is str else kind(int(text))

    cfg = dataclasses.replace(plan.cfg, **{f: value(f, x) for f, x in over.items()})
    return dataclasses.replace(plan, cfg=cfg)


def _median_ms(fn, reps: int) -> float:
    """Median CUDA-event time of fn() over reps calls, after one warm-up call."""
    import torch

    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2]


def _one_case(spec: str) -> dict:
    import torch

    from ffpa_cute import dispatch, launch
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.reference import attention_ref, attention_same_dtype, rel_err

    fields = spec.split(":")
    over = fields.pop() if "=" in fields[-1] else ""
    parts = [int(x) for x in fields]
    d, nq, nkv, causal = parts[:4]
    ratio = parts[4] if len(parts) > 4 else 1
    dtype = torch.float16 if len(parts) > 5 and parts[5] else torch.bfloat16
    hkv = 2
    torch.manual_seed(nq * 7 + nkv + d)
    q = torch.randn(1, hkv * ratio, nq, d, device="cuda", dtype=dtype)
    k = torch.randn(1, hkv, nkv, d, device="cuda", dtype=dtype)
    v = torch.randn(1, hkv, nkv, d, device="cuda", dtype=dtype)
    off = nkv - nq
    plan = _override(dispatch.plan_fwd(AttnProblem.from_tensors(q, k, v, causal=bool(causal),
                                                                causal_offset=off)), over)
    out, lse = launch.run_fwd(plan, q, k, v)
    torch.cuda.synchronize()
    ref, ref_lse = attention_ref(q, k, v, causal=bool(causal), causal_offset=off)
    base, _ = attention_same_dtype(q, k, v, causal=bool(causal), causal_offset=off)
    err, base_err = rel_err(out, ref), rel_err(base, ref)
    finite = torch.isfinite(ref_lse)
    lse_err = (lse.float() - ref_lse.float())[finite].abs().max().item() if finite.any() else 0.0
    return {"case": spec, "kernel": plan.kernel_cls.__name__ if plan.reason is None else None,
            "err": err, "torch_err": base_err, "lse_maxdiff": lse_err,
            "ok": err <= 2 * base_err + 1e-3 and lse_err < 1e-2}


def _one_bench(spec: str) -> dict:
    import torch

    from ffpa_cute import dispatch, launch
    from ffpa_cute.problem import AttnProblem

    fields = spec.split(":")
    d, n, causal = [int(x) for x in fields[:3]]
    q, k, v = (torch.randn(1, 32, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    plan = _override(dispatch.plan_fwd(AttnProblem.from_tensors(q, k, v, causal=bool(causal),
                                                                causal_offset=0)),
                     fields[3] if len(fields) > 3 else "")
    ms = _median_ms(lambda: launch.run_fwd(plan, q, k, v), 30)
    pairs = n * (n + 1) // 2 if causal else n * n
    return {"bench": spec, "kernel": plan.kernel_cls.__name__, "ms": ms,
            "tflops": 4 * 32 * pairs * d / ms / 1e9, "cfg": str(plan.cfg)}


def _one_bench_fp8(spec: str) -> dict:
    """The FP8 forward at B=1, Hq=32 (D:N:causal[:Hkv]), e4m3 in, bf16 out: the kernel alone
    (V already transposed) and the whole `attention()` call (with the transpose of V), TFLOPS
    on the 16-bit FLOP count (4 B Hq pairs D)."""
    import torch

    import ffpa_cute
    from ffpa_cute import dispatch, fp8, launch
    from ffpa_cute.problem import AttnProblem

    f = [int(x) for x in spec.split(":")]
    d, n, causal = f[:3]
    hkv = f[3] if len(f) > 3 else 32
    q8, k8, v8 = (torch.randn(1, h, n, d, device="cuda").to(torch.float8_e4m3fn)
                  for h in (32, hkv, hkv))
    ones = torch.ones(1, hkv, device="cuda")
    p = AttnProblem.from_tensors(q8, k8, v8, causal=bool(causal))
    plan = dispatch.plan_fwd(p)
    assert plan.reason is None, plan.reason
    vt = fp8._transposed_v(v8, fp8.vt_interleaved(plan.kernel_cls))
    out = torch.empty(1, 32, n, d, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(1, 32, n, device="cuda")
    (qk, kk, _, o, lo), off = launch.kernel_args(plan, q8, k8, v8, out, lse)
    t = dict(q=qk, k=kk, vt=vt, o=o, lse=lo, q_descale=ones, k_descale=ones, v_descale=ones)
    sc = dict(softmax_scale=p.softmax_scale, causal_offset=off)
    kernel_ms = _median_ms(lambda: launch.run_job(plan.kernel_cls, plan.cfg, t, sc), 20)
    call_ms = _median_ms(lambda: ffpa_cute.attention(q8, k8, v8, is_causal=bool(causal),
                                                     enable_gqa=hkv != 32), 20)
    pairs = n * (n + 1) // 2 if causal else n * n
    flop = 4 * 32 * pairs * d
    return {"bench_fp8": spec, "cfg": str(plan.cfg), "kernel_ms": round(kernel_ms, 3),
            "kernel_tflops": round(flop / kernel_ms / 1e9, 1),
            "call_tflops": round(flop / call_ms / 1e9, 1)}


def _one_decode(spec: str) -> dict:
    """Forward at Nq = Nq_: D:Nkv:Hq:Hkv:B[:Dv[:Nq]], bf16, as one head per tile and with GQA rows
    packed (`Options.pack_gqa`). Both variants' outputs are compared bit for bit."""
    import torch

    import ffpa_cute
    from ffpa_cute import dispatch, launch
    from ffpa_cute.problem import AttnProblem

    f = [int(x) for x in spec.split(":")]
    d, nkv, hq, hkv, b = f[:5]
    dv = f[5] if len(f) > 5 else d
    nq = f[6] if len(f) > 6 else 1
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, nkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, hkv, nkv, dv, device="cuda", dtype=torch.bfloat16)
    res, outs = {"decode": spec}, []
    for pack in (False, True):
        with ffpa_cute.options.use(pack_gqa=pack):
            plan = dispatch.plan_fwd(AttnProblem.from_tensors(q, k, v))
        assert plan.reason is None, plan.reason
        ms = _median_ms(lambda: launch.run_fwd(plan, q, k, v), 30)
        outs.append(launch.run_fwd(plan, q, k, v))
        key = "packed" if plan.packed else "per_head"
        res[key] = {"us": round(ms * 1e3, 1),
                    "tflops": round(2 * b * hq * nq * nkv * (d + dv) / ms / 1e9, 1)}
    res["same_bits"] = all(torch.equal(a, c) for a, c in zip(*outs))
    return res


def _first_call(d: int) -> dict:
    import time

    import torch

    from ffpa_cute import attention

    q, k, v = (torch.randn(1, 4, 256, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    torch.cuda.synchronize()
    t = time.perf_counter()
    attention(q, k, v, strict=True)
    torch.cuda.synchronize()
    return {"first_call_d": d, "seconds": round(time.perf_counter() - t, 2)}


def us_per_call(call, n: int = 2000) -> float:
    """Wall µs per call of `call()` over n calls after 20 warm-up calls, device synchronised
    before and after (host cost plus whatever the GPU does not hide)."""
    import time

    import torch

    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def _overhead(d: int) -> dict:
    """Host overhead of a cached call, without and with the per-signature launcher
    (`Options.fast_launch`), and of a call with gradients (the autograd path); the kernel time
    from a CUDA-graph replay of the same call."""

    import torch

    import ffpa_cute
    from ffpa_cute import attention, interface

    q, k, v = (torch.randn(1, 1, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    n = 2000
    walls = {}
    for fast in (False, True):
        with ffpa_cute.options.use(fast_launch=fast):
            interface._clear_caches()
            walls[fast] = us_per_call(lambda: attention(q, k, v, strict=True), n)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    walls["grad"] = us_per_call(lambda: attention(qg, kg, vg, strict=True), n)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph = torch.cuda.CUDAGraph()  # the kernel alone: the same call replayed from a graph
    with torch.cuda.graph(graph):
        attention(q, k, v, strict=True)
    graph.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    gpu_us = start.elapsed_time(end) / n * 1e3
    res = {"overhead_d": d, "call_us": round(walls[False], 1), "graph_replay_us": round(gpu_us, 1),
           "host_overhead_us": round(walls[False] - gpu_us, 1),
           "host_overhead_fast_launch_us": round(walls[True] - gpu_us, 1),
           "host_overhead_grad_us": round(walls["grad"] - gpu_us, 1)}
    res.update(_launch_paths(q, k, v, n))
    return res


def _launch_paths(q, k, v, n: int) -> dict:
    """The launch alone: the per-signature launcher (`launch.FwdCall`: outputs allocated, the
    kernel called through cutlass-dsl's TVM-FFI convention), no routing."""
    from ffpa_cute import dispatch, launch
    from ffpa_cute.problem import AttnProblem

    plan = dispatch.plan_fwd(AttnProblem.from_tensors(q, k, v))
    fwd = launch.FwdCall(plan, q, k, v)
    assert fwd(q, k, v) is not None
    return {"launch_us": round(us_per_call(lambda: fwd(q, k, v), n), 1)}


def _one_bench_bwd(spec: str) -> dict:
    """The atomic-free backward's kernels (Delta, dQ, dK, dV, each timed alone) at B=1, H=32:
    D:N:causal[:Hkv][:noseq] ("noseq": dK without `seq_scores`, the two-accumulator variant)."""
    import dataclasses

    import torch

    from ffpa_cute import dispatch, launch, options
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.sm90 import config as sm90_config

    parts = spec.split(":")
    noseq = parts[-1] == "noseq"
    if noseq:
        parts.pop()
    fields = [int(x) for x in parts]
    d, n, causal = fields[:3]
    hkv = fields[3] if len(fields) > 3 else 32
    q, do = (torch.randn(1, 32, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, hkv, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    problem = AttnProblem.from_tensors(q, k, v, causal=bool(causal), causal_offset=0)
    out, lse = launch.run_fwd(dispatch.plan_fwd(problem), q, k, v)
    # the atomic-free kernels (`deterministic`): each timed alone
    plan = dispatch.plan_bwd(problem, opts=dataclasses.replace(options.current(),
                                                               deterministic=True))
    assert plan.reason is None, plan.reason
    if noseq:
        cfgs = [sm90_config.plan_dk(problem, seq_scores=False)
                if isinstance(c, sm90_config.BwdDKConfigSm90) else c for c in plan.cfgs]
        plan = dataclasses.replace(plan, cfgs=tuple(cfgs))
    t = dict(q=q, k=k, v=v, do=do, o=out, lse=lse, delta=torch.empty_like(lse),
             dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))
    scalars = launch.kernel_scalars(problem, 0)
    times = {}
    for cls, cfg in plan.jobs:  # dV / dK with `group_split`: the workspace sum included
        times[cls.__name__] = _median_ms(lambda: launch.run_grad_job(cls, cfg, t, scalars), 10)
    pairs = n * (n + 1) // 2 if causal else n * n
    total = sum(times.values())
    return {"bench_bwd": spec, "ms": {k_: round(t_, 3) for k_, t_ in times.items()},
            "tflops": 2.5 * 4 * 32 * pairs * d / total / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="sm90")
    ap.add_argument("--cases", default="")
    ap.add_argument("--bench", default="")
    ap.add_argument("--bench-bwd", default="",
                    help="D:N:causal[:Hkv][:noseq],... the backward's kernels, each timed")
    ap.add_argument("--bench-fp8", default="",
                    help="D:N:causal[:Hkv],... the FP8 forward (kernel alone, whole call)")
    ap.add_argument("--decode", default="",
                    help="D:Nkv:Hq:Hkv:B[:Dv[:Nq]],... one head per tile vs GQA rows packed")
    ap.add_argument("--first-call", default="")
    ap.add_argument("--overhead", default="")
    ap.add_argument("--timeout", type=int, default=90)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--one-bench", help=argparse.SUPPRESS)
    ap.add_argument("--one-first", help=argparse.SUPPRESS)
    ap.add_argument("--one-bench-bwd", help=argparse.SUPPRESS)
    ap.add_argument("--one-overhead", help=argparse.SUPPRESS)
    ap.add_argument("--one-decode", help=argparse.SUPPRESS)
    ap.add_argument("--one-bench-fp8", help=argparse.SUPPRESS)
    a = ap.parse_args()
    # inside a per-job subprocess: run that one job and print its JSON line
    one = {"one_first": lambda x: _first_call(int(x)), "one_bench_bwd": _one_bench_bwd,
           "one_decode": _one_decode, "one_overhead": lambda x: _overhead(int(x)),
           "one": _one_case, "one_bench": _one_bench, "one_bench_fp8": _one_bench_fp8}
    for name, job in one.items():
        if getattr(a, name):
            print(json.dumps(job(getattr(a, name))))
            return
    import tempfile

    env = dict(os.environ, FFPA_CUTE_ARCH=a.family)
    jobs = [("--one", c) for c in a.cases.split(",") if c]
    jobs += [("--one-bench", b) for b in a.bench.split(",") if b]
    jobs += [("--one-overhead", d) for d in a.overhead.split(",") if d]
    jobs += [("--one-bench-bwd", b) for b in a.bench_bwd.split(",") if b]
    jobs += [("--one-decode", b) for b in a.decode.split(",") if b]
    jobs += [("--one-bench-fp8", b) for b in a.bench_fp8.split(",") if b]
    for d in [d for d in a.first_call.split(",") if d]:
        fresh = tempfile.mkdtemp(prefix="ffpa_cute_cold_")
        cold = dict(env, FFPA_CUTE_CACHE_DIR=fresh, CUTE_DSL_DISABLE_FILE_CACHING="1")
        r = subprocess.run([sys.executable, "-m", "perf.smoke", "--one-first", d], env=cold,
                           capture_output=True, text=True, timeout=a.timeout)
        out = r.stdout.strip().splitlines()
        print(f"first call D={d}: {out[-1] if r.returncode == 0 and out else r.stderr[-600:]}",
              flush=True)
    for flag, spec in jobs:
        try:
            r = subprocess.run([sys.executable, "-m", "perf.smoke", flag, spec], env=env,
                               capture_output=True, text=True, timeout=a.timeout)
            line = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() \
                else f"FAILED rc={r.returncode}: {r.stderr.strip()[-600:]}"
        except subprocess.TimeoutExpired:
            line = f"TIMEOUT after {a.timeout} s"
        print(f"{spec}: {line}", flush=True)


if __name__ == "__main__":
    main()
