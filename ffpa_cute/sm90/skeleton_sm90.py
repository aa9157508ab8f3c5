"""The warp-specialised WGMMA + TMA skeleton every sm90 kernel runs on (`RingSkeletonSm90`).

One CTA owns a 64-row tile of a "resident" operand and walks a sequence of column blocks. Three
warpgroups with separate roles, each feeding itself through its own TMA ring:

  WG0 "S"       the score warpgroup: S = R C^T for each block, over R's width in 64-column
                (128-byte) chunks streamed through the C ring (m64n{tile_n}k16 SS WGMMA); the
                kernel's score step turns S into P (bf16, smem) plus per-row factors;
  WG1 "O-lo"    the accumulator warpgroups: O[:, lo] += P B[:, lo] (SS WGMMA, A = P from smem,
  WG2 "O-hi"    B streamed through the warpgroup's own ring), each on its half of O's columns;
                then O (rows < the tile's valid rows) is written to global memory.

The kernels put their tensors in these roles (forward in fwd_sm90.py, gradients in bwd_sm90.py):

    role                     letter  forward   dV          dQ                  dK
    resident rows            R       Q tile    K tile      Q tile (+ dO)       K tile (+ V)
    streamed columns         C       K         Q           K (then V)          Q (then dO)
    accumulator B operand    B       V         dO          K                   Q
    output (fp32 registers)  O       O         dV          dQ                  dK

The context tuples the warpgroups and hooks pass around (Tile, BlockSeq, Scalars, the loads'
and fragments' bundles) live in ring_context.py. In this module sR / sC / sBlo / sBhi name
the shared-memory homes of those roles, gR_tma / gC_tma / gBlo_tma / gBhi_tma their TMA
views, mOut the output tensor, and tRs / tRg (tCs / tCg, tBs / tBg) the TMA partitions of a
role's smem / gmem (CuTe's tXsX / tXgX). The config fields keep the forward's names
(`k_stages`: C-ring depth; `v_stages`, `v_rows`: B rings; `stream_q`: R streamed through the C
ring; `hdim_q_padded`: R's resident width).

O[64 x 512] fp32 is 128 KB, half the register file: it is split along its columns between the two
accumulator warpgroups (lo = hi when the CTA's width % 16 == 0, else lo = hi + 8: WGMMA N is a
multiple of 8). With `half_align` each computes a wider share (its B stages then take the 64-
or 128-byte swizzle: 136 or 168 columns fit none), whose extra columns are real B columns of
the other share or TMA's zeros past the tensor, and stores only its own (`dv_split`). 384
threads give every thread 168 registers, and a 4th producer warpgroup (512 threads, 128
registers each at launch) could not hold an m64n256 accumulator (ptxas asks for 154).
`overlap` (two score accumulators) moves registers with `setmaxnreg`: the S warpgroup 184,
the accumulator warpgroups 160, and ptxas used the larger count for the S warpgroup's code
(its spills 232 -> 84 B, before P's packing removed the rest); that does not show a WGMMA
wider than the launch budget would compile after one (docs/design.md section 3).

Loads: TMA only, and every ring feeds exactly one warpgroup, which also refills it: the S
warpgroup owns R and the C ring ([tile_n x 64] chunks), each accumulator warpgroup its B ring
([v_rows x O-half] stages). As soon as a stage's WGMMAs are done (wait_group(1) after the next
stage's are issued) the owner issues the TMA for the stage `stages` positions ahead; a stage only
has a "full" mbarrier (TMA transaction bytes), and since its only reader is its only writer, no
"empty" one. TMA zero-fills rows and columns past the tensors' ends, so no load carries a
predicate. With `stream_q`, R does not stay resident: a [64 x 64] R chunk rides beside each C
chunk on the same barrier (O split over two CTAs, and the gradient kernels).

8-bit C and B under 16-bit R (`cvt`: the decode kernel's FP8 cache, config `kv_dtype`): the
TMA fills 8-bit rings (k_stages / v_stages deep, half the bytes); the warpgroup that reads a
stage converts it by bits into one of two 16-bit buffers (`_convert`), meets its 128 threads at
a named barrier, refills the 8-bit stage at once and runs its WGMMAs on the buffer; buffer
x % 2 is rewritten only after wait_group(1) has retired stage x - 2's WGMMAs.

Hand-off of P (double-buffered, mbarriers): P_full[b] (128 S-thread arrivals after a proxy fence,
so WGMMA's async proxy sees the stores) and P_empty[b] (an arrival by every O thread once its
PV WGMMAs on buffer b completed). Every thread, not one per warp: each lane reads its rows'
factors from sFactor[:, b] with a plain ld.shared, and only its own arrival (release) orders that
read before the S warpgroup's next write of sFactor[:, b] (acquire by its P_empty wait); one
arrival per warp left the other 31 lanes' reads unordered, which compute-sanitizer's racecheck
reports as write-after-read hazards on the factor buffer. Kernels whose accumulator warpgroups
read no factors (`rescale_o` False: the backward) keep one arrival per warp. After the last block
the S warpgroup publishes its final factors through the same buffers (no P), so the accumulator
warpgroups finish with the protocol they already follow.

Tensor-core order: the S warpgroup writes P[n], issues `publish_after` chunks of block n+1's
scores, then arrives on P_full[n]; WGMMAs from different warpgroups run in issue order on the
H200 (docs/perf-log.md), so PV[n] queues behind them and runs while the score step of n+1 does.
`publish_hi`: the second accumulator warpgroup gets P at another chunk (its own P_full pair).

Persistent CTAs (`persistent`, the 16-bit forward's choice where the planner says): the grid is
min(tiles, num_ctas) CTAs, one per SM, and every warpgroup of CTA c walks the row tiles c, c +
grid, ... of the one-CTA-per-tile grid's order (common/scheduler.py), with no communication
about them. Each warpgroup carries its ring position, the count of P hand-overs and (S) the R
barrier's phase from tile to tile (`Counters`), so stage s of position x is refilled and
waited exactly as within a tile; the accumulator warpgroups also release the final factors'
buffer, which the next tile's hand-overs reuse. The S warpgroup loads the next tile's R and
first C chunks as soon as its last score WGMMAs retire, so they arrive under the last PV; the
accumulator warpgroups' epilogue (final scale, O stores) runs under the next tile's first
score block.

Wide O in one CTA (`wide_o`, the 16-bit forward and gradient kernels at D in (512, 576], not
varlen): each accumulator warpgroup holds up to 288 columns, issued as m64n96 WGMMAs (`_mma`,
`pv_atom_n`), with registers moved from the S warpgroup by `setmaxnreg` (`_reg_split`).

Output split (`o_split` = 2, O wider than 512 elsewhere): two adjacent CTAs take the same row
tile and each computes half of O's columns. `kv_pair` (forward and gradients): the pair is a 2-CTA cluster that
splits the column blocks (CTA r scores block 2 i + r of step i, P tiles in a four-slot buffer, each
accumulator warpgroup runs both tiles of a step and also arrives on the peer's P_empty); the
skeleton runs the steps and sends each P tile to the peer (`_send_p`), the forward also joins
the row statistics (`pair_stats`, fwd_sm90.py).

Varlen (`varlen`): the tensors are [1, H, total, D] views of packed sequences and the kernel takes
their cumulative lengths; CTA t walks them to its sequence's row tile (`_varlen_tile`), the TMA
views start at the sequence's first row (`_from_row`) and the causal offset / window edge add
the sequence's frame. Split head groups (`group_split`, dV / dK): grid y = heads * S, each CTA
sums G / S of its KV head's G query heads into an fp32 workspace the host adds up.

V read from the C ring (`shared_kv`, V = K's first Dv columns): no B rings; each accumulator
warpgroup's B is its columns of a block's V chunks in the C ring, and the chunks' last readers
refill them (the `SharedKVRing` mixin, shared_ring.py).
"""

from __future__ import annotations


import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Uint16, Uint32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.tensor_utils import LayoutEnum

from ..common.convert import convert_stage, e4m3_pairs
from ..common.mask import apply_mask, block_needs_mask, n_block_max, n_block_min
from ..common.scheduler import rows_from, tile_coords, tile_count, varlen_tile
from ..common.softmax import OnlineSoftmax, mn_view
from ..common.tensors import CUTLASS_DTYPES, LOG2_E, KernelEntry, aligned_bhdn, aligned_bhnd
from .config import TILE_M, WIDE_O_REGS, FwdConfigSm90, cvt_tiling, pv_atom_n
from .overlap_ring import OverlapSchedule
from .shared_ring import SharedKVRing
from .ring_context import (BLoads, Barriers, BlockSeq, ColLoads, Convert, Counters, Mmas, Operands,
                           OutFrags, PairSmem, Roles, Scalars, ScoreFrags, ScoreIO, ScoreRegs,
                           ScoreStep, Smem, SmemLayouts, Tile)

WG_THREADS = 128


@cute.jit
def thread_roles():
    """(thread index, warpgroup index, warp index) of the calling thread, the last two
    warp-uniform: the first step of every warp-specialised sm90 kernel."""
    tidx, _, _ = cute.arch.thread_idx()
    return (tidx, cute.arch.make_warp_uniform(tidx // WG_THREADS),
            cute.arch.make_warp_uniform(cute.arch.warp_idx()))


@cute.jit
def tma_load(tma: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor, bar,
             nbytes: cutlass.Constexpr, tidx):
    """One TMA load by warp 0 of the calling warpgroup (tidx: the thread's index in it),
    `nbytes` expected on `bar`, where it completes."""
    if tidx // 32 == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(bar, nbytes)
        cute.copy(tma, src, dst, tma_bar_ptr=bar)


LAUNCH_REGS = 168   # registers per thread at launch: 65536 / 384 rounded down to 8


def set_regs(n: int):
    """setmaxnreg: the calling warpgroup's registers per thread from LAUNCH_REGS to n."""
    if n > LAUNCH_REGS:
        cute.arch.warpgroup_reg_alloc(n)
    else:
        cute.arch.warpgroup_reg_dealloc(n)


def row_major_layout(rows: int, cols: int, dtype, stages: int | None = None):
    """Row-major (cols contiguous) WGMMA-compatible smem layout of (rows, cols[, stages]) with
    the widest swizzle the row's bytes allow."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))


class RingSkeletonSm90(SharedKVRing, OverlapSchedule, KernelEntry):
    """The warp-specialised ring (module docstring): layouts, TMA, kernel entry, the S
    warpgroup's loop, the accumulator warpgroups' loop; one instance per config.

    Algorithm, per CTA (row tile m_block of head `head`; `o_part` of O's columns):
      1. Kernel entry: barriers initialised by warp 0 (TMA descriptors prefetched), the storage
         struct carved into R, the C ring, two B rings, the P slots and the factor buffer; the
         block sequence from `_heads` / `_block_range`; each warpgroup takes its role.
      2. S warpgroup: load R (or stream it with C), prime the C ring; for each step i (block
         `_block(seq, i)`; under `kv_pair` the CTA's own block of the pair):
           a. `_block_prefetch`: the block's statistics from global memory, before its WGMMAs;
           b. S = R C^T chunk by chunk (`_chunk` says which accumulator, which k steps), each
              stage refilled `k_stages` ahead once its WGMMAs retire; P[i-1] is published after
              `publish_after` chunks (`publish_hi`: the second half's);
           c. `_score_step`: scores -> P in the rP fragment (and the rows' factors);
           d. wait P_empty[i % 2], P -> smem slot (stmatrix; 8 bits: as byte pairs, the keys
              interleaved), `_write_factors`, proxy fence, `_after_p_store`.
         (`overlap`: steps b-d around the next block's QK instead, `_overlap_blocks`.)
         Then the last P_full, `_final_factors` published through the factor buffer with no P,
         and the LSE they return (rows < seqlen_r, `o_part` 0).
      3. Accumulator warpgroup `half`: prime its B ring; for each hand-over (one per step; a
         pair of blocks under `kv_pair`): wait P_full, rescale O's rows by the published
         factors (`rescale_o`), O += P B stage by stage (each stage refilled `v_stages` ahead),
         arrive on P_empty; finally scale by the last factors (`rescale_o`), convert to the
         output dtype and store rows < seqlen_r.
      4. Cluster pair: a cluster barrier before the peer's barriers are used, and one at the
         end (the peer may write our smem until then).
      `persistent`: steps 2 and 3 repeat for each tile of the CTA's schedule (`_tiles`,
      `_tile_at`), each warpgroup's counters carried over (module docstring).

    Constraints: sm_90a; 16-bit or 8-bit (e4m3) operands, or 16-bit R with 8-bit C / B
    converted in smem (`cvt`); TILE_M 64; tile_n 64 or 128; the widths and stage counts of
    `FwdConfigSm90` (its `smem_bytes` must equal the storage struct's size: asserted at
    compile time).

    Hook protocol (the skeleton's default in brackets; F forward, F8 FP8 forward, D decode, V dV,
    Q dQ, K dK: who overrides):
      `_heads(head, heads_r, heads_c, part)` -> (head_c, group): C's head and how many heads
          the blocks walk [head // (heads_r // heads_c), 1]; V, K: the G query heads of a KV
          head (`group_split`: part (s, S), the s-th G / S of them).
      `_seqlen_c(scalars, batch, extra)` -> rows of C for the batch row [the tensor's]; D (the
          decode kernel).
      `_causal_offset(scalars, seqlen_c, extra)` -> the rows' causal offset [the runtime
          scalar]; D (seqlen - Nq: chunked prefill).
      `_row_period(extra)` -> packed rows' query period, row r is query r % period [None]; D
          (Nq under `causal`).
      `_block_range(tile, group, extra)` -> (n_top, n_count): blocks n_top-1 downwards [the
          causal / length bound of the row tile, down to the window's left edge]; V, K, D.
      `_block(seq, i)` -> (head, n_block) of step i [one head, highest first]; V, K.
      `_chunk(c)` (compile time) -> (second accumulator?, first chunk of it?, k steps, first
          k step of R) [one product over R's width]; Q, K (two products).
      `_stats_head(head, blk_head)` -> the head whose statistics a block reads [head]; V, K.
      `_block_prefetch(tile, io, n_block, head, tScS_mn)` -> what `_score_step` reads from
          global memory [None]; V, Q, K.
      `_make_softmax(num_rows, tile, extra)` -> the score state [OnlineSoftmax at
          tile.scale_log2; the gradients read only its scale_log2]; F8 (descales).
      `_first_scores(tile, io, frags, step)`: `seq_scores`, the first product complete in
          acc_S, consumed into rP before the second overwrites it [none]; Q, K.
      `_score_step(tile, io, frags, step, n_count)`: scores -> rP (and factor) [none]; F, V,
          Q, K.
      `_write_factors(io, frags, b)`: factor -> sFactor[:, b] [one lane per quad]; V, Q, K
          (nothing: no factors).
      `_after_p_store(tile, io, b, i, n_count)`: after P of step i is in buffer b and fenced
          [`kv_pair`: P to the peer].
      `_final_factors(tile, io, frags, n_iter)` -> LSE fragment or None, leaving the last
          factors in frags.factor [none]; F (1 / row_sum, LSE), V, Q, K (None).
      `_col_src(loads, head, n_block, c)`: the TMA source of a C chunk [the tile's head]; V
          (re-tiled per head), Q and K (the first product's chunk c mod C), D (per page).
      `_b_src(loads, head, row_block)`: the TMA source of a B stage [the tile's head]; V and K
          (re-tiled per head), D (per page).
      `_copy_stream_chunk(loads, s, src, head, n_block, c)`: the copies of one C-ring stage
          with R streamed [C chunk + R chunk c]; Q, K (the second product's operands).
      `rescale_o` (class attribute) [False]: F True.
    """

    arch_family = "sm90"
    # runtime scalars after the tensors: the window's left edge is read only by configs with
    # `window` (the others compile no code for it)
    SCALARS = ("softmax_scale", "causal_offset", "window_lo")
    rescale_o = False     # accumulator warpgroups multiply O's rows by the published factors
    keys_are_rows = False  # R holds keys, C queries (dV, dK): `varlen`'s causal frame
    second_score = False  # the S warpgroup accumulates one score product (see `_chunk`)
    seq_scores = False    # with two: one accumulator, the first product consumed mid-block

    def __init__(self, cfg: FwdConfigSm90):
        self.cfg = cfg
        self.dtype = CUTLASS_DTYPES[cfg.dtype]
        # 8-bit R / C / B / P (`FwdFP8ConfigSm90`): both WGMMA operands K-major, so B arrives
        # transposed ([B, H, Dv, N]); O is written in the config's out_dtype
        self.fp8 = cfg.elem_bytes == 1
        self.out_dtype = CUTLASS_DTYPES[getattr(cfg, "out_dtype", cfg.dtype)]
        # `group_split` (dV, dK): each CTA writes its part of the group's sum in fp32 to a
        # workspace (B, H * S, N, D) that the host sums in a fixed order
        self.group_split = cfg.group_split
        if cfg.group_split:
            self.out_dtype = Float32
        self.mma_k = cfg.mma_k
        self.tile_n = cfg.tile_n
        self.num_chunks = cfg.num_k_chunks
        self.halves = cfg.dv_halves  # O columns the two accumulator warpgroups compute
        self.stored = cfg.dv_split   # and store (fewer with `half_align`)
        # whether a warpgroup computes columns it must not store: past its share
        # (`half_align`), or past Dv (the second CTA of an o_split with D % 16 == 8)
        ragged = cfg.dv_cta * cfg.o_split != cfg.dv
        self.widened = [w != s or ragged for w, s in zip(self.halves, self.stored)]
        self.b_rows = cfg.v_rows
        self.b_chunks = cfg.tile_n // cfg.v_rows  # B stages per O half per column block
        self.causal = cfg.causal
        self.kv_pair = cfg.kv_pair
        # the O warpgroups also arrive on the peer CTA's P_empty (the peer writes our P slots)
        self.peer_arrivals = cfg.cluster_pair
        # P_empty[b] arrivals per use: every O thread when the O warpgroups read the row
        # factors (`rescale_o`: plain ld.shared by each lane, so each lane must release its own
        # reads before the S warpgroup rewrites sFactor[:, b]); else one per O warp (its only
        # reads of buffer b are its WGMMAs', complete for the whole warp after wait_group);
        # plus one per peer O warp under `peer_arrivals` (the peer reads our P tile by WGMMA)
        self.empty_arrivals = ((2 * WG_THREADS if self.rescale_o else 8)
                               + (8 if self.peer_arrivals else 0))
        self.num_threads = 3 * WG_THREADS
        # bytes one TMA load brings in (the full box, zero-filled parts included)
        self.stream_r = cfg.stream_q
        eb = cfg.elem_bytes
        self.r_bytes = TILE_M * (cfg.k_chunk if cfg.stream_q else cfg.hdim_q_padded) * eb
        # 8-bit C and B under 16-bit R and P (the decode kernel's FP8 cache, `kv_dtype`): the
        # TMA brings them into 8-bit rings, and the warpgroup that reads them converts each
        # stage into one of two 16-bit buffers before its WGMMAs (`_convert`); C and B are in
        # the 16-bit dtype from there on
        self.cvt = getattr(cfg, "kv_dtype", None) is not None
        self.cvt_bufs = getattr(cfg, "cvt_bufs", 0)
        self.kv_dtype = CUTLASS_DTYPES[cfg.kv_dtype] if self.cvt else self.dtype
        kvb = cfg.kv_bytes if self.cvt else eb
        self.c_bytes = cfg.tile_n * cfg.k_chunk * kvb
        self.b_bytes = [cfg.v_rows * d * kvb for d in self.halves]
        # the rings the WGMMAs read: the TMA's stages, or (`cvt`) the two 16-bit buffers
        self.c_bufs = self.cvt_bufs or cfg.k_stages
        self.b_bufs = self.cvt_bufs or cfg.v_stages
        # `shared_kv`: V is K's first Dv columns; each accumulator warpgroup's B operand is its
        # columns of a block's V chunks in the C ring (two block slots: its two "stages"),
        # which it also refills (`_shared_pv`)
        self.shared_kv = cfg.shared_kv
        if cfg.shared_kv:
            self.b_bufs = 2

    # ---------------------------------------------------------------- layouts and MMAs
    def _smem_layout(self, rows: int, cols: int, stages: int | None = None, dtype=None):
        """`row_major_layout` in the operand dtype unless `dtype` is given."""
        return row_major_layout(rows, cols, dtype or self.dtype, stages)

    def _mma(self, n: int, b_major):
        """The tiled WGMMA of an [TILE_M x n] accumulator: one m64n`n` atom, or (n > 256, an O
        share of `wide_o`) the m64n`pv_atom_n(n)` atom repeated along N (the same accumulator
        registers, the same k-step order per column)."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, b_major, Float32,
            (1, 1, 1), (TILE_M, pv_atom_n(n)))

    def _b_major(self):
        """Major mode of P B's B operand: B's rows (MN-major) at 16 bits; at 8 bits WGMMA takes
        K-major operands only, so the transposed B's rows (K-major)."""
        return (cute.nvgpu.OperandMajorMode.K if self.fp8
                else cute.nvgpu.OperandMajorMode.MN)

    @staticmethod
    def _bhnd_to_tma(t: cute.Tensor) -> cute.Tensor:
        """(B, H, N, D) -> (N, D, H, B): the row/column modes first, as TMA tiles them."""
        return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 3, 1, 0]))

    # ---------------------------------------------------------------- host side
    def _smem_layouts(self) -> SmemLayouts:
        """R resident (or a ring with `stream_q`), the C ring, the B rings, the P slots."""
        cfg = self.cfg
        dlo, dhi = self.halves
        sR_layout = (self._smem_layout(TILE_M, cfg.k_chunk, cfg.k_stages) if self.stream_r
                     else self._smem_layout(TILE_M, cfg.hdim_q_padded))
        sC_layout = self._smem_layout(self.tile_n, cfg.k_chunk, self.c_bufs)
        if const_expr(cfg.shared_kv):  # (tile_n, Dv, 2): the C ring's V chunks, block slots 0, 1
            sBlo_layout = sBhi_layout = self._smem_layout(self.tile_n, cfg.dv, 2)
        elif const_expr(self.fp8):  # transposed B stages [half x b_rows], K (= C's rows) contiguous
            sBlo_layout = self._smem_layout(dlo, self.b_rows, cfg.v_stages)
            sBhi_layout = self._smem_layout(dhi, self.b_rows, cfg.v_stages)
        else:  # B stages [b_rows x half], read as the MN-major B of P B
            sBlo_layout = self._smem_layout(self.b_rows, dlo, self.b_bufs)
            sBhi_layout = self._smem_layout(self.b_rows, dhi, self.b_bufs)
        sP_layout = self._smem_layout(TILE_M, self.tile_n, cfg.p_slots)
        rings8 = ()
        if const_expr(self.cvt):  # the TMA's 8-bit rings, read only by `_convert`
            kv = self.kv_dtype
            rings8 = (self._smem_layout(self.tile_n, cfg.k_chunk, cfg.k_stages, kv),
                      self._smem_layout(self.b_rows, dlo, cfg.v_stages, kv),
                      self._smem_layout(self.b_rows, dhi, cfg.v_stages, kv))
        return SmemLayouts(sR_layout, sC_layout, sBlo_layout, sBhi_layout, sP_layout, *rings8)

    @cute.jit
    def _launch(self, roles: Roles, mLSE: cute.Tensor, softmax_scale: Float32,
                causal_offset: Int32, stream: cuda.CUstream, extra, window_lo: Int32 = None,
                num_ctas: Int32 = None, cu=None):
        """Build layouts, TMA atoms and the storage struct; launch. `extra`: what a kernel adds
        (FP8 descales, the two-product operands, the forward's sinks; None). `window_lo`: the
        window's left edge, passed to the device only when the config has one (`window`).
        `num_ctas`: the CTAs a `persistent` config launches at most (one per SM). `cu`:
        (`varlen`) the cumulative lengths of R's and C's sequences, int32 [B + 1] each."""
        cfg = self.cfg
        ops = self._operands(roles, mLSE)
        dlo, dhi = self.halves
        layouts = self._smem_layouts()
        SharedStorage = _shared_storage(cfg, self.dtype, layouts, self.kv_dtype)

        # the planner's budget must be the real one (else a config it accepts fails at launch)
        assert SharedStorage.size_in_bytes() == cfg.smem_bytes(), (
            SharedStorage.size_in_bytes(), cfg.smem_bytes())
        grid = (cute.ceil_div(roles.rows.shape[2], TILE_M) * cfg.ctas_per_tile,
                cute.size(roles.rows.shape[1]), cute.size(roles.rows.shape[0]))
        parts = None
        if const_expr(cfg.group_split):  # grid y: the workspace's heads, S per head of R
            parts = roles.out.shape[1] // roles.rows.shape[1]
            grid = (grid[0], cute.size(roles.out.shape[1]), grid[2])
        if const_expr(cfg.persistent):  # one CTA per SM walks the tiles (common/scheduler.py)
            grid = (cutlass.min(tile_count(*grid), num_ctas), 1, 1)
        cu_r, cu_c = None, None
        if const_expr(cfg.varlen):  # rows (1, H, total, D): sum_b ceil(n_b / TILE_M) row tiles
            cu_r, cu_c = cu     # at most, below ceil(total / TILE_M) + B (`_varlen_tile`)
            grid = ((cute.ceil_div(roles.rows.shape[2], TILE_M) + cute.size(cu_r) - 1)
                    * cfg.ctas_per_tile, grid[1], 1)
        self.kernel(
            ops,
            Scalars(roles.cols.shape[2], roles.cols.shape[1], softmax_scale * LOG2_E,
                    causal_offset, window_lo if const_expr(cfg.window) else None, cu_r, cu_c,
                    parts),
            layouts,
            Mmas(self._mma(self.tile_n, cute.nvgpu.OperandMajorMode.K),
                 self._mma(dlo, self._b_major()),
                 self._mma(dhi, self._b_major())),
            SharedStorage, extra,
        ).launch(grid=grid, block=[self.num_threads, 1, 1],
                 smem=SharedStorage.size_in_bytes(), stream=stream, min_blocks_per_mp=1,
                 **({"cluster": [2, 1, 1]} if cfg.cluster_pair else {}))

    @cute.jit
    def _operands(self, roles: Roles, mLSE: cute.Tensor) -> Operands:
        """TMA atoms and tensors of the roles' (B, H, N, D) tensors: R (resident rows or their
        chunks), C (the S ring's column chunks), B (the accumulators' halves), and O."""
        cfg = self.cfg
        mR = aligned_bhnd(roles.rows, cfg.head_dim, self.dtype)
        mC = aligned_bhnd(roles.cols, cfg.head_dim, self.kv_dtype)
        mOut = aligned_bhnd(roles.out, cfg.dv, self.out_dtype)
        if const_expr(self.fp8):  # transposed B (B, H, Dv, N): its (Dv, N) modes first for TMA
            mB = aligned_bhdn(roles.acc_b, cfg.dv, self.dtype)
        else:
            mB = aligned_bhnd(roles.acc_b, cfg.dv, self.kv_dtype)
        tR, tC, tB = [self._bhnd_to_tma(t) for t in (mR, mC, mB)]
        dlo, dhi = self.halves
        layouts = self._smem_layouts()

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        r_box = (TILE_M, cfg.k_chunk if self.stream_r else cfg.hdim_q_padded)
        # TMA coordinate tensors, (N, D, H, B) each (8-bit B: (Dv, N, H, B))
        tma_r, gR_tma = cpasync.make_tiled_tma_atom(   # box (TILE_M, Dr padded | k_chunk)
            g2s, tR, cute.select(layouts.r, mode=[0, 1]), r_box)
        # C and B land in the rings the TMA fills: the 8-bit ones under `cvt`
        c_ring, blo_ring, bhi_ring = ((layouts.c8, layouts.blo8, layouts.bhi8)
                                      if const_expr(self.cvt)
                                      else (layouts.c, layouts.blo, layouts.bhi))
        tma_c, gC_tma = cpasync.make_tiled_tma_atom(   # box (tile_n, k_chunk)
            g2s, tC, cute.select(c_ring, mode=[0, 1]), (self.tile_n, cfg.k_chunk))
        if const_expr(cfg.shared_kv):  # B is read from the C ring: no B loads
            return Operands(mOut, mLSE, gR_tma, gC_tma, None, None, tma_r, tma_c, None, None)
        # B boxes are one accumulator warpgroup wide; the kernel offsets them to its columns
        # (8 bits: to its rows of the transposed B)
        blo_box, bhi_box = (((dlo, self.b_rows), (dhi, self.b_rows)) if const_expr(self.fp8)
                            else ((self.b_rows, dlo), (self.b_rows, dhi)))
        tma_blo, gBlo_tma = cpasync.make_tiled_tma_atom(   # box (b_rows, lo) | (lo, b_rows)
            g2s, tB, cute.select(blo_ring, mode=[0, 1]), blo_box)
        tma_bhi, gBhi_tma = cpasync.make_tiled_tma_atom(   # box (b_rows, hi) | (hi, b_rows)
            g2s, tB, cute.select(bhi_ring, mode=[0, 1]), bhi_box)
        return Operands(mOut, mLSE, gR_tma, gC_tma, gBlo_tma, gBhi_tma, tma_r, tma_c, tma_blo,
                        tma_bhi)

    # ---------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, ops: Operands, scalars: Scalars, layouts: SmemLayouts, mmas: Mmas,
               SharedStorage: cutlass.Constexpr, extra):
        cfg = self.cfg
        tidx, wg, warp_idx = thread_roles()
        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        bars = Barriers(storage.bar_r.data_ptr(), storage.bar_c.data_ptr(),
                        storage.bar_b.data_ptr(), storage.bar_p_full.data_ptr(),
                        storage.bar_p_empty.data_ptr())
        if const_expr("bar_x" in cfg.pair_barriers):
            bars = bars._replace(x=storage.bar_x.data_ptr())
        if const_expr("bar_pp" in cfg.pair_barriers):
            bars = bars._replace(pp=storage.bar_pp.data_ptr())
        if warp_idx == 0:
            for tma in (ops.tma_r, ops.tma_c, ops.tma_blo, ops.tma_bhi):
                if const_expr(tma is not None):
                    cpasync.prefetch_descriptor(tma)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(bars.rows, 1)
                for s in cutlass.range_constexpr(cfg.k_stages):
                    cute.arch.mbarrier_init(bars.cols + s, 1)
                for s in cutlass.range_constexpr(2 * cfg.v_stages):
                    cute.arch.mbarrier_init(bars.accb + s, 1)
                for b in cutlass.range_constexpr(2):
                    cute.arch.mbarrier_init(bars.p_full + b, WG_THREADS)  # every S thread
                    cute.arch.mbarrier_init(bars.p_empty + b, self.empty_arrivals)
                    if const_expr(bars.x is not None):
                        cute.arch.mbarrier_init(bars.x + b, 1)
                    if const_expr(bars.pp is not None):
                        cute.arch.mbarrier_init(bars.pp + b, 1)
                if const_expr(cfg.publish_hi is not None):  # the second half's P_full
                    for b in cutlass.range_constexpr(2):
                        cute.arch.mbarrier_init(bars.p_full + 2 + b, WG_THREADS)
                cute.arch.mbarrier_init_fence()
        if const_expr(cfg.cluster_pair):  # the peer's barriers exist before anything
            # reaches them
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()

        # (TILE_M, Dr padded), or (TILE_M, k_chunk, k_stages) when R streams
        sR = storage.sR.get_tensor(layouts.r.outer, swizzle=layouts.r.inner)
        # (tile_n, k_chunk, k_stages)
        sC = storage.sC.get_tensor(layouts.c.outer, swizzle=layouts.c.inner)
        if const_expr(cfg.shared_kv):
            # (tile_n, lo | hi, 2): each half's columns of the V chunks in the C ring's two
            # block slots
            sV = storage.sC.get_tensor(layouts.blo.outer, swizzle=layouts.blo.inner)
            sBlo = cute.local_tile(sV, (self.tile_n, self.halves[0], 2), (0, 0, 0))
            sBhi = cute.local_tile(sV, (self.tile_n, self.halves[1], 2), (0, 1, 0))
        else:
            # (b_rows, lo | hi, v_stages); 8 bits: (lo | hi, b_rows, v_stages)
            sBlo = storage.sBlo.get_tensor(layouts.blo.outer, swizzle=layouts.blo.inner)
            sBhi = storage.sBhi.get_tensor(layouts.bhi.outer, swizzle=layouts.bhi.inner)
        # (TILE_M, tile_n, p_slots)
        sP = storage.sP.get_tensor(layouts.p.outer, swizzle=layouts.p.inner)
        # (TILE_M, 2): the rows' factors of each P buffer
        sFactor = storage.row_factor.get_tensor(cute.make_layout((TILE_M, 2)))
        rings8 = ()
        if const_expr(self.cvt):  # the 8-bit rings: (tile_n, k_chunk, k_stages), (b_rows,
            # lo | hi, v_stages)
            rings8 = tuple(getattr(storage, f).get_tensor(lay.outer, swizzle=lay.inner)
                           for f, lay in (("sC8", layouts.c8), ("sBlo8", layouts.blo8),
                                          ("sBhi8", layouts.bhi8)))

        bidx, head, batch = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        part = None
        if const_expr(cfg.group_split):  # grid y = head * S + s
            part = (head % scalars.parts, scalars.parts)
            head = head // scalars.parts
        work = None  # `persistent`: each warpgroup walks `_tiles` itself
        if const_expr(cfg.varlen):  # CTA tile t of the sequences' row tiles
            work = self._varlen_tile(ops, scalars, extra, bidx // cfg.ctas_per_tile,
                                     bidx % cfg.o_split, head, part)
        elif const_expr(not cfg.persistent):
            # longest tiles first under causal: the last row tiles of the queries (bottom-right)
            # or the first of the keys (`keys_are_rows`), so the shortest ones fill the last
            # wave; the CTAs of a row tile adjacent
            t = bidx // cfg.ctas_per_tile
            m_block = grid_x // cfg.ctas_per_tile - 1 - t
            if const_expr(self.keys_are_rows and self.causal):
                m_block = t
            o_part = bidx % cfg.o_split  # which 1 / o_split of O's columns
            work = self._tile(ops, scalars, extra, m_block, o_part, head, batch, part=part)

        pair = None
        if const_expr(cfg.pair_stats):
            # the peer's row statistics (TILE_M, 2), and the P slots' base
            pair = PairSmem(storage.peer_stat.get_tensor(cute.make_layout((TILE_M, 2))),
                            storage.sP.data_ptr())
        elif const_expr(cfg.cluster_pair):
            pair = PairSmem(None, storage.sP.data_ptr())
        smem = Smem(sR, sC, sBlo, sBhi, sP, sFactor, bars, pair, *rings8)
        self._warpgroups(ops, scalars, mmas, smem, work, extra, wg, tidx)
        if const_expr(cfg.cluster_pair):  # the peer may still write our smem until done
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def _tile(self, ops: Operands, scalars: Scalars, extra, m_block, o_part, head, batch,
              span=None, part=None):
        """(Tile, BlockSeq) of row tile m_block of (head, batch): C's head, the batch row's
        length and causal offset, and the column blocks n_top-1, n_top-2, ..., n_top-n_count
        it visits (descending: the masked ones first). `span` (`varlen`): the sequence's
        (rows of R, rows of C, first row in R, first row in C, Nkv - Nq), the causal offset
        and window edge then the runtime scalars plus that frame. `part`: (s, S), the CTA's
        part of the head group (`group_split`; else None)."""
        heads_r = cute.size(ops.mOut.shape[1])
        if const_expr(self.group_split):  # the workspace has S heads per head of R
            heads_r = heads_r // scalars.parts
        head_c, group = self._heads(head, heads_r, scalars.heads_c, part)
        if const_expr(span is None):
            seqlen_c = self._seqlen_c(scalars, batch, extra)
            tile = Tile(m_block, o_part, head, head_c, batch, ops.mOut.shape[2], seqlen_c,
                        self._causal_offset(scalars, seqlen_c, extra), scalars.scale_log2,
                        scalars.window_lo, self._row_period(extra), part=part)
        else:
            seqlen_r, seqlen_c, row0, row0_c, frame = span
            window_lo = None
            if const_expr(scalars.window_lo is not None):
                window_lo = scalars.window_lo + frame
            tile = Tile(m_block, o_part, head, head_c, batch, seqlen_r, seqlen_c,
                        scalars.causal_offset + frame, scalars.scale_log2, window_lo, None,
                        row0, row0_c, part)
        n_top, n_count = self._block_range(tile, group, extra)
        return tile, BlockSeq(n_top, n_count, head_c, group, batch, tile.row0, tile.row0_c)

    @cute.jit
    def _varlen_tile(self, ops: Operands, scalars: Scalars, extra, t, o_part, head, part):
        """`varlen`: (Tile, BlockSeq) of the CTA's tile t (common/scheduler.py's
        `varlen_tile`: sequence 0's row tiles, longest first under causal, then sequence
        1's, ...); a t past the last tile gets an empty tile: no rows, no blocks, nothing
        stored."""
        m_block, row0, seqlen_r, row0_c, seqlen_c, frame = varlen_tile(
            scalars.cu_r, scalars.cu_c, t, TILE_M, self.keys_are_rows and self.causal,
            self.keys_are_rows)
        return self._tile(ops, scalars, extra, m_block, o_part, head, 0,
                          (seqlen_r, seqlen_c, row0, row0_c, frame), part)

    def _from_row(self, t: cute.Tensor, row0) -> cute.Tensor:
        """t (rows first) from row `row0` on: under `varlen` the sequence's first row in the
        packed tensor (TMA coordinates may start anywhere), else t itself."""
        return rows_from(t, row0, self.cfg.varlen)

    @cute.jit
    def _tiles(self, ops: Operands):
        """`persistent`: (first, end, stride) of the CTA's tiles in the linear order of
        common/scheduler.py: the CTA index, then every grid size further, below the tile
        count."""
        bidx, _, _ = cute.arch.block_idx()
        grid_x, _, _ = cute.arch.grid_dim()
        m_tiles = cute.ceil_div(ops.mOut.shape[2], TILE_M)
        return bidx, tile_count(m_tiles, cute.size(ops.mOut.shape[1]),
                                cute.size(ops.mOut.shape[0])), grid_x

    @cute.jit
    def _tile_at(self, ops: Operands, scalars: Scalars, extra, t):
        """`persistent`: (Tile, BlockSeq) of linear tile t (common/scheduler.py)."""
        m_block, head, batch = tile_coords(t, cute.ceil_div(ops.mOut.shape[2], TILE_M),
                                           cute.size(ops.mOut.shape[1]))
        return self._tile(ops, scalars, extra, m_block, 0, head, batch)

    @cute.jit
    def _warpgroups(self, ops: Operands, scalars: Scalars, mmas: Mmas, smem: Smem, work,
                    extra, wg, tidx):
        """Each warpgroup's role: WG0 scores, WG1 / WG2 the two halves of O. `work`: the
        CTA's (Tile, BlockSeq), or (`persistent`) None: each warpgroup walks the CTA's tiles
        (`_tiles`) with its ring and hand-over counters carried from tile to tile."""
        regs = self._reg_split()
        if wg == 0:
            if const_expr(regs is not None):
                set_regs(regs[0])
            self._score_wg(mmas.s, ops, scalars, smem, work, extra, tidx)
        elif wg == 1:
            if const_expr(regs is not None):
                set_regs(regs[1])
            self._acc_wg(mmas.o_lo, ops, scalars, smem, 0, work, extra, tidx - WG_THREADS)
        else:
            if const_expr(regs is not None):
                set_regs(regs[1])
            self._acc_wg(mmas.o_hi, ops, scalars, smem, 1, work, extra, tidx - 2 * WG_THREADS)

    def _reg_split(self):
        """(S, O) registers per thread by `setmaxnreg`, or None (the launch's 168 each).
        `overlap`: two score accumulators; the O warpgroups need 154 (multiples of 8).
        `wide_o`: O shares of up to 288 columns (144 fp32 registers) take S 152 / O 176
        (WIDE_O_REGS). `setmaxnreg.inc` draws on the CTA's own pool, the launch's LAUNCH_REGS
        x 384: a request past it waits forever, so S + 2 O <= 3 LAUNCH_REGS."""
        regs = WIDE_O_REGS if self.cfg.wide_o else (184, 160) if self.cfg.overlap else None
        assert regs is None or regs[0] + 2 * regs[1] <= 3 * LAUNCH_REGS, regs
        return regs

    # ---------------------------------------------------------------- hooks: the block walk
    @cute.jit
    def _heads(self, head, heads_r, heads_c, part):
        """(head of C and B, blocks' head group): the C head of this R head (GQA / MQA)."""
        return head // (heads_r // heads_c), 1

    @cute.jit
    def _seqlen_c(self, scalars: Scalars, batch, extra):
        """Rows of C (and B) the tile's batch row has: the tensor's (the decode kernel reads a
        length per batch row)."""
        return scalars.seqlen_c

    @cute.jit
    def _causal_offset(self, scalars: Scalars, seqlen_c, extra):
        """The causal offset of the tile's rows: the kernel's runtime scalar (the decode kernel
        derives it from the batch row's length)."""
        return scalars.causal_offset

    def _row_period(self, extra):
        """Packed rows: the period of the query index over the rows (None: row r is query r;
        the decode kernel's chunked prefill packs G heads x Nq queries)."""
        return None

    @cute.jit
    def _block_range(self, tile: Tile, group, extra):
        """(n_top, n_count): the blocks this row tile visits are n_top-1 down to n_top-n_count
        (the last one any row may see under causal, down to 0, or to the first one its first
        row sees under a window's left edge)."""
        n_max = n_block_max(tile.m_block, tile.seqlen_c, tile.causal_offset, TILE_M,
                            self.tile_n, self.causal)
        if const_expr(tile.window_lo is None):
            return n_max, n_max
        n_min = n_block_min(tile.m_block, tile.window_lo, TILE_M, self.tile_n)
        return n_max, cutlass.max(n_max - n_min, 0)

    @cute.jit
    def _block(self, seq, i):
        """(head, column block) of the tile's i-th block: one head, blocks highest first."""
        return seq.head_kv, seq.n_top - 1 - i

    def _chunk(self, c: int):
        """(second accumulator?, first chunk of its accumulator?, WGMMA k steps, first k step of
        R) for S-ring chunk c (compile time): one product over R's width here."""
        cfg = self.cfg
        last = -(-(cfg.head_dim - (self.num_chunks - 1) * cfg.k_chunk) // self.mma_k)
        per = cfg.k_chunk // self.mma_k
        return False, c == 0, last if c == self.num_chunks - 1 else per, c * per

    def _stats_head(self, head, blk_head):
        """Head whose per-row statistics (LSE, Delta) the score step reads: the tile's head
        (the rows are queries; the forward reads none)."""
        return head

    @cute.jit
    def _col_src(self, loads: ColLoads, head, n_block, c):
        """Source of C chunk c of block n_block (of `head`: one head here, tCg covers it)."""
        return loads.tCg[None, n_block, c]

    @cute.jit
    def _b_src(self, loads: BLoads, head, row_block):
        """Source of B rows block row_block (of `head`: one head here, tBg covers it)."""
        return loads.tBg[None, row_block]

    @cute.jit
    def _col_src_at(self, loads: ColLoads, head, batch, n_block, c):
        """C chunk c of block n_block at (head, batch), the C TMA view re-tiled there: for
        hooks whose blocks change head (dV, dK) or batch index (the decode kernel's pages)."""
        # (tile_n, k_chunk, n_blocks, C)
        g = cute.local_tile(self._from_row(loads.gC_tma[None, None, head, batch],
                                           loads.seq.row0_c),
                            (self.tile_n, self.cfg.k_chunk), (None, None))
        # (TMA, n_blocks, C)
        _, tg = cpasync.tma_partition(loads.tma_c, 0, cute.make_layout(1),
                                      cute.group_modes(loads.sC, 0, 2), cute.group_modes(g, 0, 2))
        return tg[None, n_block, c]

    @cute.jit
    def _b_src_at(self, loads: BLoads, head, batch, row_block):
        """B rows block row_block at (head, batch), this warpgroup's columns, the B TMA view
        re-tiled there (as `_col_src_at`)."""
        rows = self._from_row(loads.gB_tma[None, None, head, batch], loads.seq.row0_c)
        # (b_rows, half, b_blocks)
        g = cute.local_tile(cute.domain_offset((0, loads.col0), rows),
                            (self.b_rows, self.halves[loads.half]), (None, 0))
        # (TMA, b_blocks)
        _, tg = cpasync.tma_partition(loads.tma, 0, cute.make_layout(1),
                                      cute.group_modes(loads.sB, 0, 2),
                                      cute.group_modes(g, 0, 2))
        return tg[None, row_block]

    # ---------------------------------------------------------------- hooks: the score step
    @cute.jit
    def _mask_block(self, tile: Tile, frags: ScoreFrags, n_block):
        """Mask block n_block's scores (acc_S) where it crosses Nkv, the causal diagonal or the
        window's left edge; the other blocks need none. Shared by every kernel's score step."""
        if block_needs_mask(tile.m_block, n_block, tile.seqlen_c, tile.causal_offset, TILE_M,
                            self.tile_n, self.causal, tile.window_lo, tile.row_period):
            apply_mask(frags.acc_S_mn, frags.tScS_mn, tile.m_block, n_block, tile.seqlen_c,
                       tile.causal_offset, TILE_M, self.tile_n, self.causal, tile.window_lo,
                       tile.row_period)

    def _block_prefetch(self, tile: Tile, io: ScoreIO, n_block, head, tScS_mn):
        """Statistics the score step of block n_block reads from global memory, loaded at the
        block's start (None: the forward reads none)."""
        return None

    @cute.jit
    def _make_softmax(self, num_rows: cutlass.Constexpr, tile: Tile, extra):
        """The S warpgroup's score state: an online softmax at the tile's scale (the FP8
        forward folds its descales in; the gradient kernels read only its scale_log2)."""
        return OnlineSoftmax(num_rows, tile.scale_log2)

    def _first_scores(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, step: ScoreStep):
        """`seq_scores`: consume the first score product mid-block (two-product kernels)."""
        raise NotImplementedError

    def _score_step(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, step: ScoreStep,
                    n_count):
        """Scores of step `step.i` -> P in frags.rP (and the rows' factors): each kernel's."""
        raise NotImplementedError

    @cute.jit
    def _p_to_regs(self, frags: ScoreFrags):
        """P (in acc_S, fp32) into the rP fragment `_store_p` stores: converted to the operand
        dtype; at 8 bits packed by `e4m3_pairs` into the 16-bit elements stmatrix moves (word
        (h, j) = the row's column pairs of n8 tiles 2j and 2j + 1: Note [Interleaved keys])."""
        if const_expr(self.fp8):
            acc, words = frags.acc_S, cute.recast_tensor(frags.rP, Uint32)
            for j in cutlass.range_constexpr(cute.size(words, mode=[0, 2])):
                for h in cutlass.range_constexpr(2):
                    words[(0, h, j), 0, 0] = e4m3_pairs(
                        acc[(0, h, 2 * j), 0, 0], acc[(1, h, 2 * j), 0, 0],
                        acc[(0, h, 2 * j + 1), 0, 0], acc[(1, h, 2 * j + 1), 0, 0])
        else:
            frags.rP.store(frags.acc_S.load().to(self.dtype))

    @cute.jit
    def _write_factors(self, io: ScoreIO, frags: ScoreFrags, b):
        """Each quad shares its rows: one lane per quad writes their factors to sFactor[:, b]."""
        sFactor, factor, tScS_mn, lane = io.sFactor, frags.factor, frags.tScS_mn, io.lane
        if lane % 4 == 0:
            for r in cutlass.range_constexpr(cute.size(factor)):
                sFactor[tScS_mn[r, 0][0], b] = factor[r]

    @cute.jit
    def _after_p_store(self, tile: Tile, io: ScoreIO, b, i, n_count):
        """After P of step i is in its slot of buffer b and fenced: `kv_pair` sends it to the
        peer when the step has a pair of blocks (nothing else here; a hook)."""
        if const_expr(self.kv_pair):
            if 2 * i + 1 < n_count:  # a pair of blocks: our P tile to the peer too
                self._send_p(io, b, tile.o_part)

    @cute.jit
    def _send_p(self, io: ScoreIO, b, rank):
        """Our P tile (slot 2 b + rank, written and fenced by all S threads) into the same
        slot of the peer's smem by one bulk copy, counted on the peer's pp[b]; we expect the
        peer's tile on ours."""
        from cutlass.experimental.primitives.nvvm_wrapper import (
            cp_async_bulk_shared_cluster_shared_cta)

        pair, bars, tidx = io.pair, io.bars, io.tidx
        cutlass.pipeline.NamedBarrier(barrier_id=1, num_threads=WG_THREADS).arrive_and_wait()
        if tidx == 0:
            nbytes = TILE_M * self.tile_n * self.cfg.elem_bytes
            cute.arch.mbarrier_arrive_and_expect_tx(bars.pp + b, nbytes)
            src = pair.p_base + (2 * b + rank) * (TILE_M * self.tile_n)
            cp_async_bulk_shared_cluster_shared_cta(
                cute.arch.map_dsmem_ptr(src, 1 - rank), src,
                cute.arch.map_dsmem_ptr(bars.pp + b, 1 - rank), nbytes)

    def _final_factors(self, tile: Tile, io: ScoreIO, frags: ScoreFrags, n_iter):
        """After the last block: the factors published with no P (in frags.factor), and the
        LSE fragment to store (or None)."""
        raise NotImplementedError

    # ---------------------------------------------------------------- S warpgroup
    @cute.jit
    def _score_wg(self, mma_s: cute.TiledMma, ops: Operands, scalars: Scalars, smem: Smem,
                  work, extra, tidx):
        """WG0: scores of every block into P, handed to the accumulator warpgroups: the
        registers once, then the CTA's tile, or (`persistent`) each tile of its schedule."""
        cfg = self.cfg
        sP = smem.p
        # ---- MMA fragments (MMA_K: k_chunk / mma_k WGMMA k steps per chunk)
        thr_mma = mma_s.get_slice(tidx)
        # (MMA, MMA_M, Dr padded / mma_k), or (MMA, MMA_M, MMA_K, k_stages) when R streams
        tSrR = mma_s.make_fragment_A(thr_mma.partition_A(smem.r))
        # (MMA, MMA_N, MMA_K, k_stages | 2 16-bit buffers)
        tSrC = mma_s.make_fragment_B(thr_mma.partition_B(smem.c))
        # (MMA, MMA_M, MMA_N) fp32: ((2, 2, tile_n / 8), 1, 1)
        acc_S = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, self.tile_n)), Float32)
        # a second score accumulator for skeletons with two score products (bwd dQ / dK)
        # (or, `overlap`, the next block's scores while the score step reads acc_S)
        acc_2 = (cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, self.tile_n)), Float32)
                 if const_expr((self.second_score and not self.seq_scores) or cfg.overlap)
                 else None)
        acc_S_mn = mn_view(acc_S)   # (rows, cols) of this thread: (2, tile_n / 4)
        # (rows, cols) -> (row, col) of the TILE_M x tile_n tile
        tScS_mn = mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_M, self.tile_n))))
        num_rows = cute.size(acc_S_mn, mode=[0])
        factor = cute.make_rmem_tensor(num_rows, Float32)   # (rows,)
        st_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4),
                                      Uint16 if const_expr(self.fp8) else self.dtype)
        if const_expr(self.fp8):
            # 8 bits: stmatrix moves 16-bit elements, so P goes as byte pairs: the tile as
            # [TILE_M x tile_n / 2] 16-bit, each thread's pair from n8 tiles 2j and 2j + 1 of
            # the accumulator (`_p_to_regs`), the keys interleaved as Vt's (common/
            # transpose.py, Note [Interleaved keys]); the view keeps sP's swizzle (in bytes)
            sP = cute.make_tensor(cute.recast_ptr(sP.iterator, self._smem_layouts().p.inner,
                                                  dtype=Uint16),
                                  cute.recast_layout(16, 8, sP.layout))
            mma_p = sm90_utils.make_trivial_tiled_mma(
                cutlass.BFloat16, cutlass.BFloat16, cute.nvgpu.OperandMajorMode.K,
                cute.nvgpu.OperandMajorMode.K, Float32, (1, 1, 1), (TILE_M, self.tile_n // 2))
            # (MMA, MMA_M, MMA_N) 16-bit: ((2, 2, tile_n / 16), 1, 1)
            rP = cute.make_rmem_tensor(
                mma_p.get_slice(tidx).partition_shape_C((TILE_M, self.tile_n // 2)), Uint16)
        else:
            mma_p = mma_s
            rP = cute.make_fragment_like(acc_S, self.dtype)   # (MMA, MMA_M, MMA_N)
        # P -> sP by stmatrix, the copy atom tiled over the (16-bit) P tile's C layout
        thr_st = cute.make_tiled_copy_C(st_atom, mma_p).get_slice(tidx)
        tPsP = thr_st.partition_D(sP)   # (CPY, CPY_M, CPY_N, p_slots)
        tPrP = thr_st.retile(rP)        # (CPY, CPY_M, CPY_N)
        regs = ScoreRegs(tSrR, tSrC, acc_S, acc_S_mn, tScS_mn, rP, acc_2, factor, thr_st, tPsP,
                         tPrP)
        if const_expr(cfg.persistent):
            x, p, n = Int32(0), Int32(0), Int32(0)
            first, end, stride = self._tiles(ops)
            for t in cutlass.range(first, end, stride, unroll=1):
                tile, seq = self._tile_at(ops, scalars, extra, t)
                x, p = self._score_tile(mma_s, ops, smem, regs, tile, seq, extra, tidx,
                                        Counters(x, p, n % 2))
                n += 1
        else:
            tile, seq = work
            self._score_tile(mma_s, ops, smem, regs, tile, seq, extra, tidx, Counters(0, 0, 0))

    @cute.jit
    def _score_tile(self, mma_s: cute.TiledMma, ops: Operands, smem: Smem, regs,
                    tile: Tile, seq: BlockSeq, extra, tidx, at):
        """The S warpgroup on one tile, from C-ring position at.ring and P hand-over at.hand
        (the R barrier in phase at.phase); returns (ring position, hand-overs) after it."""
        cfg = self.cfg
        C = self.num_chunks
        ks = cfg.k_stages
        sR, sC, bars = smem.r, smem.c, smem.bars
        tSrR, tSrC, acc_S, acc_S_mn, tScS_mn, rP, acc_2, factor = regs[:8]  # (P's store: regs)
        m_block, o_part, head, batch = tile.m_block, tile.o_part, tile.head, tile.batch
        seqlen_r = tile.seqlen_r
        mLSE = ops.mLSE
        lane = cute.arch.lane_idx()
        # ---- TMA views of R (the tile's rows) and C (every block's chunks)
        one = cute.make_layout(1)
        rows_r = self._from_row(ops.gR_tma[None, None, head, batch], tile.row0)
        if const_expr(self.stream_r):  # (TILE_M, k_chunk, C)
            gR = cute.local_tile(rows_r, (TILE_M, cfg.k_chunk), (m_block, None))
        else:  # (TILE_M, Dr padded)
            gR = cute.local_tile(rows_r, (TILE_M, cfg.hdim_q_padded), (m_block, 0))
        # (TMA) / (TMA); when R streams (TMA, k_stages) / (TMA, C)
        tRs, tRg = cpasync.tma_partition(ops.tma_r, 0, one, cute.group_modes(sR, 0, 2),
                                         cute.group_modes(gR, 0, 2))
        # the ring the TMA fills: sC, or (`cvt`) the 8-bit one that `_convert` reads into sC
        sC_tma = smem.c8 if const_expr(self.cvt) else sC
        tCs, tCg = self._c_partition(ops, sC_tma, tile)
        num_rows = cute.size(acc_S_mn, mode=[0])
        softmax = self._make_softmax(num_rows, tile, extra)
        frags = ScoreFrags(acc_S, acc_S_mn, tScS_mn, rP, acc_2, softmax, factor)
        io = ScoreIO(smem.factor, mLSE, extra, bars, smem.pair, tidx, lane)
        n_count = seq.n_count
        n_iter = n_count  # score blocks this warpgroup computes (`kv_pair`: every other one)
        if const_expr(self.kv_pair):
            n_iter = (n_count + 1) // 2
        total = n_iter * C  # C chunks this tile reads, in ring order
        hand = at.hand  # P hand-overs before this tile's (buffer (hand + i) % 2 at step i)

        # ---- R (unless it streams with C), then the first k_stages C chunks
        loads = ColLoads(ops.tma_c, tCg, tCs, ops.tma_r, tRg, tRs, ops.gC_tma, sC_tma, sR,
                         bars.cols, seq, total, at.ring, m_block, head, extra, o_part, tidx)
        # `cvt`: each chunk is converted into a 16-bit buffer first; its 8-bit stage is then
        # refilled at once, unless R streams beside it (R's stage is read by the WGMMAs)
        convert = Convert(sC_tma, sC, 2) if const_expr(self.cvt) else None
        early = self.cvt and not self.stream_r
        if const_expr(not self.stream_r):
            tma_load(ops.tma_r, tRg, tRs, bars.rows, self.r_bytes, tidx)
        if const_expr(self.shared_kv):  # block 0's chunks, then block 1's V chunks
            for j in cutlass.range_constexpr(C + cfg.v_chunks):
                if j < total:
                    self._load_c_chunk(loads, j, self._shared_stage(j // C, j % C)[0])
        else:
            for j in cutlass.range_constexpr(ks):
                if j < total:
                    self._load_c_chunk(loads, j, (at.ring + j) % ks)
        if const_expr(not self.stream_r):
            cute.arch.mbarrier_wait(bars.rows, at.phase)
        x = Int32(at.ring)  # ring position of the next C chunk
        if const_expr(cfg.overlap):  # QK[i+1] under the score step of block i
            self._overlap_blocks(mma_s, regs, smem, tile, seq, io, frags, loads, extra,
                                 at.ring, hand, n_iter, n_count)
            x = x + n_iter * C
        for i in cutlass.range(0 if const_expr(cfg.overlap) else n_iter, unroll=1):
            blk = i
            if const_expr(self.kv_pair):
                blk = self._own_block(seq, i, o_part)
            blk_head, n_block = self._block(seq, blk)
            stats_head = self._stats_head(head, blk_head)
            # per-row / per-column statistics of the block, loaded before its WGMMAs so that
            # their latency hides behind them (the forward has none)
            pre = self._block_prefetch(tile, io, n_block, stats_head, tScS_mn)
            step = ScoreStep(i, n_block, stats_head, pre)
            self._trace(extra, 0, i)
            # ---- S = R C[n]^T, streamed over the C ring; each chunk's stage is refilled
            #      with the chunk k_stages ahead as soon as its WGMMAs are done. P[i-1] is
            #      handed over after `publish_after` chunks so that PV[i-1] queues behind them.
            atom = cute.make_mma_atom(mma_s.op)  # a fresh atom: ACCUMULATE changes below
            for c in cutlass.range_constexpr(C):
                if const_expr(c == cfg.publish_after):
                    if i > 0:
                        cute.arch.mbarrier_arrive(bars.p_full + (hand + i - 1) % 2)
                if const_expr(c == cfg.publish_hi):
                    if i > 0:
                        cute.arch.mbarrier_arrive(bars.p_full + 2 + (hand + i - 1) % 2)
                if const_expr(self.seq_scores and c == self.c_half):
                    # the first product is complete: consume it (into rP) before the second
                    # product overwrites its accumulator
                    warpgroup.wait_group(0)
                    self._first_scores(tile, io, frags, step)
                if const_expr(self.shared_kv):
                    s, phase = self._shared_stage(i, c)
                    cute.arch.mbarrier_wait(bars.cols + s, phase)
                else:
                    s = x % ks
                    cute.arch.mbarrier_wait(bars.cols + s, (x // ks) & 1)
                sb = s  # the C buffer the WGMMAs read
                if const_expr(self.cvt):  # chunk x-2, the last reader of buffer x % 2, is done
                    sb = x % 2
                    self._convert(convert, s, sb, tidx)
                    if const_expr(early):
                        self._refill_c(loads, x)
                warpgroup.fence()
                second, first, n_k, r_k0 = self._chunk(c)
                acc = acc_2 if const_expr(second and not self.seq_scores) else acc_S
                for k in cutlass.range_constexpr(n_k):
                    atom.set(warpgroup.Field.ACCUMULATE, not (first and k == 0))
                    rR = (tSrR[None, None, k, s] if const_expr(self.stream_r)
                          else tSrR[None, None, r_k0 + k])
                    cute.gemm(atom, acc, rR, tSrC[None, None, k, sb], acc)
                warpgroup.commit_group()
                if const_expr(c > 0):
                    warpgroup.wait_group(1)  # chunk x-1 has been read: refill its stage
                    if const_expr(self.shared_kv):
                        self._refill_shared(loads, i, c - 1)
                    elif const_expr(not early):
                        self._refill_c(loads, x - 1)
                x += 1
            if const_expr(cfg.publish_after == C):
                if i > 0:
                    cute.arch.mbarrier_arrive(bars.p_full + (hand + i - 1) % 2)
            if const_expr(cfg.publish_hi == C):
                if i > 0:
                    cute.arch.mbarrier_arrive(bars.p_full + 2 + (hand + i - 1) % 2)
            warpgroup.wait_group(0)
            self._trace(extra, 1, i)
            if const_expr(self.shared_kv):
                self._refill_shared(loads, i, C - 1)
            elif const_expr(not early):
                self._refill_c(loads, x - 1)
            # ---- the kernel's score step: P (and the rows' factors) in registers, then smem
            self._score_step(tile, io, frags, step, n_count)
            self._trace(extra, 2, i)
            self._store_p(regs, tile, io, frags, extra, hand, i, n_count)
        # ---- last P, then the final row factors the same way; LSE
        if n_iter > 0:
            cute.arch.mbarrier_arrive(bars.p_full + (hand + n_iter - 1) % 2)
            if const_expr(cfg.publish_hi is not None):
                cute.arch.mbarrier_arrive(bars.p_full + 2 + (hand + n_iter - 1) % 2)
        lse = self._final_factors(tile, io, frags, n_iter)
        b = (hand + n_iter) % 2
        cute.arch.mbarrier_wait(bars.p_empty + b, (((hand + n_iter) // 2) & 1) ^ 1)
        self._write_factors(io, frags, b)
        cute.arch.mbarrier_arrive(bars.p_full + b)
        if const_expr(cfg.publish_hi is not None):
            cute.arch.mbarrier_arrive(bars.p_full + 2 + b)
        if const_expr(lse is not None):
            if lane % 4 == 0 and o_part == 0:
                for r in cutlass.range_constexpr(num_rows):
                    row = m_block * TILE_M + tScS_mn[r, 0][0]
                    if row < seqlen_r:
                        mLSE[batch, head, row + tile.row0] = lse[r]
        return x, hand + n_iter + 1

    @cute.jit
    def _store_p(self, regs: ScoreRegs, tile: Tile, io: ScoreIO, frags: ScoreFrags, extra,
                 hand, i, n_count):
        """P of step i (in rP, its factors in frags.factor) into buffer (hand + i) % 2 once
        the PV that last read it (hand-over hand + i - 2) is done: stmatrix (8 bits: byte
        pairs, `_p_to_regs`), the factors, a proxy fence (WGMMA reads P), `_after_p_store`."""
        b = (hand + i) % 2
        cute.arch.mbarrier_wait(io.bars.p_empty + b, (((hand + i) // 2) & 1) ^ 1)
        self._trace(extra, 3, i)
        if const_expr(self.kv_pair):  # slot 2 b + rank; the peer's tile goes to the other
            cute.copy(regs.thr_st, regs.tPrP, regs.tPsP[None, None, None, 2 * b + tile.o_part])
        else:
            cute.copy(regs.thr_st, regs.tPrP, regs.tPsP[None, None, None, b])
        self._write_factors(io, frags, b)
        cute.arch.fence_proxy("async.shared", space="cta")  # P is read by WGMMA
        self._after_p_store(tile, io, b, i, n_count)
        self._trace(extra, 4, i)

    @cute.jit
    def _convert(self, conv: Convert, s, sb, tidx):
        """`cvt`: stage s of the warpgroup's 8-bit ring into its 16-bit buffer sb (exact, by
        bits: common/convert.py, Note [e4m3 to bf16 / fp16 by bits]), then fenced for the
        WGMMAs (async proxy) and a barrier of the warpgroup's 128 threads: after it every
        thread's reads of stage s are done, so the stage may be refilled. Each thread converts
        runs of `vec` contiguous elements of a row, tpr threads per row, 128 / tpr rows per
        pass (`config.cvt_tiling`: vec 16 (a 16-byte load) or 8; a run never crosses a swizzle
        atom). The runs are unrolled up to D = 576; above, a loop
        unrolled by 2 (fully unrolled, ptxas spilled 12 B at D = 1024)."""
        src, dst = conv.src[None, None, s], conv.dst[None, None, sb]
        vec, tpr = cvt_tiling(cute.size(src, mode=[0]), cute.size(src, mode=[1]))
        convert_stage(src, dst, vec, tpr, self.cfg.dtype, tidx, self.cfg.head_dim <= 576)
        cute.arch.fence_proxy("async.shared", space="cta")   # read by WGMMA
        cute.arch.barrier(barrier_id=conv.barrier_id, number_of_threads=WG_THREADS)

    @cute.jit
    def _copy_stream_chunk(self, loads: ColLoads, s, src, head, n_block, c):
        """Stage s of the S ring when R streams: the C chunk and R[:, c], on one barrier."""
        cute.copy(loads.tma_c, src, loads.tCs[None, s], tma_bar_ptr=loads.bar + s)
        cute.copy(loads.tma_r, loads.tRg[None, c], loads.tRs[None, s], tma_bar_ptr=loads.bar + s)

    @cute.jit
    def _refill_c(self, loads: ColLoads, done: Int32):
        """The C chunk at ring position `done` was consumed: load the tile's chunk k_stages
        positions later into its stage."""
        nxt = done + self.cfg.k_stages - loads.base  # the tile's chunk index
        if nxt < loads.total:
            self._load_c_chunk(loads, nxt, done % self.cfg.k_stages)

    @cute.jit
    def _c_partition(self, ops: Operands, sC_tma: cute.Tensor, tile: Tile):
        """(tCs, tCg): the TMA partitions of the C ring's stages `sC_tma` (TMA, k_stages) and
        of the tile's C chunks (TMA, n_blocks, C), C's rows from the tile's frame."""
        # (tile_n, k_chunk, n_blocks, C)
        gC = cute.local_tile(self._from_row(ops.gC_tma[None, None, tile.head_c, tile.batch],
                                            tile.row0_c),
                             (self.tile_n, self.cfg.k_chunk), (None, None))
        return cpasync.tma_partition(ops.tma_c, 0, cute.make_layout(1),
                                     cute.group_modes(sC_tma, 0, 2), cute.group_modes(gC, 0, 2))

    @cute.jit
    def _load_c_chunk(self, loads: ColLoads, pos, s):
        """The tile's chunk pos = (block i, chunk c) into stage s: chunk c of block i's C and,
        when R streams, R[:, c] with it on the same barrier."""
        C = self.num_chunks
        if const_expr(self.kv_pair):
            head, n_block = self._block(loads.seq, self._own_block(loads.seq, pos // C,
                                                                   loads.rank))
        else:
            head, n_block = self._block(loads.seq, pos // C)
        c = pos % C
        src = self._col_src(loads, head, n_block, c)
        if const_expr(self.stream_r):
            if loads.tidx // 32 == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(loads.bar + s,
                                                            self.c_bytes + self.r_bytes)
                self._copy_stream_chunk(loads, s, src, head, n_block, c)
        else:
            tma_load(loads.tma_c, src, loads.tCs[None, s], loads.bar + s,
                           self.c_bytes, loads.tidx)

    @cute.jit
    def _own_block(self, seq, i, rank):
        """`kv_pair`: the block this CTA scores at step i: 2 i + rank; when the count is odd
        the last block is scored by both (each needs its own P; no exchange then)."""
        return cutlass.min(2 * i + rank, seq.n_count - 1)

    # ---------------------------------------------------------------- accumulator warpgroups
    @cute.jit
    def _acc_wg(self, mma_o: cute.TiledMma, ops: Operands, scalars: Scalars, smem: Smem,
                half: cutlass.Constexpr, work, extra, tidx):
        """WG1 / WG2: O[:, this half's columns] += P B over the blocks, then stored: the
        registers once, then the CTA's tile, or (`persistent`) each tile of its schedule."""
        dv = self.halves[half]
        sB = smem.blo if const_expr(half == 0) else smem.bhi
        # ---- MMA fragments: B stage (b_rows, dv) seen as (dv, b_rows), the MN-major B of P B
        #      (8 bits: the transposed stage (dv, b_rows) is the K-major B as it is)
        thr_mma = mma_o.get_slice(tidx)
        if const_expr(self.fp8):
            sBt = sB   # (dv, b_rows, v_stages)
        else:   # (dv, b_rows, v_stages): the (b_rows, dv) stage read N-major (dv contiguous)
            sBt = cute.composition(sB, cute.make_ordered_layout((dv, self.b_rows, self.b_bufs),
                                                                order=(1, 0, 2)))
        # (MMA, MMA_M, tile_n / mma_k, p_slots)
        tOrP = mma_o.make_fragment_A(thr_mma.partition_A(smem.p))
        # (MMA, MMA_N, b_rows / mma_k, v_stages | 2 16-bit buffers)
        tOrB = mma_o.make_fragment_B(thr_mma.partition_B(sBt))
        # (MMA, MMA_M, MMA_N) fp32: ((2, 2, dv / 8), 1, 1)
        acc_O = cute.make_rmem_tensor(thr_mma.partition_shape_C((TILE_M, dv)), Float32)
        # the ring the TMA fills: sB, or (`cvt`) the 8-bit one that `_convert` reads into sB
        sB_tma = sB
        if const_expr(self.cvt):
            sB_tma = smem.blo8 if const_expr(half == 0) else smem.bhi8
        frags = OutFrags(acc_O, tOrP, tOrB,
                         Convert(sB_tma, sB, 3 + half) if const_expr(self.cvt) else None)
        if const_expr(self.cfg.persistent):
            x, p = Int32(0), Int32(0)
            first, end, stride = self._tiles(ops)
            for t in cutlass.range(first, end, stride, unroll=1):
                tile, seq = self._tile_at(ops, scalars, extra, t)
                x, p = self._acc_tile(mma_o, ops, smem, half, frags, sB_tma, tile, seq, extra,
                                      tidx, Counters(x, p, 0))
        else:
            tile, seq = work
            self._acc_tile(mma_o, ops, smem, half, frags, sB_tma, tile, seq, extra, tidx,
                           Counters(0, 0, 0))

    @cute.jit
    def _acc_tile(self, mma_o: cute.TiledMma, ops: Operands, smem: Smem,
                  half: cutlass.Constexpr, frags: OutFrags, sB_tma, tile: Tile, seq: BlockSeq,
                  extra, tidx, at):
        """An accumulator warpgroup on one tile, from B-ring position at.ring and P hand-over
        at.hand; returns (ring position, hand-overs) after it."""
        cfg = self.cfg
        vs, vj = cfg.v_stages, self.b_chunks
        dv = self.halves[half]
        sFactor, bars = smem.factor, smem.bars
        gB_tma = ops.gBlo_tma if const_expr(half == 0) else ops.gBhi_tma
        tma_b = ops.tma_blo if const_expr(half == 0) else ops.tma_bhi
        m_block, o_part, head, head_c, batch = (tile.m_block, tile.o_part, tile.head,
                                                tile.head_c, tile.batch)
        lane = cute.arch.lane_idx()
        bar_b = bars.accb + half * vs
        bar_full = bars.p_full  # P ready (`publish_hi`: the second half's own barriers)
        if const_expr(half == 1 and cfg.publish_hi is not None):
            bar_full = bars.p_full + 2
        col0 = o_part * cfg.dv_cta + (0 if const_expr(half == 0) else self.stored[0])
        # ---- TMA views: B rows of this warpgroup's columns
        #      (8 bits: the transposed B's rows col0..col0+dv, its columns in blocks of b_rows)
        if const_expr(self.shared_kv):  # none: the C ring's V chunks (and C's TMA for them)
            gB = None
        elif const_expr(self.fp8):  # (dv, b_rows, b_blocks)
            gB = cute.local_tile(
                cute.domain_offset((col0, 0), gB_tma[None, None, head_c, batch]),
                (dv, self.b_rows), (0, None))
        else:  # (b_rows, dv, b_blocks)
            gB = cute.local_tile(
                cute.domain_offset((0, col0), self._from_row(gB_tma[None, None, head_c, batch],
                                                             tile.row0_c)),
                (self.b_rows, dv), (None, 0))
        tBs, tBg = None, None
        if const_expr(not self.shared_kv):  # (TMA, v_stages) / (TMA, b_blocks)
            tBs, tBg = cpasync.tma_partition(tma_b, 0, cute.make_layout(1),
                                             cute.group_modes(sB_tma, 0, 2),
                                             cute.group_modes(gB, 0, 2))
        thr_mma = mma_o.get_slice(tidx)
        acc_O = frags.acc_O
        acc_O.fill(0.0)
        acc_O_mn = mn_view(acc_O)   # (rows, cols) of this thread: (2, dv / 4)
        # (rows, cols) -> (row, col) of the TILE_M x dv tile
        tOcO_mn = mn_view(thr_mma.partition_C(cute.make_identity_tensor((TILE_M, dv))))
        num_rows = cute.size(acc_O_mn, mode=[0])
        n_count = seq.n_count
        total = n_count * vj  # B stages of this half the tile reads, in ring order
        hand = at.hand
        loads = BLoads(tma_b, tBg, tBs, bar_b, gB_tma, col0, sB_tma, seq, half, total, at.ring,
                       bars, o_part, tidx, extra)
        if const_expr(self.shared_kv):
            loads = self._shared_v_loads(ops, smem, tile, seq, extra, tidx)

        for j in cutlass.range_constexpr(vs):
            if j < total:
                self._load_b(loads, j, (at.ring + j) % vs)
        n_iter = n_count  # P hand-overs (`kv_pair`: one per pair of blocks)
        if const_expr(self.kv_pair):
            n_iter = (n_count + 1) // 2
        x = Int32(at.ring)
        for i in cutlass.range(n_iter, unroll=1):
            b = (hand + i) % 2
            self._trace(extra, 0, i)
            cute.arch.mbarrier_wait(bar_full + b, ((hand + i) // 2) & 1)
            self._trace(extra, 1, i)
            if const_expr(self.rescale_o):
                self._scale_rows(acc_O_mn, tOcO_mn, sFactor, b, num_rows)
            self._trace(extra, 2, i)
            atom = cute.make_mma_atom(mma_o.op)
            atom.set(warpgroup.Field.ACCUMULATE, True)
            if const_expr(self.shared_kv):
                self._shared_pv(atom, frags, loads, half, i, b)
            elif const_expr(self.kv_pair):
                x = self._pair_pv(atom, frags, loads, x, i, b, n_count)
            else:
                for j in cutlass.range_constexpr(vj):
                    x = self._pv_stage(atom, frags, loads, x, j, b, j > 0)
            warpgroup.wait_group(0)
            self._trace(extra, 3, i)
            if const_expr(not self.cvt and not self.shared_kv):  # (`cvt` refilled each stage
                self._refill_b(loads, x - 1)                     # once converted)
            if const_expr(self.rescale_o):  # every lane read sFactor[:, b]: each releases
                cute.arch.mbarrier_arrive(bars.p_empty + b)
            if lane == 0:
                if const_expr(not self.rescale_o):  # the warp's WGMMAs were its only reads
                    cute.arch.mbarrier_arrive(bars.p_empty + b)
                if const_expr(self.peer_arrivals):  # the peer writes our P slots too
                    cute.arch.mbarrier_arrive(bars.p_empty + b, 1 - o_part,
                                              scope=nvvm.MemScopeKind.CLUSTER)
            if const_expr(self.shared_kv):  # its V chunks of block i are free: block i + 2's
                self._refill_shared_v(loads, half, i)
        # ---- the final factors arrive through the factor buffer; store O (rows < seqlen_r)
        b = (hand + n_iter) % 2
        cute.arch.mbarrier_wait(bar_full + b, ((hand + n_iter) // 2) & 1)
        if const_expr(self.rescale_o):
            self._scale_rows(acc_O_mn, tOcO_mn, sFactor, b, num_rows)
        if const_expr(self.cfg.persistent):  # the next tile reuses buffer b: release it
            if const_expr(self.rescale_o):       # (as each P hand-over's release above)
                cute.arch.mbarrier_arrive(bars.p_empty + b)
            elif lane == 0:
                cute.arch.mbarrier_arrive(bars.p_empty + b)
        # (TILE_M, dv): this warpgroup's columns of the tile's rows of O
        out_head = head  # `group_split`: the part's slice of the workspace
        if const_expr(self.group_split):
            out_head = head * tile.part[1] + tile.part[0]
        gO = cute.local_tile(
            cute.domain_offset((0, col0), self._from_row(ops.mOut[batch, out_head, None, None],
                                                         tile.row0)),
            (TILE_M, dv), (m_block, 0))
        tOgO_mn = mn_view(thr_mma.partition_C(gO))   # (rows, cols) of this thread
        rows_left = tile.seqlen_r - m_block * TILE_M
        ncols = cute.size(acc_O_mn, mode=[1])
        for r in cutlass.range_constexpr(num_rows):  # a row at a time: its fp32 values die
            if tOcO_mn[r, 0][0] < rows_left:        # as they are converted
                rO = cute.make_rmem_tensor(ncols, self.out_dtype)   # (cols,)
                rO.store(acc_O_mn[r, None].load().to(self.out_dtype))
                for c in cutlass.range_constexpr(ncols):
                    if const_expr(not self.widened[half]):
                        tOgO_mn[r, c] = rO[c]
                    elif (tOcO_mn[r, c][1] < self.stored[half]   # `half_align`: computed only
                          and col0 + tOcO_mn[r, c][1] < cfg.dv):  # past Dv: the second CTA's
                        tOgO_mn[r, c] = rO[c]                     # last 8 when D % 16 == 8
        return x, hand + n_iter + 1

    @cute.jit
    def _pair_pv(self, atom, frags: OutFrags, loads: BLoads, x, i, b, n_count):
        """`kv_pair` step i: O += P[2i] B[2i] + P[2i+1] B[2i+1] (P tile t in slot 2 b + t, the
        peer's after pp[b]); when the count is odd the last step has one block, scored by both
        CTAs: our own tile (slot 2 b + rank). Returns the B ring position after it."""
        vj = self.b_chunks
        bars, rank = loads.bars, loads.rank
        solo = 2 * i + 1 >= n_count
        first = 2 * b
        if solo:
            first = 2 * b + rank
        else:
            cute.arch.mbarrier_wait(bars.pp + b, (i // 2) & 1)
        for jj in cutlass.range_constexpr(2 * vj):
            t, j = jj // vj, jj % vj
            if t == 0 or not solo:
                slot = first if const_expr(t == 0) else 2 * b + 1
                x = self._pv_stage(atom, frags, loads, x, j, slot, jj > 0)
        return x

    @cute.jit
    def _pv_stage(self, atom, frags: OutFrags, loads: BLoads, x, j: cutlass.Constexpr, slot,
                  refill: cutlass.Constexpr):
        """O += P[:, rows of B stage j] (P slot `slot`) times the B stage at ring position x;
        with `refill`, once the previous stage has been read, load its successor (`cvt`: the
        stage is converted into 16-bit buffer x % 2, whose last reader, stage x-2, is done, and
        refilled right after). Returns x + 1."""
        acc_O, tOrP, tOrB, convert = frags
        vs, k_per_b = self.cfg.v_stages, self.b_rows // self.mma_k
        s = x % vs
        cute.arch.mbarrier_wait(loads.bar + s, (x // vs) & 1)
        sb = s  # the B buffer the WGMMAs read
        if const_expr(self.cvt):
            sb = x % 2
            self._convert(convert, s, sb, loads.tidx)
            self._refill_b(loads, x)
        warpgroup.fence()
        for k in cutlass.range_constexpr(k_per_b):
            cute.gemm(atom, acc_O, tOrP[None, None, j * k_per_b + k, slot],
                      tOrB[None, None, k, sb], acc_O)
        warpgroup.commit_group()
        if const_expr(refill):
            warpgroup.wait_group(1)  # stage x-1 has been read: refill it
            if const_expr(not self.cvt):
                self._refill_b(loads, x - 1)
        return x + 1

    @cute.jit
    def _refill_b(self, loads: BLoads, done: Int32):
        """The B stage at ring position `done` was consumed: load the tile's stage v_stages
        positions later into its slot."""
        nxt = done + self.cfg.v_stages - loads.base  # the tile's stage index
        if nxt < loads.total:
            self._load_b(loads, nxt, done % self.cfg.v_stages)

    @cute.jit
    def _load_b(self, loads: BLoads, pos, s):
        """The tile's B stage pos = (block i, row chunk j) into stage s."""
        vj = self.b_chunks
        head, n_block = self._block(loads.seq, pos // vj)
        src = self._b_src(loads, head, n_block * vj + pos % vj)
        tma_load(loads.tma, src, loads.tBs[None, s], loads.bar + s,
                       self.b_bytes[loads.half], loads.tidx)

    @cute.jit
    def _trace(self, extra, event: cutlass.Constexpr, i):
        """A phase boundary of block / hand-over i (the S warpgroup's events 0-4, the O
        warpgroups' 0-3, where `_score_tile` and `_acc_tile` call it): nothing here; the
        experiment perf.phase_trace stamps the SM's clock there."""

    @cute.jit
    def _scale_rows(self, acc_O_mn, tOcO_mn, sFactor, b, num_rows: cutlass.Constexpr):
        """O's rows times the factors published in sFactor[:, b] (`lazy_rescale`: a row whose
        factor is 1 skipped)."""
        for r in cutlass.range_constexpr(num_rows):
            f = sFactor[tOcO_mn[r, 0][0], b]
            if const_expr(self.cfg.lazy_rescale):
                if f != 1.0:
                    acc_O_mn[r, None] = acc_O_mn[r, None].load() * f
            else:
                acc_O_mn[r, None] = acc_O_mn[r, None].load() * f


def _shared_storage(cfg: FwdConfigSm90, dtype, layouts: SmemLayouts, kv_dtype):
    """The kernel's shared-memory struct, fields in order (`kv_pair` adds its exchange
    barriers and the peer's row statistics; `cvt` the 8-bit rings in kv_dtype after P). Built
    from an annotations dict: the module's postponed annotations would reach `cute.struct` as
    strings."""
    ks, vs = cfg.k_stages, cfg.v_stages
    mem, align, i64 = cute.struct.MemRange, cute.struct.Align, cutlass.Int64

    def smem(layout, elem=dtype):
        return align[mem[elem, cute.cosize(layout)], 1024]

    fields = {
        "bar_r": mem[i64, 1],
        "bar_c": mem[i64, ks],
        "bar_b": mem[i64, 2 * vs],      # [half * vs + stage]
        "bar_p_full": mem[i64, 2 if cfg.publish_hi is None else 4],  # [half * 2 + buffer]
        "bar_p_empty": mem[i64, 2],
        # kv_pair: bar_x (the peer's row statistics landed) and bar_pp (the peer's P tile
        # landed)
        **{name: mem[i64, 2] for name in cfg.pair_barriers},
        "row_factor": align[mem[Float32, cfg.factor_floats], 16],
        **({"peer_stat": align[mem[Float32, 2 * TILE_M], 16]} if cfg.pair_stats else {}),
        "sR": smem(layouts.r), "sC": smem(layouts.c),
        # (`shared_kv`: the B operands are views of sC)
        **({} if cfg.shared_kv else {"sBlo": smem(layouts.blo), "sBhi": smem(layouts.bhi)}),
        "sP": smem(layouts.p),
        **({"sC8": smem(layouts.c8, kv_dtype), "sBlo8": smem(layouts.blo8, kv_dtype),
            "sBhi8": smem(layouts.bhi8, kv_dtype)} if layouts.c8 is not None else {}),
    }
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


__all__ = ["RingSkeletonSm90", "WG_THREADS", "row_major_layout", "thread_roles", "tma_load"]
