"""Tensor plumbing every forward kernel shares: dtypes, fake compile-time tensors, launch args.

One compiled function serves every shape and stride: q/k/v/o are (B, H, N, D) with symbolic sizes
and strides (unit stride on D), lse is (B, Hq, Nq) fp32. `fake_args` builds those stand-ins for a
CPU-only compile; `launch_args` builds the matching runtime tensors from torch tensors.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.cute.runtime  # noqa: F401  (make_fake_tensor)

from .compat import compile_target

CUTLASS_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}
LOG2_E = 1.4426950408889634


def fake_args(cfg) -> tuple:
    """Compile-time stand-ins for (q, k, v, o, lse): every size and stride symbolic.

    They match what `launch_args` builds from torch tensors (from_dlpack + dynamic layout with
    unit stride on the last mode), so one compiled function serves every shape and stride.
    """
    dtype = CUTLASS_DTYPES[cfg.dtype]

    def fake(dt, rank, div):
        shape = tuple(cute.sym_int() for _ in range(rank))
        stride = tuple(cute.sym_int(64, divisibility=div) for _ in range(rank - 1)) + (1,)
        return cute.runtime.make_fake_tensor(dt, shape, stride=stride, assumed_align=16)

    qkvo = [fake(dtype, 4, 128 // dtype.width) for _ in range(4)]
    return (*qkvo, fake(cutlass.Float32, 3, 1))


def launch_args(*tensors) -> list:
    """Runtime cute tensors for torch tensors ([B, H, N, D] / [B, H, N]; last stride 1,
    16-byte aligned, other strides multiples of 8 elements): the layouts `fake_args` promised."""
    from cutlass.cute.runtime import from_dlpack

    return [from_dlpack(t.detach(), assumed_align=16).mark_layout_dynamic(leading_dim=t.dim() - 1)
            for t in tensors]


def aligned_bhnd(t: cute.Tensor, head_dim: int, dtype) -> cute.Tensor:
    """Re-state a (B, H, N, D) tensor with D static and 16-byte-divisible strides.

    Runtime tensors arrive with fully dynamic layouts; this tells the compiler what the
    dispatcher guarantees (stride(D) == 1, every other stride a multiple of 8 elements), which
    gmem copies need to be 128-bit and TMA descriptors need for their 16-byte strides.
    """
    elems = 128 // dtype.width
    shape = (t.shape[0], t.shape[1], t.shape[2], head_dim)
    stride = tuple(cute.assume(s, divby=elems) for s in t.stride[:3]) + (1,)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


class KernelEntry:
    """Compile and launch, shared by the kernel classes whose `__call__` takes
    (q, k, v, o, lse, softmax_scale, causal_offset, stream); a class instance is built from its
    config, the compile key."""

    @staticmethod
    def arch_of(cfg) -> str:
        return cfg.arch

    @classmethod
    def compile(cls, cfg, options: str = ""):
        """Compile for cfg.arch from fake tensors: no GPU needed, one compile per config."""
        with compile_target(cfg.arch):
            return cute.compile(cls(cfg), *fake_args(cfg), 1.0, 0, cuda.CUstream(0),
                                options=options)

    @staticmethod
    def launch(fn, q, k, v, out, lse, softmax_scale: float, causal_offset: int, stream) -> None:
        """Run a compiled kernel on torch tensors ([B, H, N, D], last stride 1, 16-byte
        aligned, other strides multiples of 8 elements; lse [B, Hq, Nq] fp32 contiguous)."""
        fn(*launch_args(q, k, v, out, lse), softmax_scale, causal_offset, cuda.CUstream(stream))
