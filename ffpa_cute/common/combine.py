"""The split-KV decode's combine: out and LSE from the S split partials in one pass.

The decode kernel (sm90/decode_sm90.py) writes, per split s of each batch row's keys, the
normalised partial O_s [B, H, S, M, Dv] fp32 and its LSE_s [B, H, S, M] (-inf: the split saw no
key of that row). The exact combine is

    top = max_s LSE_s,  w_s = exp(LSE_s - top),  O = sum_s w_s O_s / sum_s w_s,
    LSE = top + log(sum_s w_s)      (a row empty in every split: O = 0, LSE = -inf)

In torch that is ~10 small kernels plus a dtype conversion (~40 µs of launches at B=8: as much
as reading 160 MB of cache); here one warp per (row, 128 columns of Dv) reads the row's S LSEs
(lanes strided over the splits, butterfly max and sum), then the S partial rows' 128 columns
(a 16-byte vector per lane, 4 splits' loads in flight) and writes O in the output dtype; the
first column slice's warp writes the LSE. The column slices are a grid axis so that few rows
with many splits still spread over many SMs (MQA at B=1: 64 rows, up to 256 splits, 16 MB of
partials).

Any arch (plain global loads and warp shuffles), compiled for the decode kernel's target
(config: common/config.py `CombineConfig`). Status: run and tested on the H200 through the
decode tests (tests/test_features_gpu.py).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .compat import compile_target
from .config import CombineConfig
from .tensors import CUTLASS_DTYPES, LOG2_E, compile_options, env_stream, fake_tensor

WARPS = 4   # rows per CTA
VEC = 4     # fp32 partials per 16-byte load
COLS = 32 * VEC  # Dv columns of one warp (a grid axis: ceil(Dv / COLS) slices)
LN2 = 0.6931471805599453


class SplitCombine:
    """O, LSE of the decode kernel's split partials for one `CombineConfig`."""

    OPERANDS = ("o_part", "lse_part", "out", "lse")  # `launch`'s tensors (no scalars)
    SCALARS = ()

    def __init__(self, cfg: CombineConfig):
        if cfg.dtype not in ("bf16", "fp16") or cfg.head_dim_v % VEC or cfg.head_dim_v <= 0:
            raise ValueError(f"SplitCombine: dtype {cfg.dtype!r} (bf16 / fp16) and head_dim_v "
                             f"{cfg.head_dim_v} (a positive multiple of {VEC}) required")
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        self.vecs = cfg.head_dim_v // VEC       # 16-byte vectors per partial row
        self.slices = -(-cfg.head_dim_v // COLS)  # column slices (the last may be partial)

    @staticmethod
    def arch_of(cfg: CombineConfig) -> str:
        return cfg.arch

    @classmethod
    def compile(cls, cfg: CombineConfig, options: str = ""):
        """Compile for cfg.arch from fake tensors: O_s [B, H, S, M, Dv] and LSE_s [B, H, S, M]
        fp32, O [B, H, M, Dv] in cfg.dtype, LSE [B, H, M] fp32 (every size and stride a
        symbol, unit stride last)."""
        out = CUTLASS_DTYPES[cfg.dtype]
        with compile_target(cfg.arch):
            return cute.compile(cls(cfg), fake_tensor(Float32, 5, VEC),
                                fake_tensor(Float32, 4, 1), fake_tensor(out, 4, 128 // out.width),
                                fake_tensor(Float32, 3, 1), env_stream(),
                                options=compile_options(options))

    @staticmethod
    def launch(fn, o_part, lse_part, out, lse) -> None:
        """On torch's current stream of the current device."""
        fn(o_part, lse_part, out, lse)

    @cute.jit
    def __call__(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor,
                 stream: cuda.CUstream):
        grid = (cute.ceil_div(mLse.shape[2], WARPS) * self.slices, cute.size(mLse.shape[1]),
                cute.size(mLse.shape[0]))
        self.kernel(mOp, mLp, mO, mLse).launch(grid=grid, block=[32 * WARPS, 1, 1],
                                               stream=stream)

    @cute.kernel
    def kernel(self, mOp: cute.Tensor, mLp: cute.Tensor, mO: cute.Tensor, mLse: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, head, batch = cute.arch.block_idx()
        lane = tidx % 32
        row = (bidx // self.slices) * WARPS + tidx // 32
        j = (bidx % self.slices) * 32 + lane   # this lane's 16-byte vector of the row
        splits = mLp.shape[2]
        if row < mLse.shape[2]:
            # the row's largest split LSE (log2 units), then the sum of the weights
            top = -Float32.inf
            for s in cutlass.range(lane, splits, 32, unroll=1):
                top = cute.arch.fmax(top, mLp[batch, head, s, row] * LOG2_E)
            for off in cutlass.range_constexpr(5):
                top = cute.arch.fmax(top, cute.arch.shuffle_sync_bfly(top, offset=16 >> off))
            if top == -Float32.inf:  # no split saw a key of this row
                top = Float32(0.0)
            total = Float32(0.0)
            for s in cutlass.range(lane, splits, 32, unroll=1):
                total = total + cute.math.exp2(mLp[batch, head, s, row] * LOG2_E - top,
                                               fastmath=True)
            for off in cutlass.range_constexpr(5):
                total = total + cute.arch.shuffle_sync_bfly(total, offset=16 >> off)
            inv = Float32(0.0)
            if total > Float32(0.0):
                inv = cute.arch.rcp_approx(total)
            # O = sum_s w_s O_s / total on this lane's vector
            gO = cute.local_tile(mO[batch, head, row, None], (VEC,), (None,))   # (VEC, vecs)
            acc = cute.make_rmem_tensor((VEC,), Float32)
            part = cute.make_rmem_tensor((VEC,), Float32)
            res = cute.make_rmem_tensor((VEC,), self.dtype)
            if j < self.vecs:
                acc.fill(0.0)
                for s in cutlass.range(splits, unroll=4):
                    w = cute.math.exp2(mLp[batch, head, s, row] * LOG2_E - top, fastmath=True)
                    gP = cute.local_tile(mOp[batch, head, s, row, None], (VEC,), (None,))
                    cute.autovec_copy(gP[None, j], part)
                    acc.store(acc.load() + part.load() * w)
                res.store((acc.load() * inv).to(self.dtype))
                cute.autovec_copy(res, gO[None, j])
            if j == 0:
                lse = -Float32.inf
                if total > Float32(0.0):
                    lse = (top + cute.math.log2(total, fastmath=True)) * LN2
                mLse[batch, head, row] = lse


__all__ = ["CombineConfig", "SplitCombine"]
