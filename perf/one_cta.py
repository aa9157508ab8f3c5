"""The 16-bit forward above D=512 with O in one CTA (`wide_o`) against the CTA pair (issue 20).

    python -m perf.one_cta                    # CPU: ptxas's registers / spills of the wide plans
    python -m perf.one_cta --precompile DIR   # CPU: compile the timed plans into DIR
    python -m perf.one_cta --time [--out F]   # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

Up to D=576 the forward keeps O[64 x D] in one CTA (`FwdConfigSm90.wide_o`): each O
warpgroup's share is at most 288 columns (144 fp32 registers a thread) with `setmaxnreg` S 152
/ O 176, and the PV product is issued as m64n96 WGMMAs past 256 columns; Q resident, K ring 3,
V rings 2. Above it (and before this plan) two CTAs share each row tile (`kv_pair`): each
scores every other block and the pair trades row maxima and P over DSMEM per block.

`--time` runs, at each D of TIMED_HEAD_DIMS (B=1, H=32, N=8K, bf16, not causal, `launch.run_fwd`
with its K / V row copy where `repack_rows` says, L2 flushed, interleaved rounds), the routed
plan (`wide`) and the CTA pair the planner gives without resident Q (`pair`:
`plan_fwd(resident_q=False)`, the route before `wide_o`), and checks both against an fp32
reference at N=1000 (max abs error; the two walk the blocks in different orders).

Measured before the route (H100, 2026-12-06, docs/perf-log.md: the one-CTA kernel as an
experiment subclass with S 152 / O 176; TFLOPS pair -> one CTA): 520 296 -> 393-404, 528 299
-> 405-426, 536 289 -> 389-395, 544 310 -> 418-451, 552 296 -> 410, 560 316 -> 430, 568 305 ->
425, 576 348 -> 462; the prediction was 470-530 (D=512's bytes per FLOP with a K ring of 3).
"""

from __future__ import annotations

import dataclasses
import sys

from perf import experiment

HEAD_DIMS = (520, 528, 536, 544, 552, 560, 568, 576)
TIMED_HEAD_DIMS = HEAD_DIMS


def variants(d: int) -> dict:
    """{name: forward plan} at D=d: the routed plan (`wide`), then the CTA pair (`pair`)."""
    from ffpa_cute.sm90 import config as sm90_config

    wide = experiment.routed_fwd(experiment.self_problem(d))
    pair = sm90_config.plan_fwd(wide.problem, "sm_90a", tuned=True, resident_q=False)
    return {"wide": wide, "pair": dataclasses.replace(wide, cfg=pair)}


def probe(d: int) -> str:
    """ptxas's verdict on the routed plan at D=d: registers, spills, the WGMMA shapes."""
    plan = experiment.routed_fwd(experiment.self_problem(d))
    cfg = plan.cfg
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    return (f"wide_o {cfg.wide_o} shares {cfg.dv_split} computed {cfg.dv_halves} K "
            f"{cfg.k_stages} V {cfg.v_stages}: {experiment.ptxas_summary(ptx)}")


def jobs() -> list:
    return experiment.forward_jobs(p for d in TIMED_HEAD_DIMS for p in variants(d).values())


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch

    res = experiment.time_forward_variants(TIMED_HEAD_DIMS, variants, dev, flush,
                                           shape=lambda c: (c.dv_halves, c.k_stages,
                                                            c.v_stages))
    for d in TIMED_HEAD_DIMS:   # each against a float32 reference
        q, k, v = (torch.randn(1, 4, 1000, d, device=dev, dtype=torch.bfloat16)
                   for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        errs = {name: (launch.run_fwd(p, q, k, v)[0].float() - ref).abs().max().item()
                for name, p in variants(d).items()}
        bf = (ref.bfloat16().float() - ref).abs().max().item()
        print(f"D={d} max abs error vs fp32: {errs} (bf16 rounding of the reference {bf:.2e})",
              flush=True)
        res[str(d)]["max_err"] = errs
    return res


def main(argv=None) -> int:
    return experiment.probe_main("perf.one_cta", __doc__, jobs, run,
                                 lambda: (f"D={d}: {probe(d)}" for d in HEAD_DIMS), argv)


if __name__ == "__main__":
    sys.exit(main())
