"""compute-sanitizer sweep: every kernel the package launches on this GPU, on small odd shapes,
under memcheck, racecheck, synccheck and initcheck. Any error or hazard fails it.

    python -m tests.sanitize                    # the four tools, in parallel; exit 1 on any finding
    python -m tests.sanitize --tools racecheck  # one tool
    python -m tests.sanitize --workload         # the workload alone (what each tool runs)
    SANITIZE_CASES=fused python -m tests.sanitize   # only the cases whose label contains one
                                                    # of the comma-separated substrings
    python -m tests.sanitize --precompile DIR   # (CPU) compile the workload's kernels into DIR

What the workload runs (`CASES`): `ffpa_cute.attention` forward and backward through the public
API, strict (a fallback would raise), for each kernel family that runs on the device, covering
every kernel class and mode the planners pick there: the sm90 WGMMA forward (one CTA, O in one
CTA up to 576 (`wide_o`), the `kv_pair` CTA pair above, Dv != D, GQA rows packed for decode,
persistent CTAs walking more tiles than there are SMs), the sm90 atomic-free dQ / dK / dV
kernels (`deterministic`: dK with sequential score products and with two accumulators, the
gradient in one CTA up to 576 and split over two CTAs above), the fused Delta kernel, the
Split-D mma.sync forward and backward (the sm80 family) in their M8N1 / M4N2 / M2N4 warp
layouts; causal in both alignments, Nq != Nkv, GQA / MQA, bf16 and fp16; the FP8 forwards
(WGMMA and Split-D); a sliding window and sinks (forward and backward, `FEATURE_CASES`, one of
them through the default fused backward) and the split-KV decode kernel on a paged and a
contiguous cache, 16-bit and e4m3, and a causal chunk (`KV_CASES`); the one-launch varlen
forward and backward over packed sequences of unequal query and key lengths, empty ones
included (`VARLEN_CASES`); the fused backward (the default at D 264-576) through
its plans (`FUSED_CASES`).

racecheck checks only our kernels (`--kernel-name kns=ffpa_cute`: torch's own kernels would
only slow it down); the other tools check every kernel of the process (initcheck must see
torch's writes of the inputs, or it would report them as uninitialized).

On the device machine: precompile on the CPU box first (`--precompile .precache`, carried with
the call) so the sanitized processes compile nothing; `FFPA_CUTE_CACHE_DIR=.precache` there.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import time

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")

# (label, family, B, Hq, Hkv, Nq, Nkv, D, Dv, causal mode, dtype, backward)
CASES = [
    ("sm90 D512 GQA causal bottom-right", "sm90", 1, 4, 2, 129, 333, 512, 512, "bottom_right",
     "bf16", True),
    ("sm90 D320", "sm90", 2, 2, 2, 77, 77, 320, 320, "none", "bf16", True),
    ("sm90 D1024 kv_pair causal", "sm90", 1, 2, 1, 65, 130, 1024, 1024, "bottom_right",
     "bf16", True),
    ("sm90 D768 MQA upper-left Nq>Nkv fp16", "sm90", 1, 4, 1, 200, 77, 768, 768, "upper_left",
     "fp16", True),
    ("sm90 D264 causal bottom-right", "sm90", 1, 2, 2, 7, 129, 264, 264, "bottom_right",
     "bf16", True),
    ("sm90 MLA 576/512 causal", "sm90", 1, 4, 1, 65, 130, 576, 512, "bottom_right", "bf16", True),
    ("sm90 decode GQA rows packed", "sm90", 2, 8, 2, 1, 300, 512, 512, "none", "bf16", False),
    # D % 16 == 8 with long rows: q, k zero-padded to D + 8 (`launch.widened_fwd`)
    ("sm90 D280 zero-padded to 288, Nq != Nkv causal", "sm90", 1, 1, 1, 3100, 3200, 280, 280,
     "bottom_right", "bf16", False),
    # O halves computed wider than stored (`half_align`): the extra columns past Dv zero-filled
    # by TMA and never stored
    ("sm90 D336 widened O halves, Nq != Nkv", "sm90", 1, 2, 2, 77, 200, 336, 336, "none",
     "bf16", False),
    ("sm90 D648 kv_pair, second CTA from a half line, causal", "sm90", 1, 2, 1, 65, 130, 648,
     648, "bottom_right", "bf16", False),
    # O in one CTA above 512 (`wide_o`): 288-column shares as m64n96 WGMMAs, `setmaxnreg`
    ("sm90 D576 wide O and gradients in one CTA causal GQA", "sm90", 1, 4, 2, 129, 333, 576,
     576, "bottom_right", "bf16", True),
    ("sm90 D536 wide O, hi share from a line, upper-left", "sm90", 1, 2, 1, 77, 200, 536, 536,
     "upper_left", "fp16", False),
    # persistent CTAs (one per SM) with more tiles than SMs: rings and hand-overs carried over
    ("sm90 D320 persistent, 144 tiles", "sm90", 1, 48, 48, 130, 200, 320, 320, "none", "bf16",
     False),
    # D % 64 != 0 persistent, the hi share from column 256 (`split_align` 64: 144 stored of 192)
    ("sm90 D400 persistent split shares, 144 tiles", "sm90", 1, 48, 48, 130, 200, 400, 400,
     "none", "bf16", False),
    # the CTA pair at the next multiple of 64 on zero-padded q, k, v (`launch.padded_fwd`),
    # long enough for the row copies (as 8-byte words, `launch.copy_rows`)
    ("sm90 D600 CTA pair at 640 on zero-padded q, k, v, GQA, Nq != Nkv", "sm90", 1, 2, 1, 2100,
     2300, 600, 600, "none", "fp16", False),
    ("sm90 D520 wide O and gradients in one CTA (D % 16 == 8)", "sm90", 1, 2, 1, 65, 130, 520,
     520, "bottom_right", "bf16", True),
    ("sm80 D320 M8N1 causal", "sm80", 1, 2, 1, 77, 129, 320, 320, "bottom_right", "bf16", True),
    ("sm80 D512 M4N2 GQA", "sm80", 1, 4, 2, 129, 333, 512, 512, "none", "fp16", True),
    ("sm80 D1024 M2N4 upper-left", "sm80", 1, 2, 1, 65, 130, 1024, 1024, "upper_left", "bf16",
     True),
    # the FP8 forward (e4m3 in, bf16 out; forward only) and the transpose that writes its Vt
    ("sm90 FP8 D512 GQA causal", "sm90", 1, 4, 2, 129, 333, 512, 512, "bottom_right", "e4m3",
     False),
    ("sm90 FP8 D1024 CTA pair", "sm90", 1, 2, 1, 65, 130, 1024, 1024, "none", "e4m3", False),
    # no mask, D <= 384: QK[i+1] under the score step (`overlap`), 3 blocks (odd), then 2
    ("sm90 FP8 D384 GQA overlapped", "sm90", 1, 4, 2, 129, 333, 384, 384, "none", "e4m3",
     False),
    ("sm90 FP8 D320 overlapped", "sm90", 1, 2, 1, 65, 200, 320, 320, "none", "e4m3", False),
    # the Split-D FP8 forward (M4N2, a partial last chunk; M2N4), Nkv not a multiple of 16
    ("sm80 FP8 D400 GQA causal", "sm80", 1, 4, 2, 129, 333, 400, 400, "bottom_right", "e4m3",
     False),
    ("sm80 FP8 D1024 upper-left", "sm80", 1, 2, 1, 65, 130, 1024, 1024, "upper_left", "e4m3",
     False),
]
# (label, B, Hq, Hkv, Nq, Nkv, D, causal, window, sinks, fused): the sliding window's left edge
# (blocks skipped and masked) and sinks in the forward, the window in dQ / dK / dV (`fused`:
# the default backward, the fused kernel where it pays, instead of the atomic-free kernels)
FEATURE_CASES = [
    ("sm90 D512 window + sinks causal GQA", 1, 4, 2, 129, 333, 512, True, (64, 0), True, False),
    ("sm90 D512 window persistent GQA, 144 tiles", 1, 48, 8, 130, 130, 512, True, (64, 0),
     False, False),
    ("sm90 D1024 window both sides kv_pair", 1, 2, 1, 65, 300, 1024, False, (40, 20), False,
     False),
    ("D520 window + sinks causal (wide O and gradients in one CTA)", 1, 2, 1, 65, 200, 520,
     True, (50, 0), True, False),
    ("sm90 fused backward D384 window both sides + sinks GQA", 1, 4, 2, 129, 333, 384, False,
     (64, 16), True, True),
]
# (label, family, B, Hq, Hkv, Nq, Nkv, D, causal, window, sinks): the FP8 forwards (e4m3 in,
# forward only) with a window and sinks
FP8_FEATURE_CASES = [
    ("sm90 FP8 D512 window + sinks causal GQA", "sm90", 1, 4, 2, 129, 333, 512, True, (64, 0),
     True),
    ("sm80 FP8 D400 window both sides + sinks", "sm80", 1, 2, 1, 65, 300, 400, False, (40, 20),
     True),
]
# (label, B, Hq, Hkv, N (every row's keys), D, Dv, page size or None, cache dtype, Nq): the
# split-KV decode (an e4m3 cache with <= 32 rows per KV head: the keys-as-rows kernel, else its
# stages converted to bf16 in smem; Nq > 1: a causal chunk)
KV_CASES = [
    ("sm90 decode paged 64 GQA", 2, 8, 2, 300, 512, 512, 64, "bf16", 1),
    ("sm90 decode contiguous MLA MQA", 1, 16, 1, 1000, 576, 512, None, "bf16", 1),
    ("sm90 decode FP8 cache paged 64 GQA (keys as rows)", 2, 8, 2, 300, 512, 512, 64, "e4m3", 1),
    ("sm90 decode FP8 cache contiguous GQA 8:1 (keys as rows)", 2, 32, 4, 1001, 512, 512, None,
     "e4m3", 1),
    ("sm90 decode FP8 cache contiguous MLA MQA", 1, 16, 1, 1000, 576, 512, None, "e4m3", 1),
    ("sm90 chunked prefill (causal, Nq 5) paged 64 GQA", 2, 8, 2, 300, 512, 512, 64, "bf16", 5),
]
# (label, Hq, Hkv, query lengths, key lengths, D, Dv, causal, window, sinks[, family]): one
# launch of `varlen_attention` over packed sequences, forward and backward (family "sm80": the
# Split-D kernels)
VARLEN_CASES = [
    ("sm90 varlen D512 GQA causal, Nq != Nkv, no keys, no queries", 4, 2, (129, 0, 77, 1, 40),
     (200, 30, 0, 1, 40), 512, 512, True, None, False),
    ("sm90 varlen D576 CTA pair window + sinks", 2, 1, (65, 130), (130, 65), 576, 576, True,
     (64, 0), True),
    ("sm80 varlen D512 GQA causal, window + sinks, no keys, no queries", 4, 2,
     (129, 0, 77, 1, 40), (200, 30, 0, 1, 40), 512, 512, True, (64, 0), True, "sm80"),
]

# the fused backward (planned here: the default route is the atomic-free one), after our forward:
# (label, Hq, Hkv, Nq, Nkv, D, causal (bottom-right), dq_grads: who forms dQ, group_split)
FUSED_CASES = [
    ("sm90 fused backward D512 GQA causal, Nq < Nkv", 4, 2, 129, 333, 512, True, 0, False),
    ("sm90 fused backward D320 Nq > Nkv", 2, 2, 200, 77, 320, False, 0, False),
    ("sm90 fused backward D448 GQA 4:1, 7 dQ pieces per block", 4, 1, 300, 200, 448, False, 0,
     False),
    ("sm90 fused backward D512 GQA causal, dQ by the dV warpgroup", 4, 2, 129, 333, 512, True,
     1, False),
    ("sm90 fused backward D448 GQA 4:1, dQ by dV (4 pieces) and dK (3)", 4, 1, 300, 200, 448,
     False, 2, False),
    ("sm90 fused backward D512 MQA 8:1 causal, head group split", 8, 1, 129, 333, 512, True, 0,
     True),
    # D=576 over the pair: 288 columns a CTA, dK / dV as m64n96 WGMMAs, one Q and one dO stage
    ("sm90 fused backward D576 over the pair (wide), GQA causal", 4, 2, 129, 333, 576, True, 1,
     False),
    ("sm90 fused backward D576 over the pair (wide) fp16, Nq > Nkv", 2, 2, 200, 77, 576, False,
     1, False, None, "fp16"),
    # D % 64 != 0 on operands zero-padded to the next multiple of 64 (`FUSED_PAD`)
    ("sm90 fused backward D520 padded to 576, GQA causal", 4, 2, 129, 333, 520, True, 1, False),
    # (query block row, key tile) units, dK / dV by fp32 reductions (`row_units`: planned for
    # causal groups of 16+)
    ("sm90 fused backward D512 MQA 32:1 causal, row units", 32, 1, 129, 333, 512, True, 1,
     False),
    ("sm90 fused backward D576 (wide) MQA 32:1 causal, row units, Nq > Nkv", 32, 1, 200, 77,
     576, True, 1, False),
    ("sm90 fused backward D320 fp16 MQA 32:1 causal, row units", 32, 1, 129, 333, 320, True, 1,
     False, None, "fp16"),
    # D over C CTAs (`scatter`; last field: C)
    ("sm90 fused backward D1024 over 4 CTAs, scatter, GQA", 4, 2, 129, 333, 1024, True, 1,
     False, 4),
    ("sm90 fused backward D576 over 3 CTAs, scatter", 2, 2, 200, 77, 576, False, 1, False, 3),
]

# the gradient kernels with each share from a 128-byte line (`line_shares_bwd`, as planned),
# after our forward: (label, Hq, Hkv, Nq, Nkv, D, causal (bottom-right))
LINE_CASES = [
    ("sm90 line-share backward D320 causal, Nq > Nkv", 2, 2, 200, 77, 320, True),
    ("sm90 line-share backward D336 GQA 8:1 causal, split head groups", 8, 1, 129, 333, 336,
     True),
]


# dense masks served as kernel calls (ffpa_cute/dense_mask.py: views or gathers of k / v, runs
# of rows, the backward by runs of keys), forward and backward: (label, B, Hq, Hkv, N, D, kind)
MASK_CASES = [
    ("sm90 key-padding mask, scattered keys per element (gathered)", 3, 4, 2, 333, 320,
     "scattered"),
    ("sm90 key-padding mask, right padding per element (views)", 3, 2, 2, 333, 512, "padding"),
    ("sm90 row-prefix mask, image blocks (row runs, key-run backward)", 1, 4, 1, 333, 512,
     "images"),
]


def _mask(kind: str, b: int, n: int):
    """A MASK_CASES mask on the GPU."""
    import torch

    i = torch.arange(n, device="cuda")
    if kind == "scattered":
        keep = torch.rand(b, n, device="cuda") > 0.4
        keep[:, 0] = True
        return keep[:, None, None]
    if kind == "padding":
        return (i < torch.tensor([n, n - 100, 7], device="cuda")[:b, None])[:, None, None]
    lengths = i + 1
    for a, e in ((40, 104), (200, 290)):
        lengths[a:e] = e
    return i[None] < lengths[:, None]


def _selected(label: str) -> bool:
    """Whether the workload runs the case labelled `label`: every case, or with SANITIZE_CASES
    set (comma-separated substrings, e.g. "fused") those whose label contains one of them."""
    only = [x for x in os.environ.get("SANITIZE_CASES", "").split(",") if x]
    return not only or any(x in label for x in only)


def _chosen(cases: list) -> list:
    """The cases of a group whose labels (their first field) `_selected` takes."""
    return [c for c in cases if _selected(c[0])]


def _n_selected() -> int:
    labels = [c[0] for group in (CASES, FEATURE_CASES, FP8_FEATURE_CASES, KV_CASES,
                                 VARLEN_CASES, FUSED_CASES, LINE_CASES, MASK_CASES)
              for c in group]
    return sum(map(_selected, labels))


def _fused_plan(hq, hkv, nq, nkv, d, causal, dq_grads, group_split, cluster_d=None,
                dtype="bf16"):
    """A FUSED_CASES case's problem and the fused backward's plan (Delta, then the kernel;
    `cluster_d`: D over that many CTAs with `scatter`; D % 64 != 0 at the next multiple of 64
    on zero-padded operands, as `plan_bwd_fused` plans it)."""
    from ffpa_cute import dispatch
    from ffpa_cute.common.config import DeltaConfig
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.sm90.fused_config import fit_dq_staging, plan_bwd_fused

    p = AttnProblem(dtype=dtype, batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_kv=nkv,
                    head_dim=d, head_dim_v=d, causal=causal, causal_offset=nkv - nq)
    kw = dict(cluster_d=cluster_d, scatter=True) if cluster_d else {}
    cfg = fit_dq_staging(dataclasses.replace(plan_bwd_fused(p, **kw), dq_grads=dq_grads,
                                             group_split=group_split))
    return p, dispatch.BwdPlan(p, "sm_90a", "sm90", cfgs=(DeltaConfig("sm_90a", dtype, d),
                                                          cfg))


def _line_plan(hq, hkv, nq, nkv, d, causal):
    """A LINE_CASES case's problem and its atomic-free backward plan (`deterministic`; its
    shares from lines: the planner's `line_shares_bwd`)."""
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    p = AttnProblem(dtype="bf16", batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_kv=nkv,
                    head_dim=d, head_dim_v=d, causal=causal, causal_offset=nkv - nq)
    plan = dispatch.plan_bwd(p, target="sm_90a", opts=Options(deterministic=True))
    assert all(c.split_align == 64 for c in plan.cfgs[1:]), plan.cfgs
    return p, plan


def _problem(case):
    from ffpa_cute.problem import AttnProblem

    _, _, b, hq, hkv, nq, nkv, d, dv, mode, dtype, _ = case
    causal = mode != "none"
    offset = {"none": 0, "bottom_right": nkv - nq, "upper_left": 0}[mode]
    return AttnProblem(dtype=dtype, batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=nq,
                       seqlen_kv=nkv, head_dim=d, head_dim_v=dv, causal=causal,
                       causal_offset=offset)


def jobs(target: str = "sm_90a") -> list:
    """(kernel class, config) of every kernel the workload launches on `target` (with
    SANITIZE_CASES set, the selected cases' only)."""
    from ffpa_cute import dispatch, launch
    from ffpa_cute.common.config import CombineConfig
    from ffpa_cute.fp8 import vt_config
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    def atomic_free(**fields):  # the workload's options: the atomic-free backward
        return Options(deterministic=True, **fields)

    out = []
    for case in _chosen(CASES):
        opts = atomic_free(family=case[1])
        p = _problem(case)
        plan = dispatch.plan_fwd(p, target=target, opts=opts)
        assert plan.reason is None, (case[0], plan.reason)
        todo = [(plan.kernel_cls, plan.cfg)]
        wide = launch.widened_fwd(plan, p.seqlen_q, p.seqlen_kv, candidate=True)
        if wide is not None:   # what runs instead at D % 16 == 8 with long rows
            todo.append((wide.kernel_cls, wide.cfg))
        if case[-2] == "e4m3":
            t = vt_config(plan.kernel_cls, target, case[8])
            todo.append((dispatch.kernel_class(t), t))
        if case[-1]:
            bwd = dispatch.plan_bwd(p, target=target, opts=opts)
            assert bwd.reason is None, (case[0], bwd.reason)
            todo += bwd.jobs
        out += [j for j in todo if j not in out]
    for _, b, hq, hkv, nq, nkv, d, causal, window, sinks, fused in _chosen(FEATURE_CASES):
        left, right = window
        p = AttnProblem(dtype="bf16", batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=nq,
                        seqlen_kv=nkv, head_dim=d, head_dim_v=d, causal=causal,
                        causal_offset=nkv - nq if causal else 0, window_lo=nkv - nq - left,
                        window_hi=None if right is None else nkv - nq + right,
                        has_sinks=sinks)
        opts = Options() if fused else atomic_free()
        plan = dispatch.plan_fwd(p, target=target, opts=opts)
        todo = [(plan.kernel_cls, plan.cfg)] + dispatch.plan_bwd(p, target=target,
                                                                 opts=opts).jobs
        out += [j for j in todo if j not in out]
    for _, family, b, hq, hkv, nq, nkv, d, causal, window, sinks in _chosen(FP8_FEATURE_CASES):
        left, right = window
        p = AttnProblem(dtype="e4m3", batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=nq,
                        seqlen_kv=nkv, head_dim=d, head_dim_v=d, causal=right is not None,
                        causal_offset=nkv - nq if causal or right is not None else 0,
                        window_lo=nkv - nq - left,
                        window_hi=None if right is None else nkv - nq + right,
                        has_sinks=sinks, out_dtype="bf16")
        plan = dispatch.plan_fwd(p, target=target, opts=atomic_free(family=family))
        assert plan.reason is None, plan.reason
        t = vt_config(plan.kernel_cls, target, d)
        out += [j for j in ((plan.kernel_cls, plan.cfg), (dispatch.kernel_class(t), t))
                if j not in out]
    for _, b, hq, hkv, n, d, dv, page, kv, nq in _chosen(KV_CASES):
        p = AttnProblem(dtype="bf16", batch=b, heads_q=hkv, heads_kv=hkv,
                        seqlen_q=hq // hkv * nq, seqlen_kv=n, head_dim=d, head_dim_v=dv,
                        causal=nq > 1)
        plan = dispatch.plan_decode(p, page, target=target, opts=atomic_free(),
                                    kv_dtype=None if kv == "bf16" else kv)
        assert plan.reason is None, plan.reason
        combine = CombineConfig(target, "bf16", dv)  # the split combine after it
        for job in ((plan.kernel_cls, plan.cfg), (dispatch.kernel_class(combine), combine)):
            if job not in out:
                out.append(job)
    for _, hq, hkv, lq, lk, d, dv, causal, window, sinks, *fam in _chosen(VARLEN_CASES):
        p = AttnProblem(dtype="bf16", batch=len(lq), heads_q=hq, heads_kv=hkv,
                        seqlen_q=max(lq), seqlen_kv=max(lk), head_dim=d, head_dim_v=dv,
                        causal=causal, window_lo=None if window is None else -window[0],
                        window_hi=None if window is None else window[1], has_sinks=sinks,
                        varlen=True)
        opts = atomic_free(family=fam[0] if fam else None)
        plan = dispatch.plan_fwd(p, target=target, opts=opts)
        assert plan.reason is None and plan.cfg.varlen, plan.reason
        todo = [(plan.kernel_cls, plan.cfg)] + dispatch.plan_bwd(p, target=target,
                                                                 opts=opts).jobs
        out += [j for j in todo if j not in out]
    for _, *case in _chosen(FUSED_CASES):
        p, bwd = _fused_plan(*case)
        plan = dispatch.plan_fwd(p, target=target, opts=atomic_free())
        out += [j for j in [(plan.kernel_cls, plan.cfg), *bwd.jobs] if j not in out]
    for _, *case in _chosen(LINE_CASES):
        p, bwd = _line_plan(*case)
        plan = dispatch.plan_fwd(p, target=target, opts=atomic_free())
        out += [j for j in [(plan.kernel_cls, plan.cfg), *bwd.jobs] if j not in out]
    return out


def workload() -> int:
    """Run every case forward (+ backward) once; prints the route of each."""
    import torch
    from torch.nn.attention.bias import causal_upper_left

    import ffpa_cute

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.bfloat16}
    torch.manual_seed(0)
    # the atomic-free backward (`deterministic`) wherever the cases go through the API: the
    # fused kernel, the default at some D, runs through its own plans (FUSED_CASES); no
    # canaries (`self_check` "off"): a canary adds torch's reference computation to what the
    # tools check (initcheck flags torch's own kernels reading a cuBLAS result in it, and
    # racecheck has ended in an internal error under it: docs/verification.md); the kernels a
    # canary would run are the workload's own, on the cases' shapes
    ffpa_cute.options.set_default(deterministic=True, self_check="off")
    for case in CASES:
        label, family, b, hq, hkv, nq, nkv, d, dv, mode, dtype, backward = case
        if not _selected(label):
            continue
        dt = dtypes[dtype]
        q = torch.randn(b, hq, nq, d, device="cuda", dtype=dt, requires_grad=backward)
        k = torch.randn(b, hkv, nkv, d, device="cuda", dtype=dt, requires_grad=backward)
        v = torch.randn(b, hkv, nkv, dv, device="cuda", dtype=dt, requires_grad=backward)
        kw = dict(enable_gqa=hq != hkv)
        if dtype == "e4m3":  # per-tensor quantised inputs, their descales
            (q, qd), (k, kd), (v, vd) = (ffpa_cute.quantize_fp8(t) for t in (q, k, v))
            kw.update(q_descale=qd, k_descale=kd, v_descale=vd)
        if mode == "upper_left":
            kw["attn_mask"] = causal_upper_left(nq, nkv)
        else:
            kw["is_causal"] = mode == "bottom_right"
        with ffpa_cute.options.use(family=family):
            route = ffpa_cute.explain(q, k, v, **{n: a for n, a in kw.items()
                                                  if not n.endswith("_descale")})
            out = ffpa_cute.attention(q, k, v, strict=True, **kw)
            if backward:
                assert "SDPA recompute" not in route, (label, route)
                out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        print(f"[workload] {label}: {route[:160]}", flush=True)
    for label, b, hq, hkv, nq, nkv, d, causal, window, sinks, fused in FEATURE_CASES:
        if not _selected(label):
            continue
        q = torch.randn(b, hq, nq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, hkv, nkv, d, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        kw = dict(is_causal=causal, enable_gqa=hq != hkv, window=window,
                  sinks=torch.randn(hq, device="cuda", requires_grad=True) if sinks else None)
        with ffpa_cute.options.use(deterministic=not fused):
            route = ffpa_cute.explain(q, k, v, **kw)
            out = ffpa_cute.attention(q, k, v, strict=True, **kw)
            assert "kernels (dQ, dK, dV)" in route, (label, route)
            assert ("FFPABwdFusedSm90" in route) == fused, (label, route)
            out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        print(f"[workload] {label}: {route[:160]}", flush=True)
    for label, family, b, hq, hkv, nq, nkv, d, causal, window, sinks in FP8_FEATURE_CASES:
        if not _selected(label):
            continue
        x = [torch.randn(b, h, n, d, device="cuda") for h, n in ((hq, nq), (hkv, nkv), (hkv, nkv))]
        (q, qd), (k, kd), (v, vd) = (ffpa_cute.quantize_fp8(t) for t in x)
        kw = dict(is_causal=causal, enable_gqa=hq != hkv, window=window,
                  sinks=torch.randn(hq, device="cuda") if sinks else None)
        with ffpa_cute.options.use(family=family):
            route = ffpa_cute.explain(q, k, v, **kw)
            ffpa_cute.attention(q, k, v, q_descale=qd, k_descale=kd, v_descale=vd, strict=True,
                                **kw)
        torch.cuda.synchronize()
        print(f"[workload] {label}: {route[:160]}", flush=True)
    from ffpa_cute import decode

    for label, b, hq, hkv, n, d, dv, page, kv, nq in KV_CASES:
        if not _selected(label):
            continue
        pages = b * -(-n // (page or n))
        rows = page or n
        kc = torch.randn(pages if page else b, rows, hkv, d, device="cuda", dtype=torch.bfloat16)
        vc = torch.randn(pages if page else b, rows, hkv, dv, device="cuda", dtype=torch.bfloat16)
        if kv == "e4m3":
            kc, vc = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn)
        table = (torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, -1) if page
                 else None)
        q = torch.randn(b, nq, hq, d, device="cuda", dtype=torch.bfloat16)
        lens = torch.tensor([n - 7 * i for i in range(b)], dtype=torch.int32, device="cuda")
        plan = decode.decode_plan(q, kc, vc, True, None, page, None)
        assert plan is not None and plan.cfg.causal == (nq > 1), label
        ffpa_cute.attention_with_kvcache(q, kc, vc, lens, table, strict=True)
        torch.cuda.synchronize()
        print(f"[workload] {label}: {plan.describe()[:160]}", flush=True)
    from ffpa_cute import varlen

    for label, hq, hkv, lq, lk, d, dv, causal, window, sinks, *fam in VARLEN_CASES:
        if not _selected(label):
            continue
        cq, ck = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32,
                               device="cuda") for n in (lq, lk))
        q = torch.randn(sum(lq), hq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(sum(lk), hkv, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(sum(lk), hkv, dv, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        sk = torch.randn(hq, device="cuda", requires_grad=True) if sinks else None
        with ffpa_cute.options.use(**(dict(family=fam[0]) if fam else {})):
            plan = varlen._one_launch_plan(q, k, v, len(lq), max(lq), max(lk), causal, None,
                                           window, sk)
            assert plan is not None, label
            out = ffpa_cute.varlen_attention(q, k, v, cq, ck, max(lq), max(lk),
                                             is_causal=causal, enable_gqa=hq != hkv,
                                             window=window, sinks=sk, strict=True)
            out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        print(f"[workload] {label}: {plan.describe()[:160]}", flush=True)
    for label, b, hq, hkv, n, d, kind in MASK_CASES:
        if not _selected(label):
            continue
        q = torch.randn(b, hq, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        mask = _mask(kind, b, n)
        route = ffpa_cute.explain(q, k, v, attn_mask=mask, enable_gqa=hq != hkv)
        out = ffpa_cute.attention(q, k, v, attn_mask=mask, enable_gqa=hq != hkv, strict=True)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        print(f"[workload] {label}: {route[:160]}", flush=True)
    from ffpa_cute import launch

    planned = ([(c[0], lambda c=c: _fused_plan(*c[1:])) for c in FUSED_CASES]
               + [(c[0], lambda c=c: _line_plan(*c[1:])) for c in LINE_CASES])
    for label, plan_of in planned:   # backward plans given here, after our forward
        if not _selected(label):
            continue
        p, plan = plan_of()
        hq, hkv, nq, nkv, d = p.heads_q, p.heads_kv, p.seqlen_q, p.seqlen_kv, p.head_dim
        dt = dtypes[p.dtype]
        q, do = (torch.randn(1, hq, nq, d, device="cuda", dtype=dt) for _ in range(2))
        k, v = (torch.randn(1, hkv, nkv, d, device="cuda", dtype=dt) for _ in range(2))
        out, lse = ffpa_cute.attention(q, k, v, is_causal=p.causal, enable_gqa=hq != hkv,
                                       return_lse=True, strict=True)
        launch.run_bwd(plan, q, k, v, out, lse, do)
        torch.cuda.synchronize()
        print(f"[workload] {label}: {plan.cfgs[1:]}", flush=True)
    return 0


def _summary(tool: str, text: str) -> tuple[int, str]:
    """(findings, summary line) from one tool's output: racecheck's hazards (errors and
    warnings), the others' error count; -1 when the tool printed no summary."""
    if tool == "racecheck":
        m = re.search(r"RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, "
                      r"(\d+) warnings?\)", text)
        if m:
            return int(m.group(1)), m.group(0)
        if re.search(r"ERROR SUMMARY: 0 errors", text):
            return 0, "RACECHECK SUMMARY: 0 hazards"
    m = re.search(r"ERROR SUMMARY: (\d+) errors?", text)
    return (int(m.group(1)), m.group(0)) if m else (-1, "no summary (crashed or timed out?)")


def _command(tool: str) -> list[str]:
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    cmd = [exe, "--tool", tool, "--print-limit", "20"]
    if tool == "racecheck":
        cmd += ["--kernel-name", "kns=ffpa_cute", "--racecheck-report", "all"]
    return cmd + [sys.executable, "-m", "tests.sanitize", "--workload"]


def sweep(tools, out_dir: str, timeout: float) -> int:
    """Run the workload under each tool (in parallel processes); print one line per tool and
    return 1 if any tool found anything or printed no summary."""
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    procs = {}
    for tool in tools:
        log = open(os.path.join(out_dir, f"sanitize-{tool}.log"), "w")
        procs[tool] = (subprocess.Popen(_command(tool), stdout=log, stderr=subprocess.STDOUT),
                       log)
    bad = 0
    for tool, (proc, log) in procs.items():
        try:
            proc.wait(timeout=max(1.0, timeout - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        text = open(log.name).read()
        n, line = _summary(tool, text)
        routes = text.count("[workload]")
        want = _n_selected()
        ok = n == 0 and routes == want
        bad |= not ok
        print(f"{tool:10s} {'ok  ' if ok else 'FAIL'} {line}; cases run {routes}/{want}; "
              f"log {log.name} ({time.time() - t0:.0f} s)", flush=True)
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.sanitize", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", action="store_true", help="run the workload (no sanitizer)")
    ap.add_argument("--precompile", metavar="DIR", help="compile the workload's kernels into DIR")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--out", default=os.environ.get("OUT", "sanitize-logs"))
    ap.add_argument("--timeout", type=float, default=480.0, help="seconds for the whole sweep")
    a = ap.parse_args(argv)
    if a.workload:
        return workload()
    if a.precompile:
        from ffpa_cute.cache import JitCache

        cache = JitCache(a.precompile, disk=True, jit="allow")
        todo = jobs()
        for cls, cfg in todo:
            cache.get(cls, cfg)
        print(f"{len(todo)} kernels in {cache.entry_dir('sm_90a')}: {cache.stats.compiles} "
              f"compiled")
        return 0
    return sweep([t for t in a.tools.split(",") if t], a.out, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
