"""The kernel path as torch operators: the custom ops `ffpa_cute::attention_fwd` and
`ffpa_cute::attention_bwd` (opaque to torch.compile, with fake implementations), their autograd
formula, and `EagerAttention`, the same forward and backward without the custom-op dispatcher
for eager calls (that dispatcher costs ~35 us per call on a small CPU). A sliding window and / or
sinks have their own pair, `ffpa_cute::feature_attention_fwd` / `_bwd` (torch.compile graphs),
and `FeatureAttention` (eager), over one forward and one backward body.

The backward runs the backward kernels where `dispatch.plan_bwd` has them for the problem, else
recomputes through SDPA (`fallback.sdpa_recompute_backward`). Both outputs carry gradients: a
loss that reads lse (e.g. through `merge_attention`) adds its term through Delta' = Delta - dlse
(Note [The gradient of lse] in math_attention.py); an output the loss does not read gives None
(no zero tensors are made for it).
"""

import contextlib
from typing import Optional

import torch

from . import dispatch, launch, selfcheck
from . import options as _options
from .fallback import sdpa_recompute_backward
from .math_attention import lse_delta, math_grads, math_lse_grads
from .problem import AttnProblem


def on(device: torch.device):
    """Make `device` current (launches go to its current stream and context)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def kernel_forward(q, k, v, causal: bool, causal_offset: int, scale: float, plan=None,
                   fwd_call=None, out=None, lse=None):
    """Kernel forward on [B, H, N, D] tensors: (out [B,Hq,Nq,Dv] q.dtype, lse [B,Hq,Nq] fp32).

    The body of the custom op, and of the eager path (`EagerAttention`), which passes the plan
    `attention()` already made and, for a repeated call signature, its `launch.FwdCall`.
    out / lse (with a plan, no fwd_call): where to write them (`launch.run_fwd`), returned as
    given.
    """
    if out is not None or lse is not None:
        with on(q.device):
            return launch.run_fwd(plan, *(t if t.stride(-1) == 1 else t.contiguous()
                                          for t in (q, k, v)), out=out, lse=lse)
    if fwd_call is not None:
        res = fwd_call(q, k, v)
        if res is not None:
            return res
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if plan is None:
        problem = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=causal_offset,
                                           scale=scale)
        plan = dispatch.plan_fwd(problem, q.device)
    if plan.reason is not None:  # attention() routed here, so the planner changed its mind
        raise RuntimeError(f"ffpa_cute::attention_fwd called for an unsupported problem: "
                           f"{plan.reason}")
    with on(q.device):
        out, lse = launch.run_fwd(plan, q, k, v)
    # The fake impl below promises contiguous outputs (Inductor indexes by the fake's strides);
    # these are no-ops for the layout run_fwd writes.
    return out.contiguous(), lse.contiguous()


@torch.library.custom_op("ffpa_cute::attention_fwd", mutates_args=())
def attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  causal_offset: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel forward on [B, H, N, D] tensors: (out [B,Hq,Nq,Dv] q.dtype, lse [B,Hq,Nq] fp32)."""
    return kernel_forward(q, k, v, causal, causal_offset, scale)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, causal_offset, scale):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, causal_offset, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.attn_args = (causal, causal_offset, scale)
    # the forward's options: the backward may run on autograd's device thread, which does not
    # see the forward's `options.use(...)` (a compiled graph's backward op plans where it runs)
    ctx.options = None if torch.compiler.is_compiling() else _options.current()
    ctx.set_materialize_grads(False)  # None for an output the loss does not read


def bwd_plan(q, k, v, causal: bool, causal_offset: int, scale: float, opts=None):
    """The backward kernels' plan when they serve the problem, else None. Symbolic shapes
    (dynamic torch.compile graphs) take the SDPA recompute."""
    if not all(type(n) is int for t in (q, k, v) for n in t.shape):
        return None
    problem = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=causal_offset,
                                       scale=scale)
    plan = dispatch.plan_bwd(problem, q.device, opts=opts)
    if plan.reason is not None or selfcheck.bwd_reason(plan, q.device, opts) is not None:
        return None  # (a failed first-use canary is logged once by selfcheck)
    return plan


def _kernel_backward(plan, q, k, v, out, lse, dout, dlse=None, **shared):
    """launch.run_bwd on q's device (shared: its dq_acc / delta, for calls over key slices).
    dout is copied where autograd hands over a broadcast (a stride 0: a loss such as
    out.sum()); other layouts reach run_bwd as they are (a row slice is read in place)."""
    if any(s == 0 for s, n in zip(dout.stride(), dout.shape) if n > 1):
        dout = dout.contiguous()
    with on(q.device):
        return launch.run_bwd(plan, q, k, v, out, lse, dout, dlse=dlse, **shared)


@torch.library.custom_op("ffpa_cute::attention_bwd", mutates_args=())
def attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dout: torch.Tensor, dlse: Optional[torch.Tensor],
                  causal: bool, causal_offset: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `attention_fwd` from the backward kernels, contiguous (dlse: lse's
    gradient, or None): what torch.compile graphs call for problems the kernels serve (an
    opaque node, never traced)."""
    plan = bwd_plan(q, k, v, causal, causal_offset, scale)
    if plan is None:  # the graph was built when the kernels served it
        raise RuntimeError("ffpa_cute::attention_bwd called for a problem the backward kernels "
                           "do not serve")
    return tuple(g.contiguous() for g in _kernel_backward(plan, q, k, v, out, lse, dout, dlse))


@attention_bwd.register_fake
def _attention_bwd_fake(q, k, v, out, lse, dout, dlse, causal, causal_offset, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _plus(a, b):
    """a + b where either may be None (no gradient)."""
    return b if a is None else a if b is None else a + b


def _backward(ctx, dout, dlse, eager=False):
    """dq, dk, dv (None where not needed): the backward kernels where they serve the problem
    (eager: called directly; torch.compile: through `ffpa_cute::attention_bwd`), else the SDPA
    recompute (traced into the graph when compiling) plus, when the loss reads lse, its term
    in torch math (`math_lse_grads`)."""
    q, k, v, out, lse = ctx.saved_tensors
    needs = tuple(ctx.needs_input_grad[:3])
    if dout is None and dlse is None:
        return (None,) * 6
    plan = bwd_plan(q, k, v, *ctx.attn_args, opts=ctx.options)
    if plan is None:
        grads = (None,) * 3
        if dout is not None:
            grads = sdpa_recompute_backward(q, k, v, dout, *ctx.attn_args, needs=needs)
        if dlse is not None:
            causal, offset, scale = ctx.attn_args
            dq, dk = math_lse_grads(q, k, lse, dlse, hi=offset if causal else None,
                                    scale=scale)
            grads = (_plus(grads[0], dq.to(q.dtype)) if needs[0] else None,
                     _plus(grads[1], dk.to(k.dtype)) if needs[1] else None, grads[2])
    else:
        dout = torch.zeros_like(out) if dout is None else dout
        grads = (_kernel_backward(plan, q, k, v, out, lse, dout, dlse) if eager else
                 attention_bwd(q, k, v, out, lse, dout, dlse, *ctx.attn_args))
        grads = tuple(g if n else None for g, n in zip(grads, needs))
    return (*grads, None, None, None)


torch.library.register_autograd("ffpa_cute::attention_fwd", _backward,
                                setup_context=_setup_context)


class EagerAttention(torch.autograd.Function):
    """Eager path: the op's forward and backward without the custom-op dispatcher.
    torch.compile still sees the custom op (`interface` picks it while compiling), so graphs
    keep an opaque node with a fake implementation."""

    @staticmethod
    def forward(ctx, q, k, v, causal, causal_offset, scale, plan, fwd_call=None):
        out, lse = kernel_forward(q, k, v, causal, causal_offset, scale, plan, fwd_call)
        _setup_context(ctx, (q, k, v, causal, causal_offset, scale), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_backward(ctx, dout, dlse, eager=True), None, None)


# ------------------------------------------------------------- sliding window and sinks
def feature_problem(q, k, v, sinks, causal: bool, causal_offset: int, window_lo, window_hi,
                    scale: float) -> AttnProblem:
    """The problem of a window / sinks call from the custom ops' scalar arguments."""
    bounds = None if window_lo is None and window_hi is None else (window_lo, window_hi)
    return AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=causal_offset,
                                    scale=scale, bounds=bounds, has_sinks=sinks is not None)


def feature_forward(q, k, v, sinks, problem: AttnProblem, plan=None):
    """(out, lse) of the forward kernel with the window's edges and the sinks (lse includes
    them); `plan`: the problem's forward plan when the caller has it."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    plan = plan if plan is not None else dispatch.plan_fwd(problem, q.device)
    if plan.reason is not None:  # the caller routed here, so the planner changed its mind
        raise RuntimeError(f"ffpa_cute::feature_attention_fwd called for an unsupported "
                           f"problem: {plan.reason}")
    with on(q.device):
        return launch.run_fwd(plan, q, k, v, sinks)


def feature_backward(q, k, v, sinks, out, lse, dout, problem: AttnProblem, opts=None,
                     need_dsinks: bool = True, dlse=None):
    """(dq, dk, dv, dsinks or None): the backward kernels with the window where
    `dispatch.plan_bwd` has them (sinks reach them through the lse), else exact torch math
    (`math_attention.math_grads`). dout / dlse: the gradients of out and lse (None: zero; Note
    [The gradient of lse] in math_attention.py). The sinks' gradient is -sum_i exp(sink -
    lse_i) Delta'_i, Delta' = rowsum(dout * out) - dlse (Note [Sinks] in common/softmax.py)."""
    p = problem
    dout = torch.zeros_like(out) if dout is None else dout
    plan = dispatch.plan_bwd(p, q.device, opts=opts)
    if plan.reason is None and selfcheck.bwd_reason(plan, q.device, opts) is None:
        with on(q.device):
            dq, dk, dv, delta = launch.run_bwd(plan, q, k, v, out, lse, dout.contiguous(),
                                               with_delta=True, dlse=dlse)
    else:
        grads = math_grads(q, k, v, out, lse, dout, lo=p.window_lo,
                           hi=p.right_edge if p.right_bounded else None, scale=p.softmax_scale,
                           dlse=dlse)
        dq, dk, dv = (g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
        delta = lse_delta((dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1), dlse, lse.shape,
                          lse.dtype, lse.device)
    dsinks = None
    if sinks is not None and need_dsinks:
        p_sink = torch.exp(sinks.to(lse.dtype)[:, None] - lse)   # [B, Hq, Nq]
        dsinks = -(p_sink * delta).sum((0, 2)).to(sinks.dtype)
    return dq, dk, dv, dsinks


@torch.library.custom_op("ffpa_cute::feature_attention_fwd", mutates_args=())
def feature_attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          sinks: Optional[torch.Tensor], causal: bool, causal_offset: int,
                          window_lo: Optional[int], window_hi: Optional[int],
                          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel forward with a window (query i sees key j iff i + window_lo <= j <= i +
    window_hi, None: unbounded, intersected with causal) and / or sinks [Hq]: (out, lse),
    contiguous. What torch.compile graphs call (an opaque node with a fake implementation)."""
    problem = feature_problem(q, k, v, sinks, causal, causal_offset, window_lo, window_hi, scale)
    out, lse = feature_forward(q, k, v, sinks, problem)
    return out.contiguous(), lse.contiguous()


@feature_attention_fwd.register_fake
def _feature_attention_fwd_fake(q, k, v, sinks, causal, causal_offset, window_lo, window_hi,
                                scale):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("ffpa_cute::feature_attention_bwd", mutates_args=())
def feature_attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          sinks: Optional[torch.Tensor], out: torch.Tensor, lse: torch.Tensor,
                          dout: Optional[torch.Tensor], dlse: Optional[torch.Tensor],
                          causal: bool, causal_offset: int,
                          window_lo: Optional[int], window_hi: Optional[int], scale: float
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dsinks) of `feature_attention_fwd`, contiguous (dsinks [Hq], or an empty
    tensor without sinks: an op returns tensors only); dout / dlse None: zero."""
    problem = feature_problem(q, k, v, sinks, causal, causal_offset, window_lo, window_hi, scale)
    dq, dk, dv, ds = feature_backward(q, k, v, sinks, out, lse, dout, problem, dlse=dlse)
    return (dq.contiguous(), dk.contiguous(), dv.contiguous(),
            ds if ds is not None else q.new_empty(0))


@feature_attention_bwd.register_fake
def _feature_attention_bwd_fake(q, k, v, sinks, out, lse, dout, dlse, causal, causal_offset,
                                window_lo, window_hi, scale):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0))


def _feature_setup_context(ctx, inputs, output):
    q, k, v, sinks, *scalars = inputs
    ctx.save_for_backward(q, k, v, sinks, *output)
    ctx.feature_args = tuple(scalars)
    ctx.set_materialize_grads(False)  # None for an output the loss does not read


def _feature_op_backward(ctx, dout, dlse):
    if dout is None and dlse is None:
        return (None,) * 9
    q, k, v, sinks, out, lse = ctx.saved_tensors
    dq, dk, dv, ds = feature_attention_bwd(q, k, v, sinks, out, lse, dout, dlse,
                                           *ctx.feature_args)
    needs = ctx.needs_input_grad
    return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
            ds if sinks is not None and needs[3] else None, None, None, None, None, None)


torch.library.register_autograd("ffpa_cute::feature_attention_fwd", _feature_op_backward,
                                setup_context=_feature_setup_context)


class FeatureAttention(torch.autograd.Function):
    """The eager kernel path of a sliding window and / or sinks (`problem` has them; `plan` is
    its forward plan): `feature_forward`, then `feature_backward` (the custom-op pair above
    runs the same bodies in torch.compile graphs)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, problem: AttnProblem, plan):
        out, lse = feature_forward(q, k, v, sinks, problem, plan)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.problem, ctx.options = problem, _options.current()
        ctx.set_materialize_grads(False)  # None for an output the loss does not read
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return (None,) * 6
        q, k, v, sinks, out, lse = ctx.saved_tensors
        needs = ctx.needs_input_grad
        dq, dk, dv, dsinks = feature_backward(q, k, v, sinks, out, lse, dout, ctx.problem,
                                              ctx.options, needs[3], dlse)
        return (dq if needs[0] else None, dk if needs[1] else None, dv if needs[2] else None,
                dsinks, None, None)


__all__ = ["EagerAttention", "FeatureAttention", "attention_bwd", "attention_fwd", "bwd_plan",
           "feature_attention_bwd", "feature_attention_fwd", "feature_backward",
           "feature_forward", "feature_problem", "kernel_forward"]
