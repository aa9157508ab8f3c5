"""MLA prefill (Dqk 576, Dv 512, one KV head): Q resident in smem instead of streamed? (issue 20)

    python -m perf.resident_q --precompile DIR     # CPU: compile both configs into DIR
    python -m perf.resident_q [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

Above D=512 the planner streams Q through the K ring (`stream_q`: a [64 x 64] Q chunk beside
each [128 x 64] K chunk), because 64 x D of resident Q does not fit beside the rings at large D.
At D=576 with Dv=512 it does, with shallower rings (K 3 stages, V 2 against the planned 4 / 3:
222208 B of smem). The forward is bound by the L2 -> SM stream at these sizes (perf-log,
session 15: the refills-faked D=512 run 692 against 540 TFLOPS), and streaming Q moves 72 KB of
every block's 344 KB (K 144, Q 72, V 128): resident Q cuts the stream by 21%. D=512 measured
575 TFLOPS with Q resident against 489 streamed (perf-log, the Dv != D entry). Prediction:
MLA prefill 466 -> 520-590 TFLOPS at N=8K causal, unless the shallower rings expose the
loads' latency. Each config through `launch.run_fwd` (the kernel alone), L2 flushed, median
of 3 benches; the outputs of the two compared (a relative error of 1e-2 or more is reported
as WRONG, and the run goes on); TFLOPS on 2 B Hq pairs (Dqk + Dv).
"""

from __future__ import annotations

import dataclasses

from perf import experiment

# (Dqk, Dv, Hq, Hkv, N, causal): MLA prefill, DeepSeek's absorbed shape
CASES = ((576, 512, 128, 1, 8192, True), (576, 512, 128, 1, 4096, True),
         (576, 512, 128, 1, 16384, True), (576, 512, 128, 1, 8192, False))
RESIDENT_STAGES = ((3, 2), (2, 2))   # (K, V) stages tried with Q resident, deepest first


def _plans(case) -> dict:
    """{"streamed": the planned forward, "resident": the same with Q resident and the deepest
    (K, V) stages that fit} on sm_90a."""
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.sm90.config import can_implement

    d, dv, hq, hkv, n, causal = case
    p = AttnProblem(dtype="bf16", batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=n, seqlen_kv=n,
                    head_dim=d, head_dim_v=dv, causal=causal)
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options(family="sm90"))
    assert plan.reason is None and plan.cfg.stream_q and not plan.packed, plan
    out = {"streamed": plan}
    for k_stages, v_stages in RESIDENT_STAGES:
        cfg = dataclasses.replace(plan.cfg, stream_q=False, k_stages=k_stages,
                                  v_stages=v_stages)
        if can_implement(cfg) is None:
            out["resident"] = dataclasses.replace(plan, cfg=cfg)
            break
    return out


def jobs() -> list:
    return experiment.forward_jobs(p for case in CASES for p in _plans(case).values())


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch
    from ffpa_cute.reference import rel_err
    from perf.flops import attn_flops_fwd

    res = {}
    for case in CASES:
        d, dv, hq, hkv, n, causal = case
        q = torch.randn(1, hq, n, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, hkv, n, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, hkv, n, dv, device=dev, dtype=torch.bfloat16)
        flops = attn_flops_fwd(1, hq, n, n, d, causal, head_dim_v=dv)
        label = f"{d}/{dv} {hq}/{hkv} N={n}{' causal' if causal else ''}"
        row, outs = {}, {}
        for name, plan in _plans(case).items():
            outs[name] = launch.run_fwd(plan, q, k, v)[0]
            fn = lambda p=plan: launch.run_fwd(p, q, k, v)  # noqa: E731
            ms = experiment.median_ms(fn, dev, flush)
            row[name] = dict(ms=ms, tflops=flops / ms / 1e9, k_stages=plan.cfg.k_stages,
                             v_stages=plan.cfg.v_stages)
        if "resident" in outs:   # a wrong variant is reported, not fatal: the others run
            row["err"] = rel_err(outs["resident"], outs["streamed"].double())
            row["wrong"] = row["err"] >= 1e-2
        print(f"{label}: " + ", ".join(
            f"{name} (K {r['k_stages']}, V {r['v_stages']}) {r['ms']:.2f} ms "
            f"{r['tflops']:.0f} TFLOPS" for name, r in row.items() if isinstance(r, dict))
            + (f"; resident vs streamed error {row['err']:.1e}"
               f"{' WRONG' if row['wrong'] else ''}" if "err" in row else ""), flush=True)
        res[label] = row
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.resident_q", __doc__, jobs, run))
