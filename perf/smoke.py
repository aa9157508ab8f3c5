"""Quick kernel smoke test for a new kernel on the GPU: each case in its own subprocess with a
timeout (a deadlocked pipeline shows up as TIMEOUT instead of hanging the device call), error vs
a float64 reference, and forward TFLOPS for the larger shapes.

    python -m perf.smoke --family sm90 --cases "512:1000:1000:0,320:129:7:1" --timeout 60
    python -m perf.smoke --family sm90 --bench "512:8192:0,512:8192:1,320:8192:0"

A case is D:Nq:Nkv:causal[:ratio[:fp16]] (causal 1 = bottom-right); a bench is
D:N:causal[:field=value;field=value], timed at B=1, H=32 with CUDA events (no L2 flush: compare
variants with each other, report with perf.sweep). Fields override the planned config, e.g.
"512:8192:0:publish_after=2;k_stages=3".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _one_case(spec: str) -> dict:
    import torch

    from ffpa_cute import dispatch
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.reference import attention_ref, attention_same_dtype, rel_err

    parts = [int(x) for x in spec.split(":")]
    d, nq, nkv, causal = parts[:4]
    ratio = parts[4] if len(parts) > 4 else 1
    dtype = torch.float16 if len(parts) > 5 and parts[5] else torch.bfloat16
    hkv = 2
    torch.manual_seed(nq * 7 + nkv + d)
    q = torch.randn(1, hkv * ratio, nq, d, device="cuda", dtype=dtype)
    k = torch.randn(1, hkv, nkv, d, device="cuda", dtype=dtype)
    v = torch.randn(1, hkv, nkv, d, device="cuda", dtype=dtype)
    off = nkv - nq
    plan = dispatch.plan_fwd(AttnProblem.from_tensors(q, k, v, causal=bool(causal),
                                                      causal_offset=off))
    out, lse = dispatch.run_fwd(plan, q, k, v)
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

    from ffpa_cute import dispatch
    from ffpa_cute.problem import AttnProblem

    import dataclasses

    fields = spec.split(":")
    d, n, causal = [int(x) for x in fields[:3]]
    over = dict(kv.split("=") for kv in fields[3].split(";")) if len(fields) > 3 else {}
    q, k, v = (torch.randn(1, 32, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    plan = dispatch.plan_fwd(AttnProblem.from_tensors(q, k, v, causal=bool(causal),
                                                      causal_offset=0))
    if over:
        cfg = dataclasses.replace(plan.cfg, **{f: int(x) for f, x in over.items()})
        plan = dataclasses.replace(plan, cfg=cfg)
    fn = lambda: dispatch.run_fwd(plan, q, k, v)  # noqa: E731
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(30):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    pairs = n * (n + 1) // 2 if causal else n * n
    return {"bench": spec, "kernel": plan.kernel_cls.__name__, "ms": ms,
            "tflops": 4 * 32 * pairs * d / ms / 1e9, "cfg": str(plan.cfg)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="sm90")
    ap.add_argument("--cases", default="")
    ap.add_argument("--bench", default="")
    ap.add_argument("--timeout", type=int, default=90)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--one-bench", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(_one_case(a.one)))
        return
    if a.one_bench:
        print(json.dumps(_one_bench(a.one_bench)))
        return
    env = dict(os.environ, FFPA_CUTE_ARCH=a.family)
    jobs = [("--one", c) for c in a.cases.split(",") if c]
    jobs += [("--one-bench", b) for b in a.bench.split(",") if b]
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
