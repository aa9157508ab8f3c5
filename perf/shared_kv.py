"""V read from K's ring when v is k's prefix (`shared_kv`, issue 20's MLA with shared K / V)

    python -m perf.shared_kv --precompile DIR     # CPU: compile the configs into DIR
    python -m perf.shared_kv [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

DeepSeek's absorbed MLA has V = K[..., :512] with Dqk 576. The planned forward (Q resident
since 2026-12-05) loads each 128-key block's K (144 KB) and V (128 KB) from L2 separately;
`shared_kv` loads the K block once and gives each O warpgroup its columns of the K chunks as
PV's B operand (64-key blocks: two of them fit beside Q, sm90/config.py). The stream per key
falls from 272 KB / 128 keys to 144: at the measured L2 -> SM ceiling (~43 B / clk / SM) a
128-key block then takes ~3350 cycles of loads against ~4350 of tensor work, where the
planned one needs ~6300. Prediction: MLA prefill 490 -> 580-650 TFLOPS at N=8K causal (H100,
counted on 2 (Dqk + Dv) per pair), unless the 64-key blocks' shorter WGMMAs or the one-block
prefetch of V (refilled only after PV[i]) cost more than the stream saves. D=512 with
`v is k` runs the same comparison against the plain D=512 forward (tile_n 128, its stream
256 KB per block: predicted within 5% either way, the S warpgroup's chain binds there too).
Measured on the H200 (2026-12-05, docs/perf-log.md): slower everywhere, MLA 8K causal 490
against 520, D=512 519 against 569: the m64n64 score WGMMAs lengthen the S chain more than the
stream saves, so `sm90.config.SHARED_KV` is off.

Each variant through `launch.run_fwd` (the kernel alone), L2 flushed, median of 3 benches; v
is `k[..., :Dv]` for all; the outputs are compared with the planned one's (a relative error
of 1e-2 or more is reported as WRONG, and the run goes on).
"""

from __future__ import annotations

import dataclasses

from perf import experiment

# (Dqk, Dv, Hq, Hkv, N, causal): MLA prefill (DeepSeek's absorbed shape), then D=512 `v is k`
CASES = ((576, 512, 128, 1, 8192, True), (576, 512, 128, 1, 4096, True),
         (576, 512, 128, 1, 16384, True), (576, 512, 128, 1, 8192, False),
         (512, 512, 32, 32, 8192, False))


def _plans(case) -> dict:
    """{"planned": the routed forward, "shared": `shared_kv` (P handed over first), "shared,
    P after QK": the same with P[i] published after all of QK[i+1]} on sm_90a."""
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.sm90.config import can_implement, shared_kv_config

    d, dv, hq, hkv, n, causal = case
    p = AttnProblem(dtype="bf16", batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=n, seqlen_kv=n,
                    head_dim=d, head_dim_v=dv, causal=causal)
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options(family="sm90"))
    assert plan.reason is None and not plan.packed and not plan.cfg.shared_kv, plan
    shared = shared_kv_config(plan.cfg)
    late = dataclasses.replace(shared, publish_after=shared.num_k_chunks)
    out = {"planned": plan}
    for name, cfg in (("shared", shared), ("shared, P after QK", late)):
        assert can_implement(cfg) is None, (cfg, can_implement(cfg))
        out[name] = dataclasses.replace(plan, cfg=cfg)
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
        v = k[..., :dv]
        flops = attn_flops_fwd(1, hq, n, n, d, causal, head_dim_v=dv)
        label = f"{d}/{dv} {hq}/{hkv} N={n}{' causal' if causal else ''}"
        row, outs = {}, {}
        for name, plan in _plans(case).items():
            outs[name] = launch.run_fwd(plan, q, k, v)[0]
            fn = lambda p=plan: launch.run_fwd(p, q, k, v)  # noqa: E731
            ms = experiment.median_ms(fn, dev, flush)
            row[name] = dict(ms=ms, tflops=flops / ms / 1e9, tile_n=plan.cfg.tile_n,
                             k_stages=plan.cfg.k_stages, v_stages=plan.cfg.v_stages)
        ref = outs["planned"].double()
        for name in outs:   # a wrong variant is reported, not fatal: the others run
            if name != "planned":
                row[name]["err"] = rel_err(outs[name], ref)
                row[name]["wrong"] = row[name]["err"] >= 1e-2
        print(f"{label}: " + ", ".join(
            f"{name} {r['ms']:.2f} ms {r['tflops']:.0f} TFLOPS"
            + (f" (err {r['err']:.1e}{' WRONG' if r['wrong'] else ''})" if "err" in r else "")
            for name, r in row.items()), flush=True)
        res[label] = row
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.shared_kv", __doc__, jobs, run))
