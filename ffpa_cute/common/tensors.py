"""Tensor plumbing every kernel shares: dtypes, fake compile-time tensors, compile and launch.

One compiled function serves every shape and stride: q/k/v/o are (B, H, N, D) with symbolic sizes
and strides (unit stride on D), lse is (B, Hq, Nq) fp32. `fake_args` builds those stand-ins for a
CPU-only compile. Kernels are compiled for cutlass-dsl's TVM-FFI calling convention
(`--enable-tvm-ffi`): the compiled function takes torch tensors and Python scalars directly
(DLPack, converted in C) and launches on torch's current stream of the current device, so the
host side packs no arguments itself.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.cute.runtime  # noqa: F401  (make_fake_tensor, make_fake_stream)

from .compat import compile_target

CUTLASS_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16,
                  "e4m3": cutlass.Float8E4M3FN, "nvfp4": cutlass.Float4E2M1FN,
                  "fp32": cutlass.Float32}
LOG2_E = 1.4426950408889634
# what `KernelEntry.compile` always passes to cute.compile: the TVM-FFI calling convention
TVM_FFI = "--enable-tvm-ffi"
# compile-time values of the runtime scalars (`KernelEntry.SCALARS`): only their types matter
FAKE_SCALARS = {"softmax_scale": 1.0, "causal_offset": 0, "window_lo": 0, "num_splits": 1,
                "nq": 1, "num_ctas": 1}


def fake_tensor(dtype, rank: int, div: int):
    """A compile-time stand-in: every size and stride symbolic, unit stride on the last mode,
    the other strides multiples of `div` elements, 16-byte aligned. Each call is a new tensor
    with its own symbols (the TVM-FFI wrapper checks each argument against its own)."""
    shape = tuple(cute.sym_int() for _ in range(rank))
    stride = tuple(cute.sym_int(64, divisibility=div) for _ in range(rank - 1)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)


def fake_args(cfg) -> tuple:
    """Compile-time stand-ins for (q, k, v, o, lse): the outer strides multiples of 16 bytes
    (what `launch.kernel_ready` guarantees), so one compiled function serves every shape and
    stride."""
    dtype = CUTLASS_DTYPES[cfg.dtype]
    qkvo = [fake_tensor(dtype, 4, 128 // dtype.width) for _ in range(4)]
    return (*qkvo, fake_tensor(cutlass.Float32, 3, 1))


def fake_fp8_args(cfg) -> tuple:
    """Stand-ins for an FP8 forward's (q, k, vt, o, lse, q_descale, k_descale, v_descale):
    q, k [B, H, N, D] and vt [B, H, D, N] e4m3 (16-byte aligned, unit last stride, outer
    strides multiples of 16 elements), o [B, Hq, Nq, D] in out_dtype, lse [B, Hq, Nq] fp32, the
    descales [B, Hkv] fp32."""
    f8, out = CUTLASS_DTYPES[cfg.dtype], CUTLASS_DTYPES[cfg.out_dtype]
    q, k, vt = (fake_tensor(f8, 4, 16) for _ in range(3))
    return (q, k, vt, fake_tensor(out, 4, 8), fake_tensor(cutlass.Float32, 3, 1),
            *(fake_tensor(cutlass.Float32, 2, 1) for _ in range(3)))


def fake_cu(cfg) -> tuple:
    """Stand-ins for a `varlen` config's cumulative sequence lengths (rows', then columns':
    int32 [B + 1] each), else (None, None)."""
    if not getattr(cfg, "varlen", False):
        return None, None
    return fake_tensor(cutlass.Int32, 1, 1), fake_tensor(cutlass.Int32, 1, 1)


def fake_grad_args(cfg) -> tuple:
    """Stand-ins for the dQ / dK kernels' (q, k, v, do, grad, lse, delta)."""
    q, k, v, _, lse = fake_args(cfg)
    do, grad, _, _, delta = fake_args(cfg)
    return q, k, v, do, grad, lse, delta


def vec4_ptx(instr: str, reg: str = "b32") -> str:
    """An inline-PTX block (`cute.arch.inline_ptx`) that moves its operands $r1 .. $r4 into the
    four registers a, b, c, d of type `reg`, then runs `instr`, which names them as the vector
    {a, b, c, d} ($r0 and any further operands as `instr` uses them)."""
    movs = "".join(f"mov.{reg} {x}, {{$r{i + 1}}};\n" for i, x in enumerate("abcd"))
    return f"{{\n.reg .{reg} a, b, c, d;\n{movs}{instr}\n}}"


def env_stream():
    """The compile-time stream argument: taken at run time from the caller's environment
    (torch's current stream of the current device) by the TVM-FFI wrapper, not passed."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def compile_options(options: str = "") -> str:
    return f"{TVM_FFI} {options}".strip()


def aligned_bhnd(t: cute.Tensor, head_dim: int, dtype) -> cute.Tensor:
    """Re-state a (B, H, N, D) tensor with D static and 16-byte-divisible strides.

    Runtime tensors arrive with fully dynamic layouts; this tells the compiler what the
    dispatcher guarantees (stride(D) == 1, every other stride a multiple of 16 bytes), which
    gmem copies need to be 128-bit and TMA descriptors need for their 16-byte strides.
    """
    return _aligned(t, (t.shape[0], t.shape[1], t.shape[2], head_dim), dtype)


def aligned_bhdn(t: cute.Tensor, head_dim: int, dtype) -> cute.Tensor:
    """`aligned_bhnd` for a transposed (B, H, D, N) tensor (V for 8-bit kernels, whose WGMMA
    needs the keys contiguous): D static, N dynamic with unit stride."""
    return _aligned(t, (t.shape[0], t.shape[1], head_dim, t.shape[3]), dtype)


def _aligned(t: cute.Tensor, shape, dtype) -> cute.Tensor:
    elems = 128 // dtype.width
    stride = tuple(cute.assume(s, divby=elems) for s in t.stride[:3]) + (1,)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=stride))


class KernelEntry:
    """Compile and launch, shared by the attention kernel classes; a class instance is built
    from its config, the compile key.

    `__call__` takes the tensors named by `OPERANDS` (in that order: "q", "k", "v", "o", "do",
    "dq", "dk", "dv" are [B, H, N, D], "lse" and "delta" [B, Hq, Nq] fp32, "sinks" [Hq] fp32
    or None), then the `SCALARS` (softmax scale, causal offset[, the window's left edge]) and
    the stream (compiled as the environment's stream, so not passed at run time);
    `launch.run_job` feeds it by these names, so the host side needs no per-kernel code."""

    OPERANDS = ("q", "k", "v", "o", "lse")
    SCALARS = ("softmax_scale", "causal_offset")

    @staticmethod
    def arch_of(cfg) -> str:
        return cfg.arch

    def _refuse(self, reason) -> None:
        """Raise ValueError naming this kernel class when `reason` (its config check's result)
        is not None: a class instance exists only for a config it can build."""
        if reason:
            raise ValueError(f"{type(self).__name__}: {reason}")

    # the tensor arguments of `__call__` as compile-time stand-ins (four [B, H, N, D], one
    # [B, Hq, Nq] fp32); kernels with other inputs name their own
    fake_inputs = staticmethod(fake_args)

    @classmethod
    def compile(cls, cfg, options: str = ""):
        """Compile for cfg.arch from fake tensors: no GPU needed, one compile per config."""
        with compile_target(cfg.arch):
            return cute.compile(cls(cfg), *cls.fake_inputs(cfg),
                                *(FAKE_SCALARS[n] for n in cls.SCALARS), env_stream(),
                                options=compile_options(options))

    @staticmethod
    def launch(fn, *args) -> None:
        """Run a compiled kernel: its torch tensors in `__call__` order ([B, H, N, D], last
        stride 1, 16-byte aligned, other strides multiples of 8 elements; [B, Hq, Nq] fp32
        contiguous), then the `SCALARS`; on torch's current stream of the current device."""
        fn(*args)
