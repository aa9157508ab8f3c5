"""Hopper split-KV decode on the forward's ring: attention of a few query rows per KV head
against a KV cache (contiguous or paged), the keys of each batch row split over several CTAs.

What it computes: for R = q packed and replicated [B, Hkv * S, M, D] (M = G * Nq query rows of
a KV head's G query heads, the same rows for each of the S splits), K / V a cache seen as
(B or pages, Hkv, rows, D) and seqlens_k [B] int32 (keys of batch row b), each CTA (row tile,
head h = kv_head * S + split, batch b) computes the softmax-normalised O over the keys of its
split of row b's keys, in fp32, and its LSE: the split partials [B, Hkv * S, M, Dv] and
[B, Hkv * S, M], which the host merges exactly (`kvcache`, LSE-weighted). Every row sees every
key of its batch row (decode, or a non-causal chunk), or under `causal` the keys up to its
query's position (chunked prefill): the rows of the G heads share one tile.

Why this shape (kernel-design.md, decode; the issue's "≥ 85% of copy bandwidth"): one decode
step reads each cached key once, so it is memory bound, and a batch of 1-8 rows has too few
(batch, KV head) pairs to fill 132 SMs. Packing a KV head's query heads into the rows reads K
and V once for all of them (GQA / MQA 128:1); splitting the keys over S CTAs (S chosen by the
host from B * Hkv and the cache capacity, never from the lengths: no device sync) puts every SM
to work. The split is the head axis: the skeleton already maps R head h to C head h // (Hr /
Hc), which with Hr = Hkv * S is the KV head, and the split is h % S.

`FFPADecodeSm90` is `FFPAFwdSm90` (fwd_sm90.py) with these hooks:
  `_seqlen_c`     the batch row's length from seqlens_k: blocks past it are not visited and
                  the last one is masked (the cache's rows past it are read by TMA and must
                  hold finite values: a NaN there would reach O through P = 0 times V);
  `_block_range`  the split's share of the row's blocks, ceil(n_blocks / S) each (an empty
                  split writes O = 0, LSE = -inf, which the merge ignores);
  `_col_src` / `_b_src`  with `page_rows`: block n of row b lies in page
                  block_table[b, n * tile_n // page_rows]; the TMA views are re-tiled on that
                  page (the cache [num_pages, page_rows, Hkv, D] seen as (pages, Hkv, rows, D)).

Chunked prefill (config `causal`, Nq > 1 a runtime argument): the rows are G heads x Nq
queries, the batch row's last Nq positions; two hooks put the mask in that frame,
`_causal_offset` (seqlen_b - Nq) and `_row_period` (row r is query r % Nq, common/mask.py).

FP8 cache (`kv_dtype` "e4m3", 16-bit q; the keys-as-rows kernel, decode_keys_sm90.py, takes
the shapes with <= 32 rows per KV head and no mask, this one the rest): K / V arrive by TMA in 8-bit rings; the warpgroup
that reads a stage (S: K chunks, each O warpgroup: its V stages) converts it into one of two
16-bit buffers (`RingSkeletonSm90._convert`: exact, every e4m3 value is a bf16 / fp16 value),
refills the 8-bit stage and runs the 16-bit WGMMAs on the buffer: half the cache bytes, the
16-bit kernel's numerics on the dequantised cache. The descales ([B, Hkv] fp32, x = x_fp8 *
descale) fold into the scores' scale (K's) and the final 1 / row_sum (V's), as the FP8
forward's do.

Constraints (`config.can_implement_decode`): the forward's (D 264-1024, Dv != D allowed), no
window / sinks / kv_pair, pages a multiple of tile_n (64 or 128) rows; an FP8 cache needs O
halves of a multiple of 32 columns (Dv per CTA a multiple of 64).
Status: compile-verified on CPU; run on the H200 by tests/test_kvcache_gpu.py (docs/verification.md
says which run).
"""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ..common.softmax import OnlineSoftmax
from ..common.tensors import CUTLASS_DTYPES, fake_tensor
from .config import DecodeConfigSm90, can_implement_decode
from .fwd_sm90 import FFPAFwdSm90
from .ring_context import BLoads, ColLoads, Roles, Scalars, Tile


class DecodeExtra(NamedTuple):
    """The decode kernel's `extra`: per-batch-row key counts, the page table (None for a
    contiguous cache), the number of splits S, the queries per head Nq (row r is query
    r % Nq; read under `causal`) and, for an FP8 cache, K's and V's descales ([B, Hkv] fp32;
    else None)."""

    seqlens: cute.Tensor
    table: object
    num_splits: Int32
    nq: Int32
    k_descale: object = None
    v_descale: object = None


def fake_decode_args(cfg: DecodeConfigSm90) -> tuple:
    """Stand-ins for (q, k, v, o, lse, seqlens_k, block_table, k_descale, v_descale): q (B, H,
    N, D) in the config's dtype, k, v in kv_dtype (outer strides multiples of 16 bytes), o
    (B, H, M, Dv) fp32, lse (B, H, M) fp32, seqlens_k (B,) int32, block_table (B, pages) int32
    or None, the descales (B, Hkv) fp32 with `kv_dtype`, else None."""
    dtype = CUTLASS_DTYPES[cfg.dtype]
    kv = CUTLASS_DTYPES[cfg.kv_dtype or cfg.dtype]
    q = fake_tensor(dtype, 4, 128 // dtype.width)
    k, v = (fake_tensor(kv, 4, 128 // kv.width) for _ in range(2))
    table = fake_tensor(Int32, 2, 1) if cfg.page_rows is not None else None
    descales = ((fake_tensor(Float32, 2, 1), fake_tensor(Float32, 2, 1)) if cfg.kv_dtype
                else (None, None))
    return (q, k, v, fake_tensor(Float32, 4, 4), fake_tensor(Float32, 3, 1),
            fake_tensor(Int32, 1, 1), table, *descales)


class FFPADecodeSm90(FFPAFwdSm90):
    """Split-KV decode (module docstring); one instance per `DecodeConfigSm90`."""

    OPERANDS = ("q", "k", "v", "o", "lse", "seqlens_k", "block_table", "k_descale",
                "v_descale")
    SCALARS = ("softmax_scale", "num_splits", "nq")
    fake_inputs = staticmethod(fake_decode_args)

    def __init__(self, cfg: DecodeConfigSm90):
        self._refuse(can_implement_decode(cfg))
        super().__init__(cfg)

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, mSeqlens: cute.Tensor, mTable, mKd, mVd,
                 softmax_scale: Float32, num_splits: Int32, nq: Int32,
                 stream: cuda.CUstream):
        """q: (B, Hkv * S, M, D); k, v: (B or pages, Hkv, rows, D / Dv) in kv_dtype; o: (B,
        Hkv * S, M, Dv) fp32; lse: (B, Hkv * S, M) fp32; seqlens_k: (B,) int32; block_table:
        (B, pages) int32 with `page_rows`, else None; k_descale, v_descale: (B, Hkv) fp32 with
        `kv_dtype`, else None; nq: queries per head (the rows are G heads x nq queries; read
        under `causal`). Grid = (M tiles * o_split, Hkv * S, B)."""
        extra = DecodeExtra(mSeqlens, mTable, num_splits, nq)
        if const_expr(self.cfg.kv_dtype is not None):
            extra = DecodeExtra(mSeqlens, mTable, num_splits, nq, mKd, mVd)
        self._launch(Roles(rows=mQ, cols=mK, acc_b=mV, out=mO), mLSE, softmax_scale, Int32(0),
                     stream, extra)

    @cute.jit
    def _causal_offset(self, scalars: Scalars, seqlen_c, extra: DecodeExtra):
        """Under `causal` (chunked prefill): the batch row's queries are its last nq
        positions, so query i sees keys j <= i + seqlen - nq."""
        return seqlen_c - extra.nq

    def _row_period(self, extra: DecodeExtra):
        """Under `causal`: row r is query r % nq (G heads x nq queries packed)."""
        return extra.nq if self.causal else None

    @cute.jit
    def _make_softmax(self, num_rows: cutlass.Constexpr, tile: Tile, extra: DecodeExtra):
        """The forward's score state; with an FP8 cache K's descale joins the scores' scale
        and V's the final 1 / row_sum."""
        if const_expr(self.cfg.kv_dtype is None):
            return OnlineSoftmax(num_rows, tile.scale_log2)
        batch, head_kv = tile.batch, tile.head_c
        return OnlineSoftmax(num_rows, tile.scale_log2 * extra.k_descale[batch, head_kv],
                             out_scale=extra.v_descale[batch, head_kv])

    # ---------------------------------------------------------------- hooks: the block walk
    @cute.jit
    def _seqlen_c(self, scalars: Scalars, batch, extra: DecodeExtra):
        """The batch row's keys (seqlens_k[b])."""
        return extra.seqlens[batch]

    @cute.jit
    def _block_range(self, tile: Tile, group, extra: DecodeExtra):
        """Split h % S of the row's blocks: [s * per, min((s + 1) * per, n_blocks)), per =
        ceil(n_blocks / S); visited highest first (the masked last block first)."""
        n_blocks = (tile.seqlen_c + self.tile_n - 1) // self.tile_n
        splits = extra.num_splits
        per = (n_blocks + splits - 1) // splits
        lo = (tile.head % splits) * per
        hi = cutlass.min(lo + per, n_blocks)
        return hi, cutlass.max(hi - lo, 0)

    @cute.jit
    def _page(self, loads, row, rows: cutlass.Constexpr):
        """(batch or page index, block of `rows` rows within it) holding the row's cache row
        `row` (a multiple of `rows`)."""
        extra, batch = loads.extra, loads.seq.batch
        if const_expr(self.cfg.page_rows is None):
            return batch, row // rows
        pr = self.cfg.page_rows
        return extra.table[batch, row // pr], (row % pr) // rows

    @cute.jit
    def _col_src(self, loads: ColLoads, head, n_block, c):
        """K chunk c of block n_block of the tile's batch row, from its page."""
        if const_expr(self.cfg.page_rows is None):
            return loads.tCg[None, n_block, c]
        page, blk = self._page(loads, n_block * self.tile_n, self.tile_n)
        return self._col_src_at(loads, head, page, blk, c)

    @cute.jit
    def _b_src(self, loads: BLoads, head, row_block):
        """V rows block row_block (of b_rows rows) of the tile's batch row, this warpgroup's
        columns, from its page."""
        if const_expr(self.cfg.page_rows is None):
            return loads.tBg[None, row_block]
        page, blk = self._page(loads, row_block * self.b_rows, self.b_rows)
        return self._b_src_at(loads, head, page, blk)


__all__ = ["DecodeExtra", "FFPADecodeSm90", "fake_decode_args"]
