"""FP8 attention: e4m3 Q, K, V with fp32 descales, out in bf16 / fp16; and the quantizer.

    q8, qd = ffpa_cute.quantize_fp8(q)                 # per tensor; granularity="head": [B, H]
    out = ffpa_cute.attention(q8, k8, v8, is_causal=True, q_descale=qd, k_descale=kd,
                              v_descale=vd)            # bf16 by default (out_dtype=)

Semantics: the attention of the dequantised inputs x = x_fp8 * descale, with `attention`'s
causal alignment, GQA and masks. Descales are fp32: a number, a 0-d / 1-element tensor, or a
tensor of shape [B, Hkv] (per batch and KV head, FlashAttention-3's convention; for q too).

Where an FP8 kernel serves the call (`dispatch` plans dtype "e4m3": e4m3 inputs, D a multiple
of 16 in [272, 1024], Dv == D, no dense mask or dropout; a sliding window and sinks on the sm90,
Split-D and sm100 kernels, sinks not requiring grad) it runs that kernel: the sm90 WGMMA kernel, the
Split-D mma.sync kernel on sm_89 / sm_120, the sm100 tcgen05 kernel. For the first two V is
written transposed first (Vt [B, Hkv, D, N], one pass over V, because their 8-bit products take
only K-major operands). Anything else dequantises to bf16 and runs the bf16 route (a logged
fallback; `strict` raises instead). Forward only: inputs that require grad are refused.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from . import dispatch, launch, selfcheck
from . import options as _options
from .problem import AttnProblem, dtype_name

log = logging.getLogger("ffpa_cute")
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = {None: torch.bfloat16, torch.bfloat16: torch.bfloat16, torch.float16: torch.float16}
_LOGGED: set = set()
# an FP8 kernel's error on the dequantised inputs (P in e4m3: ~2%): the FP8 GPU tests' bound,
# and the first-use canary's (`canary`)
FP8_TOL = 3e-2


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES


def quantize_fp8(x: torch.Tensor, granularity: str = "tensor",
                 dtype: torch.dtype = torch.float8_e4m3fn):
    """(x_fp8, descale): x scaled so its largest magnitude maps to the format's largest value,
    rounded to `dtype`; descale (fp32) undoes the scale: x ~= x_fp8.float() * descale.

    granularity: "tensor" (one factor, a 0-d tensor) or "head" (one per [B, H] of a
    [B, H, N, D] tensor, over N and D: shape [B, H])."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype}")
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dtype in FP8_DTYPES:
        raise TypeError("x must be a bf16 / fp16 / fp32 tensor")
    if granularity == "tensor":
        amax = x.abs().amax().float()
    elif granularity == "head":
        if x.dim() != 4:
            raise ValueError(f"granularity='head' needs x [B, H, N, D], got shape {tuple(x.shape)}")
        amax = x.abs().amax(dim=(-2, -1)).float()
    else:
        raise ValueError(f"granularity must be 'tensor' or 'head', got {granularity!r}")
    amax = amax.clamp(min=torch.finfo(torch.float32).tiny)
    scale = torch.finfo(dtype).max / amax
    shape = scale.shape + (1,) * (x.dim() - scale.dim())
    x8 = (x.float() * scale.reshape(shape)).to(dtype)
    return x8, (1.0 / scale)


def descale_bh(d, name: str, b: int, hkv: int, device) -> torch.Tensor:
    """A descale as the kernel reads it: [B, Hkv] fp32, contiguous, on `device`. A number is
    filled on the device (no host-to-device copy: the call stays CUDA-graph capturable)."""
    if d is None or isinstance(d, (int, float)):
        return torch.full((b, hkv), 1.0 if d is None else float(d), dtype=torch.float32,
                          device=device)
    t = torch.as_tensor(d, dtype=torch.float32, device=device)
    if t.numel() == 1:
        return t.reshape(1, 1).expand(b, hkv).contiguous()
    if t.shape != (b, hkv):
        raise ValueError(f"{name} must be a number, a 1-element tensor or [B, Hkv] = "
                         f"[{b}, {hkv}], got shape {tuple(t.shape)}")
    return t.contiguous()


def _check(q, k, v, descales, out_dtype):
    if not (is_fp8(q) and q.dtype == k.dtype == v.dtype):
        raise TypeError(f"FP8 attention needs q, k, v in one FP8 dtype (float8_e4m3fn or "
                        f"float8_e5m2), got {q.dtype}, {k.dtype}, {v.dtype}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    if q.requires_grad or k.requires_grad or v.requires_grad:
        raise NotImplementedError("FP8 attention is forward-only: the inputs must not require "
                                  "grad")
    for name, d in zip(("q_descale", "k_descale", "v_descale"), descales):
        if d is not None and isinstance(d, torch.Tensor) and d.requires_grad:
            raise NotImplementedError(f"{name} must not require grad (FP8 is forward-only)")


def vt_interleaved(kernel_cls) -> bool:
    """Whether `kernel_cls` reads Vt with each 16-key group's keys interleaved (the sm90 FP8
    forward: its class attribute VT_INTERLEAVED; Note [Interleaved keys])."""
    return getattr(kernel_cls, "VT_INTERLEAVED", False)


def vt_config(kernel_cls, arch: str, dv: int):
    """The transpose kernel's config that gives `kernel_cls` its Vt (`TransposeConfig`)."""
    from .common.config import TransposeConfig

    return TransposeConfig(arch, dv, vt_interleaved(kernel_cls))


def _transposed_v(v: torch.Tensor, interleave: bool = False) -> torch.Tensor:
    """Vt [B, Hkv, Dv, N] with rows 16-byte aligned (N padded to 16 in the allocation, the
    padding zeroed: the Split-D kernel's last 16-byte vector of a row may read it), what the
    8-bit P V products (WGMMA, mma.sync) read as their K-major operand: one pass of the
    byte-transpose kernel (common/transpose.py) on CUDA, a torch copy elsewhere.
    `interleave`: each 16-key group's keys in the sm90 FP8 forward's P order (Note
    [Interleaved keys]); the padded N' is then the tensor's extent (its bytes hold keys)."""
    from .common.config import TransposeConfig
    from .common.transpose import KEY_OF_BYTE

    b, h, n, dv = v.shape
    n16 = -(-n // 16) * 16
    buf = torch.empty(b, h, dv, n16, dtype=v.dtype, device=v.device)
    if buf.shape[-1] > n:
        buf[..., n:].view(torch.uint8).zero_()
    if v.is_cuda and v.numel():
        cfg = TransposeConfig(dispatch.current_arch(v.device), dv, interleave)
        launch.run_job(dispatch.kernel_class(cfg), cfg,
                       dict(v=launch.kernel_ready(v).view(torch.uint8),
                            vt=buf.view(torch.uint8)), {})
    else:
        buf[..., :n].copy_(v.transpose(-1, -2))
        if interleave:
            order = torch.tensor(KEY_OF_BYTE, device=v.device)
            idx = (torch.arange(0, n16, 16, device=v.device)[:, None] + order).flatten()
            buf = buf.index_select(-1, idx)
    return buf if interleave else buf[..., :n]


def run_kernel(plan, q, k, v, qd, kd, vd, out_dtype, sinks=None):
    """(out [B, Hq, Nq, Dv] out_dtype, lse [B, Hq, Nq] fp32) from the FP8 kernel's plan
    (sinks: the [Hq] logits of a plan with sinks; the window's left edge is the problem's)."""
    p = plan.problem
    b, hq, nq, _ = q.shape
    out = torch.empty(b, hq, nq, p.head_dim_v, dtype=out_dtype, device=q.device)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)
    q, k = launch.kernel_ready(q), launch.kernel_ready(k)
    (q, k, _, o, lse_k), offset = launch.kernel_args(plan, q, k, v, out, lse)
    # V as the kernel reads it: transposed for the sm90 WGMMA and the Split-D mma.sync
    # ("vt"), as it lies for sm100's N-major tcgen05 operand ("v")
    vin = (dict(vt=_transposed_v(v, vt_interleaved(plan.kernel_cls)))
           if "vt" in plan.kernel_cls.OPERANDS else dict(v=launch.kernel_ready(v)))
    tensors = dict(q=launch.kernel_ready(q), k=k, o=o, lse=lse_k, q_descale=qd, k_descale=kd,
                   v_descale=vd, sinks=None if sinks is None else sinks.float().contiguous(),
                   **vin)
    launch.run_job(plan.kernel_cls, plan.cfg, tensors, launch.kernel_scalars(p, offset))
    return out, lse


def canary(plan, cplan, device) -> str | None:
    """The canary of an FP8 forward configuration: random inputs quantised per tensor
    (`quantize_fp8`), the kernel against the float32 reference on the dequantised inputs
    (with the canary's window and sinks where the configuration has them), within FP8_TOL."""
    from .reference import attention_ref, rel_err

    cp = cplan.problem
    e4m3, out_dtype = selfcheck.DTYPES[cp.dtype], selfcheck.DTYPES[cp.out_dtype or "bf16"]
    x = selfcheck.canary_inputs(cp, device, torch.float32, 1234)[:3]
    q8, k8, v8 = (quantize_fp8(t, dtype=e4m3) for t in x)
    qd, kd, vd = (descale_bh(d, "descale", 1, 1, device) for _, d in (q8, k8, v8))
    sinks = selfcheck.canary_sinks(cp, device)
    with selfcheck.on_device(device):
        out, _ = run_kernel(cplan, q8[0], k8[0], v8[0], qd, kd, vd, out_dtype, sinks)
    deq = [t.float() * d for t, d in (q8, k8, v8)]
    ref, _ = attention_ref(*deq, causal=cp.causal, causal_offset=cp.causal_offset,
                           scale=cp.softmax_scale, upcast=torch.float32,
                           window_lo=cp.window_lo, sinks=sinks)
    err = rel_err(out, ref)
    if not err <= FP8_TOL:  # NaN fails too
        return (f"self-check failed for the {plan.family} FP8 kernel on {plan.target} "
                f"({type(plan.cfg).__name__}): canary error {err:.3g} > {FP8_TOL}; this "
                "configuration falls back (dequantised to bf16) in this process")
    return None


def attention_fp8(q, k, v, *, causal: bool, offset: int, has_mask: bool, dropout_p: float,
                  scale, strict, dense, q_descale=None, k_descale=None, v_descale=None,
                  out_dtype=None, bounds=None, sinks=None):
    """FP8 attention on [B, H, N, D] tensors (4-D; `interface` reshapes other ranks): the
    kernel where one serves the problem, else `dense(q, k, v)` (the 16-bit route with the
    call's mask, window and sinks arguments, returning (out, lse)) on the inputs dequantised to
    bf16. bounds: the window's (lo, hi) (`validate.window_bounds`), or None; sinks: [Hq]
    logits, or None. Returns (out in out_dtype (bf16 by default), lse fp32)."""
    descales = (q_descale, k_descale, v_descale)
    _check(q, k, v, descales, out_dtype)
    if sinks is not None and sinks.requires_grad:
        raise NotImplementedError("sinks must not require grad with FP8 inputs (FP8 is "
                                  "forward-only)")
    want = OUT_DTYPES[out_dtype]
    b, hkv = q.shape[0], k.shape[1]
    problem = dataclasses.replace(
        AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=offset, scale=scale,
                                 has_mask=has_mask, dropout_p=dropout_p, bounds=bounds,
                                 has_sinks=sinks is not None),
        out_dtype=dtype_name(want))
    empty = q.numel() == 0 or k.shape[2] == 0
    plan = None if empty else dispatch.plan_fwd(problem, q.device)
    # a kernel never run on this target proves itself on a canary first (selfcheck.py)
    reason = None if plan is None else plan.reason or selfcheck.reason(plan, q.device, canary)
    qd, kd, vd = (descale_bh(d, n, b, hkv, q.device)
                  for d, n in zip(descales, ("q_descale", "k_descale", "v_descale")))
    if plan is not None and reason is None:
        with torch.cuda.device(q.device):
            return run_kernel(plan, q, k, v, qd, kd, vd, want, sinks)
    if plan is not None:
        if _options.current().strict if strict is None else strict:
            raise NotImplementedError(reason)
        if reason not in _LOGGED:
            _LOGGED.add(reason)
            log.warning("FP8 attention dequantised to bf16: %s", reason)
    g = q.shape[1] // hkv
    deq = [(t.float() * d.repeat_interleave(r, dim=1)[..., None, None]).to(torch.bfloat16)
           for t, d, r in ((q, qd, g), (k, kd, 1), (v, vd, 1))]
    out, lse = dense(*deq)
    return out.to(want), lse.float()


__all__ = ["FP8_TOL", "attention_fp8", "canary", "is_fp8", "quantize_fp8"]
