"""A fake kernel route for CPU tests of the code around the kernels (the pattern of
test_api_contract's `fake_kernel` fixture): dispatch plans a "kernel" for every problem, the
forward "kernel" is the float64 reference, the backward "kernels" are `fallback.block_grads`,
which, like the real ones, use the out and lse they are given (with a window or sinks: the
exact torch math of `math_attention` on the problem's edges). Calls are recorded.

`install(monkeypatch)` for pytest; `installed()` (a context manager) in spawned processes.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ffpa_cute import dispatch, interface, launch
from ffpa_cute import math_attention as ma
from ffpa_cute.fallback import block_grads
from ffpa_cute.problem import AttnProblem
from ffpa_cute.reference import attention_ref


@dataclass(frozen=True)
class FakePlan:
    problem: AttnProblem
    reason: str | None = None
    family: str | None = "fake"
    cfg: object = None  # no compiled kernel: no per-signature launcher either
    target: str | None = None
    packed: bool = False

    def describe(self):
        return f"fake kernel D={self.problem.head_dim} causal={self.problem.causal}"


class FakeKernels:
    """Forward and backward "kernels" for every problem; `fwd_calls` / `bwd_calls` record the
    problems they ran."""

    def __init__(self):
        self.fwd_calls, self.bwd_calls = [], []
        self.reduces_dq = True   # like the fused backward: calls over key runs share dq_acc

    def plan_fwd(self, problem, *args, **kwargs):
        return FakePlan(problem)

    def plan_bwd(self, problem, device=None, target=None, opts=None):
        return dispatch.BwdPlan(problem, family="fake")

    def run_fwd(self, plan, q, k, v, sinks=None, out=None, lse=None):
        o, m = self._forward(plan, q, k, v, sinks)
        return (o if out is None else out.copy_(o)), (m if lse is None else lse.copy_(m))

    def _forward(self, plan, q, k, v, sinks):
        assert q.dim() == k.dim() == v.dim() == 4
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        p = plan.problem
        assert (sinks is not None) == p.has_sinks
        self.fwd_calls.append(p)
        if p.has_window or p.has_sinks:  # the kernels' edges: lo, and hi = the right edge
            with torch.no_grad():
                out, lse = ma._forward(q, k, v, p.window_lo, _hi(p), sinks, None,
                                       p.softmax_scale)
        else:
            out, lse = attention_ref(q, k, v, causal=p.causal, causal_offset=p.causal_offset,
                                     scale=p.softmax_scale)
        return out.to(q.dtype), lse.float() if q.dtype != torch.float64 else lse

    def run_bwd(self, plan, q, k, v, out, lse, dout, with_delta=False, dlse=None, dq_acc=None,
                delta=None):
        p = plan.problem
        self.bwd_calls.append(p)
        assert dq_acc is None or (self.reduces_dq and dq_acc.shape == (*q.shape[:-1], q.shape[-1]))
        rowdot = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
        if delta is not None:   # the caller's Delta - dlse, as the kernels would read it
            dlse = rowdot - delta
        if p.has_window:
            grads = ma.math_grads(q, k, v, out, lse, dout, lo=p.window_lo, hi=_hi(p),
                                  scale=p.softmax_scale, dlse=dlse)
        else:
            grads = block_grads(q, k, v, out, lse, dout, causal=p.causal,
                                offset=p.causal_offset, scale=p.softmax_scale, dlse=dlse)
        grads = tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
        if dq_acc is not None:
            dq_acc += grads[0]
            grads = (None, *grads[1:])
        delta = ma.lse_delta(rowdot, dlse, lse.shape, lse.dtype, lse.device)
        return (*grads, delta) if with_delta else grads

    def run_delta(self, plan, out, dout, dlse=None):
        dtype = ma.compute_dtype(out.dtype)
        rowdot = (dout.to(dtype) * out.to(dtype)).sum(-1)
        return ma.lse_delta(rowdot, dlse, rowdot.shape, dtype, out.device)

    def patches(self):
        return [(dispatch, "plan_fwd", self.plan_fwd), (dispatch, "plan_bwd", self.plan_bwd),
                (launch, "run_fwd", self.run_fwd), (launch, "run_bwd", self.run_bwd),
                (launch, "run_delta", self.run_delta),
                (launch, "reduces_dq", lambda plan: self.reduces_dq),
                (launch, "fused_width", lambda plan: plan.problem.head_dim)]


def _hi(p: AttnProblem):
    """The right edge the kernels apply (None: unbounded)."""
    return p.right_edge if p.right_bounded else None


def install(monkeypatch) -> FakeKernels:
    fake = FakeKernels()
    for obj, name, fn in fake.patches():
        monkeypatch.setattr(obj, name, fn)
    interface._clear_caches()
    return fake


@contextlib.contextmanager
def installed():
    """The same patches for a block, without pytest (a spawned test worker); yields the
    FakeKernels and restores the real functions after."""
    fake = FakeKernels()
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in fake.patches()]
    for obj, name, fn in fake.patches():
        setattr(obj, name, fn)
    interface._clear_caches()
    try:
        yield fake
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
        interface._clear_caches()
