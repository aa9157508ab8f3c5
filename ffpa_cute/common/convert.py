"""FP8 (e4m3) to 16-bit conversion in registers, four values per 32-bit word.

Note [e4m3 to bf16 / fp16 by bits]
Hopper's only e4m3 conversion is `cvt.rn.f16x2.e4m3x2` (to fp16; bf16 would take two more
conversions through fp32), and conversions issue at 16 per SM and clock: converting a decode
block's K and V (64 x 512 each) that way takes ~2x longer than reading its bytes from HBM. This
does it with the 64-per-clock integer pipe and one packed multiply per two values.

An e4m3 byte s.eeee.mmm (bias 7) reinterpreted with its exponent and mantissa bits moved to the
top of a 16-bit float's fields is the same number times a power of two, subnormals included:

  bf16 (8-bit exponent, bias 127):  s | eeee mmm << 4  =  x * 2^-120
  fp16 (5-bit exponent, bias 15):   s | eeee mmm << 7  =  x * 2^-8

(a normal e4m3 exponent e gives the 16-bit exponent e, so 2^(e-127) or 2^(e-15) against
2^(e-7); e = 0 lands on the 16-bit subnormals with the same mantissa scale). One packed
multiply by 2^120 (bf16) or 2^8 (fp16) then gives x exactly: every e4m3 value is a bf16 and an
fp16 value, and `mul.rn` on packed bf16 / fp16 keeps subnormal inputs (no flush). The NaN codes
(0x7f, 0xff) come out as +-480, not NaN: a cache holds finite values.

Per word of four bytes b3 b2 b1 b0: one AND clears the signs, four byte permutes spread the
bytes to [b1, 0, b0, 0] and [b3, 0, b2, 0] (with and without signs), two shifts move the
magnitudes into place, two LOP3 put the signs back (9 integer instructions, ~2.25 per value),
two packed multiplies rebias (the half-precision pipe); the cvt route costs two conversions per
value at a quarter of the integer rate.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Uint32

# (magnitude shift from bit 8, packed 2^bias multiplier, multiply instruction) per 16-bit type
_REBIAS = {
    "bf16": (4, 0x7B807B80, "mul.rn.bf16x2"),   # 2^120 = bf16 exponent 247, mantissa 0
    "fp16": (1, 0x5C005C00, "mul.rn.f16x2"),    # 2^8 = fp16 exponent 23, mantissa 0
}


def _ptx(kind: str) -> str:
    shift, mult, mul = _REBIAS[kind]
    return f"""{{
.reg .b32 m, s0, s1, t0, t1, k;
and.b32 m, {{$r0}}, 0x7F7F7F7F;
prmt.b32 s0, {{$r0}}, 0, 0x1404;
prmt.b32 s1, {{$r0}}, 0, 0x3424;
prmt.b32 t0, m, 0, 0x1404;
prmt.b32 t1, m, 0, 0x3424;
shr.b32 t0, t0, {shift};
shr.b32 t1, t1, {shift};
lop3.b32 t0, t0, s0, 0x80008000, 0xF8;
lop3.b32 t1, t1, s1, 0x80008000, 0xF8;
mov.b32 k, {mult:#x};
{mul} {{$w0}}, t0, k;
{mul} {{$w1}}, t1, k;
}}"""


PTX = {kind: _ptx(kind) for kind in _REBIAS}


def e4m3x4_to_16bit(word: Uint32, kind: str) -> tuple[Uint32, Uint32]:
    """Four e4m3 values (bytes b0..b3 of `word`, b0 lowest) as two words of packed 16-bit
    values ("bf16" or "fp16"): (b1:b0, b3:b2), each with the lower-addressed value in the low
    half, exactly (Note [e4m3 to bf16 / fp16 by bits])."""
    return cute.arch.inline_ptx(PTX[kind], write_only_types=[Uint32, Uint32],
                                read_only_args=[word])


__all__ = ["PTX", "e4m3x4_to_16bit"]
