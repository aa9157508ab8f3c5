"""The 16-bit forward above D=512 with O in one CTA (`wide_o`) against the CTA pair (issue 20).

    python -m perf.one_cta                    # CPU: ptxas's registers / spills of the wide plans
    python -m perf.one_cta --precompile DIR   # CPU: compile the timed plans into DIR
    python -m perf.one_cta --time [--out F]   # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)
    python -m perf.one_cta --bwd [--precompile DIR | --time]   # the gradient kernels, as below

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

`--bwd`: the dQ, dK and dV kernels (`launch.run_grad_job`, each alone, L2 flushed, median of 3
benches; TFLOPS of the whole backward, 2.5x the forward's FLOPs, from the three kernels' sum)
planned as routed (the CTA pair above 512) and with their gradient in one CTA (`wide_o`, the
planners' `WIDE_BWD`), at BWD_HEAD_DIMS (B=1, H=32, N=8K, bf16, causal). Prediction (before
any run): the forward's gain, each kernel 1.25-1.4x; the backward at D=576 from ~190 (H200, the
pair) to 240-270 TFLOPS.

Measured before the route (H100, 2026-12-06, docs/perf-log.md: the one-CTA kernel as an
experiment subclass with S 152 / O 176; TFLOPS pair -> one CTA): 520 296 -> 393-404, 528 299
-> 405-426, 536 289 -> 389-395, 544 310 -> 418-451, 552 296 -> 410, 560 316 -> 430, 568 305 ->
425, 576 348 -> 462; the prediction was 470-530 (D=512's bytes per FLOP with a K ring of 3).
Routed (`--time` at ff16c84, H100): 520 295 -> 395, 528 300 -> 428, 536 286 -> 385, 544 309
-> 439, 552 295 -> 403, 560 315 -> 421, 568 303 -> 412, 576 347 -> 457. `--bwd` not yet run.
"""

from __future__ import annotations

import dataclasses
import sys

from perf import experiment

HEAD_DIMS = (520, 528, 536, 544, 552, 560, 568, 576)
TIMED_HEAD_DIMS = HEAD_DIMS
BWD_HEAD_DIMS = (520, 544, 576)


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


def bwd_variants(d: int) -> dict:
    """{name: [(kernel class, cfg)] of dQ, dK, dV} at D=d, causal: `pair` as routed, `wide`
    with WIDE_BWD on."""
    from ffpa_cute import dispatch
    from ffpa_cute.sm90 import config as sm90_config

    p = dataclasses.replace(experiment.self_problem(d), causal=True)
    out = {}
    for name, wide in (("pair", False), ("wide", True)):
        own, sm90_config.WIDE_BWD = sm90_config.WIDE_BWD, wide
        try:
            out[name] = [(dispatch.kernel_class(c), c) for c in sm90_config.plan_bwd(p)]
        finally:
            sm90_config.WIDE_BWD = own
    return out


def bwd_jobs() -> list:
    return [job for d in BWD_HEAD_DIMS for jobs in bwd_variants(d).values() for job in jobs]


def run_bwd(dev, flush) -> dict:
    import torch

    import ffpa_cute
    from ffpa_cute import launch

    res = {}
    for d in BWD_HEAD_DIMS:
        p = dataclasses.replace(experiment.self_problem(d), causal=True)
        q, k, v, do = (torch.randn(1, p.heads_q, p.seqlen_q, d, device=dev,
                                   dtype=torch.bfloat16) for _ in range(4))
        out, lse = ffpa_cute.attention(q, k, v, is_causal=True, return_lse=True)
        delta = (out.float() * do.float()).sum(-1)
        scalars = launch.kernel_scalars(p, 0)
        grads = {}
        inputs = dict(q=q, k=k, v=v, do=do, o=out, lse=lse, delta=delta)
        for name, jobs in bwd_variants(d).items():
            times, grads[name] = experiment.time_grad_jobs(jobs, inputs, scalars, dev, flush)
            total = sum(times.values())
            tf = 2.5 * 4 * p.heads_q * p.seqlen_q * (p.seqlen_kv + 1) / 2 * d / total / 1e9
            print(f"D={d} {name}: " + " ".join(f"{n} {ms:.2f}" for n, ms in times.items())
                  + f" ms = {total:.2f} ms, {tf:.0f} TFLOPS", flush=True)
            res[f"{d}-{name}"] = dict(times_ms=times, total_ms=total, tflops=tf)
        diff = [(a.float() - b.float()).abs().max().item()
                for a, b in zip(grads["pair"], grads["wide"])]
        print(f"D={d} max |pair - wide| dq / dk / dv: {diff}", flush=True)
        res[f"{d}-diff"] = diff
    return res


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--bwd" in argv:
        return experiment.probe_main("perf.one_cta --bwd", __doc__, bwd_jobs, run_bwd,
                                     lambda: (), [a for a in argv if a != "--bwd"])
    return experiment.probe_main("perf.one_cta", __doc__, jobs, run,
                                 lambda: (f"D={d}: {probe(d)}" for d in HEAD_DIMS), argv)


if __name__ == "__main__":
    sys.exit(main())
