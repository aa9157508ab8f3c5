"""Public API: `attention` (SDPA's signature), `explain`, and the SDPA patch.

Every call is routed one of two ways, decided from shapes/dtypes only (never tensor data):
  1. kernel: `dispatch.plan_fwd(problem).reason is None` -> the custom op `ffpa_cute::attention_fwd`
     (opaque to torch.compile, with a fake impl and an autograd formula);
  2. fallback: torch's *native* SDPA, `torch._C._nn.scaled_dot_product_attention`. We never call
     `F.scaled_dot_product_attention`, which may be our own patch (recursion) or someone else's.
     The reason is logged once per distinct reason; strict mode raises NotImplementedError instead.

Causal alignment: `attention(is_causal=True)` is bottom-right (FlashAttention's convention, the same
as SDPA when Nq == Nkv); the SDPA patch keeps SDPA's upper-left meaning. Both accept torch's
`causal_lower_right` / `causal_upper_left` bias objects. Rows that see no key output 0.
"""

import contextlib
import importlib
import logging
import numbers
import operator
import os

import torch
import torch.nn.functional as F

from .fallback import causal_split as _causal_split
from .fallback import gqa_in_native as _gqa_in_native
from .fallback import native_attention as _native_attention
from .fallback import native_sdpa as _native_sdpa
from .fallback import sdpa_recompute_backward as _sdpa_recompute_backward
from .problem import AttnProblem

__all__ = ["attention", "explain", "patch_sdpa", "unpatch_sdpa"]

log = logging.getLogger("ffpa_cute")


_PLANS: dict = {}  # (problem, device, FFPA_CUTE_ARCH) -> plan; planning depends on no tensor data
_FAST = "fast call"  # _PLANS keys (_FAST, call signature) -> the kernel call (`_fast_key`)
_PLANS_MAX = 4096  # entries kept before `_PLANS` starts over (decode grows Nkv every step)
_LOGGED: set = set()  # (level, reason) pairs already logged
_EMPTY = "empty problem (zero-sized batch/heads/queries or no keys): no kernel needed"
_TRUE = ("1", "true", "yes", "on")


def _dispatch():
    # Lazy so `import ffpa_cute` never pulls in cutlass (dispatch imports kernel families).
    return importlib.import_module("ffpa_cute.dispatch")


def _on(device: torch.device):
    """Make `device` current (dispatch reads the current device's arch; launches use its stream)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _clear_caches() -> None:
    """Forget cached plans and logged reasons (tests swap dispatch and check logging)."""
    _PLANS.clear()
    _LOGGED.clear()


# ------------------------------------------------------------------------------------ checks


def _causal_bias(mask):
    """The mask if it is a torch CausalBias, else None.

    Imported only when a mask is given: torch.nn.attention.bias pulls in torch._dynamo (~1 s),
    which `import ffpa_cute` must not pay.
    """
    if mask is None:
        return None
    from torch.nn.attention.bias import CausalBias

    return mask if isinstance(mask, CausalBias) else None


def _check_args(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """Return the first argument error (TypeError/ValueError) or None; never raises.

    Returning instead of raising lets the SDPA patch hand invalid calls to native SDPA unchanged,
    so users see torch's own behaviour there, while `attention` raises our clearer message.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            return TypeError(f"{name} must have a floating dtype (bf16/fp16/fp32/fp64), "
                             f"got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        return TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        return ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.dim() < 3 or not (q.dim() == k.dim() == v.dim()):
        return ValueError("q, k, v must have the same rank >= 3 ([..., H, N, D]), got shapes "
                          f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:-3] != k.shape[:-3] or q.shape[:-3] != v.shape[:-3]:
        return ValueError(f"batch dims (all but the last 3) must match: q {tuple(q.shape[:-3])}, "
                          f"k {tuple(k.shape[:-3])}, v {tuple(v.shape[:-3])}")
    if q.shape[-1] != k.shape[-1]:
        return ValueError(f"q and k head dims (last dim) must match, got {q.shape[-1]} and "
                          f"{k.shape[-1]}")
    if k.shape[-2] != v.shape[-2] or k.shape[-3] != v.shape[-3]:
        return ValueError(f"k and v must agree on heads and length (dims -3, -2), got "
                          f"{tuple(k.shape)} and {tuple(v.shape)}")
    hq, hkv = q.shape[-3], k.shape[-3]
    if not isinstance(enable_gqa, bool):
        return TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if hq != hkv:
        if not enable_gqa:
            return ValueError(f"q has {hq} heads but k/v have {hkv}: pass enable_gqa=True for "
                              "grouped-query attention (as SDPA requires)")
        if hkv == 0 or hq % hkv:
            return ValueError(f"enable_gqa=True needs q heads ({hq}) divisible by k/v heads "
                              f"({hkv})")
    if not isinstance(is_causal, bool):
        return TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        return TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        return ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        return TypeError(f"scale must be None or a float, got {type(scale).__name__}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            return TypeError("attn_mask must be None, a bool/float tensor, or a CausalBias "
                             f"(torch.nn.attention.bias), got {type(attn_mask).__name__}")
        if is_causal:
            return ValueError("is_causal=True cannot be combined with attn_mask (as in SDPA); "
                              "pass causal_lower_right/causal_upper_left as attn_mask instead")
        if _causal_bias(attn_mask) is not None:
            if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (q.shape[-2], k.shape[-2]):
                return ValueError(f"attn_mask CausalBias is for (Nq, Nkv) = "
                                  f"({attn_mask.seq_len_q}, {attn_mask.seq_len_kv}) but the inputs "
                                  f"have ({q.shape[-2]}, {k.shape[-2]})")
        elif attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            return TypeError(f"attn_mask must be a bool or floating tensor, got {attn_mask.dtype}")
    return None


def _resolve_mask(attn_mask, is_causal, nq, nkv, upper_left):
    """Map (attn_mask, is_causal) to (causal, causal_offset, tensor_mask).

    Only a CausalBias becomes kernel-servable causal masking; any other tensor stays a mask.
    `upper_left` selects SDPA's meaning of `is_causal` (the patch) over ours (bottom-right).
    """
    if _causal_bias(attn_mask) is not None:
        from torch.nn.attention.bias import CausalVariant

        right = attn_mask.variant == CausalVariant.LOWER_RIGHT
        return True, (nkv - nq if right else 0), None
    if is_causal:
        return True, (0 if upper_left else nkv - nq), None
    return False, 0, attn_mask


# ---------------------------------------------------------------------------------- routing


def _concrete(x):
    """A Python constant for a problem field; under torch.compile this specializes the guard.

    `operator.index` / `__float__` make Dynamo burn the symbolic size or float into the graph
    (with a guard), which is what lets `_decide` run as a plain Python call at trace time.
    """
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, (float, torch.SymFloat)):
        return x.__float__()
    return operator.index(x)


def _env_strict(strict):
    if strict is not None:
        return bool(strict)
    return os.environ.get("FFPA_CUTE_STRICT", "").strip().lower() in _TRUE


def _plan(problem: AttnProblem, device: torch.device):
    """Cached `dispatch.plan_fwd`; the key holds the arch override so tests can flip it."""
    key = (problem, str(device), os.environ.get("FFPA_CUTE_ARCH"))
    plan = _PLANS.get(key)
    if plan is None:
        with _on(device):
            plan = _dispatch().plan_fwd(problem)
        _remember(key, plan)
    return plan


def _remember(key, value) -> None:
    """_PLANS[key] = value, bounded: past `_PLANS_MAX` entries the dict starts over (entries
    are cheap to rebuild; an unbounded dict would grow with every new sequence length)."""
    if len(_PLANS) >= _PLANS_MAX:
        _PLANS.clear()
    _PLANS[key] = value


def _reason(problem: AttnProblem, device: torch.device):
    """None when the kernel op serves `problem`, else why not (local checks back up dispatch)."""
    if problem.batch * problem.heads_q * problem.seqlen_q == 0 or problem.seqlen_kv == 0:
        return _EMPTY
    reason = _plan(problem, device).reason
    # The op takes no mask or dropout, so never send those to it, whatever the planner says.
    if reason is None and problem.has_mask:
        return "attn_mask has no kernel yet (only causal and CausalBias masks do)"
    if reason is None and problem.dropout_p > 0.0:
        return "dropout has no kernel yet"
    return reason


def _assume_constant_result(fn):
    """`torch.compiler.assume_constant_result` without its ~1 s import of torch._dynamo.

    The public decorator only sets this flag (tests check that it still does).
    """
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _decide(device_str: str, strict: bool, level: int, *fields):
    """Route one call: returns None (kernel) or the fallback reason, logging/raising as asked.

    Runs as ordinary Python even under torch.compile (its arguments are constants), so planning,
    logging and caches never have to be traceable by Dynamo.
    """
    problem = AttnProblem(*fields)
    reason = _reason(problem, torch.device(device_str))
    if reason is None or reason == _EMPTY:
        return reason
    if strict:
        raise NotImplementedError(reason)
    if (level, reason) not in _LOGGED:
        _LOGGED.add((level, reason))
        log.log(level, "using native SDPA: %s (ffpa_cute.explain() shows the route; "
                "FFPA_CUTE_STRICT=1 raises instead)", reason)
    return reason


def _problem(q, k, v, causal, offset, scale, mask, dropout_p) -> AttnProblem:
    q4, k4, v4 = (t.reshape(-1, *t.shape[-3:]) if t.dim() != 4 else t for t in (q, k, v))
    return AttnProblem.from_tensors(q4, k4, v4, causal=causal, causal_offset=offset, scale=scale,
                                    has_mask=mask is not None, dropout_p=dropout_p)


def _route(problem: AttnProblem, device, strict, level):
    if torch.compiler.is_compiling():
        fields = [_concrete(getattr(problem, f)) for f in AttnProblem.__dataclass_fields__]
    else:  # eager: every field is already a Python scalar (dataclass fields in order)
        fields = problem.__dict__.values()
    return _decide(str(device), strict, level, *fields)


# ------------------------------------------------------------------------------- kernel op


def _kernel_forward(q, k, v, causal: bool, causal_offset: int, scale: float, plan=None):
    """Kernel forward on [B, H, N, D] tensors: (out [B,Hq,Nq,Dv] q.dtype, lse [B,Hq,Nq] fp32).

    The body of the custom op, and of the eager fast path (`_EagerAttention`), which passes the
    plan `attention()` already made.
    """
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if plan is None:
        problem = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=causal_offset,
                                           scale=scale)
        plan = _plan(problem, q.device)
    if plan.reason is not None:  # attention() routed here, so the planner changed its mind
        raise RuntimeError(f"ffpa_cute::attention_fwd called for an unsupported problem: "
                           f"{plan.reason}")
    with _on(q.device):
        out, lse = _dispatch().run_fwd(plan, q, k, v)
    # The fake impl below promises contiguous outputs (Inductor indexes by the fake's strides);
    # these are no-ops for the layout run_fwd writes.
    return out.contiguous(), lse.contiguous()


@torch.library.custom_op("ffpa_cute::attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                   causal_offset: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel forward on [B, H, N, D] tensors: (out [B,Hq,Nq,Dv] q.dtype, lse [B,Hq,Nq] fp32)."""
    return _kernel_forward(q, k, v, causal, causal_offset, scale)


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, causal, causal_offset, scale):
    return q.new_empty(*q.shape[:-1], v.shape[-1]), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, causal_offset, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.attn_args = (causal, causal_offset, scale)
    ctx.mark_non_differentiable(output[1])  # lse is an auxiliary output


def _bwd_kernel_problem(q, k, v, causal: bool, causal_offset: int, scale: float):
    """The problem when the backward kernels serve it (`dispatch.bwd_reason`), else None.
    Symbolic shapes (dynamic torch.compile graphs) take the SDPA recompute."""
    dispatch = _dispatch()
    if not dispatch.BWD_KERNEL_FAMILIES or not all(
            type(n) is int for t in (q, k, v) for n in t.shape):
        return None
    problem = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=causal_offset,
                                       scale=scale)
    return problem if dispatch.bwd_reason(problem, q.device) is None else None


def _kernel_backward(problem, q, k, v, out, lse, dout):
    with _on(q.device):
        return _dispatch().run_bwd(problem, q, k, v, out, lse, dout.contiguous())


@torch.library.custom_op("ffpa_cute::attention_bwd", mutates_args=())
def _attention_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, dout: torch.Tensor, causal: bool, causal_offset: int,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `attention_fwd` from the backward kernels, contiguous: what
    torch.compile graphs call for problems the kernels serve (an opaque node, never traced)."""
    problem = _bwd_kernel_problem(q, k, v, causal, causal_offset, scale)
    if problem is None:  # the graph was built when the kernels served it
        raise RuntimeError("ffpa_cute::attention_bwd called for a problem the backward kernels "
                           "do not serve")
    return tuple(g.contiguous() for g in _kernel_backward(problem, q, k, v, out, lse, dout))


@_attention_bwd.register_fake
def _attention_bwd_fake(q, k, v, out, lse, dout, causal, causal_offset, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _backward(ctx, dout, _dlse, eager=False):
    """dq, dk, dv (None where not needed): the backward kernels where they serve the problem
    (eager: called directly; torch.compile: through `ffpa_cute::attention_bwd`), else the SDPA
    recompute (traced into the graph when compiling)."""
    q, k, v, out, lse = ctx.saved_tensors
    needs = tuple(ctx.needs_input_grad[:3])
    problem = _bwd_kernel_problem(q, k, v, *ctx.attn_args)
    if problem is None:
        grads = _sdpa_recompute_backward(q, k, v, dout, *ctx.attn_args, needs=needs)
    else:
        grads = (_kernel_backward(problem, q, k, v, out, lse, dout) if eager else
                 _attention_bwd(q, k, v, out, lse, dout, *ctx.attn_args))
        grads = tuple(g if n else None for g, n in zip(grads, needs))
    return (*grads, None, None, None)


torch.library.register_autograd("ffpa_cute::attention_fwd", _backward,
                                setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Eager fast path: the op's forward and backward without the custom-op dispatcher.

    That dispatcher costs ~35 us per call on a small CPU (perf/NOTES.md, host overhead), which
    matters for decode and small shapes. torch.compile still sees the custom op (`_attention`
    picks it while compiling), so graphs keep an opaque node with a fake implementation.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, causal_offset, scale, plan):
        out, lse = _kernel_forward(q, k, v, causal, causal_offset, scale, plan)
        _setup_context(ctx, (q, k, v, causal, causal_offset, scale), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*_backward(ctx, dout, dlse, eager=True), None)


# ------------------------------------------------------------------------------- public API


def _attention(q, k, v, attn_mask, dropout_p, is_causal, scale, *, upper_left, strict, level,
               fast_key=None):
    causal, offset, mask = _resolve_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2],
                                         upper_left)
    problem = _problem(q, k, v, causal, offset, scale, mask, dropout_p)
    if _route(problem, q.device, strict, level) is not None:
        return _native_attention(q, k, v, causal=causal, offset=offset, mask=mask,
                                 dropout_p=dropout_p, scale=scale)
    shape = q.shape
    q4, k4, v4 = (t if t.dim() == 4 else t.reshape(-1, *t.shape[-3:]) for t in (q, k, v))
    args = (q4, k4, v4, causal, offset if causal else 0, problem.softmax_scale)
    if torch.compiler.is_compiling():
        out, _ = _attention_fwd(*args)
    else:
        plan = _plan(problem, q.device)
        if fast_key is not None:  # the next same-signature call skips to here
            _remember(fast_key, (*args[3:], plan, _fwd_call(plan, q4, k4, v4)))
        out, _ = _EagerAttention.apply(*args, plan)
    return out if q.dim() == 4 else out.reshape(*shape[:-1], out.shape[-1])


def _fast_key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, upper_left):
    """The signature of an eager call that can take the per-signature fast path, else None.

    Everything `_check_args`, routing and planning read is in it (types, dtypes, devices,
    shapes, strides, flags, the arch override), so a call with an equal key is checked, routed
    and planned exactly as the first one was; only data pointers differ (`run_fwd` still checks
    their alignment). 4-D tensors, no mask, no dropout; the entry lives in `_PLANS`, so
    clearing the plans clears it.
    """
    if (type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor
            or attn_mask is not None or type(dropout_p) not in (float, int) or dropout_p != 0
            or type(is_causal) is not bool
            or type(enable_gqa) is not bool or not (scale is None or type(scale) is float)
            or q.dim() != 4 or torch.compiler.is_compiling()):
        return None
    return (_FAST, q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
            k.dtype, v.dtype, q.device, k.device, v.device, is_causal, scale, enable_gqa,
            upper_left, os.environ.get("FFPA_CUTE_ARCH"))


def _fwd_call(plan, q, k, v):
    """The signature's `dispatch.FwdCall` (None for plans that are not the dispatcher's, or
    while `dispatch.FAST_LAUNCH` is off)."""
    dispatch = _dispatch()
    if not dispatch.FAST_LAUNCH or not isinstance(plan, dispatch.Plan) or plan.cfg is None:
        return None
    return dispatch.FwdCall(plan, q, k, v)


def _fast_call(q, k, v, causal, offset, softmax_scale, plan, fwd_call):
    """A call whose signature already ran the kernel: straight to it (the autograd Function
    only when a gradient will be asked for; without one, `fwd_call` launches directly when it
    can)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerAttention.apply(q, k, v, causal, offset, softmax_scale, plan)[0]
    if fwd_call is not None:
        res = fwd_call(q, k, v)
        if res is not None:
            return res[0]
    return _kernel_forward(q, k, v, causal, offset, softmax_scale, plan)[0]


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, strict=None):
    """Exact attention with SDPA's signature on [..., H, N, D] tensors; returns [..., Hq, Nq, Dv].

    Differences from `F.scaled_dot_product_attention`, all deliberate:
      * `is_causal=True` is bottom-right aligned (query i sees key j iff j <= i + Nkv - Nq), as
        FlashAttention; identical to SDPA when Nq == Nkv. Pass
        `torch.nn.attention.bias.causal_upper_left(Nq, Nkv)` as `attn_mask` for SDPA's alignment.
      * Rows that see no key output 0 (SDPA may give NaN).
    Calls no kernel covers (small head dims, masks, dropout, CPU, ...) run torch's native SDPA
    and log the reason once; `strict=True` or env `FFPA_CUTE_STRICT=1` raises
    NotImplementedError(reason) instead. `explain(...)` tells which path a call takes.
    """
    key = _fast_key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, False)
    if key is not None:
        hit = _PLANS.get(key)
        if hit is not None:
            return _fast_call(q, k, v, *hit)
    err = _check_args(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if err is not None:
        raise err
    return _attention(q, k, v, attn_mask, dropout_p, is_causal, scale, upper_left=False,
                      strict=_env_strict(strict), level=logging.WARNING, fast_key=key)


def _fallback_details(q, v, problem: AttnProblem, mask) -> str:
    """What `_native_attention` will do, for explain(); mirrors its decisions."""
    p = problem
    skip, _, explicit = _causal_split(p.seqlen_q, p.seqlen_kv, p.causal, p.causal_offset)
    notes = [f"first {skip} rows see no key -> 0"] if skip else []
    if explicit:
        notes.append(f"causal offset {p.causal_offset} as an explicit bool mask")
    if p.heads_q != p.heads_kv:
        native = _gqa_in_native(q, v, True if explicit else mask)
        notes.append("GQA natively (flash)" if native else
                     f"GQA by expanding K/V heads {p.qhead_per_kvhead}x")
    return "; ".join(notes)


def explain(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False) -> str:
    """One line saying which path `attention(...)` with these arguments takes, and why; on the
    kernel path also which backward serves it (kernels, or the SDPA recompute and why).

    Runs nothing and logs nothing; validates like `attention` (same errors).
    """
    err = _check_args(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if err is not None:
        raise err
    causal, offset, mask = _resolve_mask(attn_mask, is_causal, q.shape[-2], k.shape[-2], False)
    problem = _problem(q, k, v, causal, offset, scale, mask, dropout_p)
    reason = _reason(problem, q.device)
    if reason is None:
        return (f"ffpa_cute kernel: {_plan(problem, q.device).describe()}; backward: "
                f"{_backward_route(problem, q.device)}")
    details = _fallback_details(q, v, problem, mask)
    return f"native SDPA fallback: {reason}" + (f" [{details}]" if details else "")


def _backward_route(problem: AttnProblem, device) -> str:
    """What the backward of a kernel-served forward runs (the autograd path's own decision)."""
    dispatch = _dispatch()
    with _on(device):
        why = dispatch.bwd_reason(problem, device)
        if why is None:
            family = dispatch.bwd_family(problem, device)[0]
            return f"{family + ' ' if family else ''}backward kernels (dQ, dK, dV)"
    return f"SDPA recompute ({why})"


# ------------------------------------------------------------------------------- SDPA patch

_ORIGINAL_SDPA = None


def _patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                  scale=None, enable_gqa=False):
    """`F.scaled_dot_product_attention` with SDPA's exact semantics (upper-left `is_causal`).

    Covered calls run our kernel; everything else, including calls SDPA itself would reject,
    goes to native SDPA with the caller's arguments untouched apart from GQA expansion. Never
    strict: routing uncovered calls is the point of the patch. Fallback reasons log at INFO.
    """
    fast = _fast_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, True)
    if fast is not None:
        hit = _PLANS.get(fast)
        if hit is not None:
            return _fast_call(query, key, value, *hit)
    if _check_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return _native_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, upper_left=True,
                      strict=False, level=logging.INFO, fast_key=fast)


def patch_sdpa() -> None:
    """Route `torch.nn.functional.scaled_dot_product_attention` through ffpa_cute (idempotent).

    Only code that looks the symbol up at call time (`F.scaled_dot_product_attention(...)`) is
    affected; a name imported earlier with `from torch.nn.functional import ...` is not.
    """
    global _ORIGINAL_SDPA
    if F.scaled_dot_product_attention is _patched_sdpa:
        return
    _ORIGINAL_SDPA = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _patched_sdpa


def unpatch_sdpa() -> None:
    """Restore the exact object `patch_sdpa` replaced; a no-op if we are not installed.

    If someone patched over us since, leave their wrapper alone rather than clobber it.
    """
    global _ORIGINAL_SDPA
    if F.scaled_dot_product_attention is _patched_sdpa and _ORIGINAL_SDPA is not None:
        F.scaled_dot_product_attention = _ORIGINAL_SDPA
        _ORIGINAL_SDPA = None
