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
  routed   the plan now: `cta_align` 64 and `split_align` 64 where they move a share (the hi
           share of each CTA from a line: 192 + 128 at D=576);
  even     `cta_align` 8 and `split_align` 8, the shares as even as 8 columns allow (rings
           refitted; the route until the first run below);
  cta32    `cta_align` 32 with `split_align` 64: the second CTA from a 64-byte half line, for
           the D % 64 == 8 sizes where 64 computes 13-23% of O's columns past D (D=520: 288 +
           232 stored, 576 computed against 640; 648: 352 + 296; 776: 416 + 360; 904: 480 +
           424), each CTA's hi share from its width's next multiple of 64;
  cta32e   `cta_align` 32 with even shares inside each CTA;
and whether out / lse are the same bits as routed's (each column is the same sum of products
whichever CTA and warpgroup computes it). First run (H100, 2026-12-05, when `even` was the
route): routed against even D=584 277 -> 317 TFLOPS, 600 282 -> 323, 712 290 -> 323, 776
284 -> 310, 832 344 -> 382, 576 338 -> 348, 648 281 -> 298, 704 354 -> 365, 520 279 -> 283,
1016 unchanged; cta64 alone lost at 520 / 576 and gained less elsewhere. The second run
times cta32 at the D % 64 == 8 sizes the curve still flags (520, 648, 776, 904; and 584),
with 600 / 832 as controls: 520 281 -> 295, 648 290 -> 297, 776 298 -> 301, 904 305 -> 313
(H100, the same bits; predicted +3-10%), 832 377 -> 371; the planner now takes cta32 at D % 128
== 8.

`--pair` times the pair against no pair at all (`Options(kv_pair=False)`: both CTAs of a tile
compute the whole S, each its half of O; 3 GEMM units executed for 2 counted) at D=520, 576,
648, 776, 904 and 1024:
  routed     the plan (the pair);
  recompute  no pair, its planned rings and even shares;
  recompute64  no pair, the second CTA and each CTA's hi share from lines (`cta_align` 64,
           `split_align` 64; at D % 128 != 0);
  recompute32  no pair, the second CTA from a half line (`cta_align` 32, `split_align` 64;
           at D % 64 != 0);
plus whether out / lse are the same bits as routed's. Prediction: at D=520 the pair computes
S on 576 columns (9 chunks of 64) over two CTAs and 576 of O's columns for 520, and runs at
~295 against D=512's ~610 (H100); without the pair each CTA streams 147 KB of K and 74 KB of V
per 128-key block (~5400 clocks at the ~41 B / clock L2 -> SM fill rate) against 3456 clocks of
tensor work, two CTAs per tile: ~340 (+10-20%). At 576 / 648 / 776 / 904 -5 to +10%; at 1024
the pair's known lead (447 against 346-356 on the H200).
"""

from __future__ import annotations

import sys

from perf import experiment

# (520 and 576, measured here before, now hold O in one CTA: `wide_o`, perf.one_cta)
HEAD_DIMS = (584, 648, 776, 904, 600, 832)
PAIR_HEAD_DIMS = (648, 776, 904, 1024)


def variants(d: int) -> dict:
    """{name: forward plan} at D=d (a variant that does not build is left out)."""
    routed = experiment.routed_fwd(experiment.self_problem(d))
    out = {"routed": routed}
    for name, fields in (("even", dict(cta_align=8, split_align=8)),
                         ("cta32", dict(cta_align=32, split_align=64)),
                         ("cta32e", dict(cta_align=32, split_align=8))):
        try:
            out[name] = experiment.refit(routed, **fields)
        except ValueError as e:
            print(f"D={d}: {name} does not build: {e}")
    return out


def pair_variants(d: int) -> dict:
    """{name: forward plan} at D=d: the pair (routed) against no pair (`--pair`)."""
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options

    problem = experiment.self_problem(d)
    recompute = dispatch.plan_fwd(problem, target="sm_90a", opts=Options(kv_pair=False))
    out = {"routed": experiment.routed_fwd(problem), "recompute": recompute}
    for align in [a for a in (64, 32) if d % (2 * a)]:
        try:
            out[f"recompute{align}"] = experiment.refit(recompute, cta_align=align,
                                                        split_align=64)
        except ValueError as e:
            print(f"D={d}: recompute{align} does not build: {e}")
    return out


def _set() -> tuple:
    """(head dims, variants) of the experiment the command line picks (`--pair` or not)."""
    return (PAIR_HEAD_DIMS, pair_variants) if "--pair" in sys.argv else (HEAD_DIMS, variants)


def jobs() -> list:
    dims, vary = _set()
    return experiment.forward_jobs(p for d in dims for p in vary(d).values())


def run(dev, flush) -> dict:
    dims, vary = _set()
    return experiment.time_forward_variants(
        dims, vary, dev, flush,
        shape=lambda c: (c.kv_pair, c.dv_cta, c.dv_halves, c.k_stages, c.v_stages))


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.cta_align", __doc__, jobs, run,
                                     [a for a in sys.argv[1:] if a != "--pair"]))
