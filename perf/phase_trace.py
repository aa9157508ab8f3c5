"""Where a block's time goes in the sm90 forward, per warpgroup: the kernel with clock64 stamps
at its phase boundaries (the skeleton's `_trace` hook), for issue 20's / 17's "phase trace
first".

    python -m perf.phase_trace --precompile DIR     # CPU: compile the traced kernels
    python -m perf.phase_trace [--out FILE]         # GPU: run them, print the phase table
    python -m perf.phase_trace --bwd [--out FILE]   # GPU: the backward's dQ, dK, dV kernels
    python -m perf.phase_trace --fp8 [--out FILE]   # GPU: the FP8 forward's schedules
    (each mode precompiles its own kernels: --precompile DIR after the mode flag)

Stamps (thread 0 of each warpgroup, per block i of the CTA's tile; `clock64`, the SM's cycle
counter, so only differences within a CTA mean anything; the S warpgroup's warp 1 stamps too,
"S w1": thread 0's warp also issues the S warpgroup's TMA loads, warp 1 only computes):
  S warpgroup   S0 block start (before its first C chunk's wait), S1 its scores done (after
                the last QK WGMMA retired), S2 the score step done (P and the factors in
                registers), S3 P's slot free (p_empty), S4 P stored and fenced
  O warpgroups  O0 before the P_full wait, O1 P here, O2 O rescaled, O3 the block's PV retired
Per shape the table gives each phase's median cycles per block over every traced CTA's blocks
from the third on, and the block period (S0 to the next S0). Experiment only: the traced kernel
is never routed; its result is the real forward's (the stamps only add stores).

Beside it, at D=512 and 576 (O in one CTA), the same traced kernel with the ring refills
faked (`--variants`: a plain arrival completes the stage's barrier, no bytes move, the stage
keeps stale data): "no K" (the
K ring's refills), "no V" (the V rings'), "no KV" (both): how much of a block's time is the
L2 -> SM stream's; and "no PV" (the O warpgroups wait for and refill their stages but issue no
WGMMA): what the S warpgroup's phases take with the tensor cores free of P V (wrong results;
timing only). `--fp8` times the FP8 schedules the same way, with "no PV" and "P = S" variants
(FP8_SCHEDULES).

The backward's dQ, dK and dV kernels run on the same skeleton (`_score_tile`, `_acc_tile`), so
the same stamps time them (`--bwd`: each kernel on its own, with the LSE and Delta of a real
forward): S is their score warpgroup (S / dP, then P / dS), O their accumulator warpgroups.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cuda.bindings.driver as cuda
from cutlass import Float32, Int32, const_expr

from ffpa_cute.common.tensors import fake_args, fake_cu, fake_tensor
from ffpa_cute.sm90.bwd_sm90 import FFPABwdDKSm90, FFPABwdDQSm90, FFPABwdDVSm90
from ffpa_cute.common.tensors import fake_fp8_args
from ffpa_cute.sm90.fwd_sm90 import Descales, FFPAFwdSm90, FFPAFwdSm90FP8
from ffpa_cute.sm90.skeleton_sm90 import RingSkeletonSm90, Roles
from perf import experiment
from perf import fp8_limits
from perf.fp8_limits import FP8NoExp

SHAPES = [  # (D, N, causal)
    (512, 8192, False), (512, 8192, True), (320, 8192, False), (576, 8192, False),
    (1024, 8192, False)]
HEADS = 32
MAXB = 128        # blocks stamped per CTA
EVENTS = 8        # stamp slots per (warpgroup, block)
SLOTS = 4         # S, O lo, O hi, and the S warpgroup's warp 1
S_EVENTS = ("S0 start", "S1 scores", "S2 score step", "S3 P slot", "S4 P stored")
O_EVENTS = ("O0 wait P", "O1 P here", "O2 rescaled", "O3 PV done")


@cute.jit
def _stamp(trace, event: cutlass.Constexpr, i):
    """clock64 into trace[cta, warpgroup, i, event] by each warpgroup's thread 0, and into
    trace[cta, 3, i, event] by the S warpgroup's thread 32 (warp 1)."""
    tidx, _, _ = cute.arch.thread_idx()
    if tidx % 128 == 0 or tidx == 32:
        if i < MAXB:
            bx, by, bz = cute.arch.block_idx()
            gx, gy, _ = cute.arch.grid_dim()
            slot = tidx // 128 if tidx % 128 == 0 else 3
            trace[bx + gx * (by + gy * bz), slot, i, event] = cute.arch.clock64()


class _NoPVMixin:
    """The accumulator warpgroups wait for each B stage and refill it as the kernel does, but
    issue no WGMMA: what the S warpgroup's phases take with the tensor cores free of P V
    (wrong results; timing only)."""

    @cute.jit
    def _pv_stage(self, atom, frags, loads, x, j: cutlass.Constexpr, slot,
                  refill: cutlass.Constexpr):
        vs = self.cfg.v_stages
        s = x % vs
        cute.arch.mbarrier_wait(loads.bar + s, (x // vs) & 1)
        if const_expr(refill):
            self._refill_b(loads, x - 1)
        return x + 1


class FwdTraced(FFPAFwdSm90):
    """The 16-bit forward with clock64 stamps (module docstring); the trace tensor takes the
    sinks' place (a traced config has no sinks)."""

    OPERANDS = ("q", "k", "v", "o", "lse", "trace", "cu_q", "cu_k")

    @staticmethod
    def fake_inputs(cfg):
        return (*fake_args(cfg), fake_tensor(cutlass.Int64, 4, 1), *fake_cu(cfg))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mTrace: cute.Tensor, mCuQ, mCuK, softmax_scale: Float32,
                 causal_offset: Int32, window_lo: Int32, num_ctas: Int32,
                 stream: cuda.CUstream):
        self._launch(Roles(rows=mQ, cols=mK, acc_b=mV, out=mO), mLSE, softmax_scale,
                     causal_offset, stream, mTrace, window_lo, num_ctas, (mCuQ, mCuK))

    @cute.jit
    def _trace(self, extra, event: cutlass.Constexpr, i):
        _stamp(extra, event, i)


class FwdFP8Traced(FFPAFwdSm90FP8):
    """The FP8 forward with clock64 stamps; the trace tensor rides in Descales' sinks slot (a
    traced config has no sinks)."""

    OPERANDS = ("q", "k", "vt", "o", "lse", "q_descale", "k_descale", "v_descale", "trace")

    @staticmethod
    def fake_inputs(cfg):
        return (*fake_fp8_args(cfg), fake_tensor(cutlass.Int64, 4, 1))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mVt: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mQd: cute.Tensor, mKd: cute.Tensor, mVd: cute.Tensor,
                 mTrace: cute.Tensor, softmax_scale: Float32, causal_offset: Int32,
                 window_lo: Int32, stream: cuda.CUstream):
        self._launch(Roles(rows=mQ, cols=mK, acc_b=mVt, out=mO), mLSE, softmax_scale,
                     causal_offset, stream, Descales(mQd, mKd, mVd, mTrace), window_lo)

    @cute.jit
    def _trace(self, extra, event: cutlass.Constexpr, i):
        _stamp(extra.sinks, event, i)


class FwdFP8TracedNoPV(_NoPVMixin, FwdFP8Traced):
    """FwdFP8Traced whose O warpgroups issue no WGMMA (`_NoPVMixin`)."""


class FwdFP8TracedNoExp(FwdFP8Traced, FP8NoExp):
    """FwdFP8Traced with P = S rounded to e4m3 (perf.fp8_limits' `no-exp`), stamped."""


# `--fp8`: the FP8 forward's schedules at N=8K: (name, D, config fields changed from the plan,
# traced class: the kernel, or a variant whose O warpgroups issue no WGMMA or whose score step
# is P = S). With `overlap` the S stamps are S0 step start, S1 QK[i+1]'s first chunks issued, S2
# score step done, S3 P slot, S4 P stored; S4 -> next S0 is the last chunks' issue and wait.
_SERIAL_320 = dict(overlap=0, k_stages=6, v_stages=4)
FP8_SCHEDULES = [("planned (serial)", 512, {}, FwdFP8Traced),
                 ("planned (overlap)", 320, {}, FwdFP8Traced),
                 ("serial", 320, _SERIAL_320, FwdFP8Traced),
                 ("serial, no PV", 512, {}, FwdFP8TracedNoPV),
                 ("serial, P published before QK", 512, dict(publish_after=0), FwdFP8Traced),
                 ("serial, P = S", 512, {}, FwdFP8TracedNoExp),
                 ("overlap, no PV", 320, {}, FwdFP8TracedNoPV),
                 ("serial, no PV", 320, _SERIAL_320, FwdFP8TracedNoPV)]


class TracedExtra(NamedTuple):
    """The two-product kernels' extra (bwd_sm90.TwoProductExtra's fields, which the kernels
    read by name) and the trace tensor."""

    tma_rows2: object
    g_rows2: object
    tma_cols2: object
    g_cols2: object
    mDelta: object
    trace: object


def _with_trace(inputs: tuple) -> tuple:
    """A gradient kernel's stand-ins with the trace's before its two cumulative lengths."""
    return (*inputs[:-2], fake_tensor(cutlass.Int64, 4, 1), *inputs[-2:])


class BwdDVTraced(FFPABwdDVSm90):
    """dV with stamps (its `extra` is otherwise unused: the trace takes it)."""

    OPERANDS = ("k", "q", "do", "dv", "lse", "trace", "cu_k", "cu_q")

    @staticmethod
    def fake_inputs(cfg):
        return _with_trace(FFPABwdDVSm90.fake_inputs(cfg))

    @cute.jit
    def __call__(self, mK: cute.Tensor, mQ: cute.Tensor, mdO: cute.Tensor, mdV: cute.Tensor,
                 mLSE: cute.Tensor, mTrace: cute.Tensor, mCuK, mCuQ, softmax_scale: Float32,
                 causal_offset: Int32, window_lo: Int32, stream: cuda.CUstream):
        self._launch(Roles(rows=mK, cols=mQ, acc_b=mdO, out=mdV), mLSE, softmax_scale,
                     causal_offset, stream, mTrace, window_lo, cu=(mCuK, mCuQ))

    @cute.jit
    def _trace(self, extra, event: cutlass.Constexpr, i):
        _stamp(extra, event, i)


class _TwoTraced:
    """dQ / dK with stamps (`BASE`: the kernel): `__call__` parks the trace tensor (after the
    base's seven tensors, before its two cumulative lengths) and `_launch` adds it to the
    two-product extra (TracedExtra) on its way to the kernel."""

    BASE: type

    @classmethod
    def fake_inputs(cls, cfg):
        return _with_trace(cls.BASE.fake_inputs(cfg))

    @cute.jit
    def __call__(self, t0, t1, t2, t3, t4, t5, t6, mTrace, cu0, cu1, softmax_scale: Float32,
                 causal_offset: Int32, window_lo: Int32, stream: cuda.CUstream):
        self._trace_tensor = mTrace
        self.BASE.__call__(self, t0, t1, t2, t3, t4, t5, t6, cu0, cu1, softmax_scale,
                           causal_offset, window_lo, stream)

    @cute.jit
    def _launch(self, roles, mLSE, softmax_scale, causal_offset, stream, extra,
                window_lo=None, num_ctas=None, cu=None):
        RingSkeletonSm90._launch(self, roles, mLSE, softmax_scale, causal_offset, stream,
                                 TracedExtra(*extra, self._trace_tensor), window_lo, num_ctas,
                                 cu)

    @cute.jit
    def _trace(self, extra, event: cutlass.Constexpr, i):
        _stamp(extra.trace, event, i)


class BwdDQTraced(_TwoTraced, FFPABwdDQSm90):
    OPERANDS = ("q", "k", "v", "do", "dq", "lse", "delta", "trace", "cu_q", "cu_k")
    BASE = FFPABwdDQSm90


class BwdDKTraced(_TwoTraced, FFPABwdDKSm90):
    OPERANDS = ("q", "k", "v", "do", "dk", "lse", "delta", "trace", "cu_k", "cu_q")
    BASE = FFPABwdDKSm90


BWD_TRACED = {"FFPABwdDQSm90": BwdDQTraced, "FFPABwdDKSm90": BwdDKTraced,
              "FFPABwdDVSm90": BwdDVTraced}
# D=512, and with the gradient in one CTA (`wide_o`) at 544 (1.22x its CTA pair) and 576
# (dQ / dK no faster than the pair's; perf.one_cta --bwd)
BWD_SHAPES = [(512, 8192, False), (544, 8192, True), (576, 8192, True)]


class _FakeK(FwdTraced):
    @cute.jit
    def _refill_c(self, loads, done):
        if done + self.cfg.k_stages - loads.base < loads.total:
            _fake_fill(loads.bar + done % self.cfg.k_stages, loads.tidx)


class _FakeV(FwdTraced):
    @cute.jit
    def _refill_b(self, loads, done):
        if done + self.cfg.v_stages - loads.base < loads.total:
            _fake_fill(loads.bar + done % self.cfg.v_stages, loads.tidx)


class _FakeKV(_FakeK):
    @cute.jit
    def _refill_b(self, loads, done):
        if done + self.cfg.v_stages - loads.base < loads.total:
            _fake_fill(loads.bar + done % self.cfg.v_stages, loads.tidx)


@cute.jit
def _fake_fill(bar, tidx):
    """The one arrival a stage's full barrier waits for, with no bytes."""
    if tidx // 32 == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(bar)


class _NoPV(_NoPVMixin, FwdTraced):
    pass


VARIANTS = {"no K": _FakeK, "no V": _FakeV, "no KV": _FakeKV, "no PV": _NoPV}
VARIANT_SHAPES = [(512, 8192, False), (576, 8192, False)]


def _plan(d: int, causal: bool):
    import dataclasses

    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    p = AttnProblem(dtype="bf16", batch=1, heads_q=HEADS, heads_kv=HEADS, seqlen_q=8192,
                    seqlen_kv=8192, head_dim=d, head_dim_v=d, causal=causal)
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options())
    assert plan.reason is None and not plan.cfg.sinks, plan.reason
    # one CTA per tile (a persistent CTA's stamps would mix its tiles)
    return dataclasses.replace(plan.cfg, persistent=False)


def _bwd_plan(d: int, n: int, causal: bool):
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    p = AttnProblem(dtype="bf16", batch=1, heads_q=HEADS, heads_kv=HEADS, seqlen_q=n,
                    seqlen_kv=n, head_dim=d, head_dim_v=d, causal=causal, requires_grad=True)
    # the atomic-free dQ / dK / dV kernels (`deterministic`), the ones traced here
    plan = dispatch.plan_bwd(p, target="sm_90a", opts=Options(deterministic=True))
    assert plan.reason is None, plan.reason
    return plan


def _bwd_jobs() -> list:
    return [(BWD_TRACED[cls.__name__], cfg) for d, n, causal in BWD_SHAPES
            for cls, cfg in _bwd_plan(d, n, causal).jobs if cls.__name__ in BWD_TRACED]


def _fp8_plan(d: int, causal: bool, fields: dict):
    """perf.fp8_limits' planned FP8 config (N=8K, H=32) with `fields` changed."""
    import dataclasses

    return dataclasses.replace(fp8_limits._plan(d, causal), **fields)


def _fp8_jobs() -> list:
    return [(cls, _fp8_plan(d, False, f)) for _, d, f, cls in FP8_SCHEDULES]


def run_fp8(dev, flush) -> dict:
    """The FP8 forward's schedules, stamped (N=8K)."""
    import torch

    from ffpa_cute.cache import jit_cache
    from ffpa_cute.fp8 import _transposed_v

    res, n = {}, 8192
    for name, d, fields, traced in FP8_SCHEDULES:
        cfg = _fp8_plan(d, False, fields)
        q, k, v = (torch.randn(1, HEADS, n, d, device=dev).to(torch.float8_e4m3fn)
                   for _ in "qkv")
        vt = _transposed_v(v, interleave=True)
        o = torch.empty(1, HEADS, n, d, device=dev, dtype=torch.bfloat16)
        lse = torch.empty(1, HEADS, n, device=dev)
        ds = [torch.ones(1, HEADS, device=dev) for _ in range(3)]
        trace = torch.zeros(-(-n // 64) * HEADS, SLOTS, MAXB, EVENTS, dtype=torch.int64,
                            device=dev)
        fn = jit_cache().get(traced, cfg)
        args = (q, k, vt, o, lse, *ds, trace, d ** -0.5, 0, 0)
        traced.launch(fn, *args)
        torch.cuda.synchronize()
        ms = experiment.median_ms(lambda: traced.launch(fn, *args), dev, flush)
        trace.zero_()
        traced.launch(fn, *args)
        torch.cuda.synchronize()
        key = f"FP8 {_key(d, n, False)} {name}"
        res[key] = dict(ms=ms, tflops=4 * HEADS * n * n * d / (ms * 1e9),
                        phases=phases(trace.cpu()))
        print(f"{key}: {ms:.2f} ms, {res[key]['tflops']:.0f} TFLOPS", flush=True)
        for ph, cyc in res[key]["phases"].items():
            print(f"  {ph:40s} {cyc:8.0f}", flush=True)
    return res


def jobs() -> list:
    return ([(FwdTraced, _plan(d, causal)) for d, _, causal in SHAPES]
            + [(cls, _plan(d, causal)) for d, _, causal in VARIANT_SHAPES
               for cls in VARIANTS.values()] + _bwd_jobs())


def span(x, a, b):
    """Cycles from event a to event b of each block stamped with both (x: [..., blocks,
    EVENTS]; a stamp of 0: a block the CTA did not have)."""
    d = x[..., b] - x[..., a]
    return d[(x[..., a] != 0) & (x[..., b] != 0)]


def period(x):
    """Cycles from each block's first stamp to the next block's (x: [CTAs, blocks, EVENTS])."""
    d = x[:, 1:, 0] - x[:, :-1, 0]
    return d[(x[:, 1:, 0] != 0) & (x[:, :-1, 0] != 0)]


def medians(spans: dict) -> dict:
    """{phase: median cycles} of {phase: cycle samples} (nan where there are none)."""
    import torch

    return {k: float(torch.median(v).item()) if v.numel() else float("nan")
            for k, v in spans.items()}


def phases(trace) -> dict:
    """Median cycles per block of each phase over every traced CTA's blocks from the third on
    (stamps of 0: a block the CTA did not have)."""
    t = trace[:, :, 2:].double()
    out = {}
    for name, s in (("S", t[:, 0]), ("S w1", t[:, 3])):
        for k in range(4):
            out[f"{name} {S_EVENTS[k]} -> {S_EVENTS[k + 1]}"] = span(s, k, k + 1)
        out[f"{name} block period"] = period(s)
    for name, o in (("O lo", t[:, 1]), ("O hi", t[:, 2])):
        for k in range(3):
            out[f"{name} {O_EVENTS[k]} -> {O_EVENTS[k + 1]}"] = span(o, k, k + 1)
        out[f"{name} block period"] = period(o)
    return medians(out)


def run(dev, flush) -> dict:
    res = {}
    for d, n, causal in SHAPES:
        res[_key(d, n, causal)] = _run_one(FwdTraced, d, n, causal, dev, flush)
    for d, n, causal in VARIANT_SHAPES:
        for name, cls in VARIANTS.items():
            res[f"{_key(d, n, causal)} {name}"] = _run_one(cls, d, n, causal, dev, flush,
                                                          name)
    return res


def _key(d, n, causal) -> str:
    return f"D={d} N={n}{' causal' if causal else ''}"


def _run_one(cls, d, n, causal, dev, flush, variant=None) -> dict:
    import torch

    from ffpa_cute.cache import jit_cache

    cfg = _plan(d, causal)
    q, k, v = (torch.randn(1, HEADS, n, d, device=dev, dtype=torch.bfloat16) for _ in "qkv")
    o = torch.empty_like(q)
    lse = torch.empty(1, HEADS, n, device=dev)
    ctas = -(-n // 64) * cfg.ctas_per_tile * HEADS
    trace = torch.zeros(ctas, SLOTS, MAXB, EVENTS, dtype=torch.int64, device=dev)
    fn = jit_cache().get(cls, cfg)
    args = (q, k, v, o, lse, trace, None, None, d ** -0.5, 0, 0, 132)
    cls.launch(fn, *args)
    torch.cuda.synchronize()
    ms = experiment.median_ms(lambda: cls.launch(fn, *args), dev, flush)
    pairs = n * (n + 1) // 2 if causal else n * n
    tflops = 4 * HEADS * pairs * d / (ms * 1e9)
    err = float("nan")
    if variant is None:
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        err = float(((o.float() - ref.float()).norm() / ref.float().norm()).item())
    trace.zero_()
    cls.launch(fn, *args)
    torch.cuda.synchronize()
    row = dict(ms=ms, tflops=tflops, err=err, kv_pair=cfg.kv_pair, phases=phases(trace.cpu()))
    print(f"{_key(d, n, causal)}{' ' + variant if variant else ''}: {ms:.2f} ms, "
          f"{tflops:.0f} TFLOPS, err {err:.1e}", flush=True)
    for name, cyc in row["phases"].items():
        print(f"  {name:40s} {cyc:8.0f}", flush=True)
    return row


def run_bwd(dev, flush) -> dict:
    """Each gradient kernel of the planned backward, stamped, on its own."""
    import torch

    import ffpa_cute
    from ffpa_cute import launch

    res = {}
    for d, n, causal in BWD_SHAPES:
        plan = _bwd_plan(d, n, causal)
        q, k, v, do = (torch.randn(1, HEADS, n, d, device=dev, dtype=torch.bfloat16)
                       for _ in "qkvd")
        out, lse = ffpa_cute.attention(q, k, v, is_causal=causal, return_lse=True)
        t = dict(q=q, k=k, v=v, do=do, o=out, lse=lse.contiguous(),
                 delta=(do.float() * out.float()).sum(-1).contiguous(),
                 dq=torch.empty_like(q), dk=torch.empty_like(k), dv=torch.empty_like(v))
        scalars = launch.kernel_scalars(plan.problem, plan.problem.right_edge)
        for cls, cfg in plan.jobs:
            traced = BWD_TRACED.get(cls.__name__)
            if traced is None:
                continue
            ctas = -(-n // 64) * cfg.ctas_per_tile * HEADS  # N row tiles (queries or keys)
            trace = torch.zeros(ctas, SLOTS, MAXB, EVENTS, dtype=torch.int64, device=dev)
            args = {**t, "trace": trace}
            launch.run_job(traced, cfg, args, scalars)
            torch.cuda.synchronize()
            ms = experiment.median_ms(lambda: launch.run_job(traced, cfg, args, scalars), dev,
                                      flush)
            trace.zero_()
            launch.run_job(traced, cfg, args, scalars)
            torch.cuda.synchronize()
            key = f"{_key(d, n, causal)} {cls.__name__}"
            res[key] = dict(ms=ms, phases=phases(trace.cpu()))
            print(f"{key}: {ms:.2f} ms", flush=True)
            for name, cyc in res[key]["phases"].items():
                print(f"  {name:40s} {cyc:8.0f}", flush=True)
    return res


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--fp8" in argv:
        argv.remove("--fp8")
        return experiment.main("perf.phase_trace --fp8", __doc__, _fp8_jobs, run_fp8, argv)
    if "--bwd" in argv:
        argv.remove("--bwd")
        return experiment.main("perf.phase_trace --bwd", __doc__, jobs, run_bwd, argv)
    return experiment.main("perf.phase_trace", __doc__, jobs, run, argv)


if __name__ == "__main__":
    sys.exit(main())
