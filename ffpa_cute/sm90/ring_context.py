"""The context tuples the sm90 skeleton's warpgroups and hooks pass around
(`RingSkeletonSm90`, skeleton_sm90.py): host-side (the roles' tensors, smem layouts, MMAs, TMA
operands, runtime scalars) and device-side (the CTA's tile and block sequence, barriers, smem,
each warpgroup's fragments, loads and ring counters). Plain NamedTuples: the DSL traces them
field by field, so they carry no code of their own."""

from __future__ import annotations

from typing import NamedTuple

import cutlass.cute as cute
from cutlass import Float32, Int32

from ..common.softmax import OnlineSoftmax


# ---------------------------------------------------------------------------- host-side contexts
class Roles(NamedTuple):
    """The (B, H, N, D) tensors a kernel puts in the skeleton's roles."""

    rows: cute.Tensor   # R: the resident rows (a TILE_M tile of them per CTA)
    cols: cute.Tensor   # C: the streamed columns (tile_n per block)
    acc_b: cute.Tensor  # B: the accumulators' B operand (8 bits: transposed, (B, H, D, N))
    out: cute.Tensor    # O: the output


class SmemLayouts(NamedTuple):
    """Swizzled smem layouts: R (resident, or a ring with `stream_q`), the C ring, the two B
    rings, the P slots; with an 8-bit C / B converted in smem (`cvt`), C and B are its two
    16-bit buffers each and c8 / blo8 / bhi8 the 8-bit rings the TMA fills (else None)."""

    r: cute.ComposedLayout
    c: cute.ComposedLayout
    blo: cute.ComposedLayout
    bhi: cute.ComposedLayout
    p: cute.ComposedLayout
    c8: object = None
    blo8: object = None
    bhi8: object = None


class Mmas(NamedTuple):
    """The tiled MMAs: scores (TILE_M x tile_n) and the two output halves (TILE_M x half)."""

    s: cute.TiledMma
    o_lo: cute.TiledMma
    o_hi: cute.TiledMma


class Operands(NamedTuple):
    """The kernel's global operands: the output and LSE tensors, then each role's TMA tensor
    and atom (B: one per accumulator half)."""

    mOut: cute.Tensor
    mLSE: cute.Tensor
    gR_tma: cute.Tensor
    gC_tma: cute.Tensor
    gBlo_tma: cute.Tensor
    gBhi_tma: cute.Tensor
    tma_r: cute.CopyAtom
    tma_c: cute.CopyAtom
    tma_blo: cute.CopyAtom
    tma_bhi: cute.CopyAtom


class Scalars(NamedTuple):
    """Runtime scalars of the kernel entry: the streamed sequence's length and head count,
    softmax_scale * log2(e), the causal offset, the window's left edge (None: compiled
    without one, cfg.window False), and (`varlen`) the cumulative lengths of R's and C's
    packed sequences (int32 [B + 1] tensors; else None)."""

    seqlen_c: Int32
    heads_c: Int32
    scale_log2: Float32
    causal_offset: Int32
    window_lo: object = None
    cu_r: object = None
    cu_c: object = None
    parts: object = None  # `group_split`: S, the CTAs each head group is split over


# ---------------------------------------------------------------------------- device contexts
class Tile(NamedTuple):
    """One CTA's tile and the problem sizes its hooks read."""

    m_block: Int32        # rows m_block * TILE_M .. + TILE_M of R (and of O)
    o_part: Int32         # which 1 / o_split of O's columns (`kv_pair`: the CTA's rank)
    head: Int32           # head of R and O
    head_c: Int32         # head of C and B (the first of the group when blocks change head)
    batch: Int32
    seqlen_r: Int32       # rows of R and O
    seqlen_c: Int32       # rows of C
    causal_offset: Int32  # query i sees key j iff j <= i + offset
    scale_log2: Float32   # softmax_scale * log2(e)
    window_lo: object     # query i sees key j only if j >= i + window_lo (None: no left edge)
    row_period: object = None  # packed rows: row r is query r % row_period (None: r)
    row0: object = 0      # `varlen`: the sequence's first row in the packed R and O
    row0_c: object = 0    # `varlen`: the sequence's first row in the packed C and B
    part: object = None   # `group_split` (dV, dK): (s, S), this CTA sums part s of S of the
                          # head group


class BlockSeq(NamedTuple):
    """The tile's sequence of column blocks: n_count of them, block i at `_block(seq, i)`."""

    n_top: Int32
    n_count: Int32
    head_kv: Int32
    group: Int32
    batch: Int32
    row0: object = 0      # `varlen`: the tile's `row0` and `row0_c` (for the loads' hooks)
    row0_c: object = 0


class Barriers(NamedTuple):
    """mbarrier pointers: R loaded; C / B ring stages loaded (TMA transaction bytes); P[b]
    written (128 S threads); P[b] consumed (`empty_arrivals` per use)."""

    rows: cute.Pointer
    cols: cute.Pointer
    accb: cute.Pointer    # [half * v_stages + stage]
    p_full: cute.Pointer  # [buffer], then (`publish_hi`) [2 + buffer] for the second half
    p_empty: cute.Pointer
    x: object = None   # `kv_pair`: peer's row statistics landed (st.async bytes), per buffer
    pp: object = None  # `kv_pair`: peer's P tile landed (bulk-copy bytes), per buffer


class PairSmem(NamedTuple):
    """`kv_pair`: the smem the two CTAs of a pair write into each other's copy of: the peer's
    row statistics ([2 buffers x TILE_M] fp32) and the P slots' base (slot = 2 buffer + rank)."""

    stat: cute.Tensor
    p_base: cute.Pointer


class Smem(NamedTuple):
    """The CTA's shared memory: each role's tensor, the P slots, the row-factor buffer
    (TILE_M, 2), the barriers, (cluster pair) the peer-written parts and (`cvt`) the 8-bit
    rings of C and B (else None)."""

    r: cute.Tensor
    c: cute.Tensor
    blo: cute.Tensor
    bhi: cute.Tensor
    p: cute.Tensor
    factor: cute.Tensor
    bars: Barriers
    pair: object
    c8: object = None
    blo8: object = None
    bhi8: object = None


class Convert(NamedTuple):
    """`cvt`: a warpgroup's 8-bit TMA ring (rows, cols, stages), the 16-bit buffers its WGMMAs
    read (rows, cols, 2) and the named barrier its 128 threads meet at after converting."""

    src: cute.Tensor
    dst: cute.Tensor
    barrier_id: int


class ScoreFrags(NamedTuple):
    """The S warpgroup's registers: the score accumulator and its (rows, cols) view, each
    element's (row, col) in the tile, the P fragment, the second score accumulator (two
    products, not `seq_scores`; else None), the score state (`_make_softmax`) and the rows'
    factors."""

    acc_S: cute.Tensor      # (MMA, MMA_M, MMA_N) fp32
    acc_S_mn: cute.Tensor   # (rows, cols) of this thread
    tScS_mn: cute.Tensor    # (rows, cols) -> (row, col) in the TILE_M x tile_n tile
    rP: cute.Tensor         # acc_S's layout, the operand dtype
    acc_2: object
    softmax: OnlineSoftmax
    factor: cute.Tensor     # (rows,) fp32


class ScoreIO(NamedTuple):
    """What the S warpgroup's hooks reach beyond their registers: the row-factor buffer, the
    LSE tensor, the kernel's `extra`, barriers, the pair's smem, thread and lane index."""

    sFactor: cute.Tensor
    mLSE: cute.Tensor
    extra: object
    bars: Barriers
    pair: object
    tidx: Int32
    lane: Int32


class ScoreStep(NamedTuple):
    """Step i of the S warpgroup: its column block, the head whose statistics it reads, and
    what `_block_prefetch` loaded for it."""

    i: Int32
    n_block: Int32
    head: Int32
    pre: object


class ColLoads(NamedTuple):
    """What the S warpgroup's loads need: TMA atoms and partitioned sources / stages of C and
    R, the whole TMA tensors and smem rings (for hooks that re-tile per head), the C ring's
    barriers, the block sequence, the number of chunks the tile reads and the ring position
    of its first."""

    tma_c: cute.CopyAtom
    tCg: cute.Tensor
    tCs: cute.Tensor
    tma_r: cute.CopyAtom
    tRg: cute.Tensor
    tRs: cute.Tensor
    gC_tma: cute.Tensor
    sC: cute.Tensor
    sR: cute.Tensor
    bar: cute.Pointer
    seq: BlockSeq
    total: Int32
    base: Int32   # the ring position of the tile's first chunk
    m_block: Int32
    head: Int32
    extra: object
    rank: Int32   # `kv_pair`: this CTA's rank in the pair (its own blocks: 2 i + rank)
    tidx: Int32


class BLoads(NamedTuple):
    """What an accumulator warpgroup's loads need (as ColLoads): its B ring, the barrier base
    of its stages, its first O column, which half it is (compile time), the B stages the tile
    reads and the ring position of its first, for `kv_pair` the barriers and the CTA's rank,
    and the kernel's `extra`."""

    tma: cute.CopyAtom
    tBg: cute.Tensor
    tBs: cute.Tensor
    bar: cute.Pointer
    gB_tma: cute.Tensor
    col0: Int32
    sB: cute.Tensor
    seq: BlockSeq
    half: int
    total: Int32
    base: Int32
    bars: Barriers
    rank: Int32
    tidx: Int32
    extra: object


class OutFrags(NamedTuple):
    """An accumulator warpgroup's MMA operands: O, the P slots (A) and the B stages (`cvt`:
    the two 16-bit buffers, filled from the 8-bit ring by `convert`; else None)."""

    acc_O: cute.Tensor   # (MMA, MMA_M, MMA_N) fp32
    tOrP: cute.Tensor    # (MMA, MMA_M, MMA_K, p_slots)
    tOrB: cute.Tensor    # (MMA, MMA_N, MMA_K, v_stages | 2)
    convert: object = None


class ScoreRegs(NamedTuple):
    """The S warpgroup's tile-independent fragments (built once, reused by every tile): the
    WGMMA operand views of R and C, the score accumulators and their views, P, the factors,
    and the stmatrix partition of P into its slots."""

    tSrR: cute.Tensor
    tSrC: cute.Tensor
    acc_S: cute.Tensor
    acc_S_mn: cute.Tensor
    tScS_mn: cute.Tensor
    rP: cute.Tensor
    acc_2: object
    factor: cute.Tensor
    thr_st: object
    tPsP: cute.Tensor
    tPrP: cute.Tensor


class Counters(NamedTuple):
    """Where a warpgroup's rings and hand-overs stand when a tile starts (all 0 for the first
    tile): its ring position (C for the S warpgroup, its B ring for an accumulator
    warpgroup), the P hand-overs so far (each tile makes n_iter + 1: its P tiles and the final
    factors), and the phase of the R barrier (the tile count's parity)."""

    ring: Int32
    hand: Int32
    phase: Int32


__all__ = ["BLoads", "Barriers", "BlockSeq", "ColLoads", "Convert", "Counters", "Mmas", "Operands",
           "OutFrags", "PairSmem", "Roles", "Scalars", "ScoreFrags", "ScoreIO", "ScoreRegs",
           "ScoreStep", "Smem", "SmemLayouts", "Tile"]
