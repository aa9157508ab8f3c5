"""The fused backward (5 GEMM units, sm90/bwd_fused_sm90.py) beside the routed atomic-free one
(8 units), issue 17's first measurement.

    python -m perf.bwd_fused --precompile DIR     # CPU: compile both backwards into a cache
    python -m perf.bwd_fused [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)
    python -m perf.bwd_fused --trace [--precompile DIR | --out FILE]   # the phase trace

Per case, each backward through `launch.run_bwd` (Delta, the gradient kernels, the fused one's
zeroed dq_acc and its cast: the host path a call would take), L2 flushed, median of 3 benches;
TFLOPS = 2.5 x 4 B Hq (visible pairs) D: the routed (atomic-free) backward, the fused one and
its variants (`FUSED_VARIANTS`: who forms dQ; with GQA / MQA the head group split over CTA
pairs).
Before timing, the fused one's gradients are checked against the routed ones (relative error
< 1e-2 each, the same products in another summation order; a variant past it is reported as
WRONG and the run goes on).

`--trace`: the fused kernel at D=512 and D=320 with clock64 stamps at its `_trace` hooks (the
phase table per warpgroup), the next steps beside it ("dQ in dV", "dQ in dV + dK": dQ formed
by the gradient warpgroups, config `dq_grads`; "alternating": the dQ pieces alternate between
the staging buffers across chunks and blocks; "pair stores": 8-byte st.shared; both; "S^T
first": S^T(i+1) issued before P^T(i) is published, alone and with dQ moved; their gradients
checked against the kernel's) and knockouts (dQ's pieces staged but not
added; dQ formed but not reduced; no exchange; neither; no dQ: wrong results, timing only).
Measurements and their reading: docs/design.md section 4, "The fused backward", and
docs/perf-log.md (2026-12-05, sessions 20-22).
"""

from __future__ import annotations

import sys

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Float32, Int32

from ffpa_cute.common.tensors import fake_tensor
from ffpa_cute.sm90.bwd_fused_sm90 import FFPABwdFusedSm90
from ffpa_cute.sm90.config import FUSED_DQ_PIECE, FUSED_TILE
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


# the fused kernel's variants timed beside it (config fields): who forms dQ (`dq_grads`), and
# with GQA / MQA the head group split over CTA pairs (`group_split`)
FUSED_VARIANTS = {"fused": {}, "fused dQ in dV": dict(dq_grads=1),
                  "fused dQ in dV + dK": dict(dq_grads=2),
                  "fused split": dict(group_split=True),
                  "fused dQ in dV, split": dict(dq_grads=1, group_split=True)}


def plans(case) -> dict:
    """{label: plan} of a case on sm_90a: "routed" (the atomic-free kernels), "fused" and its
    `FUSED_VARIANTS` (the split ones only with GQA / MQA)."""
    import dataclasses

    from ffpa_cute import dispatch
    from ffpa_cute.common.config import DeltaConfig
    from ffpa_cute.options import Options
    from ffpa_cute.sm90.config import plan_bwd_fused

    p = _problem(*case)
    out = {"routed": dispatch.plan_bwd(p, target="sm_90a", opts=Options(family="sm90"))}
    for name, fields in FUSED_VARIANTS.items():
        if fields.get("group_split") and p.heads_q == p.heads_kv:
            continue   # one query head per KV head: nothing to split
        cfg = dataclasses.replace(plan_bwd_fused(p, "sm_90a"), **fields)
        out[name] = dispatch.BwdPlan(p, "sm_90a", "sm90", cfgs=(
            DeltaConfig("sm_90a", p.dtype, p.head_dim_v), cfg))
    return out


def jobs() -> list:
    out = []
    for case in CASES:
        for plan in plans(case).values():
            out.extend(j for j in plan.jobs if j not in out)
    return out


def run(dev, flush) -> dict:
    import torch

    import ffpa_cute
    from ffpa_cute import launch
    from ffpa_cute.reference import rel_err
    from perf.flops import attn_flops_bwd

    res = {}
    for case in CASES:
        d, causal, hq, hkv, n = case
        q, do = (torch.randn(B, hq, n, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(B, hkv, n, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
        out, lse = ffpa_cute.attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv,
                                       return_lse=True)
        label = f"D={d} {'causal' if causal else 'full'} {hq}/{hkv} N={n}"
        variants = plans(case)
        ref = launch.run_bwd(variants["routed"], q, k, v, out, lse, do)
        flops = attn_flops_bwd(B, hq, n, n, d, causal)
        row = {}
        for name, plan in variants.items():
            errs = None
            if name != "routed":
                got = launch.run_bwd(plan, q, k, v, out, lse, do)
                errs = [rel_err(x, r.double()) for x, r in zip(got, ref)]
                if max(errs) >= 1e-2:   # reported, not fatal: the other variants still run
                    print(f"{label}: {name} WRONG, dq/dk/dv errors {errs}", flush=True)
            fn = lambda p=plan: launch.run_bwd(p, q, k, v, out, lse, do)  # noqa: E731
            ms = experiment.median_ms(fn, dev, flush)
            row[name] = dict(ms=ms, tflops=flops / ms / 1e9, errs=errs)
        print(f"{label}: " + ", ".join(
            f"{name} {r['ms']:.2f} ms {r['tflops']:.0f} TFLOPS" for name, r in row.items())
            + "; dq/dk/dv vs routed " + " | ".join(
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


class _NoRed(FusedTraced):
    """dQ's products formed, neither staged nor added (dq wrong; timing only)."""

    @cute.jit
    def _dq_reduce(self, mma, acc, ops, smem, work, head_q, n_block, col,
                   width: cutlass.Constexpr, tidx):
        pass


class _NoExchange(FusedTraced):
    """Nothing sent: each CTA scores its own partials (wrong; timing only)."""

    @cute.jit
    def _send(self, acc, smem, part: cutlass.Constexpr, rank, tidx):
        pass

    @cute.jit
    def _arm_exchange(self, smem, tidx):
        if tidx == 0:
            cute.arch.mbarrier_arrive(smem.bars.x_full)

    @cute.jit
    def _receive(self, acc_S, acc_dP, smem, tidx):
        pass


class _NoExchangeNoRed(_NoExchange, _NoRed):
    pass


class _NoCopy(FusedTraced):
    """dQ's pieces staged through smem (the barriers included), never added (dq wrong;
    timing only: what the TMA reductions' waits cost)."""

    @cute.jit
    def _add_piece(self, tma, src, dst):
        pass


class _Alternating(FusedTraced):
    """The next step, to measure (correct results): the pieces alternate between the two
    staging buffers in issue order across chunks and blocks (block i's chunk at columns col:
    running piece i * half / 32 + (col - col0) / 32 + p), so every piece waits only for the
    group two back; today a chunk's first piece waits for every earlier group. Predicted
    (perf-log, session 21): a block period of ~8200-8500 cycles at D=512 against 9024."""

    def _piece_buffer(self, work, head_q, n_block, col, p: int):
        i = ((head_q - work.head_q0) * cutlass.max(work.n_per, 1)
             + work.n_top - 1 - n_block)
        g = (i * (self.half // FUSED_DQ_PIECE) + (col - work.rank * self.half) // FUSED_DQ_PIECE
             + p)
        return g % 2, 1


class _PairStores(FusedTraced):
    """A next step, to measure (correct results): each thread's two adjacent columns of a row
    staged by one 8-byte st.shared (st.shared.v2.b32: half the store instructions; the 128-byte
    swizzle keeps an even column's pair contiguous). Staging costs ~890 cycles per block at
    D=512 today (perf-log, session 21); predicted: ~300-450 of them saved."""

    @cute.jit
    def _stage_piece(self, acc_mn, tQcQ_mn, sdq, buf, p: cutlass.Constexpr):
        dst = sdq[None, None, buf]
        per = FUSED_DQ_PIECE // 4
        for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
            for c2 in cutlass.range_constexpr(p * per // 2, (p + 1) * per // 2):
                row, cc = tQcQ_mn[r, 2 * c2]
                pair = cute.make_rmem_tensor(cute.make_layout(2), Float32)
                pair[0] = acc_mn[r, 2 * c2]
                pair[1] = acc_mn[r, 2 * c2 + 1]
                cute.autovec_copy(pair, cute.flatten(cute.local_tile(
                    dst, (1, 2), (row, (cc - p * FUSED_DQ_PIECE) // 2))))


class _AlternatingPairs(_Alternating, _PairStores):
    """Both next steps together."""


class _ScoresFirst(FusedTraced):
    """A next step, to measure (correct results): S^T_r(i+1) issued before P^T(i) / dS^T(i)
    are published, so its WGMMAs reach the tensor pipe ahead of the dV / dK products the
    publication starts (`scores_first`). In the trace, S^T(i+1) took ~2100-2270 cycles of the
    chain for ~512 of tensor work, sharing the pipe with those products; predicted: ~1000-1300
    cycles saved per block where the S chain is the period (with dQ off it, `dq_grads`)."""

    scores_first = True


class _ScoresFirstPairs(_ScoresFirst, _PairStores):
    """"S^T first" and "pair stores" together."""


class _NoDQ(_NoRed):
    """No dQ product and no reduction: the S warpgroup's chain without dQ (timing only)."""

    @cute.jit
    def _dq_issue(self, mma, sdS, sKt, c0: cutlass.Constexpr, width: cutlass.Constexpr, tidx):
        thr = mma.get_slice(tidx)
        acc = cute.make_rmem_tensor(thr.partition_shape_C((FUSED_TILE, width)), Float32)
        acc.fill(0.0)
        return acc


# name -> (traced class, the config's dq_grads)
TRACE_VARIANTS = {"traced": (FusedTraced, 0), "dQ in dV": (FusedTraced, 1),
                  "dQ in dV + dK": (FusedTraced, 2), "alternating": (_Alternating, 0),
                  "pair stores": (_PairStores, 0),
                  "alternating, pair stores": (_AlternatingPairs, 0),
                  "no copy": (_NoCopy, 0), "no red": (_NoRed, 0),
                  "no exchange": (_NoExchange, 0),
                  "no exchange, no red": (_NoExchangeNoRed, 0), "no dQ": (_NoDQ, 0),
                  "S^T first": (_ScoresFirst, 0), "dQ in dV, S^T first": (_ScoresFirst, 1),
                  "dQ in dV + dK, S^T first": (_ScoresFirst, 2),
                  "dQ in dV, pair stores": (_PairStores, 1),
                  "dQ in dV, S^T first, pair stores": (_ScoresFirstPairs, 1)}
TRACE_CASES = ((512, False, 32, 32, 8192), (320, False, 32, 32, 8192))
# the variants whose gradients are right: checked against "traced"'s (relative error < 1e-3)
CORRECT_VARIANTS = ("traced", "dQ in dV", "dQ in dV + dK", "alternating", "pair stores",
                    "alternating, pair stores", "S^T first", "dQ in dV, S^T first",
                    "dQ in dV + dK, S^T first", "dQ in dV, pair stores",
                    "dQ in dV, S^T first, pair stores")


def _trace_cfg(case, dq_grads: int):
    """The fused config a trace case runs, with `dq_grads` as the variant asks."""
    import dataclasses

    return dataclasses.replace(plans(case)["fused"].cfgs[-1], dq_grads=dq_grads)


def trace_jobs() -> list:
    return [(cls, _trace_cfg(case, g)) for case in TRACE_CASES
            for cls, g in TRACE_VARIANTS.values()]


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


def run_trace(dev, flush) -> dict:
    import torch

    import ffpa_cute
    from ffpa_cute import launch
    from ffpa_cute.reference import rel_err
    from perf.flops import attn_flops_bwd

    res = {}
    for case in TRACE_CASES:
        grads = None
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
        scalars = launch.kernel_scalars(plan.problem, plan.problem.right_edge)
        ctas = 2 * -(-n // 64) * hkv * B
        flops = attn_flops_bwd(B, hq, n, n, d, causal)
        for name, (cls, dq_grads) in TRACE_VARIANTS.items():
            cfg = _trace_cfg(case, dq_grads)
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


if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--trace" in argv:
        argv.remove("--trace")
        raise SystemExit(experiment.main("perf.bwd_fused --trace", __doc__, trace_jobs,
                                         run_trace, argv))
    raise SystemExit(experiment.main("perf.bwd_fused", __doc__, jobs, run))
