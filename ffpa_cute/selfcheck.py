"""First-use self-check: a kernel configuration never run on this kind of GPU proves itself on a
canary problem before it serves a call.

Kernels are verified by running them on real hardware (docs/verification.md); a family whose
kernels have never run on the device's compile target (sm100 and sm120 today; the sm80 kernels
on an actual sm_80 / 86 / 89, which ran only as sm_90a code) could return a wrong answer that
no test has seen. So, on such a target, the first call of each kernel configuration first runs a
small canary problem of the same configuration (same kernel, dtype, head dims, causal mode, GQA
packing) and compares it with a float32 reference on the same device, with the GPU tests'
criterion: rel_err <= 2 * rel_err(torch in the same dtype) + 1e-3. On a mismatch the
configuration is disabled for the process: that call and every later one fall back to SDPA (or
raise, in strict mode), and the reason is logged once. The cost is one canary per configuration
per process (a few ms after the kernel's compile); `Options.self_check="off"` skips it,
`"always"` checks every family (what the H200 tests use to prove the mechanism).

An FP8 forward configuration's canary (`fp8.canary`, passed to `reason` by the FP8 route)
quantises its random inputs per tensor and compares with the float32 reference on the
dequantised inputs within fp8.FP8_TOL; on a failure the call takes the dequantised bf16 route.

The backward's kernels (Delta, dQ, dK, dV) are canaried the same way on their first use
(`bwd_reason`): the same small problem with a random dO, against gradients written out in
float32 from the same out and lse (`reference.attention_grads`), each of dq, dk, dv within
2 * (torch in the same dtype) + 1e-3; on a mismatch that backward configuration recomputes
through SDPA for the process (logged once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from . import dispatch, launch
from . import options as _options
from .problem import DTYPE_NAMES, AttnProblem

CANARY_SEQLEN_Q, CANARY_SEQLEN_KV = 67, 200  # odd, several KV blocks, a partial last block
CANARY_WINDOW_LEFT = 40  # a window's left edge: 64-key blocks skipped, 128-key blocks masked
_FP8 = ("e4m3", "e5m2")
_RESULTS: dict = {}  # (family, cfg or cfgs, device) -> None (passed) or the failure reason
log = logging.getLogger("ffpa_cute")


def needed(plan, opts=None) -> bool:
    """Whether `plan`'s kernel (a forward Plan, or a BwdPlan's kernels) must pass the canary
    before serving a call."""
    opts = opts or _options.current()
    if plan.reason is not None or opts.self_check == "off":
        return False
    family = dispatch.FAMILIES.get(plan.family)
    if family is None:  # not a kernel family of ours (the tests' stand-ins): only when asked
        return opts.self_check == "always"
    return (opts.self_check == "always" or plan.target not in family.verified_targets
            or unverified(plan))


def unverified(plan) -> bool:
    """Whether a plan (forward or backward) runs a kernel not verified on any GPU (tests and
    sanitizers): its config says so (a `VERIFIED` False), whatever its
    family's targets."""
    cfgs = plan.cfgs if hasattr(plan, "cfgs") else (plan.cfg,)
    return any(not getattr(c, "VERIFIED", True) for c in cfgs)


def verified_text(plan) -> str:
    """For explain(): how far a plan's kernels are verified (its family's statement, unless
    one of them is not verified on a GPU)."""
    if unverified(plan):
        return ("not verified on a GPU: its tests or sanitizers are incomplete (the self-check "
                "canaries it first)")
    family = dispatch.FAMILIES.get(plan.family)
    return family.verified if family else ""


def canary_problem(plan, packed: bool | None = None, requires_grad: bool = False) -> AttnProblem:
    """A small problem that plans the same kernel configuration as `plan`: the same dtype,
    head dims, causal mode and GQA ratio (at most 8 query heads per KV head), packed rows when
    `plan` packs them (one query row: decode), else 67 query rows against 200 keys; the plan's
    sliding window (as a left edge CANARY_WINDOW_LEFT keys behind the bottom-right frame: blocks
    skipped and masked; a right edge is the causal rule) and sinks."""
    p = plan.problem
    g = min(p.qhead_per_kvhead, 8)
    nq = 1 if (plan.packed if packed is None else packed) else CANARY_SEQLEN_Q
    frame = CANARY_SEQLEN_KV - nq
    window = p.window_lo is not None
    return dataclasses.replace(p, batch=1, heads_q=g, heads_kv=1, seqlen_q=nq,
                               seqlen_kv=CANARY_SEQLEN_KV,
                               causal=p.right_bounded,
                               causal_offset=frame if p.right_bounded else 0,
                               requires_grad=requires_grad,
                               window_lo=frame - CANARY_WINDOW_LEFT if window else None,
                               window_hi=None, has_sinks=p.has_sinks)


def canary_sinks(cp: AttnProblem, device):
    """The canary's [Hq] sink logits (None without sinks): N(0, 4), the first 6 above zero."""
    if not cp.has_sinks:
        return None
    gen = torch.Generator(device=device).manual_seed(99)
    sinks = torch.randn(cp.heads_q, device=device, generator=gen) * 2
    sinks[0] = 6.0
    return sinks


def _canary(plan, device, canary=None) -> str | None:
    """Run the canary of `plan`'s configuration (through `canary(plan, cplan, device)` when
    given); None when it passes, else the reason."""
    from .reference import attention_ref, attention_same_dtype

    cp = canary_problem(plan)
    cplan = dispatch.plan_fwd(cp, device)
    if cplan.reason is not None or cplan.cfg != plan.cfg:
        return (f"self-check could not build a canary for {plan.cfg}: it planned "
                f"{cplan.cfg or cplan.reason}")
    if canary is not None:
        return canary(plan, cplan, device)
    if cp.dtype in _FP8:
        return f"self-check: no canary given for the FP8 configuration {plan.cfg}"
    q, k, v, _ = canary_inputs(cp, device, DTYPES[cp.dtype], 1234)
    sinks = canary_sinks(cp, device)
    with on_device(device):
        out, _ = launch.run_fwd(cplan, q, k, v, sinks)
    args = dict(causal=cp.causal, causal_offset=cp.causal_offset, scale=cp.softmax_scale,
                window_lo=cp.window_lo, sinks=sinks)
    ref, _ = attention_ref(q, k, v, upcast=torch.float32, **args)
    base, _ = attention_same_dtype(q, k, v, **args)
    miss = _miss(out, ref, base)
    if miss is not None:
        return (f"self-check failed for the {plan.family} kernel on {plan.target} "
                f"({type(plan.cfg).__name__}): canary {miss}; this configuration falls back "
                "to SDPA in this process")
    return None


DTYPES = {v: k for k, v in DTYPE_NAMES.items()}  # "bf16" -> torch.bfloat16, ...


def canary_inputs(cp: AttnProblem, device, dtype, seed: int):
    """(q, k, v, dout) of canary problem `cp`: N(0, 1) in `dtype`, drawn in this order from
    `seed` on `device` (one KV head); v is k's first Dv columns when `cp.shared_kv`."""
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = ((cp.heads_q, cp.seqlen_q, cp.head_dim), (1, cp.seqlen_kv, cp.head_dim),
              (1, cp.seqlen_kv, cp.head_dim_v), (cp.heads_q, cp.seqlen_q, cp.head_dim_v))
    q, k, v, dout = (torch.randn(1, h, n, d, device=device, dtype=dtype, generator=gen)
                     for h, n, d in shapes)
    return q, k, k[..., :cp.head_dim_v] if cp.shared_kv else v, dout


def on_device(device):
    """The CUDA device context of `device` (nothing on the CPU: the tests' fakes)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _miss(got, ref, same):
    """None when rel_err(got, ref) <= 2 * rel_err(same, ref) + 1e-3 (torch in the inputs'
    dtype: `same`), else "error E > bound B" (NaN misses too)."""
    from .reference import rel_err

    err, bound = rel_err(got, ref), 2 * rel_err(same, ref) + 1e-3
    return None if err <= bound else f"error {err:.3g} > {bound:.3g}"


def _canary_bwd(plan, device, opts=None) -> str | None:
    """Run the canary of a backward plan's kernels (planned under `opts`: the backward may run
    on autograd's thread, which does not see the forward's options); None when dq, dk and dv
    pass, else why."""
    from .reference import attention_grads, attention_ref

    cp = canary_problem(plan, packed=False, requires_grad=True)
    cplan = dispatch.plan_bwd(cp, device, opts=opts)
    if cplan.reason is not None or cplan.cfgs != plan.cfgs:
        return (f"self-check could not build a backward canary for {plan.cfgs}: it planned "
                f"{cplan.cfgs or cplan.reason}")
    dtype = DTYPES[cp.dtype]
    q, k, v, dout = canary_inputs(cp, device, dtype, 4321)
    # the window's and sinks' effect reaches the kernels through the lse (and the masks)
    args = dict(causal=cp.causal, causal_offset=cp.causal_offset, scale=cp.softmax_scale,
                window_lo=cp.window_lo, sinks=canary_sinks(cp, device))
    out, lse = attention_ref(q, k, v, upcast=torch.float32, **args)
    with on_device(device):
        got = launch.run_bwd(cplan, q, k, v, out.to(dtype), lse.float(), dout)
    ref = attention_grads(q, k, v, dout, dtype=torch.float32, **args)
    same = attention_grads(q, k, v, dout, dtype=dtype, **args)
    for name, g, r, b in zip(("dq", "dk", "dv"), got, ref, same):
        miss = _miss(g, r, b)
        if miss is not None:
            return (f"self-check failed for the {plan.family} backward on {plan.target}: "
                    f"canary {name} {miss}; its backward recomputes through SDPA in this "
                    "process")
    return None


def bwd_reason(plan, device: torch.device, opts=None, canary=None) -> str | None:
    """None when backward plan `plan` (without a reason) may serve on `device` under `opts`
    (default: the current options), else why not; runs its canary on first use (`canary(plan,
    device, opts)` when given: varlen's, else the dense one) and logs a failure once."""
    if not needed(plan, opts):
        return None
    key = (plan.family, plan.cfgs, str(device))
    if key not in _RESULTS:
        _RESULTS[key] = (canary or _canary_bwd)(plan, device, opts)
        if _RESULTS[key] is not None:
            log.warning("ffpa_cute: %s", _RESULTS[key])
    return _RESULTS[key]


def reason(plan, device: torch.device, canary=None) -> str | None:
    """None when `plan` may serve calls on `device` (checked, or no check needed), else why
    not; runs the canary on the first call of each configuration: `canary(plan, cplan,
    device)` when given (FP8: fp8.canary), else the 16-bit one."""
    if not needed(plan):
        return None
    key = (plan.family, plan.cfg, str(device))
    if key not in _RESULTS:  # a failure is logged once, as the fallback reason
        _RESULTS[key] = _canary(plan, device, canary)
    return _RESULTS[key]


def status(plan, device: torch.device) -> str:
    """For explain(): "" when no canary is needed, else whether it passed, failed or is pending
    (explain runs nothing)."""
    if not needed(plan):
        return ""
    cfg = plan.cfgs if hasattr(plan, "cfgs") else plan.cfg
    result = _RESULTS.get((plan.family, cfg, str(device)), "pending")
    if result == "pending":
        return " (self-check pending: its first call runs a canary)"
    return " (self-check passed)" if result is None else f" ({result})"


def clear() -> None:
    """Forget the results (tests)."""
    _RESULTS.clear()


__all__ = ["bwd_reason", "canary_inputs", "canary_problem", "canary_sinks", "clear", "needed",
           "on_device", "reason", "status", "unverified", "verified_text"]
