"""Does skipping O's rescale pay? (`lazy_rescale`, common/softmax.py Note [Lazy rescaling])

    python -m perf.lazy_rescale --precompile DIR     # CPU: compile the variants into a cache
    python -m perf.lazy_rescale [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

The 16-bit forward as planned, with O rescaled every block and with `lazy_rescale` (a row
keeps its max while a block's max exceeds it by at most 2^8, so its factor is 1 and the O
warpgroups skip the row's rescale; routed at LAZY_RESCALE_HEAD_DIMS), bf16, B=1, N=8K unless
noted: the kernel alone (run_fwd), L2 flushed, the two timed in
alternating order over 6 rounds (`experiment.interleaved_ms`), TFLOPS on the visible pairs;
the two outputs' largest difference relative to the largest value.
The FP8 forward's lazy frame is timed by perf.fp8_limits ("lazy").
"""

from __future__ import annotations

import dataclasses

from perf import experiment

# (D, causal, Hq, Hkv, N)
CASES = ((512, False, 32, 32, 8192), (512, False, 32, 32, 16384), (512, True, 32, 32, 8192),
         (512, True, 32, 4, 8192), (320, False, 32, 32, 8192), (384, False, 32, 32, 8192),
         (448, False, 32, 32, 8192), (448, True, 32, 32, 8192))


def _plans(case):
    """The case's forward plan with O rescaled every block, then with `lazy_rescale` (the
    planner routes the second at LAZY_RESCALE_HEAD_DIMS)."""
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    d, causal, hq, hkv, n = case
    p = AttnProblem(dtype="bf16", batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=n, seqlen_kv=n,
                    head_dim=d, head_dim_v=d, causal=causal)
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options())
    return tuple(dataclasses.replace(plan, cfg=dataclasses.replace(plan.cfg, lazy_rescale=on))
                 for on in (False, True))


def jobs() -> list:
    return experiment.forward_jobs(plan for case in CASES for plan in _plans(case))


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch
    from perf.flops import attn_flops_fwd

    res = {}
    for case in CASES:
        d, causal, hq, hkv, n = case
        q = torch.randn(1, hq, n, d, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(1, hkv, n, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        flops = attn_flops_fwd(1, hq, n, n, d, causal)
        row, outs, fns = {}, [], {}
        for name, plan in zip(("every block", "lazy"), _plans(case)):
            fns[name] = lambda plan=plan: launch.run_fwd(plan, q, k, v)  # noqa: E731
            outs.append(fns[name]()[0].float())
        for name, ms in experiment.interleaved_ms(fns, dev, flush, rounds=6).items():
            row[name] = flops / ms / 1e9
        row["diff"] = ((outs[1] - outs[0]).abs().max() / outs[0].abs().max()).item()
        key = f"D={d} {'causal' if causal else 'full'} {hq}/{hkv} N={n}"
        res[key] = row
        print(f"{key}: every block {row['every block']:.0f}, lazy {row['lazy']:.0f} TFLOPS, "
              f"diff {row['diff']:.3g}", flush=True)
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.lazy_rescale", __doc__, jobs, run))
