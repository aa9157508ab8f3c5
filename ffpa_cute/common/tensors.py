"""Tensor plumbing every forward kernel shares: dtypes, fake compile-time tensors, launch args.

One compiled function serves every shape and stride: q/k/v/o are (B, H, N, D) with symbolic sizes
and strides (unit stride on D), lse is (B, Hq, Nq) fp32. `fake_args` builds those stand-ins for a
CPU-only compile; `launch_args` builds the matching runtime tensors from torch tensors.
"""

from __future__ import annotations

import ctypes
import functools
import threading

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


class _Desc4(ctypes.Structure):
    """What the compiled host function reads for a (B, H, N, D) argument built like `fake_args`:
    data pointer, the four sizes (32-bit symbols), the three outer strides (64-bit symbols)."""
    _fields_ = [("ptr", ctypes.c_void_p), ("shape", ctypes.c_int32 * 4),
                ("stride", ctypes.c_int64 * 3)]


class _Desc3(ctypes.Structure):
    """The same for (B, H, N) (lse, delta)."""
    _fields_ = [("ptr", ctypes.c_void_p), ("shape", ctypes.c_int32 * 3),
                ("stride", ctypes.c_int64 * 2)]


_DESCS = {4: _Desc4, 3: _Desc3}


class RawTensorArg:
    """A runtime tensor argument packed directly from a torch tensor (~2 us instead of
    `from_dlpack`'s ~12 us): the executor only asks an argument for `__c_pointers__`. The
    layout is cutlass-dsl's memref descriptor for `fake_args`' tensors; `raw_args_match` checks
    it against `from_dlpack` byte for byte (once per process, before first use)."""

    __slots__ = ("_desc", "_ptrs")

    def __init__(self, t):
        self._desc = _DESCS[t.dim()](t.data_ptr(), t.shape, t.stride()[:-1])
        self._ptrs = [ctypes.addressof(self._desc)]

    def __c_pointers__(self) -> list:
        return self._ptrs

    def raw_bytes(self) -> bytes:
        return ctypes.string_at(self._ptrs[0], ctypes.sizeof(self._desc))

    def update(self, t) -> None:
        """Re-point this argument at t (same rank) in place."""
        d = self._desc
        d.ptr = t.data_ptr()
        d.shape[:] = t.shape
        d.stride[:] = t.stride()[:-1]


class _ScalarArg:
    """A scalar kernel argument in storage of its own (c_float scale, c_int32 offset,
    c_void_p stream handle), updated in place by `DirectLaunch`."""

    __slots__ = ("c", "_ptrs")

    def __init__(self, ctype):
        self.c = ctype()
        self._ptrs = [ctypes.addressof(self.c)]

    def __c_pointers__(self) -> list:
        return self._ptrs


class DirectLaunch:
    """One compiled function's launch with its argument storage kept between calls.

    cutlass-dsl's executor rebuilds the argument pointer list on every call (~25-60 us on the
    H200's host, docs/perf-log.md); the compiled host function only reads one pointer per argument.
    This keeps one `RawTensorArg` per tensor and one `_ScalarArg` per scalar, re-pointed in place,
    and calls the executor's entry with the fixed pointer list. `matches` checks once per
    function, byte for byte, that the executor's own argument generation gives the same bytes;
    anything else (another cutlass-dsl, a function without an executor) keeps the plain call.
    Per thread (the storage is shared by the calls of one thread).
    """

    def __init__(self, fn, n_tensors: int, ranks):
        self.executor = fn._default_executor
        self.descs = [RawTensorArg.__new__(RawTensorArg) for _ in range(n_tensors)]
        for d, rank in zip(self.descs, ranks):
            d._desc = _DESCS[rank]()
            d._ptrs = [ctypes.addressof(d._desc)]
        self.scale = _ScalarArg(ctypes.c_float)
        self.offset = _ScalarArg(ctypes.c_int32)
        self.stream = _ScalarArg(ctypes.c_void_p)
        self.args = [*self.descs, self.scale, self.offset, self.stream]
        self.exe_args = [p for a in self.args for p in a.__c_pointers__()]

    def set(self, tensors, softmax_scale, causal_offset, stream) -> None:
        for d, t in zip(self.descs, tensors):
            d.update(t)
        self.scale.c.value = softmax_scale
        self.offset.c.value = causal_offset
        self.stream.c.value = stream

    def __call__(self, tensors, softmax_scale, causal_offset, stream):
        self.set(tensors, softmax_scale, causal_offset, stream)
        return self.executor.run_compiled_program(self.exe_args)

    def launch_pointers(self, pointers, stream):
        """Launch after `set` with tensors of the same shapes and strides: only the data
        pointers and the stream change (`FwdCall`, one call signature)."""
        for d, ptr in zip(self.descs, pointers):
            d._desc.ptr = ptr
        self.stream.c.value = stream
        return self.executor.run_compiled_program(self.exe_args)

    def matches(self, fn, tensors, softmax_scale, causal_offset, stream) -> bool:
        """Whether the executor's argument generation for these arguments points at the same
        bytes as this launch's storage (sizes: descriptors, 4-byte scale and offset, 8-byte
        stream handle)."""
        self.set(tensors, softmax_scale, causal_offset, stream)
        ref_args = (*dlpack_args(*tensors), softmax_scale, causal_offset, cuda.CUstream(stream))
        ref, _keep = fn.execution_args.generate_execution_args(ref_args, {})  # ref_args alive
        sizes = [ctypes.sizeof(d._desc) for d in self.descs] + [4, 4, 8]
        if len(ref) != len(self.exe_args):
            return False

        def addr(p):
            return p.value if isinstance(p, ctypes.c_void_p) else p

        return all(ctypes.string_at(addr(a), n) == ctypes.string_at(addr(b), n)
                   for a, b, n in zip(ref, self.exe_args, sizes))


_DIRECT = threading.local()  # per thread: {id(fn): DirectLaunch or False (checked: plain call)}


def direct_launch_ok(fn) -> bool:
    """Whether `fn`'s argument layout has passed `DirectLaunch.matches` (in this thread)."""
    entry = getattr(_DIRECT, "table", {}).get(id(fn))
    return bool(entry and entry[1])


def _direct_launch(fn, tensors, softmax_scale, causal_offset, stream):
    """The function's `DirectLaunch` once its executor exists and the check passed, else None
    (the first call of a function goes through the plain path, which creates the executor)."""
    table = getattr(_DIRECT, "table", None)
    if table is None:
        table = _DIRECT.table = {}
    entry = table.get(id(fn))
    if entry is not None:
        return entry[1] or None
    if getattr(fn, "_default_executor", None) is None or not hasattr(fn, "execution_args"):
        return None
    direct = DirectLaunch(fn, len(tensors), [t.dim() for t in tensors])
    try:
        ok = direct.matches(fn, tensors, softmax_scale, causal_offset, stream)
    except Exception:  # noqa: BLE001  (any failure of the check means: keep the plain call)
        ok = False
    table[id(fn)] = (fn, direct if ok else False)  # fn kept alive: its id stays unique
    return direct if ok else None


def dlpack_args(*tensors) -> list:
    """Runtime cute tensors through DLPack (the reference packing)."""
    from cutlass.cute.runtime import from_dlpack

    return [from_dlpack(t.detach(), assumed_align=16).mark_layout_dynamic(leading_dim=t.dim() - 1)
            for t in tensors]


def raw_args_match(*tensors) -> bool:
    """Whether `RawTensorArg` packs `tensors` exactly as `from_dlpack` does."""
    for t, ref in zip(tensors, dlpack_args(*tensors)):
        raw = RawTensorArg(t).raw_bytes()
        if ctypes.string_at(ref.__c_pointers__()[0], len(raw)) != raw:
            return False
    return True


@functools.lru_cache(maxsize=1)
def _raw_args_ok() -> bool:
    """One check per process on strided CPU tensors (an offset view, a sliced row, a 3-mode
    fp32 tensor); on a mismatch (another cutlass-dsl ABI) launches keep using DLPack."""
    import torch

    base = torch.empty(2, 3, 9, 72, dtype=torch.bfloat16)  # views 16-byte aligned, as launched
    try:
        ok = raw_args_match(base[:, 1:, 1:, :64], base.transpose(1, 2)[..., 8:],
                            torch.empty(3, 5, 8)[:, 1:, 4:])
    except Exception:  # noqa: BLE001  (any failure of the check means: keep DLPack)
        ok = False
    if not ok:
        import logging

        logging.getLogger("ffpa_cute").warning(
            "cutlass-dsl's tensor argument layout differs from ffpa_cute's packing: kernel "
            "launches use from_dlpack (slower host path)")
    return ok


def fake_grad_args(cfg) -> tuple:
    """Stand-ins for the dQ / dK kernels' (q, k, v, do, grad, lse, delta)."""
    q, k, v, _, lse = fake_args(cfg)
    do, grad, _, _, delta = fake_args(cfg)
    return q, k, v, do, grad, lse, delta


def launch_args(*tensors) -> list:
    """Runtime tensor arguments for torch tensors ([B, H, N, D] / [B, H, N]; last stride 1,
    16-byte aligned, other strides multiples of 8 elements): the layouts `fake_args` promised."""
    if _raw_args_ok():
        return [RawTensorArg(t) for t in tensors]
    return dlpack_args(*tensors)


def current_stream_handle(device) -> int:
    """The raw handle of torch's current CUDA stream on `device` (a CUDA tensor's device).

    `torch.cuda.current_stream(device).cuda_stream` resolves the device index twice and builds
    a Stream object: ~8 us per call on the H200's host; the raw accessor is what it wraps.
    """
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None or device.index is None:
        return torch.cuda.current_stream(device).cuda_stream
    return raw(device.index)


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
    """Compile and launch, shared by the attention kernel classes; a class instance is built
    from its config, the compile key.

    `__call__` takes the tensors named by `OPERANDS` (in that order: "q", "k", "v", "o", "do",
    "dq", "dk", "dv" are [B, H, N, D], "lse" and "delta" [B, Hq, Nq] fp32), then the `SCALARS`
    (softmax scale, causal offset) and the CUDA stream; `launch.run_job` feeds it by these
    names, so the host side needs no per-kernel code."""

    OPERANDS = ("q", "k", "v", "o", "lse")
    SCALARS = ("softmax_scale", "causal_offset")

    @staticmethod
    def arch_of(cfg) -> str:
        return cfg.arch

    # the tensor arguments of `__call__` as compile-time stand-ins (four [B, H, N, D], one
    # [B, Hq, Nq] fp32); kernels with other inputs name their own
    fake_inputs = staticmethod(fake_args)

    @classmethod
    def compile(cls, cfg, options: str = ""):
        """Compile for cfg.arch from fake tensors: no GPU needed, one compile per config."""
        with compile_target(cfg.arch):
            return cute.compile(cls(cfg), *cls.fake_inputs(cfg), 1.0, 0, cuda.CUstream(0),
                                options=options)

    @staticmethod
    def launch(fn, *args) -> None:
        """Run a compiled kernel: its torch tensors in `__call__` order ([B, H, N, D], last
        stride 1, 16-byte aligned, other strides multiples of 8 elements; [B, Hq, Nq] fp32
        contiguous), then softmax_scale, causal_offset and the CUDA stream handle."""
        *tensors, softmax_scale, causal_offset, stream = args
        direct = _direct_launch(fn, tensors, softmax_scale, causal_offset, stream)
        if direct is not None:
            direct(tensors, softmax_scale, causal_offset, stream)
            return
        fn(*launch_args(*tensors), softmax_scale, causal_offset, cuda.CUstream(stream))
