"""Compile keys and planners of the Hopper WGMMA kernels: the forward (`FFPAFwdSm90`) and the
backward's dV, dQ and dK kernels (bwd_sm90.py), siblings on one warp-specialised ring
(`RingSkeletonSm90`, skeleton_sm90.py) with their operands in its roles. The fused 5-unit
backward's key and planner live in fused_config.py, on this module's sizes and checks.

Each config is frozen and holds Python scalars only; `(kernel qualname, cfg)` is the
compile-cache key and `cfg.KERNEL` names the kernel class ("module:Class"). The planners never
return a config that its `can_implement` rejects; this module imports no cutlass.

# === TUNING TABLE ===================================================================
# tile_m 64 (one m64 WGMMA row block: O[64 x D] fp32 is 128 KB at D = 512, half the register
#   file, split between two O warpgroups), tile_n 128 (QK WGMMA m64n128k16: 96 B of smem operand
#   reads per MMA-cycle, under the measured port; n64 would need 128).
# k_chunk 64: one 128-byte swizzle atom of K per ring stage, [128 x 64] = 16 KB.
# V rows per ring stage: 32 when an O half is wider than 128 columns (a [32 x 256] stage is
#   16 KB), else 64.
# Ring depths: K 4 stages (fewer starves QK), then the deepest V rings (<= 4) that fit beside
#   resident Q and two P buffers, then any room left goes to K. publish_after = all K chunks.
# D in (512, 576], 16-bit, not varlen (`wide_o`): O (the gradient kernels: their gradient)
#   stays in one CTA, each accumulator warpgroup's share at most 288 columns (144 fp32
#   registers a thread) with `setmaxnreg` S 152 / O 176 and the product issued as m64n96
#   WGMMAs (no instruction needs more than the launch's 168); the forward with Q resident, K
#   ring 3, V rings 2 (perf.one_cta: 1.3-1.45x the CTA pair; the gradient kernels 1.04-1.3x).
# D > 512 otherwise (o_split 2): O[64 x D] needs more than the O warpgroups' registers,
#   so two CTAs share each Q tile, each computing half of O's columns; both compute the full
#   S = Q K^T (QK recomputed: at most 2/3 of the tensor work is counted), and Q streams through
#   the K ring in [64 x 64] chunks (Q[64 x 1024] would take 128 KB of smem). Both CTAs own
#   ceil(D / 16) * 8 columns (one TMA box width serves both); at D % 16 == 8 the second CTA's
#   last 8 lie past D: TMA reads them as zeros and they are not stored.
# =====================================================================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from ..common.config import deepest_rings
from ..problem import AttnProblem

SMEM_CAPACITY = 232448  # bytes per CTA on sm_90a
WGMMA_MAX_N = 256       # the widest WGMMA (m64nNk16) accumulator
DTYPES = ("bf16", "fp16")
FP8_DTYPES = ("e4m3",)
ELEM_BYTES = {"bf16": 2, "fp16": 2, "e4m3": 1}
MIN_HEAD_DIM, MAX_HEAD_DIM = 264, 1024
MAX_SINGLE_CTA_HEAD_DIM = 512  # above: o_split 2, except the 16-bit forward up to WIDE_MAX_DV
TILE_M = 64
# The 16-bit forward keeps O in one CTA up to this Dv (`wide_o`), each O warpgroup computing at
# most WIDE_SHARE columns with `setmaxnreg` (S, O) = WIDE_O_REGS: 0 spills (ptxas), where a
# 320-column share (D=584-640) spilled 1.7-3.4 KB at S 144 / O 184. `setmaxnreg.inc` takes
# registers from the CTA's own pool, the launch's 168 x 384, so S + 2 O <= 504 (S 160 / O 176
# hung on the GPU); with varlen (its tile walk) S 152 spilled 20 B at D=576 causal, so varlen
# keeps the CTA pair
WIDE_MAX_DV = 576
WIDE_SHARE = 288
WIDE_O_REGS = (152, 176)
# The gradient kernels (dQ, dK, dV) with their gradient in one CTA up to WIDE_MAX_DV too
# (`wide_o`; dQ and dK K 4 / V 4 stages, dV the K tile resident, K 3 / V 2; ptxas 0 spills):
# faster than their CTA pair at every D timed (perf.one_cta --bwd, H100, causal N=8K: the three
# kernels' sum 1.16x at 520, 1.28x at 544, 1.06x at 576)
WIDE_BWD = True


@dataclass(frozen=True)
class FwdConfigSm90:
    """Everything that changes the generated code of the WGMMA forward.

    arch:          "sm_90a"
    dtype:         "bf16" | "fp16"; accumulation is fp32
    head_dim:      D, a multiple of 8 in [264, 1024]; above 512 O is split over 2 CTAs
                   (`o_split`) except where one holds it (`wide_o`)
    causal:        causal masking (the diagonal offset is a runtime argument)
    tile_n:        KV rows per block (the N of the QK WGMMA)
    k_stages:      depth of the K ring ([tile_n x 64] chunks)
    v_stages:      depth of each of the two V rings ([v_rows x D/2] chunks)
    publish_after: QK WGMMA chunks of block n+1 the S warpgroup issues before it hands P[n] to
                   the O warpgroups (0: hand over first). Orders the tensor-core queue so that
                   PV[n] runs while softmax[n+1] does (docs/perf-log.md, "WGMMA order").
    stream_q:      Q streams through the K ring (a [64 x 64] Q chunk beside each K chunk)
                   instead of staying resident: required when O is split over two CTAs (D > 512);
                   at D <= 512 it trades L2 reads of Q for smem given to the V rings.
    head_dim_v:    Dv of V and O when it differs from D (MLA-absorbed 576 / 512), else None (one
                   key per kernel): a multiple of 16 in [64, 512] (O in one CTA), or for the
                   16-bit forward D - 8 (`launch.widened_fwd`: a D % 16 == 8 problem's scores
                   over 8 zero-padded columns more)
    kv_pair:       with o_split 2: the two CTAs of a Q tile form a cluster and split the KV
                   blocks instead of both computing every S (each computes S for every other
                   block, the pair exchanges row maxima and P through distributed shared
                   memory, and each still accumulates its half of O over all blocks)
    window:        a sliding window's left edge: query i sees key j only if j >= i + window_lo
                   (a runtime argument); the blocks left of it are skipped, the ones crossing
                   it masked. The right edge is `causal` with offset min(causal, window right).
    sinks:         a per-query-head sink logit joins each row's softmax denominator and LSE
                   (a runtime [Hq] fp32 tensor; the forward's only: the gradient kernels read
                   the sink through the LSE)
    half_align:    each O warpgroup computes its columns in a width rounded up to a multiple of
                   this (8: exact; 32 or 64: a V stage wide enough for the 64- or 128-byte
                   swizzle, where the exact width, e.g. 136 or 168 columns, fits only a
                   32-byte one or none and WGMMA's reads of V conflict); the extra columns
                   are real V columns of the other half (or TMA's zeros past Dv), computed and
                   not stored. 16-bit operands only
    split_align:   the hi O warpgroup's first column (`dv_split`'s lo) rounded up to a multiple
                   of this: 8, the most even shares WGMMA allows; 64 (16-bit, half_align 32 or
                   64), a share boundary on a 128-byte line, so the hi warpgroup's V boxes start
                   on lines and, with half_align 64, the lo share is exactly its computed width:
                   the padded columns fall in the hi share only (D=320: 192 + 128 computed
                   columns instead of 192 + 192; D=400: 256 + 192 instead of 256 + 256)
    cta_align:     with O over two CTAs, each CTA's width (`dv_cta`) rounded up to a multiple of
                   this: 8, the most even split; 64 (16-bit), the second CTA's first column on
                   a 128-byte line (D=576: 320 + 256 stored instead of 288 + 288; its columns
                   past Dv come from TMA's zeros and are not stored); 32 (16-bit), on a
                   64-byte half line (D=520: 288 + 232), which the planner takes at D % 128
                   == 8 above 512 (fewer padded columns than 64 there)
    persistent:    one CTA per SM (the runtime `num_ctas`) walks row tiles t = its index,
                   + num_ctas, ... (`common/scheduler.py`) instead of one CTA per tile, so a
                   tile's prologue (Q load, ring fill) and epilogue (last PV, O store) overlap
                   its neighbours' work; one CTA per row tile (o_split 1), 16-bit forward
                   only (`plan_fwd` says where it is used)
    varlen:        packed variable-length sequences in one launch: the row and column tensors
                   are [1, H, total, D] views and the kernel takes the sequences' cumulative
                   lengths (int32 [B + 1] each); CTA t walks them to find its sequence and row
                   tile (skeleton `_varlen_tile`), and the causal offset and window edge are
                   per sequence (the runtime scalars plus the sequence's Nkv - Nq). 16-bit
                   forward, dQ, dK and dV; not persistent
    group_split:   dV and dK only: the G = Hq / Hkv query heads whose gradients a KV tile sums
                   are split over S CTAs (grid y = Hkv * S), each writing its partial sum in
                   fp32 to a workspace [B, Hkv * S, Nkv, D] that the host adds up in a fixed
                   order (`launch.run_grad_job`), so GQA / MQA with few KV tiles get enough
                   CTAs. S is a launch-time choice (`group_parts`), read by the kernel as the
                   workspace's heads / Hkv; deterministic either way
    overlap:       0, or the forward's QK[i+1] chunks issued before the score step of block i
                   (into a second score accumulator; the rest of QK[i+1] after it), so the
                   tensor cores run them and PV[i-1] under the softmax of block i: the S
                   warpgroup's chain is its waits, no longer QK + softmax + P store in series
                   (`_overlap_blocks`, overlap_ring.py). 1 <= overlap < the D chunks; one CTA
                   per row tile with Q resident (no `kv_pair` / `stream_q` / `persistent`), the FP8
                   forward (routed up to D=384, `plan_fwd`; the 16-bit forward measured
                   slower with it at D=320, docs/perf-log.md 2026-12-05). k_stages >= chunks;
                   >= chunks + overlap gives the first chunks a whole step of prefetch (fewer
                   stages only wait longer)
    shared_kv:     V is K's first Dv columns (`v is k`, or v a view of k's storage with k's
                   strides: DeepSeek's absorbed MLA, Dqk 576 / Dv 512), so the kernel reads no
                   V: each O warpgroup's B operand is its columns of the block's K chunks in
                   the K ring, and the K block is loaded once for both products. The ring then
                   holds two whole blocks of the Dv / 64 V chunks (slot i % 2 for block i) and
                   one block of the chunks past Dv; a V chunk is refilled by the O warpgroup
                   that reads it last (block i + 2, after its PV[i]), a chunk past Dv by the S
                   warpgroup after QK[i] (block i + 1). tile_n 64, Q resident, no V rings
                   (v_stages 0, k_stages `shared_stages`), Dv a multiple of 128 (each O
                   warpgroup owns whole chunks), 16-bit, one CTA per tile (no `kv_pair`,
                   `persistent`, `overlap`, `varlen`)
    lazy_rescale:  a row keeps its max (FP8: its frame) while a block's max stays within a few
                   powers of 2 of it, so its factor is exactly 1 and the O warpgroups skip the
                   row's rescale (common/softmax.py, Note [Lazy rescaling]; FlashAttention-4's
                   conditional rescaling). The forward kernels, one CTA per row tile (no
                   `kv_pair`); planned for the plain 16-bit and FP8 forwards at the head dims
                   where it measured faster (`plan_fwd`'s `tuned`, LAZY_RESCALE_HEAD_DIMS), a
                   tuning field elsewhere
    wide_o:        O (the gradient kernels: their gradient) wider than 512 columns in one CTA,
                   Dv == D in (512, WIDE_MAX_DV], 16-bit, not varlen: each accumulator
                   warpgroup holds up to WIDE_SHARE columns (144 fp32 registers a thread at
                   288), which fit by moving registers from the S warpgroup (`setmaxnreg`,
                   WIDE_O_REGS) and issuing each product as WGMMAs of `pv_atom_n` columns (one
                   m64n288 would be past WGMMA's N, and no single instruction may need more
                   registers than the launch's 168); no `kv_pair` or `persistent`. Planned for
                   the 16-bit forward (`plan_fwd`); the gradient kernels' planners take it with
                   WIDE_BWD on
    """

    arch: str
    dtype: str
    head_dim: int
    causal: bool
    tile_n: int = 128
    k_stages: int = 4
    v_stages: int = 2
    publish_after: int = 0
    stream_q: bool = False
    head_dim_v: int | None = None
    kv_pair: bool = False
    window: bool = False
    sinks: bool = False
    half_align: int = 8
    split_align: int = 8
    cta_align: int = 8
    persistent: bool = False
    varlen: bool = False
    group_split: bool = False
    overlap: int = 0
    shared_kv: bool = False
    lazy_rescale: bool = False
    wide_o: bool = False

    KERNEL: ClassVar[str] = "ffpa_cute.sm90.fwd_sm90:FFPAFwdSm90"

    @property
    def tile_m(self) -> int:
        return TILE_M

    @property
    def elem_bytes(self) -> int:
        """Bytes per element of Q, K, V and P."""
        return ELEM_BYTES[self.dtype]

    @property
    def k_chunk(self) -> int:
        """Head-dim columns per S-ring chunk: one 128-byte swizzle atom (64 at 16 bits, 128 at
        8 bits)."""
        return 128 // self.elem_bytes

    @property
    def mma_k(self) -> int:
        """K of one WGMMA instruction: 16 at 16 bits, 32 at 8 bits (32 bytes either way)."""
        return 32 // self.elem_bytes

    @property
    def num_k_chunks(self) -> int:
        return -(-self.head_dim // self.k_chunk)

    @property
    def dv(self) -> int:
        """Head dim of V and O."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def o_split(self) -> int:
        """CTAs per Q tile, each owning dv / o_split columns of O."""
        return 1 if self.dv <= MAX_SINGLE_CTA_HEAD_DIM or self.wide_o else 2

    @property
    def hdim_q_padded(self) -> int:
        """sQ width: whole 128-byte swizzle atoms (TMA zero-fills the columns past D)."""
        return self.num_k_chunks * self.k_chunk

    @property
    def dv_cta(self) -> int:
        """O columns one CTA owns: Dv / o_split rounded up to a multiple of `cta_align` (the
        second CTA of a D % 16 == 8 split owns 8 columns past Dv, with `cta_align` 64 up to 120,
        computed from TMA's zeros and not stored)."""
        a = self.cta_align
        return -(-self.dv // (a * self.o_split)) * a

    @property
    def dv_split(self) -> tuple[int, int]:
        """O columns each of the CTA's two O warpgroups stores: multiples of 8, lo >= hi (the
        hi warpgroup's first column is lo, a multiple of `split_align`). `wide_o` with
        `split_align` 64: lo 256 (the hi share from a line) where the rest fits WIDE_SHARE,
        else WIDE_SHARE (a half line), so lo < hi at D=520-544."""
        a = self.split_align
        if self.wide_o and a == 64:
            lo = 256 if self.dv_cta - 256 <= WIDE_SHARE else WIDE_SHARE
            return lo, self.dv_cta - lo
        lo = -(-self.dv_cta // (2 * a)) * a
        return lo, self.dv_cta - lo

    @property
    def dv_halves(self) -> tuple[int, int]:
        """O columns each O warpgroup computes (its WGMMA N, its V stages' width): its
        `dv_split` share rounded up to a multiple of `half_align`."""
        a = self.half_align
        return tuple(-(-w // a) * a for w in self.dv_split)

    @property
    def v_rows(self) -> int:
        """KV rows per V-ring stage: 16 KB stages at 16 bits ([32 x 256] or [64 x 128]); at 8
        bits a stage is Vt's [D/2 x 64] (a 64-byte swizzled K of the PV WGMMA)."""
        if self.elem_bytes == 1:
            return 64
        if self.shared_kv:  # the block's rows of the K chunks
            return self.tile_n
        return 32 if self.dv_halves[0] > 128 else 64

    def smem_bytes(self) -> int:
        """Shared memory of one CTA, laid out as `RingSkeletonSm90`'s storage struct: barriers and
        row factors first, then Q, the K ring, the two V rings and P, each 1 KB aligned."""
        regions = self.smem_regions()
        p_full = 2 if self.publish_hi is None else 4  # per buffer, or per buffer and half
        header = 8 * (1 + self.k_stages + 2 * self.v_stages + 2 + p_full) + self.factor_floats * 4
        if self.pair_barriers:  # the exchange barriers
            header = _align(header + 16 * len(self.pair_barriers), 16)
        if self.pair_stats:  # the peer's row statistics (2 x TILE_M)
            header += 2 * TILE_M * 4
        return sum(_align(x) for x in [header, *regions])

    def smem_regions(self) -> list[int]:
        """Bytes of the storage struct's tensors after the header, in order: Q (resident, or
        its ring), the K ring, the two V rings, P."""
        elt = self.elem_bytes
        q = (self.k_stages * TILE_M * self.k_chunk if self.stream_q
             else TILE_M * self.hdim_q_padded) * elt
        return [q,
                self.k_stages * self.tile_n * self.k_chunk * elt,
                *(0 if self.shared_kv else self.v_stages * self.v_rows * d * elt
                  for d in self.dv_halves),
                self.p_slots * TILE_M * self.tile_n * elt]

    @property
    def v_chunks(self) -> int:
        """`shared_kv`: the K ring chunks that are V's columns (Dv / k_chunk)."""
        return self.dv // self.k_chunk

    @property
    def shared_stages(self) -> int:
        """`shared_kv`: the K ring's stages, two blocks of V chunks and one block of the
        chunks past Dv."""
        return self.num_k_chunks + self.v_chunks

    @property
    def stream_chunks(self) -> int:
        """S-ring chunks per block (the bound of `publish_after`): the D chunks of QK here."""
        return self.num_k_chunks

    @property
    def publish_hi(self) -> int | None:
        """S-ring chunk after which the second accumulator warpgroup gets P when it differs
        from the first's (`publish_after`); None: both at `publish_after` (the forward)."""
        return None

    @property
    def ctas_per_tile(self) -> int:
        """CTAs per row tile on the grid (adjacent): o_split here."""
        return self.o_split

    @property
    def cluster_pair(self) -> bool:
        """Whether the CTAs of a tile form a 2-CTA cluster that writes into each other's
        shared memory (`kv_pair`)."""
        return self.kv_pair

    @property
    def pair_stats(self) -> bool:
        """Whether a `kv_pair` joins per-row statistics with the peer (the forward's running
        max and row sums; the gradient kernels read the LSE and exchange only P)."""
        return self.kv_pair

    @property
    def pair_barriers(self) -> tuple[str, ...]:
        """The exchange mbarriers (2 each) of a cluster pair: `kv_pair` has the peer's P tile
        (bar_pp) and, with `pair_stats`, its row statistics (bar_x) landing."""
        if not self.kv_pair:
            return ()
        return ("bar_x", "bar_pp") if self.pair_stats else ("bar_pp",)

    @property
    def p_slots(self) -> int:
        """P tiles in smem: two buffers, each with both CTAs' tiles under `kv_pair`."""
        return 4 if self.kv_pair else 2

    @property
    def factor_floats(self) -> int:
        """Floats of the row-factor buffer (two blocks' row factors; the backward's column
        statistics in it need 2 * tile_n)."""
        return 2 * TILE_M


def _align(nbytes: int, to: int = 1024) -> int:
    return -(-nbytes // to) * to


def _wide_fits(problem: AttnProblem) -> bool:
    """Whether a problem's O (or gradient) fits one CTA above 512 columns (`wide_o`): 16-bit,
    D == Dv in (512, WIDE_MAX_DV], not varlen (its tile walk spilled the S warpgroup)."""
    return (problem.dtype in DTYPES and problem.head_dim == problem.head_dim_v
            and MAX_SINGLE_CTA_HEAD_DIM < problem.head_dim <= WIDE_MAX_DV and not problem.varlen)


def pv_atom_n(width: int) -> int:
    """The N of the WGMMAs an O warpgroup's `width` columns are issued as: width itself up to
    WGMMA_MAX_N, else (`wide_o`, width a multiple of 32) the widest divisor of it that is at
    most WGMMA_MAX_N and a whole number of the V stage's swizzle atoms at 16 bits (64 columns
    for the 128-byte swizzle, when width % 64 == 0; else 32 for the 64-byte one): 96 for 288."""
    if width <= WGMMA_MAX_N:
        return width
    step = 64 if width % 64 == 0 else 32
    return max(n for n in range(step, WGMMA_MAX_N + 1, step) if width % n == 0)


@dataclass(frozen=True)
class FwdFP8ConfigSm90(FwdConfigSm90):
    """Compile key of the FP8 forward (`FFPAFwdSm90FP8`): the forward's fields with dtype "e4m3"
    (Q, K, V and P in e4m3, K = 32 WGMMAs, fp32 accumulation) and the output's dtype.

    out_dtype: "bf16" | "fp16", the dtype of O (LSE stays fp32).
    """

    out_dtype: str = "bf16"

    KERNEL: ClassVar[str] = "ffpa_cute.sm90.fwd_sm90:FFPAFwdSm90FP8"


@dataclass(frozen=True)
class DecodeConfigSm90(FwdConfigSm90):
    """Compile key of the split-KV decode forward (`FFPADecodeSm90`, decode_sm90.py): the
    forward's fields for a problem whose rows see every key of their batch row (decode with
    the query heads packed into rows; no window, sinks or `kv_pair`), with K / V read from a
    cache of per-row length and O written as fp32 split partials. `causal`: chunked prefill,
    the rows are G heads x Nq queries (Nq a runtime argument), query i at key position
    seqlen - Nq + i seeing the keys up to it.

    page_rows: the cache's page size when K / V are paged (a multiple of tile_n: each KV block
               lies in one page), None for a contiguous cache.
    kv_dtype:  "e4m3" for an FP8 cache with 16-bit queries (K / V dequantised to `dtype` in
               shared memory, exactly: every e4m3 value is a bf16 and an fp16 value; the
               per-(batch, KV head) descales fold into the softmax scale and O's final factor),
               None when K / V are in `dtype`.
    """

    page_rows: int | None = None
    kv_dtype: str | None = None

    KERNEL: ClassVar[str] = "ffpa_cute.sm90.decode_sm90:FFPADecodeSm90"

    @property
    def out_dtype(self) -> str:
        """O's dtype: fp32 (split partials, merged on the host)."""
        return "fp32"

    @property
    def kv_bytes(self) -> int:
        """Bytes per element of K and V in global memory (1: an FP8 cache)."""
        return self.elem_bytes if self.kv_dtype is None else ELEM_BYTES[self.kv_dtype]

    @property
    def v_rows(self) -> int:
        """The forward's, halved for an FP8 cache where the conversion can tile 16 rows (O
        halves of a multiple of 64 columns): its two 16-bit V buffers per O half are then
        16 KB in all, and the smem they free deepens the 8-bit rings (D=512: 96 KB in flight
        instead of 64; measured: no change, the conversion and the 64-row MMA tiles bound the
        kernel, docs/design.md section 11)."""
        rows = super().v_rows
        if self.kv_dtype is None or any(cvt_tiling(rows // 2, d) is None
                                        for d in self.dv_halves):
            return rows
        return rows // 2

    def cvt_tiles(self) -> list[tuple[int, int]]:
        """(rows, cols) of the stages `_convert` converts: a K chunk, each O half's V stage."""
        return [(self.tile_n, self.k_chunk), *((self.v_rows, d) for d in self.dv_halves)]

    @property
    def cvt_bufs(self) -> int:
        """16-bit K chunks and V stages the score and accumulator warpgroups convert an FP8
        cache into (two each: one converted while the WGMMAs read the other); 0 without."""
        return 0 if self.kv_dtype is None else 2

    def smem_regions(self) -> list[int]:
        """The forward's, with an FP8 cache: the K and V rings hold two 16-bit conversion
        buffers each, and the TMA's 8-bit stages (k_stages / v_stages deep) follow P."""
        regions = super().smem_regions()
        if self.kv_dtype is None:
            return regions
        q, _, _, _, p = regions
        c16 = self.tile_n * self.k_chunk * self.elem_bytes
        b16 = [self.v_rows * d * self.elem_bytes for d in self.dv_halves]
        kv, elt = self.kv_bytes, self.elem_bytes
        return [q, self.cvt_bufs * c16, *(self.cvt_bufs * b for b in b16), p,
                self.k_stages * c16 * kv // elt, *(self.v_stages * b * kv // elt for b in b16)]


KEYS_TILE = 64        # keys per block of the keys-as-rows decode (the WGMMA M)
KEYS_MAX_ROWS = 32    # query rows per KV head it takes (3 x 32 columns of Q's e4m3 terms)


@dataclass(frozen=True)
class DecodeKeysConfigSm90:
    """Compile key of the keys-as-rows decode (`FFPADecodeKeysSm90`, decode_keys_sm90.py): an
    FP8 (e4m3) cache under 16-bit queries when a KV head has few query rows (G * Nq <= 32, not
    causal), where the row-tiled decode kernel fills 8 of WGMMA's 64 rows and spends 8x the
    tensor work (docs/design.md section 11). Keys are the WGMMA's M and the query rows its N.

    dtype:      "bf16" | "fp16": the queries (the products run in e4m3 and fp16 whatever it is)
    head_dim:   D, a multiple of 32 (one e4m3 WGMMA k step) in [64, 1024]
    head_dim_v: Dv when it differs from D (MLA 576 / 512), else None; a multiple of 128 (two
                warpgroups each take half of it in 64-row M tiles of the P V product)
    rows:       query rows per KV head, padded to a multiple of 8 (the WGMMA N), <= 32
    page_rows:  the page size of a paged cache (a multiple of 64), None for a contiguous one
    stages:     depth of the K / V ring (one 64-key block of K and of V per stage)
    """

    arch: str
    dtype: str
    head_dim: int
    rows: int
    head_dim_v: int | None = None
    page_rows: int | None = None
    stages: int = 2
    kv_dtype: str = "e4m3"

    KERNEL: ClassVar[str] = "ffpa_cute.sm90.decode_keys_sm90:FFPADecodeKeysSm90"

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def causal(self) -> bool:
        """The rows see every key of their batch row (causal chunks take the row-tiled kernel)."""
        return False

    @property
    def tile_n(self) -> int:
        """Keys per block."""
        return KEYS_TILE

    @property
    def tile_m(self) -> int:
        """Query rows one CTA takes (all of a KV head's)."""
        return self.rows

    @property
    def o_split(self) -> int:
        return 1

    def smem_regions(self) -> list[int]:
        """Bytes of: the K stages, the two warpgroups' e4m3 V stages (a half of Dv each), Q's
        three e4m3 terms, each warpgroup's P (fp16), then the small buffers (barriers, row
        scales, the column reductions)."""
        d, dv, n, t = self.head_dim, self.dv, self.rows, KEYS_TILE
        small = 8 * 4 * self.stages + 4 * n + 2 * 4 * 4 * n
        return [self.stages * t * d, self.stages * t * dv, 3 * n * d, 2 * 2 * n * t, small]

    def smem_bytes(self) -> int:
        """An upper bound of the storage struct (each region 1024-byte aligned)."""
        return sum(-(-r // 1024) * 1024 for r in self.smem_regions())


def can_implement_decode_keys(cfg: DecodeKeysConfigSm90) -> str | None:
    """None when the keys-as-rows decode can be built for cfg, else the reason."""
    if cfg.arch != "sm_90a":
        return f"arch {cfg.arch!r}: WGMMA and TMA need sm_90a"
    if cfg.dtype not in DTYPES or cfg.kv_dtype not in FP8_DTYPES:
        return (f"dtype {cfg.dtype!r} / kv_dtype {cfg.kv_dtype!r}: 16-bit queries {DTYPES} "
                f"over an FP8 cache {FP8_DTYPES}")
    if cfg.head_dim % 32 or not 64 <= cfg.head_dim <= MAX_HEAD_DIM:
        return f"head_dim={cfg.head_dim}: a multiple of 32 in [64, {MAX_HEAD_DIM}]"
    if cfg.dv % 128 or not 128 <= cfg.dv <= MAX_HEAD_DIM:
        return (f"head_dim_v={cfg.dv}: a multiple of 128 in [128, {MAX_HEAD_DIM}] (two "
                "warpgroups' halves of 64-row M tiles)")
    if cfg.rows % 8 or not 8 <= cfg.rows <= KEYS_MAX_ROWS:
        return f"rows={cfg.rows}: a multiple of 8 in [8, {KEYS_MAX_ROWS}]"
    if cfg.page_rows is not None and (cfg.page_rows <= 0 or cfg.page_rows % KEYS_TILE):
        return f"page_rows={cfg.page_rows}: pages of a multiple of {KEYS_TILE} rows"
    if cfg.stages < 2:
        return "stages must be >= 2"
    if cfg.smem_bytes() > SMEM_CAPACITY:
        return (f"shared memory {cfg.smem_bytes()} B > {SMEM_CAPACITY} (D={cfg.head_dim}, "
                f"Dv={cfg.dv}, rows={cfg.rows}, stages={cfg.stages})")
    return None


def plan_decode_keys(problem: AttnProblem, arch: str,
                     page_rows: int | None) -> DecodeKeysConfigSm90 | None:
    """The keys-as-rows decode's config (the deepest ring that fits, at most 4) for a packed
    FP8-cache problem with at most 32 rows per KV head and no mask, or None."""
    if problem.causal or problem.has_window or problem.has_sinks:
        return None
    rows = -(-problem.seqlen_q // 8) * 8
    dv = problem.head_dim_v if problem.head_dim_v != problem.head_dim else None
    best = None
    for stages in (2, 3, 4):
        cfg = DecodeKeysConfigSm90(arch, problem.dtype, problem.head_dim, rows, dv, page_rows,
                                   stages)
        if can_implement_decode_keys(cfg) is None:
            best = cfg
    return best


CVT_THREADS = 128  # a warpgroup converts each stage


def cvt_tiling(rows: int, cols: int) -> tuple[int, int] | None:
    """(vec, tpr) of the in-smem FP8 conversion of a [rows x cols] stage, or None when no
    tiling fits: runs of vec contiguous values per thread (16: one 16-byte load, else 8; a run
    never crosses a swizzle atom), tpr = gcd(cols / vec, 128) threads per row, 128 / tpr rows
    per pass, which must divide rows. The planner's check and the kernel's layout both."""
    for vec in (16, 8):
        if cols % vec == 0:
            tpr = math.gcd(cols // vec, CVT_THREADS)
            if rows % (CVT_THREADS // tpr) == 0:
                return vec, tpr
    return None


def can_implement_decode(cfg: DecodeConfigSm90) -> str | None:
    """The decode kernel's constraints beyond the forward's."""
    reason = can_implement(cfg)
    if reason is None and (cfg.window or cfg.sinks or cfg.kv_pair):
        reason = ("the decode kernel serves rows that see every key of their batch row, or "
                  "(causal) a chunk of the row's last queries: no window, sinks or kv_pair")
    if reason is None and cfg.kv_dtype not in (None, *FP8_DTYPES):
        reason = f"kv_dtype {cfg.kv_dtype!r}: None (K / V in {cfg.dtype}) or one of {FP8_DTYPES}"
    if reason is None and cfg.kv_dtype is not None and any(
            cvt_tiling(r, c) is None for r, c in cfg.cvt_tiles()):
        reason = (f"head_dim_v={cfg.dv}: an FP8 cache is converted in runs that need O halves "
                  f"of a multiple of 32 columns (Dv per CTA a multiple of 64), got "
                  f"{cfg.dv_halves}")
    if reason is None and cfg.page_rows is not None and (
            cfg.page_rows <= 0 or cfg.page_rows % cfg.tile_n):
        reason = (f"page_rows={cfg.page_rows}: a paged cache needs pages of a multiple of "
                  f"tile_n={cfg.tile_n} rows")
    return reason


KEYS_DECODE = True  # an FP8 cache with <= 32 rows per KV head: the keys-as-rows kernel


def plan_decode(problem: AttnProblem, arch: str, page_rows: int | None,
                kv_dtype: str | None = None) -> DecodeConfigSm90 | DecodeKeysConfigSm90:
    """The decode kernel's config for a packed, mask-free problem: the forward's plan without
    `kv_pair`, tile_n 128 (64 for pages of 64 rows, which a 128-row block would straddle, and for
    an FP8 cache), the forward's deepest rings at that tile, exact O halves (`half_align` 8:
    the widened ones are measured on the compute-bound forward only); `kv_dtype` "e4m3": an FP8
    cache under 16-bit queries, served by the keys-as-rows kernel (`plan_decode_keys`) where
    it takes the shape (<= 32 rows per KV head, no mask). Raises ValueError with the reason when
    it cannot run it."""
    if problem.has_window or problem.has_sinks:
        raise ValueError("the decode kernel serves rows that see every key, or (causal) a "
                         "chunk of the row's last queries (no window or sinks)")
    if kv_dtype is not None and KEYS_DECODE:
        keys = plan_decode_keys(problem, arch, page_rows)
        if keys is not None:
            return keys
    # 64-row blocks also for an FP8 cache: its 8-bit stages and 16-bit buffers fit beside
    # resident Q only at the smaller tile
    tile_n = 64 if (page_rows is not None and page_rows % 128) or kv_dtype else 128
    base = {**dataclasses.asdict(plan_fwd(problem, arch, kv_pair=False, resident_q=False)),
            "tile_n": tile_n,
            "page_rows": page_rows, "kv_dtype": kv_dtype, "half_align": 8}

    def make(k, v):
        return DecodeConfigSm90(**{**base, "k_stages": k, "v_stages": v})

    if kv_dtype is None:
        return deepest_rings(make, can_implement_decode)
    # an FP8 cache: as many 8-bit bytes in flight as fit, 8 K chunks, then the deepest V ring,
    # then K again (up to 16 stages each)
    def fits(k, v):
        return can_implement_decode(make(k, v)) is None

    if not fits(4, 2):
        raise ValueError(can_implement_decode(make(4, 2)))
    k0 = 8 if fits(8, 2) else 4
    v = max(x for x in range(2, 17) if fits(k0, x))
    return make(max(x for x in range(k0, 17) if fits(x, v)), v)


def can_implement(cfg: FwdConfigSm90) -> str | None:
    """None when the kernel can be built for cfg, else the reason."""
    if cfg.arch != "sm_90a":
        return f"arch {cfg.arch!r}: WGMMA and TMA need sm_90a"
    if isinstance(cfg, FwdFP8ConfigSm90):
        if cfg.dtype not in FP8_DTYPES or cfg.out_dtype not in DTYPES:
            return (f"dtype {cfg.dtype!r} / out_dtype {cfg.out_dtype!r}: the FP8 forward takes "
                    f"{FP8_DTYPES} in and gives {DTYPES}")
        if cfg.head_dim % 16 or cfg.head_dim_v is not None:
            return (f"head_dim={cfg.head_dim}: the FP8 forward needs a multiple of 16 (16-byte "
                    "rows for TMA) and head_dim_v == head_dim")
    elif cfg.dtype not in DTYPES:
        return f"dtype {cfg.dtype!r} not in {DTYPES}"
    if cfg.head_dim % 8 or not MIN_HEAD_DIM <= cfg.head_dim <= MAX_HEAD_DIM:
        return f"head_dim={cfg.head_dim}: need a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    widened = type(cfg) is FwdConfigSm90 and cfg.head_dim_v == cfg.head_dim - 8
    if cfg.head_dim_v is not None and (
            cfg.head_dim_v == cfg.head_dim or (cfg.head_dim_v % 16 and not widened)
            or not 64 <= cfg.head_dim_v <= MAX_SINGLE_CTA_HEAD_DIM):
        return (f"head_dim_v={cfg.head_dim_v}: None when equal to head_dim, else a multiple of "
                f"16 in [64, {MAX_SINGLE_CTA_HEAD_DIM}] (or, the 16-bit forward, head_dim - 8)")
    if cfg.o_split > 1 and not cfg.stream_q:
        return f"head_dim={cfg.head_dim} > {MAX_SINGLE_CTA_HEAD_DIM} needs stream_q=True"
    if cfg.kv_pair and (cfg.o_split != 2 or cfg.head_dim_v is not None
                        or (cfg.pair_stats and cfg.tile_n != 128)):
        return ("kv_pair needs O split over two CTAs (head_dim > 512), Dv == D and (the "
                "forward) tile_n 128")
    if cfg.persistent and (cfg.ctas_per_tile != 1 or type(cfg) is not FwdConfigSm90):
        return ("persistent needs one CTA per row tile (Dv <= 512, no kv_pair) and the 16-bit "
                "forward kernel")
    if cfg.group_split and (not isinstance(cfg, (BwdDVConfigSm90, BwdDKConfigSm90))
                            or cfg.persistent):
        return "group_split is for the dV and dK kernels only"
    if cfg.varlen and (cfg.persistent or cfg.elem_bytes != 2
                       or isinstance(cfg, DecodeConfigSm90)):
        return "varlen needs a 16-bit forward or gradient kernel, not persistent"
    if cfg.half_align not in (8, 32, 64) or (cfg.half_align != 8 and cfg.elem_bytes != 2):
        return ("half_align must be 8, 32 or 64, and 8 for 8-bit operands (their V stages are "
                "transposed: the O width is not the swizzled dimension)")
    if cfg.split_align not in (8, 64) or (cfg.split_align == 64 and (
            cfg.half_align not in (32, 64) or cfg.dv_split[1] <= 0)):
        return ("split_align must be 8, or 64 with half_align 32 or 64 and a hi share left "
                "(Dv > 64)")
    if cfg.cta_align not in (8, 32, 64) or (cfg.cta_align != 8 and (
            cfg.o_split != 2 or cfg.elem_bytes != 2 or cfg.dv_cta >= cfg.dv)):
        return ("cta_align must be 8, or 32 or 64 with O over two CTAs, 16-bit operands and "
                "columns left for the second CTA")
    if cfg.wide_o:
        if (not MAX_SINGLE_CTA_HEAD_DIM < cfg.dv <= WIDE_MAX_DV or cfg.head_dim_v is not None
                or cfg.elem_bytes != 2 or isinstance(cfg, DecodeConfigSm90) or cfg.varlen
                or cfg.half_align not in (32, 64) or max(cfg.dv_halves) > WIDE_SHARE
                or cfg.persistent):
            return (f"wide_o (O in one CTA above {MAX_SINGLE_CTA_HEAD_DIM} columns) needs "
                    f"Dv == D in ({MAX_SINGLE_CTA_HEAD_DIM}, {WIDE_MAX_DV}], 16-bit operands, "
                    f"no decode, varlen or persistent CTAs, half_align 32 or 64 and shares of "
                    f"at most {WIDE_SHARE} columns")
    elif max(cfg.dv_halves) > WGMMA_MAX_N:
        return f"O warpgroup width {max(cfg.dv_halves)} > {WGMMA_MAX_N} (a WGMMA N)"
    if cfg.tile_n not in (64, 128):
        return "tile_n must be 128 (64: the backward's dQ kernel, two score accumulators)"
    if cfg.shared_kv:
        if (type(cfg) is not FwdConfigSm90 or cfg.o_split != 1 or cfg.dv % 128
                or cfg.dv > cfg.head_dim or cfg.tile_n != 64 or cfg.stream_q or cfg.kv_pair
                or cfg.persistent or cfg.overlap or cfg.varlen or cfg.half_align != 64):
            return ("shared_kv needs the 16-bit forward with Dv a multiple of 128 up to 512, "
                    "Dv <= D, tile_n 64, half_align 64, Q resident and no kv_pair, "
                    "persistent, overlap or varlen")
        if cfg.v_stages != 0 or cfg.k_stages != cfg.shared_stages:
            return (f"shared_kv has no V rings and a K ring of two blocks' V chunks and one "
                    f"block's others: v_stages 0, k_stages {cfg.shared_stages}")
    elif cfg.k_stages < 2 or cfg.v_stages < 2:
        return "k_stages and v_stages must be >= 2"
    if not 0 <= cfg.publish_after <= cfg.stream_chunks:
        return f"publish_after must be in [0, {cfg.stream_chunks}]"
    if cfg.publish_hi is not None and not 0 <= cfg.publish_hi <= cfg.stream_chunks:
        return f"publish_hi must be None or in [0, {cfg.stream_chunks}]"
    if cfg.overlap and (type(cfg) is not FwdFP8ConfigSm90 or cfg.kv_pair
                        or cfg.stream_q or cfg.persistent
                        or not 0 < cfg.overlap < cfg.num_k_chunks
                        or cfg.k_stages < cfg.num_k_chunks):
        return (f"overlap={cfg.overlap}: 0, or in [1, {cfg.num_k_chunks - 1}] (the D chunks) "
                "for the FP8 forward with Q resident (no kv_pair, stream_q, persistent) and "
                f"k_stages >= {cfg.num_k_chunks}")
    if cfg.lazy_rescale and (type(cfg) not in (FwdConfigSm90, FwdFP8ConfigSm90)
                             or cfg.kv_pair):
        return ("lazy_rescale is for the forward kernels with one CTA per row tile (no "
                "kv_pair)")
    if cfg.smem_bytes() > SMEM_CAPACITY:
        return f"needs {cfg.smem_bytes()} B of smem, sm_90a has {SMEM_CAPACITY}"
    return None


# The FP8 forward takes the `overlap` schedule up to this many D chunks (128 columns each):
# D <= 384 (`plan_fwd` says what was measured)
OVERLAP_MAX_CHUNKS = 3
# `shared_kv` for problems whose v is k's prefix (AttnProblem.shared_kv): off, measured slower
# than the planned forward (perf.shared_kv, H200, 2026-12-05: MLA 576 / 512 N=8K causal 490
# against 520 TFLOPS, 16K 503 against 540, D=512 with v is k 519 against 569)
SHARED_KV = False


def shared_kv_config(cfg: FwdConfigSm90) -> FwdConfigSm90:
    """cfg (a 16-bit forward config) with `shared_kv`: tile_n 64, Q resident, one CTA per
    tile, the K ring of `shared_stages`, no V rings, P handed over before QK[i+1] (its PV then
    runs first, and the O warpgroups' refills of block i + 2 start under QK[i+1])."""
    shared = dataclasses.replace(cfg, shared_kv=True, tile_n=64, stream_q=False, kv_pair=False,
                                 persistent=False, overlap=0, half_align=64, publish_after=0,
                                 v_stages=0)
    return dataclasses.replace(shared, k_stages=shared.shared_stages)


# The head dims at which the plain forward takes `lazy_rescale`, per dtype class: those where it
# measured faster than rescaling every block (16-bit: D=512 +1-5%, GQA 32/4 causal +6-17%,
# D=320 +2-5%, with the hi O share from a line (`split_align` 64, N=8K, not causal, H100) 328
# +5.7%, 336 +4.1%, 456 +3.5%, 368 +2.6%; FP8: D=512 +6-7%, causal +7%, D=320 +3%; the others
# are unmeasured or within 1.5% (264 / 272 / 480 -0.6 to -1.3%, 400 / 408 / 448 +0.5 to +1%);
# docs/design.md sections 3 and 10 have the numbers).
LAZY_RESCALE_HEAD_DIMS = {"16-bit": (320, 328, 336, 368, 456, 512), "fp8": (320, 512)}


def _o_shares(cfg) -> tuple:
    """How `cfg` cuts O's columns: each CTA's width, each warpgroup's stored and computed share."""
    return cfg.dv_cta, cfg.dv_split, cfg.dv_halves


def _line_shares(problem: AttnProblem, width: int) -> bool:
    """Whether an accumulator `width` columns wide (O: Dv) may start its hi share on a 128-byte
    line (`split_align` 64): 16-bit operands, one CTA per tile (D, Dv <= 512), width > 64 and
    not a multiple of 128 (else the even shares already are), no window or varlen (measured
    without them: perf.split_align)."""
    return (problem.dtype not in FP8_DTYPES
            and max(problem.head_dim, problem.head_dim_v) <= MAX_SINGLE_CTA_HEAD_DIM
            and width > 64 and width % 128 and problem.window_lo is None and not problem.varlen)


def plan_fwd(problem: AttnProblem, arch: str, kv_pair: bool = True,
             persistent: bool = False, shared: bool = False,
             resident_q: bool = True, tuned: bool = False) -> FwdConfigSm90:
    """The config for `problem`; raises ValueError with the reason if this kernel cannot run it.
    `kv_pair`: whether D > 512 with Dv == D pairs the CTAs (`Options.kv_pair`); `shared`:
    whether v being k's prefix (`problem.shared_kv`) may take `shared_kv` (with SHARED_KV on,
    where it builds); `resident_q`: whether Q may stay resident above D=512 (below; the dV
    and decode planners, which start from this plan, keep it streamed there as they were
    measured); `persistent`: whether persistent CTAs may serve it (`Options.persistent`);
    `tuned`: the forward's own route, measured on the forward only (the decode and gradient
    planners, which start from this plan, keep the defaults): a plain forward (no window,
    sinks, varlen or CTA pair) at a head dim in LAZY_RESCALE_HEAD_DIMS of its dtype class takes
    `lazy_rescale`, and a 16-bit one with O in one CTA and Dv % 128 != 0 (no window, sinks or
    varlen) `split_align` 64: measured (perf.split_align, H100, B=1, H=32, N=8K, against even
    shares, the same bits) D=272 354 -> 438 TFLOPS, 320 494 -> 554, 336 392 -> 465, 400 376
    -> 445, 448 480 -> 529, 328 / 368 / 456 +5-8%. A plain 16-bit forward over the CTA pair
    (`kv_pair`) takes `cta_align` 64 and `split_align` 64: the second CTA's columns and each
    CTA's hi share start on 128-byte lines, the padding in the second CTA's hi share (perf.
    cta_align, H100, B=1, H=32, N=8K, against even shares, the same bits): D=584 277 -> 317,
    600 282 -> 323, 712 290 -> 323, 776 284 -> 310, 832 344 -> 382, 576 338 -> 348, 648
    281 -> 298, 704 354 -> 365, 520 279 -> 283, 1016 unchanged (its shares already on lines).
    At D % 128 == 8 (520, 648, 776, 904) the second CTA starts on a 64-byte half line instead
    (`cta_align` 32; 64 put 13-23% of O's computed columns past D there): measured against
    `cta_align` 64 (H100, same shapes, the same bits) 520 281 -> 295, 648 290 -> 297, 776 298
    -> 301, 904 305 -> 313 (at 832, D % 128 == 64, 377 -> 371: not taken).
    They do for a 16-bit problem with O in one CTA whose tiles are (nearly) equal in length:
    no right bound (with a window or sinks: D and Dv multiples of 64), or a sliding window at
    D and Dv multiples of 64 (common/scheduler.py says why not under a plain causal mask).
    Measured on the H200 (persistent / one CTA per tile; docs/perf-log.md): D=384
    1.09, 448 1.04, 512 1.00-1.02, 320 0.96-1.02 without a right bound; windows 1.10 (D=512,
    left 1024) to 1.52 (left 128, MQA 64:1). D % 64 != 0 lost with exact O halves (264 0.74,
    280 0.90, 328 0.84; with a window 264 0.76, 328 0.95), and measured 1.00-1.03 once the
    halves were widened (`half_align`); persistent there on rows padded to lines (H100,
    perf.pad_d, kernel alone): 264 / 328 / 376 / 440 / 504 1.02-1.05, 400 0.99, the same bits.

    Measured on the H200 (docs/perf-log.md, 2026-12-02): a K ring under 4 stages starves QK
    (D=512, 2 stages: 346 vs 581 TFLOPS); past that, V depth pays (D=320: 4+4 stages 507 vs
    7+2 449); P is handed over after all of QK[n+1] is issued (D=512: 581 vs 561). 16-bit O
    halves are computed 64 columns wide (one CTA per tile) or 32 (O over two CTAs), so every
    V stage takes the 128- or 64-byte swizzle (`half_align`; measured TFLOPS, exact ->
    aligned: D=264 281 -> 373, 328 241 -> 394, 336 194 -> 441, 448 481 -> 520, 320 475 -> 495,
    576 311 -> 379 (64: 337, it costs a V stage), 704 270 -> 387; 640 keeps its 160-wide
    64-byte swizzled halves (192: 374 vs 404)).

    D > 512 with Dv <= 512 (O in one CTA: MLA's 576 / 512) keeps Q resident where it fits (K 3,
    V 2 stages; D <= 640) instead of streaming it beside each K chunk: the forward is bound by
    the L2 -> SM stream there, and streamed Q is 72 of each block's 344 KB at 576 / 512.
    Measured (perf.resident_q, kernel alone, Hq 128 / Hkv 1, H100, 2026-12-05): N=8K causal
    400 -> 490 TFLOPS, 4K 375 -> 453, 16K 408 -> 526, 8K non-causal 406 -> 528.

    D = Dv in (512, WIDE_MAX_DV], 16-bit (`wide_o`; the forward's own plan: `resident_q`):
    O in one CTA instead of the CTA pair, Q resident, K 3 and V 2 stages, the hi share from
    a line with `tuned` (no window, sinks or varlen). Measured (perf.one_cta, H100, B=1, H=32,
    N=8K, not causal, `run_fwd`, TFLOPS; pair -> one CTA with even shares / with the hi share
    from a line): 520 296 -> 404 / 393, 528 299 -> 365 / 405 (426 without the K / V row
    copy: `launch.repack_rows` then copies only at D % 16 == 8, as below 512), 536 289 ->
    395 / 389, 544 310 -> 405 / 418 (451 without the copy), 552 296 -> 367 / 410, 560 316 ->
    383 / 430, 568 305 -> 425, 576 348 -> 462; out within the pair's error against fp32.

    FP8 with at most OVERLAP_MAX_CHUNKS D chunks and neither a right nor a left edge takes the
    `overlap` schedule (h = half the D chunks, K ring >= chunks + h). Measured on the H200
    against the serial schedule, both with P stored by stmatrix (kernel, B=1, H=32, N=8K /
    16K, one run, docs/perf-log.md 2026-12-04): D=320 761 TFLOPS against 738 (h=1, K 6, V 4);
    D=512 885 / 891 against 910 / 918 (h=2, K 7, V 2; h=3 899 / 924), causal 788 against 808:
    at four chunks the serial schedule's score step is short enough that overlapping it buys
    nothing.
    """
    dv = problem.head_dim_v
    fp8 = problem.dtype in FP8_DTYPES
    # O in one CTA above 512 (`wide_o`): the 16-bit forward's own plan (not the decode and dV
    # planners', which start from this one with resident_q off)
    wide = resident_q and _wide_fits(problem)
    split = max(problem.head_dim, dv) > MAX_SINGLE_CTA_HEAD_DIM and not wide
    cls, extra = ((FwdFP8ConfigSm90, dict(out_dtype=problem.out_dtype or "bf16")) if fp8
                  else (FwdConfigSm90, {}))
    k_chunk = 128 // ELEM_BYTES.get(problem.dtype, 2)
    base = dict(arch=arch, dtype=problem.dtype, head_dim=problem.head_dim,
                half_align=8 if fp8 else (32 if dv > MAX_SINGLE_CTA_HEAD_DIM else 64),
                causal=problem.right_bounded, publish_after=-(-problem.head_dim // k_chunk),
                stream_q=problem.head_dim > MAX_SINGLE_CTA_HEAD_DIM and not wide,
                head_dim_v=None if dv == problem.head_dim else dv,
                window=problem.window_lo is not None, sinks=problem.has_sinks,
                varlen=problem.varlen, wide_o=wide, **extra)
    if kv_pair and split and dv == problem.head_dim:
        base["kv_pair"] = True
    if (tuned and not split
            and problem.head_dim in LAZY_RESCALE_HEAD_DIMS["fp8" if fp8 else "16-bit"]
            and problem.window_lo is None and not problem.has_sinks and not problem.varlen):
        base["lazy_rescale"] = True
    plain = problem.window_lo is None and not problem.has_sinks and not problem.varlen
    if tuned and not problem.has_sinks and (_line_shares(problem, dv)
                                            or (wide and problem.window_lo is None)):
        base["split_align"] = 64   # the hi share from a 128-byte line (measured below)
    if tuned and plain and base.get("kv_pair") and not fp8:
        # the CTA pair: the second CTA's columns and each CTA's hi share from lines (below),
        # where that moves a share (else the compile key stays as it is)
        half = problem.head_dim % 128 == 8   # a half line: fewer padded columns (below)
        lines = {**base, "cta_align": 32 if half else 64, "split_align": 64}
        if _o_shares(cls(**lines)) != _o_shares(cls(**base)):
            base = lines
    aligned = problem.head_dim % 64 == 0 and dv % 64 == 0
    if (persistent and not fp8 and not split and not wide and not problem.varlen
            and ((plain and not problem.right_bounded)
                 or (aligned and (not problem.right_bounded or problem.window_lo is not None)))):
        base["persistent"] = True
    min_k = 3 if wide else 4   # Q [64 x 576] resident beside V rings of 2 (below)
    chunks = -(-problem.head_dim // k_chunk)
    if (fp8 and chunks <= OVERLAP_MAX_CHUNKS and not problem.right_bounded
            and problem.window_lo is None):
        # QK[i+1] under the score step (`overlap`): half the D chunks before it, a K ring a
        # block and a half deep (measured below)
        base["overlap"] = chunks // 2
        min_k = chunks + chunks // 2
    if shared and problem.shared_kv and SHARED_KV and not fp8:
        cfg = shared_kv_config(cls(**base))
        if can_implement(cfg) is None:
            return cfg
    if resident_q and base["stream_q"] and dv <= MAX_SINGLE_CTA_HEAD_DIM and not fp8:
        # D > 512 with O in one CTA (MLA's 576 / 512): Q resident where it fits beside a K
        # ring of 3 and V rings of 2 (D <= 640), measured below
        resident = {**base, "stream_q": False}
        with contextlib.suppress(ValueError):
            return deepest_rings(lambda k, v: cls(**resident, k_stages=k, v_stages=v),
                                 can_implement, 3)
    return deepest_rings(lambda k, v: cls(**base, k_stages=k, v_stages=v), can_implement, min_k)


# ==================================================================================== backward
# The backward kernels (bwd_sm90.py) run on the forward's ring with other operands in its roles.
# Each loads the per-row / per-column statistics (LSE, Delta) of a block before the block's
# WGMMAs, so their latency hides behind them (D=512: 206 -> 215 TFLOPS, docs/perf-log.md).
# Above 512 the gradient is split over two CTAs as the forward splits O; with `kv_pair` (the
# planners' default, `Options.kv_pair`) the pair splits the column blocks and exchanges P / dS,
# else each CTA recomputes every score block.
BWD_MAX_HEAD_DIM = 1024
# dK forms its two score products one after the other in one accumulator (`seq_scores`, tile_n
# 128) up to this D; above it ptxas spills (148 B at D=1024), so dK keeps tile_n 64 there. dQ
# never does: it spills 88-300 B at D = 320-512.
SEQ_SCORES_MAX_HEAD_DIM = 512
# Up to this D the two-product kernels hand each block to their two accumulator warpgroups at
# different S-ring chunks (`publish_hi`), so the gradient product's halves fill different gaps
# of the tensor pipe (dQ 16.8 -> 15.3 ms at D=512).
SPLIT_PUBLISH_MAX_HEAD_DIM = 512


@dataclass(frozen=True)
class BwdDVConfigSm90(FwdConfigSm90):
    """Compile key of the dV kernel: the forward's fields, read with a 64-row K tile as the
    resident rows, 128-query blocks of Q through the S ring and dO as the accumulator's B.
    `kv_pair` (D > 512): the two CTAs of a K tile score every other query block and exchange
    P^T (no row statistics: `pair_stats` False)."""

    KERNEL: ClassVar[str] = "ffpa_cute.sm90.bwd_sm90:FFPABwdDVSm90"

    @property
    def pair_stats(self) -> bool:
        return False


@dataclass(frozen=True)
class BwdDQConfigSm90(FwdConfigSm90):
    """Compile key of the dQ kernel: tile_n 64 (two 64 x 64 score accumulators fit the S
    warpgroup's registers), Q and dO streamed through the S ring (stream_q). `seq_scores`:
    tile_n 128 and one 64 x 128 accumulator that holds S, then dP (P waits in the bf16 P
    fragment in between). `second_dim`: the width of the second product's operands (dO and V:
    Dv) when it differs from D (MLA-absorbed 576 / 512), else None. `publish_after` counts
    chunks of both products (2 C in all); `publish_hi`: the chunk after which the second
    accumulator warpgroup gets the block (None: with the first). `kv_pair` (D > 512): the two
    CTAs of a Q tile score every other KV block (S and dP) and exchange dS (no row
    statistics: `pair_stats` False)."""

    seq_scores: bool = False
    second_dim: int | None = None
    publish_hi: int | None = None

    KERNEL: ClassVar[str] = "ffpa_cute.sm90.bwd_sm90:FFPABwdDQSm90"

    @property
    def pair_stats(self) -> bool:
        return False

    @property
    def second_width(self) -> int:
        return self.head_dim if self.second_dim is None else self.second_dim

    @property
    def stream_chunks(self) -> int:
        return self.num_k_chunks + -(-self.second_width // self.k_chunk)


@dataclass(frozen=True)
class BwdDKConfigSm90(BwdDQConfigSm90):
    """Compile key of the dK kernel: dQ's fields (tile_n 64 or, with `seq_scores`, 128; rows
    streamed; `second_dim`), a larger staging buffer."""

    KERNEL: ClassVar[str] = "ffpa_cute.sm90.bwd_sm90:FFPABwdDKSm90"

    @property
    def factor_floats(self) -> int:
        """The columns' LSE and Delta: 2 * tile_n floats."""
        return 2 * max(TILE_M, self.tile_n)


def can_implement_dv(cfg: BwdDVConfigSm90) -> str | None:
    reason = can_implement(cfg)
    if reason is None and cfg.sinks:
        reason = "sinks is the forward's field (the gradient kernels read it through the LSE)"
    return reason


def can_implement_dq(cfg: BwdDQConfigSm90) -> str | None:
    """The dQ and dK kernels' constraints (both two-product kernels)."""
    reason = can_implement_dv(cfg)
    if reason is None and (not cfg.stream_q or cfg.head_dim_v is not None
                           or cfg.tile_n != (128 if cfg.seq_scores else 64)):
        reason = ("the dQ / dK kernels need head_dim_v == head_dim, stream_q and tile_n 64 "
                  "(seq_scores: 128)")
    if reason is None and cfg.second_dim is not None and (
            cfg.second_dim == cfg.head_dim or cfg.second_dim % 16
            or not 64 <= cfg.second_dim <= 512):
        reason = (f"second_dim={cfg.second_dim} (Dv): None when equal to head_dim, else a "
                  "multiple of 16 in [64, 512]")
    return reason


def _check_bwd_head_dim(problem: AttnProblem):
    if problem.head_dim > BWD_MAX_HEAD_DIM:
        raise ValueError(f"head_dim={problem.head_dim} > {BWD_MAX_HEAD_DIM} (the sm90 backward)")


# CTAs the dV / dK grid should reach before a KV tile's head group is split over CTAs
# (`group_split`): about four waves of an H100 / H200's 132 SMs, so that causal KV tiles of
# unequal length (the first ones see every query) balance over the SMs
GROUP_SPLIT_TARGET_CTAS = 512


def group_parts(batch: int, heads_q: int, heads_kv: int, seqlen_kv: int, o_split: int) -> int:
    """S, the CTAs a KV tile's head group is split over in the dV / dK kernels: the smallest
    power of two dividing G = Hq / Hkv that brings B * Hkv * (KV tiles) * o_split CTAs to
    GROUP_SPLIT_TARGET_CTAS (1 for MHA, or when the tiles alone fill the waves). E.g. MQA 64:1
    at Nkv = 8K: 128 tiles -> 4 (512 CTAs, 16 query heads each); GQA 32:4 at 8K: 512 tiles
    -> 1. Sizes are not part of a config: the planner asks whether S > 1 (`group_split`), the
    launcher computes S from the tensors it launches on (varlen: Nkv = the packed total)."""
    g = heads_q // heads_kv
    ctas = batch * heads_kv * -(-seqlen_kv // TILE_M) * o_split
    parts = 1
    while g % (2 * parts) == 0 and ctas * parts < GROUP_SPLIT_TARGET_CTAS:
        parts *= 2
    return parts


def _group_split(problem: AttnProblem, o_split: int) -> bool:
    """The planner's `group_split`: whether `group_parts` splits the problem's head groups."""
    return group_parts(problem.batch, problem.heads_q, problem.heads_kv, problem.seqlen_kv,
                       o_split) > 1


def _wide_bwd(problem: AttnProblem) -> bool:
    """Whether the gradient kernels hold their gradient in one CTA (`wide_o`): WIDE_BWD on,
    where the forward holds O in one CTA (`_wide_fits`)."""
    return WIDE_BWD and _wide_fits(problem)


# the fields that make a gradient kernel's config `wide_o` (even shares, 64-byte swizzle)
WIDE_BWD_FIELDS = dict(wide_o=True, kv_pair=False, half_align=32, split_align=8, cta_align=8)


def plan_dv(problem: AttnProblem, arch: str = "sm_90a", kv_pair: bool = True) -> BwdDVConfigSm90:
    """The dV kernel's config: the forward's plan for the same problem (same ring budget; the
    CTA pair splitting the query blocks above 512 with `kv_pair`), the head group split where
    `group_parts` says so. With `_wide_bwd`: dV in one CTA, the K tile resident, a Q ring of
    3 and dO rings of 2 (the forward's `wide_o` plan)."""
    _check_bwd_head_dim(problem)
    fwd = dataclasses.replace(plan_fwd(problem, arch, kv_pair=kv_pair, resident_q=False),
                              sinks=False)
    cfg = BwdDVConfigSm90(**dataclasses.asdict(fwd))
    if _wide_bwd(problem):
        wide = dataclasses.replace(cfg, stream_q=False, persistent=False, lazy_rescale=False,
                                   **WIDE_BWD_FIELDS)
        cfg = deepest_rings(lambda k, v: dataclasses.replace(wide, k_stages=k, v_stages=v),
                            can_implement_dv, 3)
    cfg = dataclasses.replace(cfg, group_split=_group_split(problem, cfg.o_split))
    reason = can_implement_dv(cfg)
    if reason:
        raise ValueError(reason)
    return cfg


def _publish_points(problem: AttnProblem, grad: str) -> tuple[int, int | None]:
    """(publish_after, publish_hi) of the dQ / dK plan: dQ's halves after half of S's chunks and
    after half of dP's; dK's (`seq_scores`) after S^T and after dP^T; above
    SPLIT_PUBLISH_MAX_HEAD_DIM both halves after the first product."""
    c = -(-problem.head_dim // 64)
    c2 = -(-problem.head_dim_v // 64)
    if problem.head_dim > SPLIT_PUBLISH_MAX_HEAD_DIM:
        return c, None
    return (c // 2, c + c2 // 2) if grad == "dq" else (c, c + c2)


def _plan_two(cls, problem: AttnProblem, arch: str, seq_scores: bool, kv_pair: bool):
    """The two-product kernels' plan: a 4-deep S ring (first product's chunks, then the
    second's), then the deepest accumulator-operand rings that fit; above 512 (`kv_pair`) the
    CTA pair splits the column blocks, or (`_wide_bwd`) one CTA holds the gradient."""
    _check_bwd_head_dim(problem)
    dv = problem.head_dim_v
    publish_after, publish_hi = _publish_points(
        problem, "dq" if cls is BwdDQConfigSm90 else "dk")
    base = dict(arch=arch, dtype=problem.dtype, head_dim=problem.head_dim,
                causal=problem.right_bounded, window=problem.window_lo is not None,
                tile_n=128 if seq_scores else 64, stream_q=True,
                publish_after=publish_after, publish_hi=publish_hi, seq_scores=seq_scores,
                second_dim=None if dv == problem.head_dim else dv, varlen=problem.varlen,
                kv_pair=kv_pair and problem.head_dim > MAX_SINGLE_CTA_HEAD_DIM)
    if _wide_bwd(problem):   # the gradient in one CTA (`wide_o`)
        base.update(WIDE_BWD_FIELDS)
    for v in (4, 3, 2):
        cfg = cls(**base, k_stages=4, v_stages=v)
        if cls is BwdDKConfigSm90:  # dK sums over the head group as dV does
            cfg = dataclasses.replace(cfg, group_split=_group_split(problem, cfg.o_split))
        if can_implement_dq(cfg) is None:
            return cfg
    raise ValueError(can_implement_dq(cls(**base, k_stages=4, v_stages=2)))


def plan_dq(problem: AttnProblem, arch: str = "sm_90a", kv_pair: bool = True) -> BwdDQConfigSm90:
    return _plan_two(BwdDQConfigSm90, problem, arch, False, kv_pair)


def plan_dk(problem: AttnProblem, arch: str = "sm_90a", seq_scores: bool | None = None,
            kv_pair: bool = True) -> BwdDKConfigSm90:
    """As dQ's, with `seq_scores` (tile_n 128, one score accumulator; None: up to
    SEQ_SCORES_MAX_HEAD_DIM)."""
    if seq_scores is None:
        seq_scores = problem.head_dim <= SEQ_SCORES_MAX_HEAD_DIM
    return _plan_two(BwdDKConfigSm90, problem, arch, seq_scores, kv_pair)


def plan_bwd(problem: AttnProblem, arch: str = "sm_90a", kv_pair: bool = True,
             lines: bool = True) -> list:
    """The dQ, dK and dV configs for `problem` (in that order); raises ValueError with the
    reason when the WGMMA backward cannot run it. `kv_pair`: above 512 the CTA pair splits the
    column blocks (`Options.kv_pair`).

    `lines`: each accumulator's hi share from a 128-byte line where `line_shares_bwd` takes
    it (else the shares are as even as 8 columns allow: dQ / dK exact): measured against
    even shares (perf.split_align_bwd, H100, B=1, H=32, N=8K, the three kernels summed, the
    same bits at every D): D=272 159 -> 183 TFLOPS, 320 205 -> 216, 328 138 -> 155, 336 168
    -> 189, 400 168 -> 196, 448 223 -> 225."""
    cfgs = [plan_dq(problem, arch, kv_pair), plan_dk(problem, arch, kv_pair=kv_pair),
            plan_dv(problem, arch, kv_pair)]
    return line_shares_bwd(problem, cfgs) if lines else cfgs


def line_shares_bwd(problem: AttnProblem, cfgs: list) -> list:
    """`plan_bwd`'s dQ, dK, dV configs with each accumulator's hi share from a 128-byte line
    where `_line_shares` allows it without sinks (as tested) (dV: `split_align` 64; dQ / dK:
    `half_align` and `split_align` 64, shares computed 64 wide), each with the deepest V ring
    that fits; the others unchanged (`plan_bwd`'s `lines`)."""
    out = []
    for cfg in cfgs:
        dv = isinstance(cfg, BwdDVConfigSm90)
        if problem.has_sinks or not _line_shares(problem,
                                                 problem.head_dim_v if dv else problem.head_dim):
            out.append(cfg)
            continue
        check = can_implement_dv if dv else can_implement_dq
        fields = dict(split_align=64) if dv else dict(half_align=64, split_align=64)
        fits = [c for c in (dataclasses.replace(cfg, **fields, v_stages=v) for v in (4, 3, 2))
                if check(c) is None]
        if not fits:
            raise ValueError(check(dataclasses.replace(cfg, **fields)))
        out.append(fits[0])
    return out
