"""The fused backward (5 GEMM units, sm90/bwd_fused_sm90.py; the default route where it pays)
beside the atomic-free one (8 units, `deterministic`), issue 17's first measurement.

    python -m perf.bwd_fused --precompile DIR     # CPU: compile both backwards into a cache
    python -m perf.bwd_fused [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)
    python -m perf.bwd_fused --trace [--precompile DIR | --out FILE]   # the phase trace
    python -m perf.bwd_fused --trace-wide [...]   # traced at D=576 / 512, MQA / MHA causal
    python -m perf.bwd_fused --trace-narrow [...]   # traced at D=320 / 384
    python -m perf.bwd_fused --schedule [...]     # where and when each CTA ran (GQA / MQA)
    python -m perf.bwd_fused --scatter [--precompile DIR | --out FILE] # D over C CTAs
    python -m perf.bwd_fused --variation [--precompile DIR | --out FILE]   # run to run
    python -m perf.bwd_fused --wide [--precompile DIR | --out FILE]   # D=576 over the pair
    python -m perf.bwd_fused --padded [...]       # D % 64 != 0 on the fused kernel, padded
    python -m perf.bwd_fused --l2-probe [...]     # MQA / MHA causal once each, for ncu
    python -m perf.bwd_fused --row-units [...]    # grouped causal by (row, tile) units
    python -m perf.bwd_fused --big-group [...]    # MQA 128:1 (DeepSeek-V4 Pro's group)

Per case, each backward through `launch.run_bwd` (Delta, the gradient kernels, the fused one's
zeroed dq_acc and its cast: the host path a call would take), L2 flushed, timed in rounds of
rotated order (`experiment.interleaved_ms`), one round per variant;
TFLOPS = 2.5 x 4 B Hq (visible pairs) D: the atomic-free backward, the fused one as
planned and its variants (`FUSED_VARIANTS`: who forms dQ; with GQA / MQA the head group split
over CTA pairs), each only where it differs from the plan.
Before timing, the fused one's gradients are checked against the atomic-free ones (relative error
< 1e-2 each, the same products in another summation order; a variant past it is reported as
WRONG and the run goes on).

`--scatter`: the fused kernel with D over C CTAs (`scatter`: the score partials
reduce-scattered, P^T / dS^T gathered; first run 2026-12-05, docs/perf-log.md) beside the atomic-free
backward at D=576, 768 and 1024 (the CTA pair's atomic-free kernels there: 192-228 TFLOPS
against issue 17's 250-300), and at D=320 / 512 its C = 2 form beside the pair's full exchange
(`SCATTER_CASES`); same timing and checks as the default run.

`--wide`: the fused pair at D=576 (288 columns a CTA, one Q and one dO stage, dK / dV as
m64n96 WGMMAs; not routed until measured) beside the routed backward there (the gradient
kernels in one CTA, `wide_o`), `WIDE_CASES`; same timing and checks as the default run.

`--padded`: D % 64 != 0 on the fused kernel at the next multiple of 64 (q, k, v, dout
zero-padded by `launch.run_bwd`, the copies timed with it; `sm90/fused_config.FUSED_PAD`, on since
this measured it, 2026-12-06) beside the atomic-free backward (`deterministic`) (`PAD_CASES`).

`--big-group`: MQA 128:1 at D=512 (DeepSeek-V4 Pro), above FUSED_MAX_GROUP, where the route is
the atomic-free backward: the fused kernel as `plan_bwd_fused` plans it (by row units under
causal masking) beside it (`BIG_GROUP_CASES`); same timing and checks as the default run.

`--variation`: the default backward (the fused kernel at these D) five times on the same
inputs (`VARIATION_CASES`): how many elements of each gradient differ from the first run and by
how much (dQ's fp32 reductions land in any order; dK / dV are summed in registers).

`--trace`: the fused kernel as planned at D=512 with clock64 stamps at its `_trace` hooks (the
phase table per warpgroup), the next steps beside it ("dQ in dV + dK": `dq_grads` 2; its
gradients checked against the kernel's) and knockouts (dQ's pieces staged but not added; dQ
formed but neither staged nor added; 16-byte stores of permuted columns: wrong results,
timing only), one device call (~20 s). `--trace-narrow` traces D=320 / 384 the same way,
with the knockouts and the variants of TRACE_NARROW_VARIANTS. Measurements and their reading:
docs/design.md section 4, "The fused backward", and docs/perf-log.md.
"""

from __future__ import annotations

import dataclasses
import sys

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Float32, Int32, const_expr

from ffpa_cute.common.tensors import fake_tensor
from ffpa_cute.sm90.bwd_fused_sm90 import FFPABwdFusedSm90
from ffpa_cute.sm90.fused_config import FUSED_DQ_PIECE
from perf import experiment
from perf.phase_trace import EVENTS, MAXB, SLOTS, _stamp, medians, period, span

B = 1
# (D, causal, Hq, Hkv, N)
CASES = ((512, False, 32, 32, 8192), (512, True, 32, 32, 8192), (512, True, 32, 4, 8192),
         (512, True, 64, 1, 8192), (512, False, 32, 32, 16384), (320, False, 32, 32, 8192),
         (384, False, 32, 32, 8192), (448, False, 32, 32, 8192))


def _problem(d, causal, hq, hkv, n):
    from ffpa_cute.problem import AttnProblem

    return AttnProblem(dtype="bf16", batch=B, heads_q=hq, heads_kv=hkv, seqlen_q=n,
                       seqlen_kv=n, head_dim=d, head_dim_v=d, causal=causal)


# the fused kernel's variants timed beside the planned one (config fields): who forms dQ
# (`dq_grads`) through how many staging buffers (`dq_buffers`), where row units are planned
# the key-tile walk, and with GQA / MQA the head group split over CTA pairs (`group_split`,
# by key tiles)
FUSED_VARIANTS = {"fused": {}, "fused dQ in S": dict(dq_grads=0, dq_buffers=2),
                  "fused dQ in dV": dict(dq_grads=1, dq_buffers=2),
                  "fused dQ in dV, 3 buffers": dict(dq_grads=1, dq_buffers=3),
                  "fused dQ in dV + dK": dict(dq_grads=2, dq_buffers=2),
                  "fused dQ in dV + dK, 4 buffers": dict(dq_grads=2, dq_buffers=4),
                  "fused by key tiles": dict(row_units=False),
                  "fused split": dict(group_split=True, row_units=False)}


# D over C CTAs (`--scatter`): (D, causal, Hq, Hkv, N, C); at D <= 512 C = 2 beside the pair
SCATTER_CASES = ((576, True, 32, 32, 8192, 3), (768, False, 32, 32, 8192, 3),
                 (1024, False, 32, 32, 8192, 4), (1024, True, 32, 32, 8192, 4),
                 (512, False, 32, 32, 8192, 2), (320, False, 32, 32, 8192, 2))


# the fused pair at D=576 (`--wide`): (D, causal, Hq, Hkv, N)
WIDE_CASES = ((576, False, 32, 32, 8192), (576, True, 32, 32, 8192), (576, True, 32, 4, 8192),
              (576, False, 32, 32, 16384))


# MQA 128:1, causal (`--big-group`): (D, causal, Hq, Hkv, N)
BIG_GROUP_CASES = ((512, True, 128, 1, 8192), (512, True, 128, 1, 4096))
# D % 64 != 0 padded onto the fused kernel (`--padded`): (D, causal, Hq, Hkv, N)
PAD_CASES = tuple((d, causal, 32, 32, 8192) for d in (264, 336, 400, 480, 520, 544)
                  for causal in (False, True)) + ((336, True, 32, 4, 8192),)


def plans(case) -> dict:
    """{label: plan} of a case on sm_90a: "atomic-free" (`deterministic`), "fused" (as
    planned) and those of its `FUSED_VARIANTS` whose config differs from the plan's (the
    split one only with GQA / MQA; those that build), at D % 64 != 0 "fused padded" (the
    kernel at the next multiple of 64) instead; a `SCATTER_CASES` case: "atomic-free", "fused
    C=<c>" (D over C CTAs, `scatter`) with dQ in the dV and in the dV + dK warpgroups, and at
    D <= 512 the pair's "fused" beside them."""
    import dataclasses

    from ffpa_cute import dispatch
    from ffpa_cute.common.config import DeltaConfig
    from ffpa_cute.options import Options
    from ffpa_cute.sm90.fused_config import can_implement_fused, plan_bwd_fused

    p = _problem(*case[:5])
    out = {"atomic-free": dispatch.plan_bwd(p, target="sm_90a",
                                          opts=Options(family="sm90", deterministic=True))}
    if len(case) == 6:
        cfgs = {} if case[0] > 512 else {"fused": plan_bwd_fused(p, "sm_90a")}
        scatter = plan_bwd_fused(p, "sm_90a", cluster_d=case[5], scatter=True)
        for grads in (1, 2):
            cfgs[f"fused C={case[5]} dQ in {'dV' if grads == 1 else 'dV + dK'}"] = \
                dataclasses.replace(scatter, dq_grads=grads)
        for name, cfg in cfgs.items():
            out[name] = dispatch.BwdPlan(p, "sm_90a", "sm90", cfgs=(
                DeltaConfig("sm_90a", p.dtype, p.head_dim_v), cfg))
        return out
    if p.head_dim % 64:
        out["fused padded"] = dispatch.BwdPlan(p, "sm_90a", "sm90", cfgs=(
            DeltaConfig("sm_90a", p.dtype, p.head_dim_v), plan_bwd_fused(p, "sm_90a", pad=True)))
        return out
    planned = plan_bwd_fused(p, "sm_90a")
    for name, fields in FUSED_VARIANTS.items():
        if fields.get("group_split") and p.heads_q == p.heads_kv:
            continue   # one query head per KV head: nothing to split
        cfg = with_fields(planned, fields)
        if name != "fused" and (cfg == planned or can_implement_fused(cfg) is not None):
            continue   # the plan itself, or not built (D=576 takes dq_grads 1 only)
        out[name] = dispatch.BwdPlan(p, "sm_90a", "sm90", cfgs=(
            DeltaConfig("sm_90a", p.dtype, p.head_dim_v), cfg))
    return out


def jobs(cases=CASES) -> list:
    """The cases' kernels: the forward that gives out / lse, then every backward of `plans`."""
    from ffpa_cute import dispatch

    out = []
    for case in cases:
        fwd = dispatch.plan_fwd(_problem(*case[:5]), target="sm_90a")
        out.append((fwd.kernel_cls, fwd.cfg))
        for plan in plans(case).values():
            out.extend(j for j in plan.jobs if j not in out)
    return out


def run(dev, flush, cases=CASES) -> dict:
    import torch

    import ffpa_cute
    from ffpa_cute import launch
    from ffpa_cute.reference import rel_err
    from perf.flops import attn_flops_bwd

    res = {}
    for case in cases:
        d, causal, hq, hkv, n = case[:5]
        q, do = (torch.randn(B, hq, n, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(B, hkv, n, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        out, lse = ffpa_cute.attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv,
                                       return_lse=True)
        label = f"D={d} {'causal' if causal else 'full'} {hq}/{hkv} N={n}"
        variants = plans(case)
        ref = launch.run_bwd(variants["atomic-free"], q, k, v, out, lse, do)
        flops = attn_flops_bwd(B, hq, n, n, d, causal)
        row, fns = {}, {}
        for name, plan in variants.items():
            errs = None
            if name != "atomic-free":
                got = launch.run_bwd(plan, q, k, v, out, lse, do)
                errs = [rel_err(x, r.double()) for x, r in zip(got, ref)]
                if max(errs) >= 1e-2:   # reported, not fatal: the other variants still run
                    print(f"{label}: {name} WRONG, dq/dk/dv errors {errs}", flush=True)
            fns[name] = lambda p=plan: launch.run_bwd(p, q, k, v, out, lse, do)  # noqa: E731
            row[name] = dict(errs=errs)
        for name, ms in experiment.interleaved_ms(fns, dev, flush, rounds=len(fns)).items():
            row[name].update(ms=ms, tflops=flops / ms / 1e9)
        print(f"{label}: " + ", ".join(
            f"{name} {r['ms']:.2f} ms {r['tflops']:.0f} TFLOPS" for name, r in row.items())
            + "; dq/dk/dv vs atomic-free " + " | ".join(
                " ".join(f"{e:.1e}" for e in r["errs"]) for r in row.values() if r["errs"]),
            flush=True)
        res[label] = row
    return res


# ---- `--trace`: where a block's time goes, per warpgroup (perf.phase_trace's stamps: thread 0
# of each warpgroup writes clock64 at the kernel's `_trace` hooks). S warpgroup, block i:
S_EVENTS = ("start", "dP^T done", "dP^T sent, dQ(i-1) rest reduced", "peer's partials here",
            "P^T / dS^T published", "S^T(i+1) + dQ(i) chunk 0 done",
            "S^T(i+1) sent, chunk 0 reduced")
G_EVENTS = ("wait P", "P here", "stage here", "product done", "dQ share added")


class FusedTraced(FFPABwdFusedSm90):
    """The fused backward with clock64 stamps (trace: [CTAs, SLOTS, MAXB, EVENTS] int64)."""

    OPERANDS = (*FFPABwdFusedSm90.OPERANDS, "trace")

    @staticmethod
    def fake_inputs(cfg):
        return (*FFPABwdFusedSm90.fake_inputs(cfg), fake_tensor(cutlass.Int64, 4, 1))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mdQ: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mLSE: cute.Tensor,
                 mDelta: cute.Tensor, mTrace: cute.Tensor, softmax_scale: Float32,
                 causal_offset: Int32, window_lo: Int32, stream: cuda.CUstream):
        self._launch(mQ, mK, mV, mdO, mdQ, mdK, mdV, mLSE, mDelta, softmax_scale,
                     causal_offset, window_lo, stream, mTrace)

    @cute.jit
    def _trace(self, extra, event: cutlass.Constexpr, i):
        _stamp(extra, event, i)


END_EVENT = S_EVENTS.index("P^T / dS^T published")


class FusedScheduled(FusedTraced):
    """The fused backward stamping where each CTA ran (`--schedule`): the S warpgroup's thread
    0 writes trace[cta, 3, 0..3, 0] = (globaltimer at its first block's start, %smid,
    globaltimer at its last block's P^T publication, blocks walked); each warpgroup's thread 0
    stamps clock64 at trace[cta, warpgroup, i % MAXB, event], so the stamps left are those of
    the walk's last MAXB blocks."""

    @cute.jit
    def _trace(self, extra, event: cutlass.Constexpr, i):
        tidx, _, _ = cute.arch.thread_idx()
        bx, by, bz = cute.arch.block_idx()
        gx, gy, _ = cute.arch.grid_dim()
        cta = bx + gx * (by + gy * bz)
        if tidx == 0:
            if const_expr(event == 0):
                if i == 0:
                    extra[cta, 3, 0, 0] = cutlass.Int64(cute.arch.globaltimer())
                    extra[cta, 3, 1, 0] = cutlass.Int64(cute.arch.smid())
            if const_expr(event == END_EVENT):
                extra[cta, 3, 2, 0] = cutlass.Int64(cute.arch.globaltimer())
                extra[cta, 3, 3, 0] = cutlass.Int64(i + 1)
        if tidx % 128 == 0:
            extra[cta, tidx // 128, i % MAXB, event] = cute.arch.clock64()


class _NoCopy(FusedTraced):
    """dQ's pieces staged through smem (the barriers included), never added (dq wrong;
    timing only: what the TMA reductions' waits cost)."""

    @cute.jit
    def _add_piece(self, tma, src, dst):
        pass


class _QuadStores(FusedTraced):
    """Timing only (dq wrong: columns permuted within each 32-column piece): each thread's
    eight values of a row in a piece staged by two 16-byte st.shared (half the kernel's
    8-byte stores), as a layout of dq_acc whose columns the host cast un-permutes would
    store them."""

    @cute.jit
    def _stage_piece(self, acc_mn, tQcQ_mn, sdq, buf, p: cutlass.Constexpr):
        dst = sdq[None, None, buf]
        per = FUSED_DQ_PIECE // 4
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            row, cc = tQcQ_mn[r, p * per]
            quad = (cc - p * FUSED_DQ_PIECE) // 2   # the thread's column pair in a group
            for h in cutlass.range_constexpr(2):
                vals = cute.make_rmem_tensor(cute.make_layout(4), Float32)
                for j in cutlass.range_constexpr(4):
                    vals[j] = acc_mn[r, p * per + 4 * h + j]
                cute.autovec_copy(vals, cute.flatten(cute.local_tile(
                    dst, (1, 4), (row, 2 * quad + h))))


class _NoPut(FusedTraced):
    """dQ's products formed, neither staged nor added (dq wrong; timing only: what staging
    and reducing dQ cost the dQ-forming warpgroups)."""

    @cute.jit
    def _put_piece(self, ops, smem, sync, acc_mn, tQcQ_mn, ts, tg, buf, p: cutlass.Constexpr,
                   n_block, piece, tidx, unread: cutlass.Constexpr = -1):
        pass


# name -> (traced class, config fields over the plan's)
TRACE_VARIANTS = {"traced": (FusedTraced, {}),
                  "two buffers": (FusedTraced, dict(dq_buffers=2)),
                  "dQ in dV + dK": (FusedTraced, dict(dq_grads=2, dq_buffers=2)),
                  "dQ in dV + dK, 4 buffers": (FusedTraced, dict(dq_grads=2, dq_buffers=4)),
                  "no copy": (_NoCopy, {}), "no put": (_NoPut, {}),
                  "quad stores (timing only)": (_QuadStores, {})}
TRACE_CASES = ((512, False, 32, 32, 8192),)
# `--trace-wide`: D=576 over the pair (one Q and one dO stage) beside D=512 (two Q stages),
# traced and with dQ's pieces not added ("no put"), and MQA 64/1 causal beside MHA causal
TRACE_WIDE_CASES = ((576, False, 32, 32, 8192), (512, False, 32, 32, 8192),
                    (512, True, 64, 1, 8192), (512, True, 32, 32, 8192))
TRACE_WIDE_VARIANTS = ("traced", "no put")
# `--trace-narrow`: D=320 / 384 (two Q and two dO stages, three dQ staging buffers; issue 17
# asks 350 TFLOPS at 320), traced, with two staging buffers (two barriers a piece), with dQ
# staged but not added ("no copy") and not staged ("no put"): whether the S warpgroup's chain
# or the reductions set the period there, and how long the dV / dK warpgroups wait for their
# stages; dQ split between the dV and dK warpgroups with two buffers each, one barrier a
# piece (`dq_buffers` 4: the dK warpgroup idles ~2700 cycles a block at D=320); and with
# 16-byte stores of permuted columns (timing only: what a column-permuted dq_acc would save)
TRACE_NARROW_CASES = ((320, False, 32, 32, 8192), (384, False, 32, 32, 8192))
TRACE_NARROW_VARIANTS = ("traced", "two buffers", "dQ in dV + dK, 4 buffers",
                         "quad stores (timing only)", "no copy", "no put")
# the variants whose gradients are right: checked against "traced"'s (relative error < 1e-3)
CORRECT_VARIANTS = ("traced", "two buffers", "dQ in dV + dK", "dQ in dV + dK, 4 buffers")


def _tiles_cfg(case, **fields):
    """The fused config of a case walking by key tiles (`row_units` off: what the trace and
    schedule experiments read, one pair per key tile), with `fields` changed."""
    return with_fields(plans(case)["fused"].cfgs[-1], {"row_units": False, **fields})


def with_fields(cfg, fields: dict):
    """cfg with `fields` changed, its dQ staging refitted to them (`fit_dq_staging`) and then
    set where they name it (dq_buffers, dq_pairs, dq_ahead)."""
    from ffpa_cute.sm90.fused_config import fit_dq_staging

    staging = {k: v for k, v in fields.items() if k in ("dq_buffers", "dq_pairs", "dq_ahead")}
    return dataclasses.replace(fit_dq_staging(dataclasses.replace(cfg, **fields)), **staging)


def _trace_cfg(case, fields: dict):
    """The fused config a trace case runs: the plan's, by key tiles, with the variant's
    fields."""
    return _tiles_cfg(case, **fields)


def _trace_runs(cases, variants) -> list:
    """(case, variant name, traced class, config) of each variant that builds at each case and
    differs from the plan's code (a FusedTraced variant whose fields leave the plan's config
    is skipped)."""
    from ffpa_cute.sm90.fused_config import can_implement_fused

    runs = [(case, name, cls, _trace_cfg(case, f)) for case in cases
            for name, (cls, f) in TRACE_VARIANTS.items() if name in variants]
    return [r for r in runs if can_implement_fused(r[3]) is None
            and (r[1] == "traced" or r[2] is not FusedTraced or r[3] != _trace_cfg(r[0], {}))]


def trace_jobs(cases=TRACE_CASES, variants=tuple(TRACE_VARIANTS)) -> list:
    return [(cls, cfg) for _, _, cls, cfg in _trace_runs(cases, variants)]


def trace_phases(trace) -> dict:
    """Median cycles per block of each phase over every CTA's blocks from the third on."""
    t = trace[:, :, 2:].double()
    out = {}
    for k in range(len(S_EVENTS) - 1):
        out[f"S {S_EVENTS[k]} -> {S_EVENTS[k + 1]}"] = span(t[:, 0], k, k + 1)
    last = t[:, 0, :-1, len(S_EVENTS) - 1]
    nxt = t[:, 0, 1:, 0]
    out[f"S {S_EVENTS[-1]} -> next start"] = (nxt - last)[(last != 0) & (nxt != 0)]
    out["S block period"] = period(t[:, 0])
    for name, g in (("dV", t[:, 1]), ("dK", t[:, 2])):
        for k in range(len(G_EVENTS) - 1):
            out[f"{name} {G_EVENTS[k]} -> {G_EVENTS[k + 1]}"] = span(g, k, k + 1)
        out[f"{name} block period"] = period(g)
    return medians(out)


def _kernel_inputs(case, dev):
    """(the fused plan, the kernel's tensors, its scalars) of a (D, causal, Hq, Hkv, N) case on
    fresh random inputs, the forward's out / lse and Delta computed as `launch.run_bwd` would."""
    import torch

    import ffpa_cute
    from ffpa_cute import launch

    d, causal, hq, hkv, n = case
    plan = plans(case)["fused"]
    q, do = (torch.randn(B, hq, n, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, hkv, n, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    out, lse = ffpa_cute.attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv,
                                   return_lse=True)
    t = dict(q=q, k=k, v=v, do=do, lse=lse.contiguous(),
             delta=(do.float() * out.float()).sum(-1).contiguous(),
             dq_acc=torch.zeros(q.shape, dtype=torch.float32, device=dev),
             dk=torch.empty_like(k), dv=torch.empty_like(v))
    return plan, t, launch.kernel_scalars(plan.problem, plan.problem.right_edge)


def run_trace(dev, flush, cases=TRACE_CASES, variants=tuple(TRACE_VARIANTS)) -> dict:
    import torch

    from ffpa_cute import launch
    from ffpa_cute.reference import rel_err
    from perf.flops import attn_flops_bwd

    res = {}
    for case in cases:
        grads = None
        d, causal, hq, hkv, n = case
        plan, t, scalars = _kernel_inputs(case, dev)
        ctas = 2 * -(-n // 64) * hkv * B
        flops = attn_flops_bwd(B, hq, n, n, d, causal)
        for _, name, cls, cfg in _trace_runs((case,), variants):
            trace = torch.zeros(ctas, SLOTS, MAXB, EVENTS, dtype=torch.int64, device=dev)
            args = {**t, "trace": trace}
            launch.run_job(cls, cfg, args, scalars)
            torch.cuda.synchronize()
            ms = experiment.median_ms(lambda c=cls: launch.run_job(c, cfg, args, scalars), dev,
                                      flush, rounds=1)   # every variant inside one device call
            trace.zero_()
            args["dq_acc"].zero_()
            launch.run_job(cls, cfg, args, scalars)
            torch.cuda.synchronize()
            key = f"D={d} {'causal' if causal else 'full'} {hq}/{hkv} N={n} {name}"
            res[key] = dict(ms=ms, tflops=flops / ms / 1e9, phases=trace_phases(trace.cpu()))
            if name in CORRECT_VARIANTS:
                got = [args[x].clone() for x in ("dq_acc", "dk", "dv")]
                grads = grads or got
                res[key]["errs"] = [rel_err(x, y.double()) for x, y in zip(got, grads)]
                if max(res[key]["errs"]) >= 1e-3:   # reported, not fatal
                    print(f"{key}: WRONG, dq/dk/dv errors {res[key]['errs']}", flush=True)
            print(f"{key}: {ms:.2f} ms (the kernel alone), {res[key]['tflops']:.0f} TFLOPS",
                  flush=True)
            for ph, cyc in res[key]["phases"].items():
                print(f"  {ph:58s} {cyc:8.0f}", flush=True)
    return res


# `--schedule`: (D, causal, Hq, Hkv, N) whose CTAs' placement in time is stamped
SCHEDULE_CASES = ((512, True, 64, 1, 8192), (512, True, 32, 4, 8192), (512, True, 32, 32, 8192),
                  (512, False, 64, 1, 8192))


def schedule_jobs() -> list:
    return [(FusedScheduled, _tiles_cfg(case)) for case in SCHEDULE_CASES]


def schedule_summary(trace, n_tiles: int, heads_kv: int) -> dict:
    """From a `FusedScheduled` trace: the kernel's span (us), the SMs used, the busy fraction
    (CTA time over SMs x span), when the running CTAs first fall below 90% of the SMs (us before
    the end), how far launch order strays from the grid's (the largest start rank minus grid
    rank, in CTAs), the period (median cycles) over each CTA's last MAXB blocks, and the span's
    share a perfectly balanced walk would take (blocks x period / SMs, from the block counts)."""
    import torch

    t = trace.double()
    start, sm, end, blocks = t[:, 3, 0, 0], t[:, 3, 1, 0], t[:, 3, 2, 0], t[:, 3, 3, 0]
    live = end > 0
    start, sm, end, blocks = start[live], sm[live], end[live], blocks[live]
    t0 = start.min()
    span = (end.max() - t0) / 1e3
    n_sm = int(torch.unique(sm).numel())
    busy = float((end - start).sum() / 1e3 / (n_sm * span))
    edges = torch.cat([start - t0, end - t0]) / 1e3
    steps = torch.cat([torch.ones_like(start), -torch.ones_like(end)])
    order = torch.argsort(edges)
    running = torch.cumsum(steps[order], 0)
    times = edges[order]
    full = (running >= 0.9 * n_sm).nonzero()
    drop = float(span - times[full[-1, 0] + 1]) if full.numel() else float("nan")
    rank = torch.argsort(torch.argsort(start))
    stray = int((rank - torch.arange(rank.numel())).abs().max())
    per = period(t[:, 0])
    return dict(span_us=float(span), sms=n_sm, busy=busy, below_90pct_us=drop,
                launch_order_stray=stray, last_blocks_period=float(per.median()),
                blocks_max=float(blocks.max()), blocks_mean=float(blocks.mean()),
                ctas=int(live.sum()), tiles=n_tiles, heads_kv=heads_kv)


def run_schedule(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch

    res = {}
    for case in SCHEDULE_CASES:
        d, causal, hq, hkv, n = case
        plan, t, scalars = _kernel_inputs(case, dev)
        cfg = _tiles_cfg(case)
        tiles = -(-n // 64)
        ctas = 2 * tiles * hkv * B
        trace = torch.zeros(ctas, SLOTS, MAXB, EVENTS, dtype=torch.int64, device=dev)
        args = {**t, "trace": trace}
        for _ in range(2):   # the first run warms up; the second is read
            trace.zero_()
            args["dq_acc"].zero_()
            launch.run_job(FusedScheduled, cfg, args, scalars)
            torch.cuda.synchronize()
        key = f"D={d} {'causal' if causal else 'full'} {hq}/{hkv} N={n}"
        res[key] = schedule_summary(trace.cpu(), tiles, hkv)
        print(f"{key}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                     for k, v in res[key].items()), flush=True)
    return res


# `--l2-probe`: (D, causal, Hq, Hkv, N, walk) whose fused kernel runs once each, for a profiler
class _BlocksOuter(FFPABwdFusedSm90):
    """The pair's walk with the query blocks outer and the group's heads inner: step i is block
    row n_top - 1 - i // G of head i % G, so the pairs of a wave visit each (head, block) at
    the same step (MQA causal's planned walk, heads outer, spreads them over the heads).
    ROTATE: each tile's heads rotated by its index, head (i + m_block) % G (a wave's pairs on
    one block row, on different heads)."""

    ROTATE = False

    @cute.jit
    def _block(self, work, i):
        n_per = cutlass.max(work.n_per, 1)
        group = cutlass.max(work.n_count // n_per, 1)
        step = i + work.m_block if const_expr(self.ROTATE) else i
        return work.head_q0 + step % group, work.n_top - 1 - i // group


class _Rotated(_BlocksOuter):
    ROTATE = True


# walk -> (kernel class, row_units): by key tiles (heads outer), its experiment subclasses, and
# the config's row units (`row_units`: one pair per (query block row, key tile))
WALKS = {"key tiles": (FFPABwdFusedSm90, False), "blocks outer": (_BlocksOuter, False),
         "rotated": (_Rotated, False), "row units": (FFPABwdFusedSm90, True)}
L2_PROBE_CASES = (*((512, True, 64, 1, 8192, walk) for walk in WALKS),
                  (512, True, 32, 32, 8192, "key tiles"), (512, False, 64, 1, 8192, "key tiles"))


def _walk_job(case, walk) -> tuple:
    """(kernel class, config) of a (D, causal, Hq, Hkv, N) case's fused kernel on `walk`."""
    cls, rows = WALKS[walk]
    return cls, _tiles_cfg(case, row_units=rows)


def l2_probe_jobs() -> list:
    return [_walk_job(case[:5], case[5]) for case in L2_PROBE_CASES]


def run_l2_probe(dev, flush) -> dict:
    """The fused kernel (by key tiles, or at MQA causal the walks of `WALKS`) launched once
    per case on fresh inputs, nothing timed: the workload for Nsight Compute's counters
    (verify_gpu.sh's `l2` section reads DRAM bytes and the L2 hit rate of each launch): MQA
    causal's key-tile walk visits each (head, block) from up to 128 key tiles at times far apart,
    where MHA's and non-causal MQA's pairs, in step, find Q / dO and dq_acc in L2."""
    import torch

    from ffpa_cute import launch

    for case in L2_PROBE_CASES:
        plan, t, scalars = _kernel_inputs(case[:5], dev)
        cls, cfg = _walk_job(case[:5], case[5])
        torch.cuda.synchronize()
        launch.run_grad_job(cls, cfg, t, scalars)   # row units: with their fp32 workspaces
        torch.cuda.synchronize()
        print(f"launched: D={case[0]} {'causal' if case[1] else 'full'} {case[2]}/{case[3]} "
              f"N={case[4]} {case[5]} walk", flush=True)
    return {}


# `--row-units`: grouped cases timed by key tiles and by row units (`row_units`), the rows that
# set FUSED_ROW_UNITS_MIN_GROUP (causal G = 8-64, D, N, not causal; G = 8 / 16 at D 320-576)
ROW_UNIT_CASES = ((512, True, 64, 1, 8192), (512, True, 32, 4, 8192), (576, True, 64, 1, 8192),
                  (512, True, 64, 4, 8192), (512, True, 64, 2, 8192), (512, True, 32, 1, 8192),
                  (512, True, 16, 1, 8192), (320, True, 64, 1, 8192), (384, True, 64, 1, 8192),
                  (512, True, 64, 1, 16384), (512, False, 64, 1, 8192),
                  (320, True, 32, 2, 8192), (320, True, 32, 4, 8192), (576, True, 32, 2, 8192),
                  (576, True, 32, 4, 8192), (384, True, 32, 2, 8192))


def row_unit_jobs() -> list:
    """Per case the forward that gives out / lse, then the fused kernel by key tiles and by
    row units."""
    from ffpa_cute import dispatch

    out = []
    for case in ROW_UNIT_CASES:
        fwd = dispatch.plan_fwd(_problem(*case), target="sm_90a")
        if (fwd.kernel_cls, fwd.cfg) not in out:
            out.append((fwd.kernel_cls, fwd.cfg))
        out += [(FFPABwdFusedSm90, _tiles_cfg(case, row_units=rows)) for rows in (False, True)]
    return out


def run_row_units(dev, flush) -> dict:
    """Per case, the fused kernel by key tiles against by row units on the same inputs: dQ,
    dK, dV compared (relative error < 5e-3: the same products summed in another order, dK / dV
    through fp32 partial sums), then both timed in interleaved rounds, the row units with their
    workspaces' zeroing and cast (as `launch.run_grad_job` runs them); Delta and dQ's cast are
    left out of both."""
    import torch

    from ffpa_cute import launch
    from ffpa_cute.reference import rel_err
    from perf.flops import attn_flops_bwd

    res = {}
    for case in ROW_UNIT_CASES:
        d, causal, hq, hkv, n = case
        _, t, scalars = _kernel_inputs(case, dev)
        by_tiles, by_rows = (_tiles_cfg(case, row_units=rows) for rows in (False, True))
        flops = attn_flops_bwd(B, hq, n, n, d, causal)
        key = f"D={d} {'causal' if causal else 'full'} {hq}/{hkv} N={n}"
        tiles_t = {**t, "dq_acc": torch.zeros_like(t["dq_acc"])}
        rows_t = {**t, "dq_acc": torch.zeros_like(t["dq_acc"]),
                  "dk": torch.empty_like(t["dk"]), "dv": torch.empty_like(t["dv"])}

        def rows():
            launch.run_grad_job(FFPABwdFusedSm90, by_rows, rows_t, scalars)

        def tiles():
            launch.run_job(FFPABwdFusedSm90, by_tiles, tiles_t, scalars)

        tiles()
        rows()
        torch.cuda.synchronize()
        errs = [rel_err(rows_t[x], tiles_t[x].double()) for x in ("dq_acc", "dk", "dv")]
        row = {name: dict(ms=ms, tflops=flops / ms / 1e9) for name, ms in
               experiment.interleaved_ms({"key tiles": tiles, "row units": rows}, dev, flush,
                                         rounds=4).items()}
        row["row units"]["errs"] = errs
        if max(errs) >= 5e-3:   # reported, not fatal
            print(f"{key} row units: WRONG, dq/dk/dv errors {errs}", flush=True)
        res[key] = row
        print(f"{key} (the kernels, no Delta / dQ cast): " + ", ".join(
            f"{name} {r['ms']:.2f} ms {r['tflops']:.0f} TFLOPS" for name, r in row.items())
            + "; dq/dk/dv vs key tiles " + " ".join(f"{e:.1e}" for e in errs), flush=True)
    return res


# `--variation`: (D, causal, Hq, Hkv, N) of the default backward run again and again
VARIATION_CASES = ((512, False, 32, 32, 8192), (512, True, 32, 4, 8192),
                   (320, False, 32, 32, 8192), (512, True, 64, 1, 8192))


def variation_jobs() -> list:
    from ffpa_cute import dispatch

    return [j for case in VARIATION_CASES
            for j in dispatch.plan_bwd(_problem(*case), target="sm_90a").jobs]


def run_variation(dev, flush, runs: int = 5) -> dict:
    """The default backward (`launch.run_bwd` of `dispatch.plan_bwd`: the fused kernel here)
    `runs` times on the same inputs: per gradient, the largest over the later runs of the
    fraction of elements that differ from the first run, of the relative (Frobenius)
    difference, and of the largest difference over the gradient's largest magnitude."""
    import torch

    import ffpa_cute
    from ffpa_cute import dispatch, launch

    res = {}
    for case in VARIATION_CASES:
        d, causal, hq, hkv, n = case
        p = _problem(*case)
        plan = dispatch.plan_bwd(p, dev)
        q, do = (torch.randn(B, hq, n, d, device=dev, dtype=torch.bfloat16) for _ in "qd")
        k, v = (torch.randn(B, hkv, n, d, device=dev, dtype=torch.bfloat16) for _ in "kv")
        out, lse = ffpa_cute.attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv,
                                       return_lse=True)
        grads = [launch.run_bwd(plan, q, k, v, out, lse, do) for _ in range(runs)]
        row = {"kernel": plan.jobs[1][0].__name__}
        for i, name in enumerate(("dq", "dk", "dv")):
            first = grads[0][i].float()
            diff = [(g[i].float() - first).abs() for g in grads[1:]]
            row[name] = dict(differ=max(float((x != 0).float().mean()) for x in diff),
                             rel=max(float(x.norm() / first.norm()) for x in diff),
                             max_rel=max(float(x.max() / first.abs().max()) for x in diff))
        res[f"D={d}{' causal' if causal else ''} {hq}/{hkv} N={n}"] = row
        print(f"D={d} causal={causal} Hq/Hkv={hq}/{hkv} N={n} ({row['kernel']}, {runs} runs): "
              + "; ".join(f"{g} {row[g]['differ']:.2e} of elements differ, relative "
                          f"{row[g]['rel']:.1e}, max {row[g]['max_rel']:.1e} of max |{g}|"
                          for g in ("dq", "dk", "dv")),
              flush=True)
    return res


# flag -> (the jobs to precompile, the run): each mode of the module docstring
MODES = {
    "--variation": (variation_jobs, run_variation),
    "--schedule": (schedule_jobs, run_schedule),
    "--l2-probe": (l2_probe_jobs, run_l2_probe),
    "--row-units": (row_unit_jobs, run_row_units),
    "--trace-wide": (lambda: trace_jobs(TRACE_WIDE_CASES, TRACE_WIDE_VARIANTS),
                     lambda dev, flush: run_trace(dev, flush, TRACE_WIDE_CASES,
                                                  TRACE_WIDE_VARIANTS)),
    "--trace-narrow": (lambda: trace_jobs(TRACE_NARROW_CASES, TRACE_NARROW_VARIANTS),
                       lambda dev, flush: run_trace(dev, flush, TRACE_NARROW_CASES,
                                                    TRACE_NARROW_VARIANTS)),
    "--trace": (trace_jobs, run_trace),
    "--scatter": (lambda: jobs(SCATTER_CASES),
                  lambda dev, flush: run(dev, flush, SCATTER_CASES)),
    "--wide": (lambda: jobs(WIDE_CASES), lambda dev, flush: run(dev, flush, WIDE_CASES)),
    "--padded": (lambda: jobs(PAD_CASES), lambda dev, flush: run(dev, flush, PAD_CASES)),
    "--big-group": (lambda: jobs(BIG_GROUP_CASES),
                    lambda dev, flush: run(dev, flush, BIG_GROUP_CASES)),
}


if __name__ == "__main__":
    argv = sys.argv[1:]
    for flag, (mode_jobs, mode_run) in MODES.items():
        if flag in argv:
            argv.remove(flag)
            raise SystemExit(experiment.main(f"perf.bwd_fused {flag}", __doc__, mode_jobs,
                                             mode_run, argv))
    raise SystemExit(experiment.main("perf.bwd_fused", __doc__, jobs, run))
