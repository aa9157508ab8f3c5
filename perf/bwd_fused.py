"""The fused backward (5 GEMM units, sm90/bwd_fused_sm90.py) beside the routed atomic-free one
(8 units), issue 17's first measurement.

    python -m perf.bwd_fused --precompile DIR     # CPU: compile both backwards into a cache
    python -m perf.bwd_fused [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

Per case, each backward through `launch.run_bwd` (Delta, the gradient kernels, the fused one's
zeroed dq_acc and its cast: the host path a call would take), L2 flushed, median of 3 benches;
TFLOPS = 2.5 x 4 B Hq (visible pairs) D: the routed backward, the fused one, and at D=512 the
fused one with `red_v4` (dQ reduced 16 bytes per instruction) and with `persistent` (resident
clusters walking the tiles: no cluster launch per tile). Before timing, each fused
variant's gradients are checked against the routed ones (relative error < 1e-2 each; the same
products in another summation order).

Prediction (docs/design.md section 4, "The fused backward"): at the atomic-free kernels' rate
per executed unit (8 units in 42 ms at D=512, N=8K: 5.3 ms each) the fused one's 5 units take
~26 ms plus the exchange and the dQ reductions on the S warpgroup's path: 330-400 TFLOPS at
D=512 against 258.
"""

from __future__ import annotations

from perf import experiment

B = 1
# (D, causal, Hq, Hkv, N)
CASES = ((512, False, 32, 32, 8192), (512, True, 32, 32, 8192), (512, True, 32, 4, 8192),
         (512, True, 64, 1, 8192), (512, False, 32, 32, 16384), (320, False, 32, 32, 8192),
         (384, False, 32, 32, 8192), (448, False, 32, 32, 8192))


def _problem(d, causal, hq, hkv, n):
    from ffpa_cute.problem import AttnProblem

    return AttnProblem(dtype="bf16", batch=B, heads_q=hq, heads_kv=hkv, seqlen_q=n,
                       seqlen_kv=n, head_dim=d, head_dim_v=d, causal=causal)


def plans(case) -> dict:
    """{label: plan} of a case on sm_90a: "routed" (the atomic-free kernels), "fused", and at
    D=512 "fused v4" (`red_v4`) and "fused persistent" (`persistent`)."""
    import dataclasses

    from ffpa_cute import dispatch
    from ffpa_cute.common.config import DeltaConfig
    from ffpa_cute.options import Options
    from ffpa_cute.sm90.config import plan_bwd_fused

    p = _problem(*case)
    out = {"routed": dispatch.plan_bwd(p, target="sm_90a", opts=Options(family="sm90"))}
    cfg = plan_bwd_fused(p, "sm_90a")
    for label, c in (("fused", cfg), ("fused v4", dataclasses.replace(cfg, red_v4=True)),
                     ("fused persistent", dataclasses.replace(cfg, persistent=True))):
        if label == "fused" or p.head_dim == 512:
            out[label] = dispatch.BwdPlan(p, "sm_90a", "sm90", cfgs=(
                DeltaConfig("sm_90a", p.dtype, p.head_dim_v), c))
    return out


def jobs() -> list:
    out = []
    for case in CASES:
        for plan in plans(case).values():
            out.extend(j for j in plan.jobs if j not in out)
    return out


def run(dev, flush) -> dict:
    import torch

    import ffpa_cute
    from ffpa_cute import launch
    from ffpa_cute.reference import rel_err
    from perf.flops import attn_flops_bwd

    res = {}
    for case in CASES:
        d, causal, hq, hkv, n = case
        q, do = (torch.randn(B, hq, n, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(B, hkv, n, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        out, lse = ffpa_cute.attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv,
                                       return_lse=True)
        label = f"D={d} {'causal' if causal else 'full'} {hq}/{hkv} N={n}"
        variants = plans(case)
        ref = launch.run_bwd(variants["routed"], q, k, v, out, lse, do)
        flops = attn_flops_bwd(B, hq, n, n, d, causal)
        row = {}
        for name, plan in variants.items():
            errs = None
            if name != "routed":
                got = launch.run_bwd(plan, q, k, v, out, lse, do)
                errs = [rel_err(x, r.double()) for x, r in zip(got, ref)]
                assert max(errs) < 1e-2, (label, name, errs)
            fn = lambda p=plan: launch.run_bwd(p, q, k, v, out, lse, do)  # noqa: E731
            ms = experiment.median_ms(fn, dev, flush)
            row[name] = dict(ms=ms, tflops=flops / ms / 1e9, errs=errs)
        print(f"{label}: " + ", ".join(
            f"{name} {r['ms']:.2f} ms {r['tflops']:.0f} TFLOPS" for name, r in row.items())
            + "; dq/dk/dv vs routed " + " | ".join(
                " ".join(f"{e:.1e}" for e in r["errs"]) for r in row.values() if r["errs"]),
            flush=True)
        res[label] = row
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.bwd_fused", __doc__, jobs, run))
