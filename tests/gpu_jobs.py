"""The kernels the GPU tests compile on an sm_90a device, to precompile on a CPU box so the
lent GPU's minutes go to running, not compiling:

    CUTE_DSL_ARCH=sm_90a python -m tests.gpu_jobs --precompile .precache [--workers 2]
                                                 [--sections fp8,varlen] [--pack FILE]

`--pack FILE` also writes the selected kernels' cache entries, and only those, to an xz tarball
(`.precache/<fingerprint>/k*.o`): what travels to the device is limited to 64 MiB, the staged
toolchain takes ~59 of it, and a few hundred kernels fit beside it, not every section's
(~1300). On the device: `tar xJf FILE -C /tmp/pc` and FFPA_CUTE_CACHE_DIR=/tmp/pc/.precache.
The cache's fingerprint hashes every kernel source, so pack after the last edit of
ffpa_cute/common or ffpa_cute/sm*.

A superset by construction: every head dim the GPU tests use, both dtypes and causal modes, under
both families that run on an H200 (the device's own sm90, and sm80 for the Split-D pass), forward
and backward, plus the Dv != D pairs, the FP8 forwards (WGMMA and Split-D) with their transpose
kernel, and the non-default variants the tests select (the CTA pair off above 512, dK without sequential score
products, one CTA per tile where the default is persistent, dV / dK with split head groups),
the sliding-window / sinks configurations, the split-KV decode kernels and the one-launch
varlen kernels with their per-sequence twins, the fused backward (the default route where
it pays) beside the atomic-free kernels (`Options(deterministic=True)`), and (`lines`) the
plans with shares from 128-byte lines (the forward's and `line_shares_bwd`'s) with
test_line_shares' even-share twins, and (`cta`) the CTA pair's forwards at D % 128 == 8
(`cta_align` 32), and (`wide`) the forwards with O in one CTA above 512 (`wide_o`), the
pair's test cases above 576 and the gradient kernels in one CTA, and (`rows`) the fused
backward's row-unit tests and its default route's. A kernel the tests need that
is missing here is compiled on the device on first use, as for any user.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

HEAD_DIMS = (264, 320, 328, 384, 448, 512, 576, 640, 712, 768, 1016, 1024)
DV_PAIRS = ((576, 512), (512, 320), (320, 256), (1024, 512), (768, 128))
# the HEAD_DIMS whose plans the shares from lines change (and 512 beside them): the `lines` pack
LINE_HEAD_DIMS = (264, 320, 328, 448, 512, 576, 640, 712)
FP8_HEAD_DIMS = (272, 320, 384, 400, 512, 768, 1024)
FEATURE_HEAD_DIMS = (320, 384, 512, 520, 576, 1024)
# (window_lo, window_hi, causal, sinks): a left edge, a right edge, both, sinks alone and with
FEATURE_FIELDS = ((-8, None, True, False), (-8, None, True, True), (-8, 4, False, False),
                  (-8, 4, False, True), (None, 4, False, True), (None, None, True, True),
                  (None, None, False, True), (-8, None, False, True), (-8, None, False, False))
DECODE_DIMS = ((320, 320), (512, 512), (576, 512), (1024, 1024))
# the one-launch varlen kernels (and the per-sequence kernels the GPU tests compare them with):
# (d, dv, causal, window_lo, window_hi, sinks, dtype)
VARLEN_FIELDS = ((512, 512, True, None, None, False, "bf16"),
                 (512, 512, False, None, None, True, "bf16"),
                 (320, 320, True, -100, 20, True, "fp16"),
                 (576, 576, True, None, None, False, "bf16"),
                 (576, 512, True, -300, None, False, "bf16"),
                 (1024, 1024, False, -64, 64, True, "bf16"),
                 (512, 512, True, -200, 0, True, "bf16"))
# the Split-D family's one-launch varlen kernels and their per-sequence twins
# (test_splitd_varlen_one_launch_is_the_per_sequence_kernel): (d, causal, window_lo,
# window_hi, sinks, dtype)
SPLITD_VARLEN_FIELDS = ((320, True, None, None, False, "bf16"),
                        (512, True, -100, 20, True, "bf16"),
                        (1024, True, None, None, True, "fp16"),
                        (512, True, -64, 0, True, "bf16"))
TARGET = "sm_90a"


SECTIONS = ("main", "fp8", "features", "decode", "varlen", "dv", "sanitize", "fused",
            "fused_perf", "fwd_perf", "lazy", "lines", "widened", "cta", "wide", "rows",
            "padded_pair")


def jobs(sections=SECTIONS) -> list:
    """The kernels of the named `SECTIONS` (main: every head dim, dtype and causal mode under
    both families, forward and backward; sanitize: the compute-sanitizer workload's,
    tests/sanitize.py; fused: what the fused backward's GPU tests run, the sm90 forward, the
    Delta kernel and the fused kernel at D 320-576 (a subset of main, small enough to carry
    alone); fused_perf: `python -m perf.bwd_fused`'s, timed and traced, and fwd_perf:
    `python -m perf.shared_kv`'s (all run from the repository's root); lazy: what
    tests/test_lazy_rescale_gpu.py, `perf.lazy_rescale` and `perf.fp8_limits` run (the
    forwards with and without `lazy_rescale`); the others as the module docstring lists
    them)."""
    import dataclasses

    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.sm90 import config as sm90_config
    from ffpa_cute.sm90 import fused_config as sm90_fused

    out = []

    def add(items):
        out.extend(j for j in items if j not in out)

    def problem(d, dv, dtype, causal):
        return AttnProblem(dtype=dtype, batch=1, heads_q=2, heads_kv=2, seqlen_q=4096,
                           seqlen_kv=4096, head_dim=d, head_dim_v=dv, causal=causal)

    for family in ("sm90", "sm80") if "main" in sections else ():
        opts = Options(family=family)
        for d in HEAD_DIMS:
            for dtype in ("bf16", "fp16"):
                for causal in (False, True):
                    p = problem(d, d, dtype, causal)
                    plan = dispatch.plan_fwd(p, target=TARGET, opts=opts)
                    if plan.reason is None:
                        add([(plan.kernel_cls, plan.cfg), *_one_cta_per_tile(plan.cfg)])
                    # the atomic-free kernels (`deterministic`), and the default route (the
                    # fused kernel where it pays)
                    bwd = dispatch.plan_bwd(p, target=TARGET, opts=dataclasses.replace(
                        opts, deterministic=True)).jobs
                    add(bwd + dispatch.plan_bwd(p, target=TARGET, opts=opts).jobs)
                    if family == "sm90" and (dtype == "bf16" or d in (512, 1024)):
                        add(_group_split_twins(bwd))  # GQA / MQA's split head groups
                    if family == "sm90" and d > 512 and d % 16 == 0:  # the CTA pair off
                        off = Options(family="sm90", kv_pair=False)
                        plan = dispatch.plan_fwd(p, target=TARGET, opts=off)
                        add([(plan.kernel_cls, plan.cfg)])
                        if dtype == "bf16":
                            add(dispatch.plan_bwd(p, target=TARGET, opts=off).jobs)
                    if family == "sm90" and d <= 512:  # dK without sequential score products
                        cfg = sm90_config.plan_dk(p, TARGET, seq_scores=False)
                        add([(dispatch.kernel_class(cfg), cfg)])
                    if family == "sm90" and d % 64 == 0 and 256 < d <= 512:  # the fused
                        cfg = sm90_fused.plan_bwd_fused(p, TARGET)         # backward
                        add([(dispatch.kernel_class(cfg), cfg)])
    from ffpa_cute.common.config import DeltaConfig

    for d in (320, 384, 448, 512, 576) if "fused" in sections else ():
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                p = problem(d, d, dtype, causal)
                plan = dispatch.plan_fwd(p, target=TARGET, opts=Options(family="sm90"))
                cfg = sm90_fused.plan_bwd_fused(p, TARGET)
                add([(plan.kernel_cls, plan.cfg), (dispatch.kernel_class(cfg), cfg)])
                # who forms dQ; the head group split over CTA pairs (D=576: dq_grads 1 only)
                for dq_grads, split in ((1, False), (2, False), (0, True), (1, True)):
                    if dtype == "bf16" and (d <= 512 or dq_grads == 1):
                        var = sm90_fused.fit_dq_staging(dataclasses.replace(
                            cfg, dq_grads=dq_grads, group_split=split))
                        add([(dispatch.kernel_class(var), var)])
                delta = DeltaConfig(TARGET, dtype, d)
                add([(dispatch.kernel_class(delta), delta)])
    if "rows" in sections:
        add(_row_unit_jobs())
    # D over C CTAs (`scatter`): test_fused_scatter's configs, with their Delta kernels
    for d, c in ((1024, 4), (576, 3), (768, 3), (640, 4), (512, 2)) if "fused" in sections else ():
        for causal in (False, True):
            cfg = sm90_fused.plan_bwd_fused(problem(d, d, "bf16", causal), TARGET, cluster_d=c,
                                             scatter=True)
            delta = DeltaConfig(TARGET, "bf16", d)
            add([(dispatch.kernel_class(cfg), cfg), (dispatch.kernel_class(delta), delta)])
    from ffpa_cute.common.config import TransposeConfig

    for d in FP8_HEAD_DIMS if "fp8" in sections else ():  # the FP8 forward (e4m3 in; bf16 out, fp16 at 512) and its Vt
        for interleave in (False, True):  # Split-D's Vt, sm90's (keys interleaved)
            t = TransposeConfig(TARGET, d, interleave)
            add([(dispatch.kernel_class(t), t)])
        for causal in (False, True):
            for out_dtype in ("bf16", "fp16") if d == 512 else ("bf16",):
                p = AttnProblem(dtype="e4m3", batch=1, heads_q=2, heads_kv=2, seqlen_q=4096,
                                seqlen_kv=4096, head_dim=d, head_dim_v=d, causal=causal,
                                out_dtype=out_dtype)
                for family in ("sm90", "sm80"):  # the WGMMA and the Split-D FP8 kernels
                    plan = dispatch.plan_fwd(p, target=TARGET, opts=Options(family=family))
                    add([(plan.kernel_cls, plan.cfg)])
                    for lo, hi, sinks in ((-8, None, True), (-8, 4, True), (-8, 4, False),
                                          (None, None, True)):  # window / sinks
                        if out_dtype == "bf16" and (hi is None or not causal):
                            q = dataclasses.replace(p, window_lo=lo, window_hi=hi,
                                                    has_sinks=sinks)
                            plan = dispatch.plan_fwd(q, target=TARGET,
                                                     opts=Options(family=family))
                            add([(plan.kernel_cls, plan.cfg)])
    for d in FEATURE_HEAD_DIMS if "features" in sections else ():  # sliding window / sinks: every combination of the fields,
        for lo, hi, causal, sinks in FEATURE_FIELDS:  # both families
            p = dataclasses.replace(problem(d, d, "bf16", causal), window_lo=lo, window_hi=hi,
                                    has_sinks=sinks)
            for opts in (Options(), Options(family="sm80"), Options(deterministic=True)):
                plan = dispatch.plan_fwd(p, target=TARGET, opts=opts)
                add([(plan.kernel_cls, plan.cfg), *_one_cta_per_tile(plan.cfg)])
                bwd = dispatch.plan_bwd(p, target=TARGET, opts=opts).jobs
                add(bwd + _group_split_twins(bwd))
    for d, dv in DECODE_DIMS if "decode" in sections else ():  # the split-KV decode, contiguous and paged; 16-bit or e4m3
        for page in (None, 64, 128, 256):  # caches (bf16 queries; fp16 with an e4m3 cache)
            for dtype, kv, causal in (("bf16", None, False), ("bf16", "e4m3", False),
                                      ("fp16", "e4m3", False), ("bf16", None, True),
                                      ("bf16", "e4m3", True)):  # causal: chunked prefill
                p = AttnProblem(dtype=dtype, batch=1, heads_q=4, heads_kv=4, seqlen_q=8,
                                seqlen_kv=4096, head_dim=d, head_dim_v=dv, causal=causal)
                plan = dispatch.plan_decode(p, page, target=TARGET, opts=Options(),
                                            kv_dtype=kv)
                add([(plan.kernel_cls, plan.cfg)])
    from ffpa_cute.common.config import CombineConfig

    for dv in sorted({dv for _, dv in DECODE_DIMS}) if "decode" in sections else ():
        for dtype in ("bf16", "fp16"):
            c = CombineConfig(TARGET, dtype, dv)
            add([(dispatch.kernel_class(c), c)])
    for d, dv, causal, lo, hi, sinks, dtype in VARLEN_FIELDS if "varlen" in sections else ():
        p = AttnProblem(dtype=dtype, batch=1, heads_q=4, heads_kv=2, seqlen_q=1000,
                        seqlen_kv=1000, head_dim=d, head_dim_v=dv, causal=causal,
                        window_lo=lo, window_hi=hi, has_sinks=sinks)
        for q in (p, dataclasses.replace(p, varlen=True)):
            plan = dispatch.plan_fwd(q, target=TARGET, opts=Options())
            add([(plan.kernel_cls, plan.cfg), *_one_cta_per_tile(plan.cfg)])
            bwd = dispatch.plan_bwd(q, target=TARGET, opts=Options()).jobs
            add(bwd + _group_split_twins(bwd))
    for d, causal, lo, hi, sinks, dtype in SPLITD_VARLEN_FIELDS if "varlen" in sections else ():
        splitd = Options(family="sm80")
        for nq, nkv, varlen in ((1000, 1000, True), (1000, 1000, False), (7, 300, False),
                                (300, 1, False), (1, 1, False)):
            off = 0 if varlen else nkv - nq   # the per-sequence calls' own frames
            p = AttnProblem(dtype=dtype, batch=1, heads_q=4, heads_kv=2, seqlen_q=nq,
                            seqlen_kv=nkv, head_dim=d, head_dim_v=d, causal=causal,
                            causal_offset=off, varlen=varlen,
                            window_lo=None if lo is None else off + lo,
                            window_hi=None if hi is None else off + hi, has_sinks=sinks)
            plan = dispatch.plan_fwd(p, target=TARGET, opts=splitd)
            add([(plan.kernel_cls, plan.cfg)])
            add(dispatch.plan_bwd(p, target=TARGET, opts=splitd).jobs)
    for d, dv in DV_PAIRS if "dv" in sections else ():
        for dtype in ("bf16", "fp16"):
            for causal in (False, True):
                p = problem(d, dv, dtype, causal)
                plan = dispatch.plan_fwd(p, target=TARGET, opts=Options(family="sm90"))
                add([(plan.kernel_cls, plan.cfg)])
                if dtype == "bf16":
                    bwd = dispatch.plan_bwd(p, target=TARGET, opts=Options(family="sm90")).jobs
                    add(bwd + _group_split_twins(bwd))
    if "fused_perf" in sections:
        from perf import bwd_fused

        add(bwd_fused.jobs() + bwd_fused.trace_jobs())
    if "fwd_perf" in sections:
        from perf import shared_kv

        add(shared_kv.jobs())
    if "lazy" in sections:
        from perf import fp8_limits, lazy_rescale

        add(lazy_rescale.jobs() + fp8_limits.jobs())
        for d, dtype, kw in ((320, "bf16", {}), (512, "bf16", {}), (448, "fp16", {}),
                             (512, "e4m3", dict(out_dtype="bf16")),
                             (320, "e4m3", dict(out_dtype="bf16")),
                             (384, "e4m3", dict(out_dtype="bf16"))):
            for causal in (False, True):
                p = dataclasses.replace(problem(d, d, dtype, causal), **kw)
                plan = dispatch.plan_fwd(p, target=TARGET, opts=Options(family="sm90"))
                add([(plan.kernel_cls, dataclasses.replace(plan.cfg, lazy_rescale=on))
                     for on in (False, True)])
            if dtype == "e4m3":   # V's transpose
                from ffpa_cute.fp8 import vt_config

                t = vt_config(plan.kernel_cls, TARGET, d)
                add([(dispatch.kernel_class(t), t)])
    if "sanitize" in sections:
        sys.path.insert(0, str(pathlib.Path(__file__).parent))  # as a module or imported
        import sanitize

        add(sanitize.jobs(TARGET))
    if "lines" in sections:
        add(_lines_jobs())
    if "widened" in sections:
        add(_widened_jobs())
    if "padded_pair" in sections:
        add(_padded_pair_jobs())
    # the CTA pair's second CTA on a half line (`cta_align` 32 at D % 128 == 8): the forward
    # plans test_kv_pair_forward runs there and the curve's (not causal, and causal)
    for d in (648, 776, 904) if "cta" in sections else ():
        for causal in (False, True):
            plan = dispatch.plan_fwd(problem(d, d, "bf16", causal), target=TARGET)
            add([(plan.kernel_cls, plan.cfg)])
    if "wide" in sections:
        add(_wide_jobs())
    return out


def _wide_jobs() -> list:
    """The `wide` section: the forwards of test_forward_wide_o (O in one CTA above 512), of
    the CTA pair tests' cases (test_kv_pair_forward, test_forward_sm90_split_o: the pair with
    and without `kv_pair`), and the fast grid's D=576 fp16 (both causal modes)."""
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    sys.path.insert(0, str(pathlib.Path(__file__).parent))  # the test module's own imports
    import torch
    from test_attention_gpu import KV_PAIR_CASES, SPLIT_O_CASES, WIDE_O_CASES

    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    cases = [(d, names[dt], mode, {}) for d, dt, mode, *_ in WIDE_O_CASES]
    cases += [(d, "bf16", mode, {}) for d, mode, *_ in KV_PAIR_CASES]
    cases += [(d, "bf16", mode, {"kv_pair": False}) for d, mode, *_ in SPLIT_O_CASES]
    cases += [(576, "fp16", mode, {}) for mode in ("none", "bottom_right")]
    out = []
    for d, dt, mode, opts in cases:
        p = AttnProblem(dtype=dt, batch=1, heads_q=2, heads_kv=2, seqlen_q=4096,
                        seqlen_kv=4096, head_dim=d, head_dim_v=d, causal=mode != "none")
        plan = dispatch.plan_fwd(p, target=TARGET, opts=Options(family="sm90", **opts))
        if (plan.kernel_cls, plan.cfg) not in out:
            out.append((plan.kernel_cls, plan.cfg))
    # test_wide_gradient_kernels: the forward and the gradient kernels in one CTA (WIDE_BWD)
    from test_backward_sm90_gpu import WIDE_BWD_CASES

    for d, causal, nq, nkv, ratio, dt in WIDE_BWD_CASES:
        p = AttnProblem(dtype=names[dt], batch=1, heads_q=2 * ratio, heads_kv=2, seqlen_q=nq,
                        seqlen_kv=nkv, head_dim=d, head_dim_v=d, causal=causal,
                        causal_offset=nkv - nq)
        plan = dispatch.plan_fwd(p, target=TARGET, opts=Options(family="sm90"))
        bwd = dispatch.plan_bwd(p, target=TARGET, opts=Options(family="sm90"))
        for job in [(plan.kernel_cls, plan.cfg), *bwd.jobs]:
            if job not in out:
                out.append(job)
    return out


def _lines_jobs() -> list:
    """The `lines` section: the shares from 128-byte lines as planned (the forward's hi share
    and CTA pair, the gradient kernels' `line_shares_bwd`): the sm90 forward and backward
    plans at LINE_HEAD_DIMS (bf16, both causal modes), and test_line_shares' kernels (the
    forward, the planned backward and its even-share twin, `plan_bwd(lines=False)`)."""
    import dataclasses

    from ffpa_cute import dispatch
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.sm90 import config as sm90_config

    sys.path.insert(0, str(pathlib.Path(__file__).parent))  # the test module's own imports
    import torch
    from test_backward_sm90_gpu import LINE_CASES

    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    out = []
    cases = [(d, causal, 4096, 4096, 1, torch.bfloat16) for d in LINE_HEAD_DIMS
             for causal in (False, True)]
    for d, causal, nq, nkv, ratio, dt in cases + LINE_CASES:
        p = AttnProblem(dtype=names[dt],
                        batch=1, heads_q=2 * ratio, heads_kv=2, seqlen_q=nq, seqlen_kv=nkv,
                        head_dim=d, head_dim_v=d, causal=causal, causal_offset=nkv - nq)
        fwd = dispatch.plan_fwd(p, target=TARGET)
        bwd = dispatch.plan_bwd(p, target=TARGET)
        out += [(fwd.kernel_cls, fwd.cfg), *bwd.jobs]
        if (d, causal, nq, nkv, ratio, dt) in LINE_CASES:
            even = sm90_config.plan_bwd(p, TARGET, lines=False)
            out += dataclasses.replace(bwd, cfgs=(bwd.cfgs[0], *even)).jobs
    return out


def _padded_pair_jobs() -> list:
    """The `padded_pair` section: test_padded_pair_forward's kernels (the forward at D and the
    pair at the next multiple of 64 that `launch.padded_fwd` runs), then perf.pad_pair's."""
    from ffpa_cute import dispatch, launch
    from ffpa_cute.problem import AttnProblem
    from perf import pad_pair

    sys.path.insert(0, str(pathlib.Path(__file__).parent))  # the test module's own imports
    import torch
    from test_attention_gpu import PADDED_PAIR_CASES

    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    out = []
    for d, mode, nq, nkv, ratio, dt in PADDED_PAIR_CASES:
        p = AttnProblem(dtype=names[dt], batch=1, heads_q=2 * ratio, heads_kv=2, seqlen_q=nq,
                        seqlen_kv=nkv, head_dim=d, head_dim_v=d, causal=mode != "none",
                        causal_offset=nkv - nq if mode == "bottom_right" else 0)
        plan = dispatch.plan_fwd(p, target=TARGET)
        pad = launch._padded_plan(plan)
        out += [(plan.kernel_cls, plan.cfg), (pad.kernel_cls, pad.cfg)]
    return out + pad_pair.jobs(pad_pair.DIAG_HEAD_DIMS)


def _widened_jobs() -> list:
    """The `widened` section: test_widened_forward_is_exact's and test_row_repack_is_the_same
    _kernel's kernels (the forward at D and the widened one `launch.widened_fwd` runs; the
    backward of the latter test)."""
    from ffpa_cute import dispatch, launch
    from ffpa_cute.problem import AttnProblem

    sys.path.insert(0, str(pathlib.Path(__file__).parent))  # the test module's own imports
    import torch
    from test_attention_gpu import WIDENED_CASES

    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    cases = [(d, mode, nq, nkv, ratio, names[dt]) for d, mode, nq, nkv, ratio, dt in WIDENED_CASES]
    cases += [(d, "bottom_right", 3100, 3100, 1, "bf16") for d in (328, 520, 600)]
    out = []
    for d, mode, nq, nkv, ratio, dt in cases:
        p = AttnProblem(dtype=dt, batch=1, heads_q=2 * ratio, heads_kv=2, seqlen_q=nq,
                        seqlen_kv=nkv, head_dim=d, head_dim_v=d, causal=mode != "none",
                        causal_offset=nkv - nq if mode == "bottom_right" else 0)
        plan = dispatch.plan_fwd(p, target=TARGET)
        wide = launch.widened_fwd(plan, nq, nkv, candidate=True)
        out += [(plan.kernel_cls, plan.cfg)] + ([(wide.kernel_cls, wide.cfg)] if wide else [])
        if ratio == 1 and mode == "bottom_right":
            out += dispatch.plan_bwd(p, target=TARGET).jobs
    return out


def _row_unit_jobs() -> list:
    """(`rows`) test_fused_row_units' and test_default_route's kernels as their problems plan
    them (the forward, Delta, the fused backward: with `row_units` forced, or as routed)."""
    import dataclasses

    import torch

    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.sm90.fused_config import plan_bwd_fused

    sys.path.insert(0, str(pathlib.Path(__file__).parent))  # the test module's own imports
    from test_backward_sm90_gpu import DEFAULT_CASES, ROW_UNIT_CASES

    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    out = []
    for forced, cases in ((True, ROW_UNIT_CASES), (False, DEFAULT_CASES)):
        for d, causal, nq, nkv, ratio, dt in cases:
            p = AttnProblem(dtype=names[dt], batch=1, heads_q=2 * ratio, heads_kv=2,
                            seqlen_q=nq, seqlen_kv=nkv, head_dim=d, head_dim_v=d,
                            causal=causal, causal_offset=nkv - nq)
            plan = dispatch.plan_fwd(p, target=TARGET, opts=Options(family="sm90"))
            out.append((plan.kernel_cls, plan.cfg))
            bwd = dispatch.plan_bwd(p, target=TARGET, opts=Options(family="sm90")).jobs
            if forced:
                cfg = dataclasses.replace(plan_bwd_fused(p, TARGET), row_units=True)
                bwd = [bwd[0], (dispatch.kernel_class(cfg), cfg)]
            out += bwd
    return out


def _group_split_twins(jobs) -> list:
    """The dV / dK configs of a backward plan with the head group split over CTAs
    (`group_split`: what GQA / MQA with few KV tiles plan, e.g. the tests' Hq/Hkv = 8/2 at
    Nkv = 1000)."""
    import dataclasses

    from ffpa_cute import dispatch

    twins = []
    for _, cfg in jobs:
        if hasattr(cfg, "group_split") and type(cfg).__name__ in ("BwdDKConfigSm90",
                                                                   "BwdDVConfigSm90"):
            twin = dataclasses.replace(cfg, group_split=not cfg.group_split)
            twins.append((dispatch.kernel_class(twin), twin))
    return twins


def _one_cta_per_tile(cfg) -> list:
    """A persistent config's one-CTA-per-tile twin (`Options(persistent=False)`: the GPU tests
    compare their bits, perf runs time both)."""
    import dataclasses

    from ffpa_cute import dispatch

    if not getattr(cfg, "persistent", False):
        return []
    twin = dataclasses.replace(cfg, persistent=False)
    return [(dispatch.kernel_class(twin), twin)]


def _compile_part(args):
    directory, part, parts, sections = args
    from ffpa_cute.cache import JitCache

    cache = JitCache(directory, disk=True, jit="allow")
    for i, (cls, cfg) in enumerate(jobs(sections)):
        if i % parts == part:
            cache.get(cls, cfg)
    return cache.stats.compiles


def pack(directory: str, sections, out: str) -> tuple[int, int]:
    """Write the cache entries of `jobs(sections)` found under `directory` to the xz tarball
    `out` as .precache/<fingerprint>/k*.o (whatever `directory` is called: the device
    unpacks it into /tmp/pc and reads /tmp/pc/.precache); (packed, missing)."""
    import tarfile

    from ffpa_cute.cache import JitCache, kernel_name, key_hash

    entries = JitCache(directory, disk=True).entry_dir(TARGET)
    names = sorted({f"k{key_hash(kernel_name(cls), cfg)}.o" for cls, cfg in jobs(sections)})
    found = [n for n in names if (entries / n).exists()]
    with tarfile.open(out, "w:xz") as tar:
        for n in found:
            tar.add(entries / n, arcname=f".precache/{entries.name}/{n}")
    return len(found), len(names) - len(found)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.gpu_jobs", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precompile", metavar="DIR", required=True)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--pack", metavar="FILE",
                    help="also write the selected kernels' entries to this xz tarball")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help=f"comma list of {', '.join(SECTIONS)} (default: all)")
    a = ap.parse_args(argv)
    sections = tuple(a.sections.split(","))
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        ap.error(f"--sections: unknown {sorted(unknown)}; accepted: {', '.join(SECTIONS)}")
    n = len(jobs(sections))
    if a.workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(a.workers) as pool:
            compiled = sum(pool.map(_compile_part, [(a.precompile, i, a.workers, sections)
                                                    for i in range(a.workers)]))
    else:
        compiled = _compile_part((a.precompile, 0, 1, sections))
    print(f"{n} kernels for {TARGET} in {a.precompile}: {compiled} compiled")
    if a.pack:
        packed, missing = pack(a.precompile, sections, a.pack)
        print(f"{a.pack}: {packed} kernels packed ({missing} not in the cache)")
        return 1 if missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
