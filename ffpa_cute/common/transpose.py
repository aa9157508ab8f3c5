"""Transpose of 8-bit [B, H, N, D] tensors to [B, H, D, N]: V for the FP8 forward, whose P V
WGMMA takes only K-major operands (the keys contiguous).

One CTA moves a 64 (N) x 64 (D) byte tile through shared memory: 256 threads each load 16
bytes of a row of V (coalesced, one 16-byte load), write them into the tile, and after one
barrier each gathers 16 bytes of a column and stores them as 16 bytes of a row of Vt
(coalesced). Rows past N read as zero; Vt's rows are padded to a multiple of 16 bytes by the
caller, so every store is a whole 16-byte vector inside the allocation. The tile's rows are 68
bytes apart in shared memory so that a column's 16 reads fall in different banks.

Any arch (plain loads, stores and one barrier); bytes are moved as uint8 (the host passes
`view(torch.uint8)` views), so the values are never converted.

Note [Interleaved keys] (config `interleave`, the sm90 FP8 forward's Vt): P V contracts over
the keys, so any order of them serves if P and Vt share it. The FP8 forward stores its P tile
with stmatrix, whose 16-bit elements are byte pairs: the 4 bytes a thread owns in each 16-key
group are keys 2q, 2q + 1 (n8 tile j) and 8 + 2q, 9 + 2q (tile j + 1) of its accumulator
(q = lane % 4), and stmatrix puts them at bytes 4q .. 4q + 3 of the group. So Vt's byte p of
each 16-key group holds key 2 (p / 4) + p % 2 + 8 ((p / 2) % 2) (`KEY_OF_BYTE`), and the
padding past N (to 16) is part of Vt's extent: its bytes hold keys below N.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint8, const_expr

from .compat import compile_target
from .config import TransposeConfig
from .tensors import aligned_bhdn, aligned_bhnd, compile_options, env_stream, fake_tensor

TILE = 64          # rows and columns of a tile (bytes)
ROW_PITCH = 68     # bytes between the tile's rows in shared memory (bank-conflict free columns)
VEC = 16           # bytes per thread per load / store
THREADS = TILE * TILE // VEC
# byte p of an interleaved 16-key group holds key KEY_OF_BYTE[p] (Note [Interleaved keys])
KEY_OF_BYTE = tuple(2 * (p // 4) + p % 2 + 8 * ((p // 2) % 2) for p in range(VEC))


class Transpose8:
    """Vt[b, h, d, n] = V[b, h, n, d] for bytes, one `TransposeConfig`."""

    OPERANDS = ("v", "vt")
    SCALARS = ()

    def __init__(self, cfg: TransposeConfig):
        if cfg.head_dim % VEC or cfg.head_dim <= 0:
            raise ValueError(f"Transpose8: head_dim {cfg.head_dim} must be a positive multiple "
                             f"of {VEC}")
        self.cfg = cfg
        self.d_tiles = -(-cfg.head_dim // TILE)

    @staticmethod
    def arch_of(cfg: TransposeConfig) -> str:
        return cfg.arch

    @classmethod
    def compile(cls, cfg: TransposeConfig, options: str = ""):
        """Compile for cfg.arch from fake tensors: V (B, H, N, D) and Vt (B, H, D, N') uint8."""
        with compile_target(cfg.arch):
            return cute.compile(cls(cfg), fake_tensor(Uint8, 4, VEC), fake_tensor(Uint8, 4, VEC),
                                env_stream(),
                                options=compile_options(options))

    @staticmethod
    def launch(fn, v, vt) -> None:
        """v: (B, H, N, D) uint8 view of V; vt: (B, H, D, N') uint8 with N' >= N a multiple of
        16 (the padded allocation's row); on torch's current stream of the current device."""
        fn(v, vt)

    @cute.jit
    def __call__(self, mV: cute.Tensor, mVt: cute.Tensor, stream: cuda.CUstream):
        d = self.cfg.head_dim
        mV, mVt = aligned_bhnd(mV, d, Uint8), aligned_bhdn(mVt, d, Uint8)  # (B,H,N,D), (B,H,D,N)
        n_tiles = cute.ceil_div(mV.shape[2], TILE)
        grid = (n_tiles * self.d_tiles, cute.size(mV.shape[1]), cute.size(mV.shape[0]))
        self.kernel(mV, mVt, n_tiles).launch(grid=grid, block=[THREADS, 1, 1], stream=stream,
                                             smem=TILE * ROW_PITCH)

    @cute.kernel
    def kernel(self, mV: cute.Tensor, mVt: cute.Tensor, n_tiles: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, head, batch = cute.arch.block_idx()
        n0 = (bidx % n_tiles) * TILE
        d0 = (bidx // n_tiles) * TILE
        seqlen, d = mV.shape[2], self.cfg.head_dim
        smem = cutlass.memory.SmemAllocator()
        sT = smem.allocate_tensor(Uint8, cute.make_layout((TILE, TILE), stride=(ROW_PITCH, 1)),
                                  16)
        r, c = tidx // (TILE // VEC), tidx % (TILE // VEC)
        frag = cute.make_rmem_tensor((VEC,), Uint8)
        # ---- V rows n0 + r, bytes d0 + 16 c .. + 15 -> tile row r (zero past N)
        frag.fill(0)
        if n0 + r < seqlen and d0 + c * VEC < d:
            src = cute.local_tile(mV[batch, head, n0 + r, None], (VEC,), (d0 // VEC + c,))
            cute.autovec_copy(src, frag)
        for i in cutlass.range_constexpr(VEC):
            sT[r, c * VEC + i] = frag[i]
        cute.arch.sync_threads()
        # ---- tile column r (= Vt row d0 + r), bytes 16 c .. + 15 -> Vt row, keys n0 + 16 c ..
        #      (`interleave`: in KEY_OF_BYTE's order)
        for i in cutlass.range_constexpr(VEC):
            key = KEY_OF_BYTE[i] if const_expr(self.cfg.interleave) else i
            frag[i] = sT[c * VEC + key, r]
        if d0 + r < d and n0 + c * VEC < seqlen:
            dst = cute.local_tile(mVt[batch, head, d0 + r, None], (VEC,), (n0 // VEC + c,))
            cute.autovec_copy(frag, dst)


__all__ = ["KEY_OF_BYTE", "Transpose8", "TransposeConfig"]
