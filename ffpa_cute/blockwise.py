"""Attention of one (query block, key block) pair with an arbitrary causal offset, forward and
backward: the unit of work of ring attention and other split-KV schemes.

`block_forward` routes like `attention()` (the same `interface._route`: kernel where dispatch
plans one, else the fallback, logged once per reason or raised under strict mode) and always
returns (out, lse). `block_backward` computes one block's share of the gradients given the
rows' *global* out and lse (over every key block), as the FlashAttention ring backward needs:
the backward kernels where `dispatch.plan_bwd` serves the block (`launch.run_bwd` takes exactly
q, k, v, out, lse, dout and applies P = exp(S * scale - lse) with the lse it is given), else
`fallback.block_grads` (torch math in float32, float64 for float64 inputs). The SDPA recompute
of the ordinary backward cannot serve a block: it would renormalise over the block's keys only.

Causal offset as everywhere in the package: query i sees key j iff j <= i + offset, in the
block's own indices; a window's `bounds` = (lo, hi) likewise (i + lo <= j <= i + hi), which
runs `math_attention` (no kernel has a window yet). Tensors are [B, H, N, D].
"""

from __future__ import annotations

import logging

from . import dispatch, launch, ops
from .fallback import block_grads, native_attention_lse
from .interface import _route
from .math_attention import math_attention
from .problem import AttnProblem

__all__ = ["block_backward", "block_forward"]


def block_forward(q, k, v, *, causal: bool, offset: int, scale: float | None, strict=None,
                  bounds=None):
    """(out [B, Hq, Nq, Dv] in q.dtype, lse [B, Hq, Nq]) of q against this key block.

    lse is float32 from a kernel, `math_attention.compute_dtype(q.dtype)` from the fallback; rows
    that see no key of the block give out 0 and lse -inf. No autograd (callers that need
    gradients use `block_backward`). bounds: a sliding window's (lo, hi) in the block's
    indices, or None.
    """
    offset = int(offset) if causal else 0
    problem = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=offset,
                                       scale=scale, bounds=bounds)
    if _route(problem, q.device, strict, logging.WARNING) is None:
        plan = dispatch.plan_fwd(problem, q.device)
        return ops.kernel_forward(q, k, v, causal, offset, problem.softmax_scale, plan)
    if bounds is not None:
        return math_attention(q, k, v, causal=causal, offset=offset, bounds=bounds, sinks=None,
                              mask=None, scale=scale)
    return native_attention_lse(q, k, v, causal=causal, offset=offset, mask=None, scale=scale)


def block_backward(q, k, v, out, lse, dout, *, causal: bool, offset: int,
                   scale: float | None, dlse=None):
    """(dq, dk, dv) of this block's share of the attention, given the rows' global `out`
    ([B, Hq, Nq, Dv]) and `lse` ([B, Hq, Nq]) and the gradient `dout` of out (and `dlse` of
    lse, or None: Note [The gradient of lse] in math_attention.py).

    dk and dv are summed over each KV head's query heads. Dtypes: the inputs' from the backward
    kernels, `math_attention.compute_dtype` from the math; accumulate them in float32 or wider.
    """
    offset = int(offset) if causal else 0
    softmax_scale = AttnProblem.from_tensors(q, k, v, scale=scale).softmax_scale
    plan = ops.bwd_plan(q, k, v, causal, offset, softmax_scale)
    if plan is None or q.shape[-2] == 0 or k.shape[-2] == 0:
        return block_grads(q, k, v, out, lse, dout, causal=causal, offset=offset,
                           scale=softmax_scale, dlse=dlse)
    with ops.on(q.device):
        return launch.run_bwd(plan, q, k, v, out, lse.contiguous(), dout.contiguous(),
                              dlse=dlse)
