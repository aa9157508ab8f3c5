"""NVFP4: the quantizer, dequantizer and container the FP4 attention kernels are to read, in
torch, bit-exact with the format. **No FP4 attention kernel exists yet** on any family:
`attention` with `NVFP4Tensor` inputs raises NotImplementedError naming what exists (there is
no meaningful fallback for packed FP4 inside a kernel route; dequantize and call the 16-bit
path if that is what you want).

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

Layouts: `data` uint8 [..., D / 2], `block_scale` float8_e4m3fn [..., D / 16] row-major (the
kernels' TMA reads it as is and re-tiles it in shared memory), `tensor_scale` a 0-d fp32 tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# magnitudes of codes 0..7, and the midpoints between neighbours (the rounding boundaries)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_BOUNDARIES = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))
NO_NVFP4_KERNEL = ("NVFP4 attention has no kernel yet on any GPU family (FP8 e4m3 has: sm90, "
                   "run on an H200; sm100, compile-verified only). Dequantize "
                   "(NVFP4Tensor.dequantize()) and call attention in bf16, or quantize to FP8 "
                   "with ffpa_cute.quantize_fp8.")


@dataclass(frozen=True)
class NVFP4Tensor:
    """A tensor in NVFP4: packed E2M1 codes, E4M3 block scales, an fp32 tensor scale (module
    docstring); `shape` is the logical (unpacked) shape."""

    data: torch.Tensor
    block_scale: torch.Tensor
    tensor_scale: torch.Tensor

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


__all__ = ["NO_NVFP4_KERNEL", "NVFP4Tensor", "decode_e2m1", "dequantize_nvfp4", "encode_e2m1", "is_nvfp4",
           "quantize_nvfp4"]
