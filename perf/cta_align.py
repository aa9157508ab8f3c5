"""Above 512: the second CTA's columns from a 128-byte line (`cta_align` 64), and its hi share
too (`split_align` 64), against the route (issue 20's curve above 512).

    python -m perf.cta_align --precompile DIR     # CPU: compile the variants into DIR
    python -m perf.cta_align [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

Above 512 the forward splits O over a CTA pair: CTA r owns the columns from r ceil(D / 16) * 8,
so at D=576 the second CTA's V boxes start at column 288 (byte 576, mid-line), at 584 at byte
592; within each CTA the hi warpgroup's share starts at its lo width (160 at D=576: byte 320
past the CTA's first column). Below 512 starting the hi share on a line alone gave +4-8% where
the computed widths stayed the same (perf.split_align: D=328, 368, 456). Here `cta_align` 64
rounds the CTA's width up to a multiple of 64 (D=576: 320 + 256 stored; the second CTA's columns
past D come from TMA's zeros and are not stored); at D=576, 584, 600, 704, 712, 832 the computed
shares do not change (160 + 160, 192 + 192, 224 + 224), at the D % 64 == 8 sizes (520, 648, 776)
they grow by 7-11%. Below 512 the hi share's start gained where it split 32-byte sectors (D=328,
368, 456: byte 336, 368, 464; +4-8%), while a start on a sector but mid-line (D=320: byte 320)
was not measured apart from the padding it also removed. So the prediction: +5-15% where the
second CTA now starts mid-sector (D=584: byte 592, 712: 720), 0-4% where it starts mid-line on a
sector (576, 600, 704, 832), 0 +- 5% at 520 / 648 / 776 (more columns). Variants per D (B=1,
H=32, N=8K, bf16, not causal; `launch.run_fwd`, so rows are repacked where `repack_rows` says;
L2 flushed; `interleaved_ms`):
  routed   the plan now;
  cta64    `cta_align` 64 (rings refitted);
  both     `cta_align` 64 and `split_align` 64 (the hi share of each CTA from a line: 192 + 128
           at D=576);
and whether out / lse are the same bits as routed's (each column is the same sum of products
whichever CTA and warpgroup computes it).
"""

from __future__ import annotations

import dataclasses

from perf import experiment

HEAD_DIMS = (520, 576, 584, 600, 648, 704, 712, 776, 832, 1016)
HEADS, N = 32, 8192


def _problem(d: int):
    from ffpa_cute.problem import AttnProblem

    return AttnProblem(dtype="bf16", batch=1, heads_q=HEADS, heads_kv=HEADS, seqlen_q=N,
                       seqlen_kv=N, head_dim=d, head_dim_v=d, causal=False)


def variants(d: int) -> dict:
    """{name: forward plan} at D=d (a variant that does not build is left out)."""
    from ffpa_cute import dispatch
    from ffpa_cute.common.config import deepest_rings
    from ffpa_cute.options import Options
    from ffpa_cute.sm90 import config as sm90_config

    routed = dispatch.plan_fwd(_problem(d), target="sm_90a", opts=Options())
    out = {"routed": routed}
    for name, fields in (("cta64", dict(cta_align=64)),
                         ("both", dict(cta_align=64, split_align=64))):
        try:
            cfg = deepest_rings(lambda k, v, f=fields: dataclasses.replace(
                routed.cfg, **f, k_stages=k, v_stages=v), sm90_config.can_implement)
        except ValueError as e:
            print(f"D={d}: {name} does not build: {e}")
            continue
        out[name] = dataclasses.replace(routed, cfg=cfg)
    return out


def jobs() -> list:
    return experiment.forward_jobs(p for d in HEAD_DIMS for p in variants(d).values())


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch

    res = {}
    for d in HEAD_DIMS:
        plans = variants(d)
        q, k, v = (torch.randn(1, HEADS, N, d, device=dev, dtype=torch.bfloat16)
                   for _ in range(3))
        fns = {n: (lambda p=p: launch.run_fwd(p, q, k, v)) for n, p in plans.items()}
        ref = fns["routed"]()
        same = {n: all(map(torch.equal, fn(), ref)) for n, fn in fns.items() if n != "routed"}
        ms = experiment.interleaved_ms(fns, dev, flush)
        tf = {n: 4 * HEADS * N * N * d / t / 1e9 for n, t in ms.items()}
        shapes = {n: (p.cfg.dv_cta, p.cfg.dv_halves, p.cfg.k_stages, p.cfg.v_stages)
                  for n, p in plans.items()}
        print(f"D={d:4d} " + "  ".join(f"{n} {ms[n]:6.3f} ms {tf[n]:5.0f}" for n in ms)
              + f"  same bits {same}  {shapes}", flush=True)
        res[str(d)] = dict(ms=ms, tflops=tf, same_bits=same,
                           configs={n: repr(p.cfg) for n, p in plans.items()})
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.cta_align", __doc__, jobs, run))
