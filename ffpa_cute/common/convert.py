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

import cutlass
import cutlass.cute as cute
from cutlass import Uint32

from .tensors import CUTLASS_DTYPES

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


_E4M3_PAIRS = """{
.reg .b16 lo, hi;
cvt.rn.satfinite.e4m3x2.f32 lo, {$r1}, {$r0};
cvt.rn.satfinite.e4m3x2.f32 hi, {$r3}, {$r2};
mov.b32 {$w0}, {lo, hi};
}"""


def e4m3_pairs(a0, a1, b0, b1) -> Uint32:
    """Four fp32 values rounded to e4m3 (saturating to +-448) in one word: bytes a0, a1, b0, b1
    from the lowest (the two pairs as two 16-bit elements, a's the lower)."""
    return cute.arch.inline_ptx(_E4M3_PAIRS, write_only_types=[Uint32],
                                read_only_args=[a0, a1, b0, b1])


@cute.jit
def convert_stage(src: cute.Tensor, dst: cute.Tensor, vec: cutlass.Constexpr,
                  tpr: cutlass.Constexpr, kind: cutlass.Constexpr, tidx,
                  unrolled: cutlass.Constexpr):
    """Convert a [rows x cols] e4m3 stage `src` into the 16-bit ("bf16" | "fp16": `kind`)
    buffer `dst` of the same shape, exactly, by the 128 threads of a warpgroup (tidx: the
    thread's index in it): each converts runs of `vec` contiguous values of a row, `tpr`
    threads per row, 128 / tpr rows per pass (the planner's `cvt_tiling` chose them so that a
    run never crosses a swizzle atom). `unrolled`: every run unrolled (else a loop unrolled
    by 2, which keeps the registers of large stages down). No fence or barrier: the caller
    orders the reads and writes."""
    src8, dst16 = src.element_type, CUTLASS_DTYPES[kind]
    thr = cute.make_ordered_layout((128 // tpr, tpr), order=(1, 0))
    val = cute.make_layout((1, vec))   # the tile (128 / tpr, vec * tpr), repeated
    load = cute.make_tiled_copy_tv(   # one load of vec 8-bit values
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), src8,
                            num_bits_per_copy=vec * src8.width), thr, val)
    store = cute.make_tiled_copy_tv(   # 16-byte stores of 8 16-bit values
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dst16, num_bits_per_copy=128),
        thr, val)
    tXs8 = load.get_slice(tidx).partition_S(src)   # (CPY, CPY_M, CPY_N)
    tXs16 = store.get_slice(tidx).partition_D(dst)   # (CPY, CPY_M, CPY_N)
    # one run at a time (vec + 2 vec bytes of registers: callers may hold accumulators)
    r8 = cute.make_rmem_tensor(vec, src8)
    r16 = cute.make_rmem_tensor(vec, dst16)
    runs_m = cute.size(tXs8, mode=[1])
    runs = runs_m * cute.size(tXs8, mode=[2])
    if cutlass.const_expr(unrolled):
        for mn in cutlass.range_constexpr(runs):
            _convert_run(load, store, tXs8, tXs16, r8, r16, mn % runs_m, mn // runs_m, kind)
    else:
        for mn in cutlass.range(runs, unroll=2):
            _convert_run(load, store, tXs8, tXs16, r8, r16, mn % runs_m, mn // runs_m, kind)


@cute.jit
def _convert_run(load, store, tXs8, tXs16, r8, r16, m, n, kind: cutlass.Constexpr):
    """One run of `convert_stage`: vec 8-bit values in, the 16-bit ones out; word i of r8
    (four values) is words 2i, 2i + 1 of r16 (two each)."""
    w8, w16 = cute.recast_tensor(r8, Uint32), cute.recast_tensor(r16, Uint32)
    cute.copy(load, tXs8[None, m, n], r8)
    for i in cutlass.range_constexpr(cute.size(w8)):
        w16[2 * i], w16[2 * i + 1] = e4m3x4_to_16bit(w8[i], kind)
    cute.copy(store, r16, tXs16[None, m, n])


__all__ = ["PTX", "convert_stage", "e4m3_pairs", "e4m3x4_to_16bit"]
