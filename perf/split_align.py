"""The O warpgroups' share boundary on a 128-byte line (`split_align` 64) and persistent CTAs
at every D, against the route before them (issue 20's cliffs).

    python -m perf.split_align --precompile DIR     # CPU: compile the variants into DIR
    python -m perf.split_align [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

With `split_align` 8 the hi O warpgroup's first column is ceil(D / 16) * 8: at D=320 column
160 (byte 320 of a row, mid-line), and both shares are computed 192 wide (`half_align` 64),
384 PV columns for 320. With 64 it is column 192: its V boxes start on lines and the shares
compute 192 + 128. Prediction: where the computed PV columns drop (D=272, 320: 384 -> 320; 400,
448: 512 -> 448) the forward gains up to the PV share of the saved work (~8%) if the tensor
cores bound it, nothing if the lo warpgroup's chain does; where they do not (328, 368, 456,
480) only the aligned boxes (0-4%, as `rows` in perf.pad_d). Persistent CTAs gained 1-5% at
five of six D % 64 != 0 sizes (perf.pad_d, H100). Each D in HEAD_DIMS is timed (B=1, H=32,
N=8K, bf16, not causal; `launch.run_fwd`, so the rows are repacked where `repack_rows` says;
L2 flushed; `interleaved_ms`) as:
  routed   the plan now (`split_align` 64, persistent);
  split8   the same with `split_align` 8 (the rings refitted);
  before   `split_align` 8 and one CTA per tile (D % 64 != 0: the route before this change);
  lazy     the routed plan with `lazy_rescale` (routed at D=320 / 512 only: is it the same
           gain elsewhere? The routed plan already has it at 320);
and the routed out / lse are checked to be the same bits as split8's (each O column is the same
sum of products whichever warpgroup computes it).
"""

from __future__ import annotations

import dataclasses

from perf import experiment

HEAD_DIMS = (264, 272, 320, 328, 336, 368, 400, 408, 448, 456, 480)
HEADS, N = 32, 8192


def _problem(d: int):
    from ffpa_cute.problem import AttnProblem

    return AttnProblem(dtype="bf16", batch=1, heads_q=HEADS, heads_kv=HEADS, seqlen_q=N,
                       seqlen_kv=N, head_dim=d, head_dim_v=d, causal=False)


def variants(d: int) -> dict:
    """{name: forward plan} at D=d."""
    from ffpa_cute import dispatch
    from ffpa_cute.common.config import deepest_rings
    from ffpa_cute.options import Options
    from ffpa_cute.sm90 import config as sm90_config

    routed = dispatch.plan_fwd(_problem(d), target="sm_90a", opts=Options())

    def refit(**fields):
        cfg = deepest_rings(lambda k, v: dataclasses.replace(
            routed.cfg, **fields, k_stages=k, v_stages=v), sm90_config.can_implement)
        return dataclasses.replace(routed, cfg=cfg)

    lazy = dataclasses.replace(routed, cfg=dataclasses.replace(routed.cfg, lazy_rescale=True))
    return {"routed": routed, "split8": refit(split_align=8),
            "before": refit(split_align=8, persistent=d % 64 == 0), "lazy": lazy}


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
        same = all(map(torch.equal, fns["routed"](), fns["split8"]()))
        for fn in fns.values():
            fn()
        ms = experiment.interleaved_ms(fns, dev, flush)
        tf = {n: 4 * HEADS * N * N * d / t / 1e9 for n, t in ms.items()}
        cfgs = {n: (p.cfg.dv_halves, p.cfg.k_stages, p.cfg.v_stages, p.cfg.persistent)
                for n, p in plans.items()}
        print(f"D={d:4d} " + "  ".join(f"{n} {ms[n]:6.3f} ms {tf[n]:5.0f}" for n in ms)
              + f"  same bits {same}  {cfgs}", flush=True)
        res[str(d)] = dict(ms=ms, tflops=tf, same_bits=same,
                           configs={n: repr(p.cfg) for n, p in plans.items()})
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.split_align", __doc__, jobs, run))
