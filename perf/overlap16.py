"""The 16-bit forward with QK[i+1] under the score step (`overlap`) at D=320? (issue 20)

    python -m perf.overlap16 --precompile DIR     # CPU: compile the configs into DIR
    python -m perf.overlap16 [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

The session-15 phase trace has D=320's S warpgroup spend 1753 of a block's 4413 cycles in the
score step, after QK (2094) and before P's store (267), with nothing of its own queued on the
tensor cores meanwhile: the serial chain, not the stream (160 KB per block, ~3900 cycles at
the 41 B / clk TMA ceiling), sets the period. The FP8 kernels' `overlap` schedule issues
QK[i+1]'s first h of the C D-chunks before the score step of block i and the rest after it
(skeleton `_overlap_blocks`); in 16 bits it fits the registers without spills only at D=320
(two 64 x 128 fp32 accumulators and 16-bit P in the S warpgroup's 184; D=384 spills 72-168 B),
and only with one CTA per tile (not `persistent`) and two V stages (K 6 stages).

Timed at D=320 (B=1, H=32, bf16, not causal, N=8K and 16K): the planned forward (persistent
CTAs), the same with one CTA per tile, and `overlap` h = 1, 2, 3 (C = 5 chunks); each
through `launch.run_fwd` (the kernel alone), L2 flushed, median of 3 benches; every output
compared with the one-CTA-per-tile kernel's (the same arithmetic per block: bit-equal
expected; a relative error of 1e-3 or more is reported as WRONG, and the run goes on).
Prediction: the period falls toward the stream's ~3900 cycles, 500 -> ~540-565 TFLOPS at
N=8K (the issue's D=320 goal is 560); the FP8 kernel gained 3% from it at D=320, where its
stream is half as long and its softmax shorter than its QK.
"""

from __future__ import annotations

import dataclasses

from perf import experiment

D, HEADS = 320, 32
SEQLENS = (8192, 16384)
OVERLAPS = (1, 2, 3)


def _plans(n: int) -> dict:
    """{name: plan} at sequence length n on sm_90a: "planned", "one CTA per tile" and
    "overlap h" (K stages: as many as fit, at least the D chunks; V stages 2)."""
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.sm90.config import SMEM_CAPACITY, can_implement

    p = AttnProblem(dtype="bf16", batch=1, heads_q=HEADS, heads_kv=HEADS, seqlen_q=n,
                    seqlen_kv=n, head_dim=D, head_dim_v=D, causal=False)
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options(family="sm90"))
    assert plan.reason is None and not plan.packed, plan
    single = dataclasses.replace(plan.cfg, persistent=False)
    out = {"planned": plan, "one CTA per tile": dataclasses.replace(plan, cfg=single)}
    chunks = single.num_k_chunks
    for h in OVERLAPS:
        cfg = None
        for k_stages in range(chunks + h, chunks - 1, -1):
            cand = dataclasses.replace(single, overlap=h, k_stages=k_stages, v_stages=2)
            if cand.smem_bytes() <= SMEM_CAPACITY:
                cfg = cand
                break
        assert cfg is not None and can_implement(cfg) is None, (h, cfg)
        out[f"overlap {h}"] = dataclasses.replace(plan, cfg=cfg)
    return out


def jobs() -> list:
    return experiment.forward_jobs(p for n in SEQLENS for p in _plans(n).values())


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch
    from ffpa_cute.reference import rel_err
    from perf.flops import attn_flops_fwd

    res = {}
    for n in SEQLENS:
        q, k, v = (torch.randn(1, HEADS, n, D, device=dev, dtype=torch.bfloat16)
                   for _ in range(3))
        flops = attn_flops_fwd(1, HEADS, n, n, D, False)
        plans = _plans(n)
        ref = launch.run_fwd(plans["one CTA per tile"], q, k, v)[0]
        row = {}
        for name, plan in plans.items():
            out = launch.run_fwd(plan, q, k, v)[0]
            err = rel_err(out, ref.double())
            fn = lambda p=plan: launch.run_fwd(p, q, k, v)  # noqa: E731
            ms = experiment.median_ms(fn, dev, flush)
            # a wrong variant is reported and timed, not fatal: the others still run
            row[name] = dict(ms=ms, tflops=flops / ms / 1e9, err=err, wrong=err >= 1e-3,
                             bit_equal=bool(torch.equal(out, ref)),
                             k_stages=plan.cfg.k_stages, v_stages=plan.cfg.v_stages)
        print(f"D={D} N={n}: " + ", ".join(
            f"{name} {r['ms']:.3f} ms {r['tflops']:.0f} TFLOPS"
            f"{' WRONG (error %.1e)' % r['err'] if r['wrong'] else ''}"
            f"{'' if r['bit_equal'] or r['wrong'] else ' (not bit-equal)'}"
            for name, r in row.items()), flush=True)
        res[f"N={n}"] = row
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.overlap16", __doc__, jobs, run))
