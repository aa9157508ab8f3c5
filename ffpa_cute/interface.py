"""Public API: `attention` (SDPA's signature), `explain`, and the SDPA patch (sdpa_patch.py).

Every call is routed one of two ways, decided from shapes/dtypes and `options.current()` only
(never tensor data, but for a dense mask's values: `dense_mask`, below):
  1. kernel: `dispatch.plan_fwd(problem).reason is None` -> the kernel forward (eagerly
     `ops.EagerAttention`; under torch.compile the custom op `ffpa_cute::attention_fwd`, opaque
     with a fake impl), whose backward runs the backward kernels or the SDPA recompute;
  2. fallback: torch's *native* SDPA, `torch._C._nn.scaled_dot_product_attention`. We never call
     `F.scaled_dot_product_attention`, which may be our own patch (recursion) or someone else's.
     The reason is logged once per distinct reason; strict mode raises NotImplementedError instead.
     A sliding window or sinks run the 16-bit kernels (`ops.FeatureAttention`; under
     torch.compile the custom op `ffpa_cute::feature_attention_fwd`), else exact torch math
     (`math_attention`). A dense mask that only drops keys (a key-padding mask) or keeps one
     interval of keys in every row (causal or a sliding window as a tensor, image blocks) runs
     as kernel calls on the keys it keeps (`dense_mask`; eager calls).

A repeated eager call with the same signature (shapes, strides, dtypes, devices, flags, options)
skips the checks and the routing: its first call left the decision in `_FAST_CALLS`.

Causal alignment: `attention(is_causal=True)` is bottom-right (FlashAttention's convention, the same
as SDPA when Nq == Nkv); the SDPA patch keeps SDPA's upper-left meaning. Both accept torch's
`causal_lower_right` / `causal_upper_left` bias objects. Rows that see no key output 0.

`return_lse=True` also returns the log-sum-exp of each row's scaled, masked scores (float32;
-inf for rows that see no key), which `merge.merge_attention` combines across key splits: the
kernels compute it anyway; the fallback adds it with torch math (`fallback.native_lse`).
"""

import dataclasses
import logging
import math

import torch

from . import dense_mask, dispatch, fp8, launch, nested, nvfp4, ops, selfcheck
from . import options as _options
from .fallback import fallback_details, native_attention, native_attention_lse
from .math_attention import math_attention
from .problem import AttnProblem, kv_shared
from .problem import concrete as _concrete
from .validate import check_args, check_return_lse, check_window_sinks, resolve_mask, window_bounds

__all__ = ["attention", "explain"]

log = logging.getLogger("ffpa_cute")

_FAST_CALLS: dict = {}  # call signature (`_fast_key`) -> the decided kernel call
_FAST_CALLS_MAX = 4096  # entries kept before the dict starts over (decode grows Nkv every step)
_LOGGED: set = set()  # (level, reason) pairs already logged
_EMPTY = "empty problem (zero-sized batch/heads/queries or no keys): no kernel needed"


def _clear_caches() -> None:
    """Forget remembered calls, plans and logged reasons (tests swap planners, check logging)."""
    _FAST_CALLS.clear()
    _LOGGED.clear()
    dispatch.clear_plans()
    selfcheck.clear()
    dense_mask.clear()


# ---------------------------------------------------------------------------------- routing


def _reason(problem: AttnProblem, device: torch.device, check: bool = True):
    """None when the kernel path serves `problem`, else why not (`dispatch.feature_reason`
    backs up the planners: no mask, dropout, window or sinks reaches the op). `check`: run the
    first-use self-check of a configuration never run on this target (selfcheck.py)."""
    if problem.batch * problem.heads_q * problem.seqlen_q == 0 or problem.seqlen_kv == 0:
        return _EMPTY
    plan = dispatch.plan_fwd(problem, device)
    reason = plan.reason or dispatch.feature_reason(problem)
    return selfcheck.reason(plan, device) if reason is None and check else reason


def _assume_constant_result(fn):
    """`torch.compiler.assume_constant_result` without its ~1 s import of torch._dynamo.

    The public decorator only sets this flag (tests check that it still does).
    """
    fn._dynamo_marked_constant = True
    return fn


@_assume_constant_result
def _decide(device_str: str, strict, level: int, *fields):
    """Route one call: returns None (kernel) or the fallback reason, logging/raising as asked
    (`strict` None: `Options.strict`).

    Runs as ordinary Python even under torch.compile (its arguments are constants), so planning,
    the options, logging and caches never have to be traceable by Dynamo.
    """
    problem = AttnProblem(*fields)
    reason = _reason(problem, torch.device(device_str))
    if reason is None or reason == _EMPTY:
        return reason
    if _options.current().strict if strict is None else strict:
        raise NotImplementedError(reason)
    if (level, reason) not in _LOGGED:
        _LOGGED.add((level, reason))
        log.log(level, "using the native torch fallback: %s (ffpa_cute.explain() shows the "
                "route; FFPA_CUTE_STRICT=1 raises instead)", reason)
    return reason


def _as4d(t):
    """[..., H, N, D] as [B', H, N, D] (B' the product of the leading dims, 0 allowed)."""
    return t if t.dim() == 4 else t.reshape(math.prod(t.shape[:-3]), *t.shape[-3:])


def _problem(q, k, v, attn_mask, dropout_p, is_causal, scale, upper_left, window=None,
             sinks=None):
    """(causal, offset, mask, window bounds, problem) of a validated call; the window's frame
    is causal's, else bottom-right (upper-left for the SDPA patch)."""
    nq, nkv = q.shape[-2], k.shape[-2]
    causal, offset, mask = resolve_mask(attn_mask, is_causal, nq, nkv, upper_left)
    bounds = window_bounds(window, offset if causal else 0 if upper_left else nkv - nq)
    problem = AttnProblem.from_tensors(
        _as4d(q), _as4d(k), _as4d(v), causal=causal, causal_offset=offset, scale=scale,
        has_mask=mask is not None, dropout_p=dropout_p, bounds=bounds,
        has_sinks=sinks is not None)
    return causal, offset, mask, bounds, problem


def _route(problem: AttnProblem, device, strict, level):
    if torch.compiler.is_compiling():
        fields = [_concrete(getattr(problem, f)) for f in AttnProblem.__dataclass_fields__]
    else:  # eager: every field is already a Python scalar (dataclass fields in order)
        fields = problem.__dict__.values()
    return _decide(str(device), strict, level, *fields)


# ----------------------------------------------------------------------- the fast path


def _fast_key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, upper_left,
              return_lse=False):
    """The signature of an eager call that can take the per-signature fast path, else None.

    Everything `check_args`, routing and planning read is in it (types, dtypes, devices,
    shapes, strides, flags, whether v is k's prefix, the options in force), so a call with an
    equal key is checked, routed and planned exactly as the first one was; only data pointers
    differ (`run_fwd` still checks their alignment). 4-D tensors, no mask, no dropout. With
    `return_lse` in the key, calls returning (out, lse) and calls returning out never mix.
    """
    if (type(q) is not torch.Tensor or type(k) is not torch.Tensor or type(v) is not torch.Tensor
            or attn_mask is not None or type(dropout_p) not in (float, int) or dropout_p != 0
            or type(is_causal) is not bool or type(return_lse) is not bool
            or type(enable_gqa) is not bool or not (scale is None or type(scale) is float)
            or q.dim() != 4 or torch.compiler.is_compiling()):
        return None
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype,
            k.dtype, v.dtype, q.device, k.device, v.device, is_causal, scale, enable_gqa,
            upper_left, kv_shared(k, v), return_lse, _options.current())


def _remember(key, value) -> None:
    """_FAST_CALLS[key] = value, bounded: past `_FAST_CALLS_MAX` entries the dict starts over
    (entries are cheap to rebuild; an unbounded dict would grow with every sequence length)."""
    if len(_FAST_CALLS) >= _FAST_CALLS_MAX:
        _FAST_CALLS.clear()
    _FAST_CALLS[key] = value


def _fast_call(q, k, v, causal, offset, softmax_scale, plan, fwd_call):
    """A call whose signature already ran the kernel: straight to it (through the autograd
    Function only when a gradient will be asked for); `fwd_call` launches when it can.
    Returns (out, lse)."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return ops.EagerAttention.apply(q, k, v, causal, offset, softmax_scale, plan, fwd_call)
    return ops.kernel_forward(q, k, v, causal, offset, softmax_scale, plan, fwd_call)


# ------------------------------------------------------------------------------- public API


def _attention(q, k, v, attn_mask, dropout_p, is_causal, scale, *, upper_left, strict, level,
               fast_key=None, return_lse=False, window=None, sinks=None):
    """out, or (out, lse) with `return_lse`, of a validated call."""
    causal, offset, mask, bounds, problem = _problem(q, k, v, attn_mask, dropout_p, is_causal,
                                                     scale, upper_left, window, sinks)
    features = bounds is not None or sinks is not None
    kept = _kept_keys(q, k, mask, dropout_p, features, problem)
    if kept is not None:  # the kernels on the keys the mask keeps (dense_mask.py)
        return dense_mask.run(kept, q, k, v, lambda *t, causal=False, window=None: _attention(
            *t, None, 0.0, causal, scale, upper_left=False, strict=strict, level=level,
            return_lse=return_lse, window=window), scale=scale, strict=strict,
            return_lse=return_lse)
    if _route(problem, q.device, strict, level) is not None:
        if features:
            out, lse = math_attention(q, k, v, causal=causal, offset=offset, bounds=bounds,
                                      sinks=sinks, mask=mask, scale=scale)
            return (out, lse) if return_lse else out
        if return_lse:
            return native_attention_lse(q, k, v, causal=causal, offset=offset, mask=mask,
                                        scale=scale)
        return native_attention(q, k, v, causal=causal, offset=offset, mask=mask,
                                dropout_p=dropout_p, scale=scale)
    shape = q.shape
    args = (_as4d(q), _as4d(k), _as4d(v), causal, offset if causal else 0, problem.softmax_scale)
    if features and torch.compiler.is_compiling():  # an opaque op in the graph
        out, lse = ops.feature_attention_fwd(*args[:3], sinks, *args[3:5], problem.window_lo,
                                             problem.window_hi, args[5])
    elif features:
        plan = dispatch.plan_fwd(problem, q.device)
        out, lse = ops.FeatureAttention.apply(*args[:3], sinks, problem, plan)
    elif torch.compiler.is_compiling():
        out, lse = ops.attention_fwd(*args)
    else:
        plan = dispatch.plan_fwd(problem, q.device)
        if fast_key is not None:  # the next same-signature call skips to here
            fwd_call = None
            if _options.current().fast_launch and plan.cfg is not None:
                fwd_call = launch.FwdCall(plan, *args[:3])
            _remember(fast_key, (*args[3:], plan, fwd_call))
        out, lse = ops.EagerAttention.apply(*args, plan)
    if q.dim() != 4:
        out, lse = out.reshape(*shape[:-1], out.shape[-1]), lse.reshape(shape[:-1])
    return (out, lse) if return_lse else out


def _kept_keys(q, k, mask, dropout_p, features, problem):
    """What a dense mask keeps where the kernels serve the unmasked call (dense_mask.py)."""
    if (mask is None or dropout_p != 0 or features or q.dim() != 4 or mask.device != q.device
            or torch.compiler.is_compiling() or _reason(dataclasses.replace(
                problem, has_mask=False), q.device, check=False) is not None):
        return None
    return dense_mask.kept_keys(mask, *q.shape[:3], k.shape[-2])


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, *, strict=None, return_lse=False, window=None, sinks=None,
              q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """Exact attention with SDPA's signature on [..., H, N, D] tensors; returns [..., Hq, Nq, Dv],
    or with `return_lse=True` (out, lse).

    Differences from `F.scaled_dot_product_attention`, all deliberate:
      * `is_causal=True` is bottom-right aligned (query i sees key j iff j <= i + Nkv - Nq), as
        FlashAttention; identical to SDPA when Nq == Nkv. Pass
        `torch.nn.attention.bias.causal_upper_left(Nq, Nkv)` as `attn_mask` for SDPA's alignment.
      * Rows that see no key output 0 (SDPA may give NaN).
    A dense `attn_mask` (bool, or float zeros and values <= -65504) that is the same for every
    head and either the same for every query (a key-padding mask) or keeps one interval of
    keys in every row (a causal or sliding-window tensor, image blocks, prefix-LM) runs as
    kernel calls on the kept keys (ffpa_cute/dense_mask.py). Calls no kernel covers (small head dims, other
    masks, dropout, CPU, ...) run torch's native SDPA and log the reason once; `strict=True`
    (or `Options.strict`, env `FFPA_CUTE_STRICT=1`) raises NotImplementedError(reason)
    instead. `explain(...)` tells which path a call takes; `ffpa_cute.options` holds what else
    can be switched.

    return_lse: also return lse [..., Hq, Nq], float32 (float64 for float64 inputs on the
    fallback), the natural-log log-sum-exp of each row's scaled, masked scores; -inf for rows
    that see no key (their out is 0). `merge_attention` combines (out, lse) pairs computed over
    disjoint key sets; gradients flow through out and lse (Note [The gradient of lse] in
    math_attention.py). Not with dropout_p > 0 (ValueError).

    window=(left, right): a sliding window; each side an int >= 0 or None (unbounded). Query
    i, placed at key i + Nkv - Nq (bottom-right; a causal_upper_left mask places it at key i),
    sees key j iff i + Nkv - Nq - left <= j <= i + Nkv - Nq + right, and with causal also
    j <= i + Nkv - Nq. sinks: a float tensor [Hq] of learned logits (GPT-OSS), compared with
    the *scaled* scores: row i's softmax denominator becomes sum_j exp(s_ij) + exp(sinks[h]);
    gradients flow to sinks; lse includes the sink term (a row with no key: out 0, lse =
    sink). The 16-bit kernels (sm90, Split-D) serve both (eager calls), blocks outside the
    window skipped; FP8 too (forward); elsewhere exact torch math (logged). Not with dropout.

    q, k, v may also be torch jagged NestedTensors [B, H, j, D] (SDPA's NJT layout):
    `varlen_attention` on their values (one launch where the kernels serve it; with dropout,
    one call per sequence), out (and lse) on q's offsets (`ffpa_cute.nested`).

    FP8: q, k, v in float8_e4m3fn (or e5m2) with fp32 `q_descale` / `k_descale` / `v_descale`
    (a number, or [B, Hkv] per batch and KV head; x = x_fp8 * descale) give the attention of
    the dequantised inputs in `out_dtype` (bf16 by default); forward only (ffpa_cute/fp8.py).
    NVFP4Tensor inputs (v: V^T's): the sm_100 / sm_120 NVFP4 kernels (compile-verified only),
    else NotImplementedError; FP8 descales are refused with them (nvfp4.py).
    """
    if nvfp4.NVFP4Tensor in (type(q), type(k), type(v)):
        return nvfp4.attention_nvfp4(q, k, v, attn_mask, dropout_p, is_causal, scale,
                                     return_lse, out_dtype, enable_gqa, window, sinks,
                                     (q_descale, k_descale, v_descale))
    fp8_args = (q_descale, k_descale, v_descale, out_dtype)
    if nested.is_nested(q) or nested.is_nested(k) or nested.is_nested(v):
        return nested.per_sequence(attention, q, k, v, attn_mask, fp8_args, return_lse, dict(
            dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            strict=strict, window=window, sinks=sinks))
    key = None if window is not None or sinks is not None else _fast_key(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, False, return_lse)
    if key is not None and fp8_args == (None,) * 4 and (hit := _FAST_CALLS.get(key)):
        return _fast_call(q, k, v, *hit) if return_lse else _fast_call(q, k, v, *hit)[0]
    err = (check_args(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
           or check_return_lse(return_lse, dropout_p)
           or check_window_sinks(window, sinks, q, dropout_p))
    if err is not None:
        raise err
    if fp8.is_fp8(q) or fp8_args != (None,) * 4:
        return _attention_fp8(q, k, v, attn_mask, dropout_p, is_causal, scale, strict, return_lse,
                              *fp8_args, window, sinks)
    return _attention(q, k, v, attn_mask, dropout_p, is_causal, scale, upper_left=False,
                      strict=None if strict is None else bool(strict), level=logging.WARNING,
                      fast_key=key, return_lse=return_lse, window=window, sinks=sinks)


def _attention_fp8(q, k, v, attn_mask, dropout_p, is_causal, scale, strict, return_lse,
                   q_descale, k_descale, v_descale, out_dtype, window, sinks):
    """`attention` for FP8 inputs: the FP8 kernel, else the 16-bit route on dequantised
    inputs (fp8.attention_fp8); a window and sinks as for 16-bit inputs."""
    if not fp8.is_fp8(q):
        raise TypeError("q_descale, k_descale, v_descale and out_dtype are for FP8 inputs "
                        f"(torch.float8_e4m3fn / float8_e5m2); q is {q.dtype}")
    causal, offset, mask, bounds, _ = _problem(q, k, v, attn_mask, dropout_p, is_causal, scale,
                                               False, window, sinks)
    shape = q.shape

    def dense(qb, kb, vb):
        return _attention(qb, kb, vb, attn_mask, dropout_p, is_causal, scale, upper_left=False,
                          strict=strict, level=logging.WARNING, return_lse=True, window=window,
                          sinks=sinks)

    out, lse = fp8.attention_fp8(_as4d(q), _as4d(k), _as4d(v), causal=causal, offset=offset if causal else 0,
                                 has_mask=mask is not None, dropout_p=dropout_p, scale=scale,
                                 strict=strict, dense=dense, q_descale=q_descale,
                                 k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
                                 bounds=bounds, sinks=sinks)
    if q.dim() != 4:
        out, lse = out.reshape(*shape[:-1], out.shape[-1]), lse.reshape(shape[:-1])
    return (out, lse) if return_lse else out


def explain(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False, *, window=None, sinks=None) -> str:
    """One line saying which path `attention(...)` with these arguments takes, and why; on the
    kernel path also which backward serves it (kernels, or the SDPA recompute and why).

    Runs nothing and logs nothing; validates like `attention` (same errors).
    """
    err = (check_args(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
           or check_window_sinks(window, sinks, q, dropout_p))
    if err is not None:
        raise err
    _, _, mask, bounds, problem = _problem(q, k, v, attn_mask, dropout_p, is_causal, scale,
                                           False, window, sinks)
    kept = _kept_keys(q, k, mask, dropout_p, bounds is not None or sinks is not None, problem)
    if kept is not None:  # the route of the unmasked call on the most keys kept
        c = kept.most_keys
        return dense_mask.describe(kept) + explain(q, k[..., :c, :], v[..., :c, :], scale=scale,
                                                 enable_gqa=enable_gqa)
    reason = _reason(problem, q.device, check=False)
    if reason is None:
        plan = dispatch.plan_fwd(problem, q.device)
        check = selfcheck.status(plan, q.device)
        return (f"ffpa_cute kernel: {launch.describe_fwd(plan)}{check}; "
                f"backward: {_backward_route(problem, q.device)}")
    if bounds is not None or sinks is not None:
        return f"torch-math fallback (window / sinks, forward and backward): {reason}"
    details = fallback_details(q, v, problem, mask)
    return f"native SDPA fallback: {reason}" + (f" [{details}]" if details else "")


def _backward_route(problem: AttnProblem, device) -> str:
    """What the backward of a kernel-served forward runs (the autograd path's own decision)."""
    plan = dispatch.plan_bwd(problem, device)
    if plan.reason is None:
        fam, names = dispatch.FAMILIES.get(plan.family), [c.__name__ for c, _ in plan.jobs[1:]]
        what = f" [{', '.join(names)}: {selfcheck.verified_text(plan)}]" if fam and names else ""
        return f"{plan.family} backward kernels (dQ, dK, dV){what}{selfcheck.status(plan, device)}"
    math = problem.has_window or problem.has_sinks
    return f"{'torch math' if math else 'SDPA recompute'} ({plan.reason})"
