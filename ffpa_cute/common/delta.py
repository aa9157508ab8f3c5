"""Delta = rowsum(dO * O) in fp32: the backward's per-row term, in one pass over dO and O.

Both backward families read Delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] (fp32). In
torch that is `(dout.float() * out.float()).sum(-1)`: two fp32 copies of [B, H, N, D] (2 x 512 MB
at B=1, H=32, N=8K, D=512) and ~1.3 ms on the H200. This kernel reads each bf16/fp16 element
once and keeps nothing but Delta: one warp per row, 16-byte loads (8 elements) strided over the
lanes, products accumulated in fp32, a butterfly reduction across the warp.

Any arch (plain global loads and warp shuffles): compiled for the device's target like the
kernels it feeds (config: common/config.py `DeltaConfig`). Status: run and tested on the H200
(tests/test_attention_gpu.py::test_fused_delta); every backward plan runs it first.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .compat import compile_target
from .config import DeltaConfig
from .tensors import CUTLASS_DTYPES, aligned_bhnd, compile_options, env_stream, fake_args

WARPS = 8   # rows per CTA
VEC = 8     # elements per 16-byte load


class RowDot:
    """Delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] for one `DeltaConfig`."""

    OPERANDS = ("do", "o", "delta")  # `launch`'s tensors (no scalars)
    SCALARS = ()

    def __init__(self, cfg: DeltaConfig):
        if cfg.dtype not in CUTLASS_DTYPES or cfg.head_dim % VEC or cfg.head_dim <= 0:
            raise ValueError(f"RowDot: dtype {cfg.dtype!r} (bf16/fp16) and head_dim "
                             f"{cfg.head_dim} (a positive multiple of {VEC}) required")
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        self.vecs = cfg.head_dim // VEC           # 16-byte vectors per row
        self.rounds = -(-self.vecs // 32)         # vectors per lane (the last may be partial)

    @staticmethod
    def arch_of(cfg: DeltaConfig) -> str:
        return cfg.arch

    @classmethod
    def compile(cls, cfg: DeltaConfig, options: str = ""):
        """Compile for cfg.arch from fake tensors (dO, O [B, H, N, D]; Delta [B, H, N] fp32),
        dO's and O's shapes and strides independent symbols (the TVM-FFI wrapper checks each
        argument against its own)."""
        do, _k, _v, o, lse = fake_args(cfg)
        with compile_target(cfg.arch):
            return cute.compile(cls(cfg), do, o, lse, env_stream(),
                                options=compile_options(options))

    @staticmethod
    def launch(fn, dout, out, delta) -> None:
        """dout, out: [B, H, N, D] (last stride 1, 16-byte aligned rows); delta: [B, H, N] fp32
        contiguous; on torch's current stream of the current device."""
        fn(dout, out, delta)

    @cute.jit
    def __call__(self, mdO: cute.Tensor, mO: cute.Tensor, mDelta: cute.Tensor,
                 stream: cuda.CUstream):
        d = self.cfg.head_dim
        mdO, mO = [aligned_bhnd(t, d, self.dtype) for t in (mdO, mO)]
        grid = (cute.ceil_div(mDelta.shape[2], WARPS), cute.size(mDelta.shape[1]),
                cute.size(mDelta.shape[0]))
        self.kernel(mdO, mO, mDelta).launch(grid=grid, block=[32 * WARPS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdO: cute.Tensor, mO: cute.Tensor, mDelta: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, head, batch = cute.arch.block_idx()
        lane = tidx % 32
        row = bidx * WARPS + tidx // 32
        acc = Float32(0.0)
        if row < mDelta.shape[2]:
            gdo = cute.local_tile(mdO[batch, head, row, None], (VEC,), (None,))  # (VEC, vecs)
            go = cute.local_tile(mO[batch, head, row, None], (VEC,), (None,))
            rdo = cute.make_rmem_tensor((VEC,), self.dtype)
            ro = cute.make_rmem_tensor((VEC,), self.dtype)
            for r in cutlass.range_constexpr(self.rounds):
                j = r * 32 + lane
                if j < self.vecs:
                    cute.autovec_copy(gdo[None, j], rdo)
                    cute.autovec_copy(go[None, j], ro)
                    prod = rdo.load().to(Float32) * ro.load().to(Float32)
                    acc = acc + prod.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        for off in cutlass.range_constexpr(5):
            acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=16 >> off)
        if lane == 0 and row < mDelta.shape[2]:
            mDelta[batch, head, row] = acc


__all__ = ["DeltaConfig", "RowDot"]
