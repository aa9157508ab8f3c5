"""NVFP4: the quantizer, dequantizer and container the FP4 attention kernel reads (in torch,
bit-exact with the format), and `attention`'s NVFP4 route.

    q4, k4 = ffpa_cute.quantize_nvfp4(q), ffpa_cute.quantize_nvfp4(k)     # [B, H, N, D]
    v4 = ffpa_cute.quantize_nvfp4(v.transpose(-1, -2))                    # V^T: [B, Hkv, D, N]
    out = ffpa_cute.attention(q4, k4, v4, is_causal=True)                # bf16 (out_dtype=)

V is given as the NVFP4 of V^T: its 16-element scale blocks must run along the keys (P V's
contraction). If Nkv is not a multiple of 16, pad V with zero keys to the next multiple first.
The kernels: `FFPAFwdSm100FP4` (sm_100a, tcgen05.mma kind::mxf4nvf4) and `FFPAFwdSm80FP4`
(sm_120a / sm_121a, the block-scaled mma.sync kind::mxf4nvf4); **compile-verified only, never
run**: each configuration first passes a canary on the GPU (`canary`). Everywhere else NVFP4
inputs raise NotImplementedError naming what exists (there is no meaningful fallback for packed
FP4; dequantize and call the 16-bit path if that is what you want). Forward only; D a
multiple of 64 in [320, 1024]; a sliding window and sinks as for 16-bit inputs (sinks not
requiring grad); no dense mask or dropout.

The format (NVIDIA NVFP4, the operand of sm_100a's `tcgen05.mma kind::mxf4nvf4` with 16-element
scale blocks and of sm_120a's block-scaled mma.sync):
  values      E2M1, 4 bits: sign, 2 exponent bits (bias 1), 1 mantissa bit; magnitudes
              0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0..7 (code 1 is the subnormal), code | 8
              negative. Rounding to nearest, ties to the even code (mantissa bit 0); beyond 6
              saturates to 6.
  packing     two codes per byte along the last dim: element 2i in the low nibble, 2i + 1 in
              the high nibble (PTX's e2m1x2 order).
  block scale one per 16 consecutive elements of the last dim (the MMA's K), E4M3, positive:
              block_amax / 6 / tensor_scale, rounded by E4M3's conversion (to nearest even).
  tensor      fp32 per tensor, amax / (6 * 448), so every block scale fits E4M3 (max 448).
  scale       x ~= value(code) * block_scale * tensor_scale.

Layouts: `data` uint8 [..., D / 2], `block_scale` float8_e4m3fn [..., D / 16] row-major,
`tensor_scale` a 0-d fp32 tensor. The sm_120 kernel reads the scales as they are (4-byte words);
the sm_100 kernel reads them re-tiled by `blocked_scales` (on the GPU, kept on the NVFP4Tensor
while its scales are unchanged, so a reused K / V cache pays it once), the layout
tcgen05's scale-factor copies take: per 128-row atom and 64-element K-block, 512 contiguous
bytes, row r's 4 scales at byte 16 (r % 32) + 4 (r // 32).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .problem import tensor_version
from .sm100.config import FP4_MMA_K, SF_ATOM_BYTES, SF_ATOM_ROWS, FwdFP4ConfigSm100

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# magnitudes of codes 0..7, and the midpoints between neighbours (the rounding boundaries)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_BOUNDARIES = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))
NO_NVFP4_KERNEL = ("NVFP4 attention has kernels only on sm_100 (tcgen05 kind::mxf4nvf4) "
                   "and sm_120 / sm_121 (the Split-D block-scaled mma.sync) "
                   "GPUs, both compile-verified only; FP8 e4m3 has kernels on sm90 (run on an "
                   "H200), sm_89 / sm_120 (Split-D) and sm100 (compile-verified only). "
                   "Dequantize (NVFP4Tensor.dequantize()) and call attention in bf16, or "
                   "quantize to FP8 with ffpa_cute.quantize_fp8.")
# the canary's bound on the kernel's error against float32 attention of the dequantised
# inputs: P rounded to E2M1 costs ~9% at D=512 (docs/design.md, perf.quant_error)
FP4_TOL = 0.2


@dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor in NVFP4: packed E2M1 codes, E4M3 block scales, an fp32 tensor scale (module
    docstring); `shape` is the logical (unpacked) shape."""

    data: torch.Tensor
    block_scale: torch.Tensor
    tensor_scale: torch.Tensor
    # the sm_100 kernel's blocked scales of this tensor, kept for the next call while
    # block_scale is unchanged (`_blocked_once`): a reused K / V cache re-tiles once
    _blocked: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], 2 * self.data.shape[-1]))

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_nvfp4(self, dtype)


def encode_e2m1(y: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) of `y` (any float tensor): nearest magnitude, ties to the even
    code, saturating at 6; the sign bit set for y < 0."""
    a = y.abs().float()
    bounds = torch.tensor(_BOUNDARIES, dtype=torch.float32, device=y.device)
    idx = torch.bucketize(a, bounds)  # the number of boundaries below a (a tie counts below)
    tie = (idx < len(_BOUNDARIES)) & (a == bounds[idx.clamp(max=len(_BOUNDARIES) - 1)])
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)  # a tie goes to the even code
    return (idx | torch.where(y < 0, 8, 0)).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of E2M1 codes (uint8, 0..15)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=dtype,
                         device=codes.device)
    return table[codes.long()]


def quantize_nvfp4(x: torch.Tensor, tensor_scale: float | None = None) -> NVFP4Tensor:
    """`x` (floating, last dim a multiple of 16) in NVFP4 (module docstring). `tensor_scale`:
    a fixed tensor scale instead of amax / (6 * 448) (what a kernel quantising P on the fly
    uses: it cannot know P's amax in advance)."""
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise TypeError("x must be a floating tensor (bf16 / fp16 / fp32)")
    if x.dim() == 0 or x.shape[-1] % BLOCK:
        raise ValueError(f"x's last dim must be a multiple of {BLOCK}, got shape "
                         f"{tuple(x.shape)}")
    xf = x.float()
    if tensor_scale is None:
        amax = xf.abs().amax().clamp(min=torch.finfo(torch.float32).tiny)
        tensor_scale = amax / (E2M1_MAX * E4M3_MAX)
    else:
        tensor_scale = torch.tensor(float(tensor_scale))
    blocks = xf.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    block_scale = (blocks.abs().amax(-1) / E2M1_MAX / tensor_scale).to(torch.float8_e4m3fn)
    scale = block_scale.float()[..., None] * tensor_scale
    y = torch.where(scale > 0, blocks / torch.where(scale > 0, scale, 1.0), 0.0)
    codes = encode_e2m1(y).reshape(x.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return NVFP4Tensor(packed, block_scale, tensor_scale)


def dequantize_nvfp4(t: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values `t` encodes, in `dtype` (computed in fp32)."""
    codes = torch.stack((t.data & 0xF, t.data >> 4), dim=-1).reshape(t.shape)
    values = decode_e2m1(codes).reshape(*t.shape[:-1], t.shape[-1] // BLOCK, BLOCK)
    scale = t.block_scale.float()[..., None] * t.tensor_scale.float()
    return (values * scale).reshape(t.shape).to(dtype)


def is_nvfp4(x) -> bool:
    return isinstance(x, NVFP4Tensor)


def _check(q, k, v, out_dtype):
    """Raise for NVFP4 inputs the kernel route cannot take as given (module docstring)."""
    if not (is_nvfp4(q) and is_nvfp4(k) and is_nvfp4(v)):
        raise TypeError("NVFP4 attention needs q, k and v as NVFP4Tensor (quantize_nvfp4)")
    if out_dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, "
                         f"{v.device}")
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        raise ValueError("NVFP4 attention takes q, k [B, H, N, D] and v = V^T [B, Hkv, D, N]")
    (b, hq, _, d), (bk, hkv, nkv, dk), (bv, hv, dv, nv) = q.shape, k.shape, v.shape
    if (b, d) != (bk, dk) or (b, hkv, d) != (bv, hv, dv) or hq % hkv:
        raise ValueError(f"NVFP4 shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v (V^T) {tuple(v.shape)}; need the same B and D, Hq a multiple of "
                         "Hkv, v as [B, Hkv, D, N]")
    if not nkv <= nv < nkv + 16:
        raise ValueError(f"v must be the NVFP4 of V^T with Nkv = {nkv} keys (padded to a "
                         f"multiple of 16 at most), got {nv}: quantize_nvfp4(v.transpose(-1, -2))")


def blocked_scales(scales: torch.Tensor, rows: int | None = None,
                   k_multiple: int = 1) -> torch.Tensor:
    """Row-major block scales [..., R, K / 16] (uint8 or float8_e4m3fn) in the sm_100
    kernel's blocked layout (module docstring): uint8 [..., Ra, Kb * 512] with Ra = rows / 128
    atoms (rows: R rounded up to 128 unless given, a multiple of 128 >= R) and Kb the
    64-element K-blocks rounded up to a multiple of `k_multiple`; zero where padded (zero
    scales make zero values)."""
    *lead, r, ks = scales.shape
    rows = -(-r // SF_ATOM_ROWS) * SF_ATOM_ROWS if rows is None else rows
    if rows % SF_ATOM_ROWS or rows < r:
        raise ValueError(f"rows={rows} must be a multiple of {SF_ATOM_ROWS} and >= {r}")
    kb = -(-ks // 4)
    kb = -(-kb // k_multiple) * k_multiple
    padded = torch.zeros(*lead, rows, kb * 4, dtype=torch.uint8, device=scales.device)
    padded[..., :r, :ks] = scales.view(torch.uint8)
    # row = 32 m1 + m0 of its atom, scale = 4 k + k1: byte 16 m0 + 4 m1 + k1 of atom block k
    t = padded.reshape(*lead, rows // SF_ATOM_ROWS, 4, 32, kb, 4)
    n = len(lead)
    t = t.permute(*range(n), n, n + 3, n + 2, n + 1, n + 4)
    return t.reshape(*lead, rows // SF_ATOM_ROWS, kb * SF_ATOM_BYTES).contiguous()


def _blocked_once(t: NVFP4Tensor, scales: torch.Tensor, **kw) -> torch.Tensor:
    """`blocked_scales(scales, **kw)` of t's block scales (`scales`: t.block_scale as the
    kernel takes it, reshaped or padded), remembered on t and returned again while t.block_scale
    is the same storage at the same version (an in-place write bumps it) and the arguments and
    shape match."""
    src = t.block_scale
    version = tensor_version(src)   # None for an inference tensor: recomputed every call
    key = (src.data_ptr(), version, tuple(scales.shape), tuple(sorted(kw.items())))
    hit = t._blocked.get("scales")
    if hit is None or hit[0] != key or version is None:
        hit = (key, blocked_scales(scales, **kw))
        t._blocked["scales"] = hit
    return hit[1]


def prepare_v(v: NVFP4Tensor, nkv: int, keys_multiple: int = 64
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """V^T's codes and scales as the kernels read them (uint8): the keys zero-padded to a
    multiple of `keys_multiple` (a whole KV block; zero scales make zero values). Already
    padded contiguous tensors are passed as they are (no copy)."""
    b, h, dv, nv = v.shape
    npad = -(-nkv // keys_multiple) * keys_multiple
    scales = v.block_scale.view(torch.uint8)
    if nv == npad and v.data.is_contiguous() and scales.is_contiguous():
        return v.data, scales
    data = torch.zeros(b, h, dv, npad // 2, dtype=torch.uint8, device=v.device)
    padded = torch.zeros(b, h, dv, npad // BLOCK, dtype=torch.uint8, device=v.device)
    data[..., : v.data.shape[-1]] = v.data
    padded[..., : scales.shape[-1]] = scales
    return data, padded


def run_kernel(plan, q: NVFP4Tensor, k: NVFP4Tensor, v: NVFP4Tensor, out_dtype, sinks=None):
    """(out [B, Hq, Nq, D] in out_dtype, lse [B, Hq, Nq] fp32) from the NVFP4 kernel's plan
    (sinks: the [Hq] logits of a plan with sinks; the window's left edge is the problem's)."""
    from . import fp8, launch

    p = plan.problem
    (b, hq, nq, d), hkv = q.shape, k.shape[1]
    out = torch.empty(b, hq, nq, d, dtype=out_dtype, device=q.device)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)
    qd, qs = q.data, q.block_scale.view(torch.uint8)
    o, lse_k, offset = out, lse, p.right_edge
    if plan.packed:  # GQA rows packed: [B, Hkv, G * Nq, .] (no row is masked)
        qd, qs = qd.reshape(b, hkv, -1, qd.shape[-1]), qs.reshape(b, hkv, -1, qs.shape[-1])
        o, lse_k, offset = out.view(b, hkv, -1, d), lse.view(b, hkv, -1), 0
    ks = k.block_scale.view(torch.uint8)
    if isinstance(plan.cfg, FwdFP4ConfigSm100):  # blocked scales, whole 128-key blocks
        vd, vs = prepare_v(v, k.shape[2], keys_multiple=128)
        chunk = plan.cfg.k_chunk // FP4_MMA_K  # K-blocks per QK stage
        qs = _blocked_once(q, qs, k_multiple=chunk)
        ks = _blocked_once(k, ks, k_multiple=chunk)
        vs = _blocked_once(v, vs, rows=plan.cfg.vt_scale_rows())
    else:
        vd, vs = prepare_v(v, k.shape[2])
    tensors = dict(q=launch.kernel_ready(qd), q_sf=qs.contiguous(),
                   k=launch.kernel_ready(k.data), k_sf=ks.contiguous(), v=vd, v_sf=vs, o=o,
                   lse=lse_k, sinks=None if sinks is None else sinks.float().contiguous())
    for name, t in (("q_descale", q), ("k_descale", k), ("v_descale", v)):
        tensors[name] = fp8.descale_bh(t.tensor_scale, name, b, hkv, q.device)
    launch.run_job(plan.kernel_cls, plan.cfg, tensors, launch.kernel_scalars(p, offset))
    return out, lse


def problem_of(q: NVFP4Tensor, k: NVFP4Tensor, *, causal: bool, offset: int, scale,
               out_dtype, bounds=None, has_sinks: bool = False):
    """The AttnProblem of an NVFP4 call (dtype "nvfp4"); bounds: the window's (lo, hi)
    (`validate.window_bounds`), or None."""
    from .problem import AttnProblem, dtype_name

    (b, hq, nq, d), (_, hkv, nkv, _) = q.shape, k.shape
    lo, hi = bounds if bounds is not None else (None, None)
    return AttnProblem(dtype="nvfp4", batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=nq,
                       seqlen_kv=nkv, head_dim=d, head_dim_v=d, causal=causal,
                       causal_offset=offset if causal else 0, window_lo=lo, window_hi=hi,
                       has_sinks=has_sinks,
                       scale=None if scale is None else float(scale),
                       device_type=q.device.type, out_dtype=dtype_name(out_dtype))


def canary(plan, cplan, device) -> str | None:
    """The canary of an NVFP4 configuration: random inputs quantised (`quantize_nvfp4`), the
    kernel against float32 attention of the dequantised inputs, within FP4_TOL."""
    from . import selfcheck
    from .reference import attention_ref, rel_err

    cp = cplan.problem
    out_dtype = selfcheck.DTYPES[cp.out_dtype or "bf16"]
    x = selfcheck.canary_inputs(cp, device, torch.float32, 1234)[:3]
    q4, k4 = quantize_nvfp4(x[0]), quantize_nvfp4(x[1])
    vpad = torch.nn.functional.pad(x[2], (0, 0, 0, -cp.seqlen_kv % BLOCK))  # zero keys
    v4 = quantize_nvfp4(vpad.transpose(-1, -2))
    sinks = selfcheck.canary_sinks(cp, device)
    with selfcheck.on_device(device):
        out, _ = run_kernel(cplan, q4, k4, v4, out_dtype, sinks)
    deq = [q4.dequantize(), k4.dequantize(),
           v4.dequantize().transpose(-1, -2)[..., : cp.seqlen_kv, :]]
    ref, _ = attention_ref(*deq, causal=cp.causal, causal_offset=cp.causal_offset,
                           scale=cp.softmax_scale, upcast=torch.float32,
                           window_lo=cp.window_lo, sinks=sinks)
    err = rel_err(out, ref)
    if not err <= FP4_TOL:  # NaN fails too
        return (f"self-check failed for the {plan.family} NVFP4 kernel on {plan.target} "
                f"({type(plan.cfg).__name__}): canary error {err:.3g} > {FP4_TOL}")
    return None


def attention_nvfp4(q, k, v, attn_mask, dropout_p, is_causal, scale, return_lse, out_dtype,
                    enable_gqa=False, window=None, sinks=None, descales=(None, None, None)):
    """`attention` for NVFP4 inputs (module docstring): out in out_dtype (bf16 by default)
    [and lse fp32] from the kernel where one serves the call, else NotImplementedError naming
    what exists (a failed canary too: there is no fallback for packed FP4, so `strict` changes
    nothing). A sliding window and sinks as `attention` takes them (sinks not requiring grad:
    forward only); FP8 descales are refused (an NVFP4Tensor carries its own scales); GQA needs
    enable_gqa=True as everywhere."""
    from . import dispatch, selfcheck
    from .validate import check_window_sinks, resolve_mask, window_bounds

    _check(q, k, v, out_dtype)
    if any(d is not None for d in descales):
        raise TypeError("q_descale, k_descale and v_descale are for FP8 inputs; an NVFP4Tensor "
                        "carries its own block and tensor scales")
    err = check_window_sinks(window, sinks, q, dropout_p)
    if err is not None:
        raise err
    if sinks is not None and sinks.requires_grad:
        raise NotImplementedError("sinks must not require grad with NVFP4 inputs (NVFP4 is "
                                  "forward-only)")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if q.shape[1] != k.shape[1] and not enable_gqa:
        raise ValueError(f"q has {q.shape[1]} heads but k/v have {k.shape[1]}: pass "
                         "enable_gqa=True for grouped-query attention (as SDPA requires)")
    causal, offset, mask = resolve_mask(attn_mask, is_causal, q.shape[2], k.shape[2], False)
    if mask is not None or dropout_p:
        raise NotImplementedError("NVFP4 attention has no dense mask or dropout (is_causal "
                                  "and causal_upper_left / causal_lower_right only)")
    out_dtype = out_dtype or torch.bfloat16
    nq, nkv = q.shape[2], k.shape[2]
    bounds = window_bounds(window, offset if causal else nkv - nq)
    problem = problem_of(q, k, causal=causal, offset=offset, scale=scale, out_dtype=out_dtype,
                         bounds=bounds, has_sinks=sinks is not None)
    plan = dispatch.plan_fwd(problem, q.device)
    reason = plan.reason or selfcheck.reason(plan, q.device, canary)
    if reason is not None:
        raise NotImplementedError(f"{reason}. {NO_NVFP4_KERNEL}")
    with torch.cuda.device(q.device):
        out, lse = run_kernel(plan, q, k, v, out_dtype, sinks)
    return (out, lse) if return_lse else out

__all__ = ["FP4_TOL", "NO_NVFP4_KERNEL", "NVFP4Tensor", "attention_nvfp4", "blocked_scales",
           "canary",
           "decode_e2m1", "dequantize_nvfp4", "encode_e2m1", "is_nvfp4", "prepare_v",
           "quantize_nvfp4", "run_kernel"]
