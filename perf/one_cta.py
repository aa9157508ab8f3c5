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
with the CTA pair (`pair`, the planners' `WIDE_BWD` off) and with their gradient in one CTA
(`wide`, `wide_o`, routed), at BWD_HEAD_DIMS (B=1, H=32, N=8K, bf16, causal). Prediction
(before any run): the forward's gain, each kernel 1.25-1.4x; the backward at D=576 from ~190
(H200, the pair) to 240-270 TFLOPS. Measured (H100, 2026-12-06, ms dQ + dK + dV, pair -> wide):
520 18.6 + 18.3 + 9.6 = 46.5 -> 16.5 + 16.5 + 7.1 = 40.1 (120 -> 139 TFLOPS); 544 41.8 -> 32.7
(140 -> 179); 576 12.8 + 14.4 + 7.9 = 35.1 -> 12.7 + 14.1 + 6.2 = 32.9 (176 -> 188): the same
bits (max |pair - wide| 0 on all three gradients). Short of the prediction at 576: dQ and dK
gain 1-2% there and dV 22%, against 18-33% for all three at 544; why the two-product kernels
barely move at 576 is not yet traced.

Measured before the route (H100, 2026-12-06, docs/perf-log.md: the one-CTA kernel as an
experiment subclass with S 152 / O 176; TFLOPS pair -> one CTA): 520 296 -> 393-404, 528 299
-> 405-426, 536 289 -> 389-395, 544 310 -> 418-451, 552 296 -> 410, 560 316 -> 430, 568 305 ->
425, 576 348 -> 462; the prediction was 470-530 (D=512's bytes per FLOP with a K ring of 3).
Routed (`--time` at ff16c84, H100): 520 295 -> 395, 528 300 -> 428, 536 286 -> 385, 544 309
-> 439, 552 295 -> 403, 560 315 -> 421, 568 303 -> 412, 576 347 -> 457. `--bwd` also times
the whole `launch.run_bwd` of each plan with the row copy forced on and off (docs/perf-log.md,
session 32: routed 520 150 -> 164, 544 135 -> 177, 576 177 -> 184 TFLOPS).
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
    """{name: [(kernel class, cfg)] of dQ, dK, dV} at D=d, causal: `pair` with WIDE_BWD off
    (the CTA pair), `wide` with it on (the route)."""
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
    """The gradient kernels of `bwd_variants`, and the causal forward `run_bwd` takes O and
    the LSE from."""
    fwd = experiment.forward_jobs(
        experiment.routed_fwd(dataclasses.replace(experiment.self_problem(d), causal=True))
        for d in BWD_HEAD_DIMS)
    return fwd + [job for d in BWD_HEAD_DIMS for jobs in bwd_variants(d).values()
                  for job in jobs]


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
        res[f"{d}-routed"] = _time_routed_bwd(p, inputs, dev, flush)
    return res


def _time_routed_bwd(p, inputs: dict, dev, flush) -> dict:
    """`launch.run_bwd` (Delta, then dQ, dK, dV, with or without the row copy) of the pair and
    of the wide plan, each with `repack_rows` forced on and off: {"<variant> copy|no copy":
    ms}, printed with TFLOPS."""
    from ffpa_cute import dispatch, launch

    plan = dispatch.plan_bwd(p, dev)
    own = launch.repack_rows
    res = {}
    try:
        for name, jobs in bwd_variants(p.head_dim).items():
            bp = dataclasses.replace(plan, cfgs=(plan.cfgs[0], *(cfg for _, cfg in jobs)))
            for copy in (True, False):
                launch.repack_rows = lambda *a, c=copy: c
                fn = lambda b=bp: launch.run_bwd(b, *(inputs[n] for n in  # noqa: E731
                                                      ("q", "k", "v", "o", "lse", "do")))
                fn()
                ms = experiment.median_ms(fn, dev, flush)
                label = f"{name} {'copy' if copy else 'no copy'}"
                tf = 2.5 * 4 * p.heads_q * p.seqlen_q * (p.seqlen_kv + 1) / 2 * p.head_dim / ms
                print(f"D={p.head_dim} run_bwd {label}: {ms:.2f} ms, {tf / 1e9:.0f} TFLOPS",
                      flush=True)
                res[label] = ms
    finally:
        launch.repack_rows = own
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
