"""Reductions into global memory from registers (the fused backward's dQ): two or four
adjacent fp32 values per instruction."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

# two adjacent fp32 values added to global memory in one vector reduction (sm_90, PTX 8.1);
# the address must be 8-byte aligned
_RED_ADD_F32X2 = """{
.reg .f32 a, b;
mov.f32 a, {$r1};
mov.f32 b, {$r2};
red.global.add.v2.f32 [{$r0}], {a, b};
}"""


_RED_ADD_F32X4 = """{
.reg .f32 a, b, c, d;
mov.f32 a, {$r1};
mov.f32 b, {$r2};
mov.f32 c, {$r3};
mov.f32 d, {$r4};
red.global.add.v4.f32 [{$r0}], {a, b, c, d};
}"""


def red_add_f32x2(ptr, a: cutlass.Float32, b: cutlass.Float32) -> None:
    """ptr[0] += a, ptr[1] += b in global memory, one `red.global.add.v2.f32` (relaxed, gpu
    scope: the sum's order is whatever order the reductions reach L2 in)."""
    cute.arch.inline_ptx(_RED_ADD_F32X2, read_only_args=[ptr, a, b])


def red_add_f32x4(ptr, a: cutlass.Float32, b: cutlass.Float32, c: cutlass.Float32,
                  d: cutlass.Float32) -> None:
    """ptr[0..3] += a, b, c, d in global memory, one `red.global.add.v4.f32` (16-byte aligned
    address)."""
    cute.arch.inline_ptx(_RED_ADD_F32X4, read_only_args=[ptr, a, b, c, d])
