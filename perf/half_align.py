"""Does widening the O warpgroups' V stages to a swizzle-friendly width pay? (`half_align`)

    python -m perf.half_align --precompile DIR     # CPU: compile the variants into a cache
    python -m perf.half_align [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

For each D, the 16-bit forward's planned config with its O halves computed in widths rounded up
to 8 (exact), 32 or 64 columns (`FwdConfigSm90.half_align`; variants with the same widths are
timed once). The exact widths of e.g. D=336 (168 + 168) fit no smem swizzle, D=576's per-CTA
144 only a 32-byte one; rounded up, the V stages take the 64- or 128-byte swizzle and WGMMA
reads them without bank conflicts, at the price of computing (and dropping) the extra columns.
Also, at the D % 64 != 0 sizes where persistent CTAs lost with exact halves (264, 328, 336), the
planned (widened) config with persistent CTAs forced on. B=1, H=32, N=8K, bf16, not causal; the
kernel alone (run_fwd), L2 flushed, median of 3 benches.
"""

from __future__ import annotations

import dataclasses
import sys

from perf import experiment

HEAD_DIMS = (264, 280, 320, 328, 336, 448, 576, 640, 704)
ALIGNS = (8, 32, 64)
PERSISTENT_DIMS = (264, 328, 336)
HEADS, N = 32, 8192


def _plan(d: int):
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    p = AttnProblem(dtype="bf16", batch=1, heads_q=HEADS, heads_kv=HEADS, seqlen_q=N,
                    seqlen_kv=N, head_dim=d, head_dim_v=d, causal=False)
    return dispatch.plan_fwd(p, target="sm_90a", opts=Options())


def variants():
    """(label, plan) for every distinct buildable variant."""
    from ffpa_cute.sm90 import config as sm90_config

    out = []
    for d in PERSISTENT_DIMS:
        base = _plan(d)
        for on in (True, False):
            out.append((f"D={d:4d} planned, persistent {on}",
                        dataclasses.replace(base, cfg=dataclasses.replace(base.cfg,
                                                                          persistent=on))))
    for d in HEAD_DIMS:
        base = _plan(d)
        seen = set()
        for a in ALIGNS:
            cfg = dataclasses.replace(base.cfg, half_align=a)
            try:  # the widened V stages may leave fewer ring stages
                cfg = sm90_config.deepest_rings(
                    lambda k, v, c=cfg: dataclasses.replace(c, k_stages=k, v_stages=v),
                    sm90_config.can_implement)
            except ValueError as e:
                print(f"D={d} half_align={a}: {e}", file=sys.stderr)
                continue
            if cfg.dv_halves in seen:
                continue
            seen.add(cfg.dv_halves)
            out.append((f"D={d:4d} half_align={a:2d}", dataclasses.replace(base, cfg=cfg)))
    return out


def jobs() -> list:
    return [(plan.kernel_cls, plan.cfg) for _, plan in variants()]


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch

    res = {}
    for label, plan in variants():
        d = plan.cfg.head_dim
        q, k, v = (torch.randn(1, HEADS, N, d, device=dev, dtype=torch.bfloat16)
                   for _ in range(3))
        fn = lambda: launch.run_fwd(plan, q, k, v)  # noqa: E731
        fn()
        ms = experiment.median_ms(fn, dev, flush)
        tf = 4 * HEADS * N * N * d / ms / 1e9
        c = plan.cfg
        print(f"{label}: halves {c.dv_halves} (store {c.dv_split}) k/v stages "
              f"{c.k_stages}/{c.v_stages}: {ms:7.3f} ms {tf:6.1f} TFLOPS", flush=True)
        res[label] = dict(d=d, half_align=c.half_align, persistent=c.persistent,
                          halves=c.dv_halves, ms=ms, tflops=tf)
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.half_align", __doc__, jobs, run))
