"""Variable-length attention on packed sequences: `varlen_attention`, FlashAttention's varlen
convention.

Layout: q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv] hold B sequences back to
back; sequence b owns rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and
cu_seqlens_k[b]:cu_seqlens_k[b+1] of k and v (int32 or int64, [B + 1], starting at 0). lse
comes back [Hq, total_q], FlashAttention's varlen `softmax_lse` shape.

Two routes. cu_seqlens are read on the host first either way (validation: one device sync
on CUDA), once per tensor: a cu_seqlens tensor passed again unchanged (the same object, no
in-place write since: its version counter) reuses the bounds it gave, so the layers of a model
sharing one cu_seqlens sync once per step, not once per layer.

* One launch (`Options.varlen_launch`, the 16-bit kernels of sm90, sm100 and the Split-D
  families; those never run on the device's target (sm100; Split-D off sm_90a) only after
  their canaries, `canary` / `bwd_canary`, pass on the device): the packed tensors are passed as
  [1, H, total, D] views and the kernels take cu_seqlens themselves: each CTA of the forward,
  dQ, dK and dV kernels finds its sequence and row tile by walking cu_seqlens (no padding
  work, no host-side tile list), and masks, causal offset and window are per sequence
  (`varlen` in the families' config.py). `VarlenAttention` is its autograd
  function; Delta runs on the packed views as it is. Taken when the forward plan (and, for
  inputs that require grad, the backward plan) of the problem has varlen kernels.
* Otherwise a host loop: each sequence is one call of the routine behind `attention()`,
  routed like it (a kernel where one serves that sequence, window and sinks included, else the
  native fallback, logged once per reason; strict raises). On CUDA the sequences are issued
  longest first, round-robin on `STREAMS` side streams forked from and joined to the caller's
  stream, so one kernel's last, partial wave overlaps the next kernel's first; autograd runs
  each backward on its forward's stream.

Under torch.compile the call is one opaque custom op, `ffpa_cute::varlen_fwd` (its gradient
`ffpa_cute::varlen_bwd`), which takes cu_seqlens as tensors: the graph neither reads them on
the host nor specialises on the sequence lengths (one graph for every packing, fullgraph
included), and at run time the op takes the routes above. Its backward runs the one-launch
gradient kernels where they serve the problem, else exact torch math per sequence
(`math_attention.math_grads` on the forward's out and lse).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import numbers
import weakref
from typing import Optional

import torch

from . import dispatch, dense_mask, launch, nested, selfcheck
from . import options as _options
from .math_attention import compute_dtype, math_grads
from .interface import _attention
from .ops import on
from .problem import AttnProblem, dtype_name, tensor_version
from .validate import check_args, check_return_lse, check_window_sinks, window_bounds

__all__ = ["varlen_attention"]

CU_DTYPES = (torch.int32, torch.int64)
STREAMS = 4  # side streams the sequences are spread over on CUDA
_SIDE: dict = {}  # device index -> its side streams (created once)


def _side_streams(device: torch.device, n: int) -> list:
    """`n` side streams of `device`, forked from its current stream (they wait for it)."""
    if device.index not in _SIDE:
        _SIDE[device.index] = [torch.cuda.Stream(device) for _ in range(STREAMS)]
    streams = _SIDE[device.index][:n]
    main = torch.cuda.current_stream(device)
    for s in streams:
        s.wait_stream(main)
    return streams


def _check_packed(q, k, v):
    """The first shape error of packed q, k, v (or None); check_args checks the rest."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            return ValueError(f"{name} must be packed [total_tokens, heads, head_dim] (3-D), got "
                              f"shape {tuple(t.shape)}")
    if k.shape[:2] != v.shape[:2]:
        return ValueError(f"k and v must agree on total_k and heads (dims 0, 1), got "
                          f"{tuple(k.shape)} and {tuple(v.shape)}")
    return None


def _nothing():
    return contextlib.nullcontext()


_BOUNDS: dict = {}  # id(cu) -> (weakref to cu, (version, total, max_seqlen, device), bounds)
_BOUNDS_MAX = 64


def sequence_bounds(name: str, cu, total: int, max_name: str, max_seqlen, device):
    """[(start, end)] per sequence from a cumulative-lengths tensor, or raise naming it. The
    values are read (and checked) once per tensor and version (module docstring)."""
    version = tensor_version(cu)
    if version is None:   # not a tensor (the read raises), or an inference tensor: no cache
        return tuple(_read_bounds(name, cu, total, max_name, max_seqlen, device))
    key = (version, total, type(max_seqlen), max_seqlen, device)
    hit = _BOUNDS.get(id(cu))
    if hit is not None and hit[0]() is cu and hit[1] == key:
        return hit[2]
    bounds = tuple(_read_bounds(name, cu, total, max_name, max_seqlen, device))
    if len(_BOUNDS) >= _BOUNDS_MAX:
        _BOUNDS.clear()
    _BOUNDS[id(cu)] = (weakref.ref(cu), key, bounds)
    return bounds


def _read_bounds(name: str, cu, total: int, max_name: str, max_seqlen, device):
    """`sequence_bounds` without the cache: the device sync and the checks."""
    if not isinstance(cu, torch.Tensor) or cu.dtype not in CU_DTYPES:
        raise TypeError(f"{name} must be an int32 or int64 tensor [B + 1], got "
                        f"{getattr(cu, 'dtype', type(cu).__name__)}")
    if cu.dim() != 1 or cu.numel() == 0:
        raise ValueError(f"{name} must be 1-D [B + 1] (0 first, then each sequence's end), got "
                         f"shape {tuple(cu.shape)}")
    if cu.device.type != "cpu" and cu.device != device:
        raise ValueError(f"{name} must be on the CPU or on q's device ({device}), got {cu.device}")
    ends = cu.tolist()
    if ends[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {ends[0]}")
    for b in range(1, len(ends)):
        if ends[b] < ends[b - 1]:
            raise ValueError(f"{name} must be non-decreasing: {name}[{b}] = {ends[b]} < "
                             f"{name}[{b - 1}] = {ends[b - 1]}")
    if ends[-1] != total:
        raise ValueError(f"{name}[-1] = {ends[-1]} must equal the packed length {total}")
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, numbers.Integral):
        raise TypeError(f"{max_name} must be a Python int, got {type(max_seqlen).__name__}")
    longest = max((b - a for a, b in zip(ends, ends[1:])), default=0)
    if max_seqlen < longest:
        raise ValueError(f"{max_name}={max_seqlen} is below the longest sequence of {name} "
                         f"({longest})")
    return list(zip(ends, ends[1:]))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     is_causal=False, scale=None, enable_gqa=False, window=None, sinks=None,
                     return_lse=False, strict=None):
    """Attention of each packed sequence against its own keys; returns out [total_q, Hq, Dv] in
    q's dtype, or with `return_lse=True` (out, lse [Hq, total_q]).

    q [total_q, Hq, D], k [total_k, Hkv, D], v [total_k, Hkv, Dv]; cu_seqlens_q / cu_seqlens_k
    int32 or int64 [B + 1] (cumulative lengths from 0, on the CPU or q's device);
    max_seqlen_q / max_seqlen_k Python ints >= the longest sequence. Empty sequences are
    allowed (no keys: out rows 0, lse -inf, or the sink with sinks).

    The arguments mean what they mean in `attention()`, per sequence: `is_causal` is
    bottom-right (query i of a sequence with nq queries and nkv keys sees key j iff
    j <= i + nkv - nq), `window=(left, right)` is in the same frame, `sinks` [Hq] joins every
    row's denominator, GQA needs `enable_gqa=True`; lse is float32 (float64 for float64
    inputs). out and lse are differentiable in q, k, v and sinks. One kernel launch over
    all sequences where the kernels serve the problem that way, else one
    `attention()`-routed call per sequence (module docstring).
    """
    err = (_check_packed(q, k, v)
           or check_args(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), None, 0.0,
                         is_causal, scale, enable_gqa)
           or check_return_lse(return_lse, 0.0)
           or check_window_sinks(window, sinks, q.transpose(0, 1)))
    if err is not None:
        raise err
    if torch.compiler.is_compiling():  # one opaque op: cu_seqlens stay tensors in the graph
        out, lse = varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, max_seqlen_q,
                              max_seqlen_k, bool(is_causal),
                              None if scale is None else float(scale), *_window_args(window),
                              None if strict is None else bool(strict))
        return (out, lse) if return_lse else out
    seq_q = sequence_bounds("cu_seqlens_q", cu_seqlens_q, q.shape[0], "max_seqlen_q",
                            max_seqlen_q, q.device)
    seq_k = sequence_bounds("cu_seqlens_k", cu_seqlens_k, k.shape[0], "max_seqlen_k",
                            max_seqlen_k, q.device)
    if len(seq_q) != len(seq_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
                         f"sequences, got {len(seq_q)} and {len(seq_k)}")
    strict = None if strict is None else bool(strict)
    plan = _one_launch_plan(q, k, v, len(seq_q), max_seqlen_q, max_seqlen_k, is_causal, scale,
                            window, sinks)
    if plan is not None:
        cu_q, cu_k = (c.to(device=q.device, dtype=torch.int32).contiguous()
                      for c in (cu_seqlens_q, cu_seqlens_k))
        out, lse = VarlenAttention.apply(q, k, v, sinks, cu_q, cu_k, plan)
        return (out, lse) if return_lse else out
    outs, lses = [None] * len(seq_q), [None] * len(seq_q)
    order = sorted(range(len(seq_q)), key=lambda i: -(seq_q[i][1] - seq_q[i][0])
                   * (seq_k[i][1] - seq_k[i][0]))  # the most work first
    streams = (_side_streams(q.device, min(STREAMS, len(order)))
               if q.device.type == "cuda" and len(order) > 1 else [])
    for n, i in enumerate(order):
        (qa, qb), (ka, kb) = seq_q[i], seq_k[i]
        qs, ks, vs = (t[a:b].transpose(0, 1).unsqueeze(0)  # [1, H, n, D] views
                      for t, a, b in ((q, qa, qb), (k, ka, kb), (v, ka, kb)))
        with torch.cuda.stream(streams[n % len(streams)]) if streams else _nothing():
            res = _attention(qs, ks, vs, None, 0.0, is_causal, scale, upper_left=False,
                             strict=strict, level=logging.WARNING, return_lse=return_lse,
                             window=window, sinks=sinks)
        out, lse = res if return_lse else (res, None)
        outs[i], lses[i] = out[0].transpose(0, 1), lse
    if streams:  # join: the caller's stream waits for every side stream, and its allocator
        main = torch.cuda.current_stream(q.device)  # knows the outputs are used there
        for s in streams:
            main.wait_stream(s)
        for t in (*outs, *lses):
            if t is not None:
                t.record_stream(main)
    hq, dv = q.shape[1], v.shape[-1]
    out = torch.cat(outs) if outs else q.new_zeros(0, hq, dv)
    if not return_lse:
        return out
    dtype = compute_dtype(q.dtype)
    lse = (torch.cat([x[0].to(dtype) for x in lses], dim=-1) if lses
           else torch.zeros(hq, 0, dtype=dtype, device=q.device))
    return out, lse


def _one_launch_plan(q, k, v, nseq: int, max_q: int, max_k: int, is_causal, scale, window,
                     sinks, backward: bool = False):
    """The forward plan of the one-launch route, or None (host loop): CUDA, not under
    torch.compile, `Options.varlen_launch`, something to compute, and a varlen kernel for the
    forward and, when an input requires grad (or `backward`), for the backward too."""
    if (q.device.type != "cuda" or torch.compiler.is_compiling()
            or not _options.current().varlen_launch or q.shape[0] == 0 or k.shape[0] == 0):
        return None
    lo, hi = window_bounds(window, 0) if window is not None else (None, None)
    problem = AttnProblem(
        dtype=dtype_name(q.dtype), batch=nseq, heads_q=q.shape[1], heads_kv=k.shape[1],
        seqlen_q=max_q, seqlen_kv=max_k, head_dim=q.shape[2], head_dim_v=v.shape[2],
        causal=bool(is_causal), causal_offset=0,
        scale=float(scale) if scale is not None else None, device_type=q.device.type,
        requires_grad=backward or any(t.requires_grad for t in (q, k, v)),
        window_lo=lo, window_hi=hi, has_sinks=sinks is not None, varlen=True)
    plan = dispatch.plan_fwd(problem, q.device)
    if plan.reason is not None or not getattr(plan.cfg, "varlen", False):
        return None
    if selfcheck.reason(plan, q.device, canary) is not None:   # a kernel never run here
        return None
    if backward or torch.is_grad_enabled() and (problem.requires_grad or (
            sinks is not None and sinks.requires_grad)):
        bwd = dispatch.plan_bwd(problem, q.device)
        if bwd.reason is not None or selfcheck.bwd_reason(bwd, q.device,
                                                          canary=bwd_canary) is not None:
            return None
    return plan


def _bhnd(t: torch.Tensor) -> torch.Tensor:
    """A packed [total, H, D] tensor as the kernels' [1, H, total, D] view."""
    return t.transpose(0, 1).unsqueeze(0)


class VarlenAttention(torch.autograd.Function):
    """The one-launch route: the forward kernel over all sequences -> (out [total_q, Hq, Dv],
    lse [Hq, total_q] fp32); backward: Delta (minus lse's gradient), then the dQ, dK and dV
    kernels over all sequences (their grad of sinks as `ops.feature_backward`'s)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_q, cu_k, plan):
        with on(q.device):
            out, lse = _forward(plan, q, k, v, sinks, cu_q, cu_k)
        ctx.save_for_backward(q, k, v, sinks, cu_q, cu_k, out, lse)
        ctx.problem = plan.problem
        ctx.options = _options.current()
        ctx.set_materialize_grads(False)  # None for an output the loss does not read
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return (None,) * 7
        q, k, v, sinks, cu_q, cu_k, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        p = ctx.problem
        plan = dispatch.plan_bwd(p, q.device, opts=ctx.options)
        if plan.reason is not None:  # planned at the forward: the planner changed its mind
            raise RuntimeError(f"varlen backward: {plan.reason}")
        with on(q.device):
            dq, dk, dv, delta = _backward(plan, q, k, v, out, lse, dout, cu_q, cu_k, dlse)
        needs = ctx.needs_input_grad
        dsinks = None
        if sinks is not None and needs[3]:  # -sum_i exp(sink - lse_i) Delta'_i per head
            dsinks = -(torch.exp(sinks.to(lse.dtype)[:, None] - lse) * delta).sum(1)
            dsinks = dsinks.to(sinks.dtype)
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                dsinks, None, None, None)


def _forward(plan, q, k, v, sinks, cu_q, cu_k):
    """The one-launch forward kernel of `plan` on packed q, k, v with int32 cu_q, cu_k: (out
    [total_q, Hq, Dv], lse [Hq, total_q] fp32)."""
    p = plan.problem
    total_q, hq, dv = q.shape[0], q.shape[1], v.shape[-1]
    out = torch.empty(total_q, hq, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(hq, total_q, dtype=torch.float32, device=q.device)
    sinks32 = sinks.to(torch.float32).contiguous() if sinks is not None else None
    tensors = dict(q=launch.kernel_ready(_bhnd(q)), k=launch.kernel_ready(_bhnd(k)),
                   v=launch.kernel_ready(_bhnd(v)), o=_bhnd(out), lse=lse.unsqueeze(0),
                   sinks=sinks32, cu_q=cu_q, cu_k=cu_k)
    launch.run_job(plan.kernel_cls, plan.cfg, tensors, launch.kernel_scalars(p, p.right_edge))
    return out, lse


def _backward(plan, q, k, v, out, lse, dout, cu_q, cu_k, dlse=None):
    """The one-launch backward kernels of `plan` (Delta, dQ, dK, dV; Delta - dlse with lse's
    gradient) on packed tensors: (dq, dk, dv, Delta - dlse [Hq, total_q])."""
    p = plan.problem
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    delta = torch.empty_like(lse)
    t = dict(q=launch.kernel_ready(_bhnd(q)), k=launch.kernel_ready(_bhnd(k)),
             v=launch.kernel_ready(_bhnd(v)), o=_bhnd(out),
             do=launch.kernel_ready(_bhnd(dout)), lse=lse.unsqueeze(0),
             delta=delta.unsqueeze(0), dq=_bhnd(dq), dk=_bhnd(dk), dv=_bhnd(dv),
             cu_q=cu_q, cu_k=cu_k)
    launch.run_grad_jobs(plan, t, launch.kernel_scalars(p, p.right_edge), dlse)
    return dq, dk, dv, delta


# the varlen canaries' sequences: rows of q, keys of k / v (several row tiles and key blocks,
# partial last ones; a causal row of the second that sees no key)
CANARY_ROWS, CANARY_KEYS = (67, 131), (200, 130)


class _Canary:
    """Two packed sequences (CANARY_ROWS / CANARY_KEYS) of canary problem `cp` on `device`:
    q, k, v (and dout) drawn from `seed`, int32 cu_q / cu_k, the sinks, the window's left edge
    (CANARY_WINDOW_LEFT keys behind each sequence's bottom-right frame), the run's problem
    (its runtime offsets in frame 0: the kernels add each sequence's frame), and per sequence
    the reference's arguments and [1, H, n, .] views."""

    def __init__(self, cp: AttnProblem, device, seed: int):
        dtype = selfcheck.DTYPES[cp.dtype]
        gen = torch.Generator(device=device).manual_seed(seed)
        tq, tk = sum(CANARY_ROWS), sum(CANARY_KEYS)
        shapes = ((tq, cp.heads_q, cp.head_dim), (tk, cp.heads_kv, cp.head_dim),
                  (tk, cp.heads_kv, cp.head_dim_v), (tq, cp.heads_q, cp.head_dim_v))
        self.q, self.k, self.v, self.dout = (
            torch.randn(*s, device=device, dtype=dtype, generator=gen) for s in shapes)
        self.cu_q, self.cu_k = (torch.tensor([0, n[0], n[0] + n[1]], dtype=torch.int32,
                                             device=device) for n in (CANARY_ROWS, CANARY_KEYS))
        self.sinks = selfcheck.canary_sinks(cp, device)
        left = selfcheck.CANARY_WINDOW_LEFT if cp.window_lo is not None else None
        self.problem = dataclasses.replace(cp, causal_offset=0,
                                           window_lo=None if left is None else -left)
        self.seqs = []
        for b in range(2):
            (qa, qb), (ka, kb) = self.cu_q[b:b + 2].tolist(), self.cu_k[b:b + 2].tolist()
            frame = (kb - ka) - (qb - qa)
            args = dict(causal=cp.causal, causal_offset=frame, scale=cp.softmax_scale,
                        window_lo=None if left is None else frame - left, sinks=self.sinks)
            views = tuple(t[a:e].transpose(0, 1)[None] for t, a, e in (
                (self.q, qa, qb), (self.k, ka, kb), (self.v, ka, kb), (self.dout, qa, qb)))
            self.seqs.append((args, views))


def canary(plan, cplan, device) -> str | None:
    """`selfcheck`'s canary for a one-launch varlen forward configuration never run on this
    target: two packed sequences (`_Canary`) through the kernel at once, against float32
    attention per sequence (its bottom-right frame, window and sinks) within twice torch's
    same-dtype error plus 1e-3; None when it passes, else why."""
    from .reference import attention_ref, attention_same_dtype

    c = _Canary(cplan.problem, device, 1234)
    with selfcheck.on_device(device):
        out, _ = _forward(dataclasses.replace(cplan, problem=c.problem), c.q, c.k, c.v,
                          c.sinks, c.cu_q, c.cu_k)
    refs = [attention_ref(*x[:3], upcast=torch.float32, **a)[0][0] for a, x in c.seqs]
    bases = [attention_same_dtype(*x[:3], **a)[0][0] for a, x in c.seqs]
    miss = selfcheck._miss(out.transpose(0, 1), torch.cat(refs, 1), torch.cat(bases, 1))
    if miss is not None:
        return (f"self-check failed for the {plan.family} one-launch varlen kernel on "
                f"{plan.target} ({type(plan.cfg).__name__}): canary {miss}; varlen_attention "
                "runs each sequence on its own in this process")
    return None


def bwd_canary(plan, device, opts=None) -> str | None:
    """`selfcheck.bwd_reason`'s canary for a one-launch varlen backward plan never run on
    this target: the forward's out and lse in float32 per sequence (`_Canary`, packed), then
    the backward kernels over both sequences at once; dq, dk, dv against float32 gradients per
    sequence within twice torch's same-dtype error plus 1e-3."""
    from .reference import attention_grads, attention_ref

    cp = selfcheck.canary_problem(plan, packed=False, requires_grad=True)
    cplan = dispatch.plan_bwd(cp, device, opts=opts)
    if cplan.reason is not None or cplan.cfgs != plan.cfgs:
        return (f"self-check could not build a varlen backward canary for {plan.cfgs}: it "
                f"planned {cplan.cfgs or cplan.reason}")
    c = _Canary(cp, device, 4321)
    fwd = [attention_ref(*x[:3], upcast=torch.float32, **a) for a, x in c.seqs]
    out = torch.cat([o[0].transpose(0, 1) for o, _ in fwd]).to(c.q.dtype)
    lse = torch.cat([m[0] for _, m in fwd], 1).float()
    with selfcheck.on_device(device):
        got = _backward(dataclasses.replace(cplan, problem=c.problem), c.q, c.k, c.v, out, lse,
                        c.dout, c.cu_q, c.cu_k)[:3]
    for i, name in enumerate(("dq", "dk", "dv")):
        per = [[attention_grads(*x, dtype=dt, **a)[i][0].transpose(0, 1) for a, x in c.seqs]
               for dt in (torch.float32, c.q.dtype)]
        miss = selfcheck._miss(got[i], torch.cat(per[0]), torch.cat(per[1]))
        if miss is not None:
            return (f"self-check failed for the {plan.family} one-launch varlen backward on "
                    f"{plan.target}: canary {name} {miss}; varlen_attention runs each "
                    "sequence on its own in this process")
    return None


# ------------------------------------------------------------------ torch.compile: one op


def _window_args(window):
    """(has_window, left, right): a window as the ops' scalar arguments."""
    return (False, None, None) if window is None else (True, *window)


@torch.library.custom_op("ffpa_cute::varlen_fwd", mutates_args=())
def varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
               cu_k: torch.Tensor, sinks: Optional[torch.Tensor], max_q: int, max_k: int,
               causal: bool, scale: Optional[float], has_window: bool, left: Optional[int],
               right: Optional[int], strict: Optional[bool]) -> tuple[torch.Tensor, torch.Tensor]:
    """`varlen_attention(..., enable_gqa=True, return_lse=True)` as one op (its arguments
    checked at trace time, cu_seqlens and max_seqlen here): (out [total_q, Hq, Dv], lse [Hq,
    total_q]), contiguous."""
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=causal,
                                scale=scale, enable_gqa=True,
                                window=(left, right) if has_window else None, sinks=sinks,
                                return_lse=True, strict=strict)
    return out.contiguous(), lse.contiguous()


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_q, cu_k, sinks, max_q, max_k, causal, scale, has_window, left,
                     right, strict):
    return (q.new_empty(q.shape[0], q.shape[1], v.shape[-1]),
            q.new_empty(q.shape[1], q.shape[0], dtype=compute_dtype(q.dtype)))


@torch.library.custom_op("ffpa_cute::varlen_bwd", mutates_args=())
def varlen_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
               cu_k: torch.Tensor, sinks: Optional[torch.Tensor], out: torch.Tensor,
               lse: torch.Tensor, dout: torch.Tensor, dlse: Optional[torch.Tensor], max_q: int,
               max_k: int, causal: bool, scale: Optional[float], has_window: bool,
               left: Optional[int], right: Optional[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks) of `varlen_fwd` (dsinks [Hq] in lse's dtype, zeros without
    sinks): the one-launch gradient kernels where they serve the problem, else `math_grads`
    per sequence on the forward's out and lse (dlse: lse's gradient, or None)."""
    window = (left, right) if has_window else None
    seq_q = sequence_bounds("cu_seqlens_q", cu_q, q.shape[0], "max_seqlen_q", max_q, q.device)
    seq_k = sequence_bounds("cu_seqlens_k", cu_k, k.shape[0], "max_seqlen_k", max_k, q.device)
    plan = _one_launch_plan(q, k, v, len(seq_q), max_q, max_k, causal, scale, window, sinks,
                            backward=True)
    if plan is not None:
        bwd = dispatch.plan_bwd(plan.problem, q.device)
        cu_q, cu_k = (c.to(device=q.device, dtype=torch.int32).contiguous() for c in (cu_q, cu_k))
        with on(q.device):
            dq, dk, dv, delta = _backward(bwd, q, k, v, out, lse, dout, cu_q, cu_k, dlse)
    else:
        rowdot = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1).transpose(0, 1)
        delta = rowdot if dlse is None else rowdot - dlse
        dq, dk, dv = (torch.zeros(t.shape, dtype=compute_dtype(t.dtype), device=t.device)
                      for t in (q, k, v))
        for (qa, qb), (ka, kb) in zip(seq_q, seq_k):
            if qb == qa or kb == ka:
                continue
            frame = (kb - ka) - (qb - qa)   # bottom-right: row i sits at key i + frame
            lo, hi = window_bounds(window, frame) or (None, None)
            if causal:
                hi = frame if hi is None else min(hi, frame)
            rows = [t[a:b].transpose(0, 1) for t, a, b in (  # [H, n, D] / [H, n]
                (q, qa, qb), (k, ka, kb), (v, ka, kb), (out, qa, qb), (dout, qa, qb))]
            g = math_grads(*rows[:4], lse[:, qa:qb], rows[4], lo=lo, hi=hi, scale=scale,
                           dlse=None if dlse is None else dlse[:, qa:qb])
            for acc, grad, a, b in ((dq, g[0], qa, qb), (dk, g[1], ka, kb), (dv, g[2], ka, kb)):
                acc[a:b] = grad.transpose(0, 1)
        dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    dsinks = torch.zeros(q.shape[1], dtype=compute_dtype(q.dtype), device=q.device)
    if sinks is not None:  # -sum_i exp(sink - lse_i) (Delta_i - dlse_i) per head
        dsinks = -(torch.exp(sinks.to(lse.dtype)[:, None] - lse) * delta).sum(1).to(dsinks.dtype)
    return dq.contiguous(), dk.contiguous(), dv.contiguous(), dsinks


@varlen_bwd.register_fake
def _varlen_bwd_fake(q, k, v, cu_q, cu_k, sinks, out, lse, dout, dlse, max_q, max_k, causal,
                     scale, has_window, left, right):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            q.new_empty(q.shape[1], dtype=compute_dtype(q.dtype)))


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, sinks, *args = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k, sinks, *output)
    ctx.args = tuple(args[:-1])   # max_q .. right (strict is the forward's)
    ctx.set_materialize_grads(False)  # None for an output the loss does not read


def _varlen_op_backward(ctx, dout, dlse):
    if dout is None and dlse is None:
        return (None,) * 14
    q, k, v, cu_q, cu_k, sinks, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv, dsinks = varlen_bwd(q, k, v, cu_q, cu_k, sinks, out, lse, dout, dlse, *ctx.args)
    needs = ctx.needs_input_grad
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
            None, None, dsinks.to(sinks.dtype) if sinks is not None and needs[5] else None,
            *(None,) * 8)


torch.library.register_autograd("ffpa_cute::varlen_fwd", _varlen_op_backward,
                                setup_context=_varlen_setup)


dense_mask.PACKED["varlen_attention"] = varlen_attention  # key-padding masks of unequal counts
nested.PACKED["varlen_attention"] = varlen_attention  # jagged NestedTensors
