"""Compile keys, resource plan and planners of the Blackwell tcgen05 kernels: the forward
(`FFPAFwdSm100`, its e4m3 and NVFP4 forms; the NVFP4 plan differs, `FwdFP4ConfigSm100`) and
the backward's dQ / dK / dV, all on `RingSkeletonSm100`.

**Compile-verified only, never run**: no sm_100 GPU is available to the project. Everything here
is what the host can prove without one: the TMEM ledger, the shared-memory plan, the warp roles
and their register budget, and the mbarrier protocol (modelled by `sm100/protocol.py` from the
constants below, which the kernel reads too). On a B200 each configuration first passes
selfcheck.py's canary.

# === RESOURCE PLAN ===================================================================
# TMEM is 128 lanes x 512 columns of 32 bits per SM. A 128-row fp32 accumulator takes one lane
# per row and one column per output column, so O[128 x D] alone fills TMEM at D = 512; beside
# it the score tiles S[128 x 128] need 128 columns each. This first design therefore splits O's
# columns over `o_split` = ceil(Dv / 256) CTAs per row tile (as the sm90 kernel does above
# D = 512), each owning `acc_cta` <= 256 columns and recomputing S = Q K^T in full:
#
#   columns [0, 128)    S[0]  (fp32), P[0] (16-bit, packed two per column) over its last 64
#   columns [128, 256)  S[1], P[1]: two score buffers, so QK[n+1] runs while softmax[n] does
#   columns [256, 256 + acc_cta)  O (fp32)
#
# executing (o_split + 1) / 2 GEMM units per counted unit (1.5 at D <= 512, 2 at <= 768, 2.5
# at <= 1024; docs/design.md section 7 has the predicted TFLOPS per D). The o_split CTAs of a
# row tile form a cluster that multicasts the Q and K chunks (`multicast`): L2 serves them once
# per row tile, which the prediction says is what keeps D = 512 tensor-bound.
# Shared memory: a QK ring (a [128 x 64] Q chunk beside each [128 x 64] K chunk, 32 KB at 16
# bits, [128 x 128] at 8: Q streams because Q[128 x 512] alone would be 128 KB) and a V ring
# ([64 x acc_cta] stages, <= 32 KB), as deep as 227 KB allows (QK >= 3, V >= 2); no P in smem
# (it stays in TMEM and feeds the PV MMA as its A operand; NVFP4's goes through smem,
# `FwdFP4ConfigSm100`) and no O staging (the epilogue stores from registers).
# =====================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..common.config import deepest_rings
from ..problem import AttnProblem

ARCH = "sm_100a"
SMEM_CAPACITY = 232448  # bytes of shared memory one CTA may use on sm_100a (227 KB)
TMEM_LANES, TMEM_COLUMNS = 128, 512  # per SM, 32-bit cells
DTYPES = ("bf16", "fp16")
FP8_DTYPES = ("e4m3",)
FP4_DTYPE = "nvfp4"
ELEM_BYTES = {"bf16": 2, "fp16": 2, "e4m3": 1}
MIN_HEAD_DIM, MAX_HEAD_DIM = 264, 1024
TILE_M = 128  # query rows per CTA: one TMEM lane per row (tcgen05 M = 128, cta_group::1)
MAX_MMA_N = 256  # tcgen05.mma kind::f16 with M = 128: N a multiple of 16 in [16, 256]
CHUNK_BYTES = 128  # head-dim bytes per QK-ring stage row: one 128-byte swizzle atom
MMA_K_BYTES = 32  # K bytes of one tcgen05.mma (kind::f16: 16 elements; kind::f8f6f4: 32)
V_ROWS = 64  # keys per V-ring stage
BARRIER_BYTES = 8

# Warp roles (warp index ranges) and the registers each thread of the role may use. The CTA
# has 6 warps (192 threads), so every thread may take the hardware's 255 (65536 / 192 = 341);
# the budget below is the plan the roles are written to, checked against the register file.
WARP_ROLES = (
    # role, first warp, warps, registers per thread
    ("softmax", 0, 4, 255),  # S row -> P, row statistics, O rescale, epilogue; TMEM lane = row
    ("mma", 4, 1, 255),  # one elected thread issues every tcgen05.mma; owns the TMEM allocation
    ("load", 5, 1, 255),  # one elected thread issues every TMA load
)
REGISTER_FILE = 65536  # 32-bit registers per SM
# NVFP4 (tcgen05.mma kind::mxf4nvf4, one E4M3 scale per 16 elements along K). A scale-factor
# "atom" is 128 rows x 4 scales (one MMA K-block of 64 elements): 512 bytes, row r at byte
# 16 (r % 32) + 4 (r // 32) (BlockScaledBasicChunk); tcgen05.cp (32x128b, warpx4) puts it in
# TMEM as 4 columns. The accumulator slice is FP4_ACC_CTA columns: V^T's scale atoms cover 128
# of its rows, so a 192-row slice starts 0 or 64 rows into an atom and always spans two.
SF_ATOM_ROWS, SF_VEC, FP4_MMA_K = 128, 16, 64
SF_ATOM_BYTES = SF_ATOM_ROWS * FP4_MMA_K // SF_VEC  # 512
FP4_ACC_CTA = 192
RESCALE_THRESHOLD = 8.0  # log2 units: O is rescaled only when a row's max grows by more


@dataclass(frozen=True)
class FwdConfigSm100:
    """Everything that changes the generated code of the tcgen05 forward.

    arch:       "sm_100a"
    dtype:      "bf16" | "fp16"; accumulation in fp32 (TMEM)
    head_dim:   D, a multiple of 8 in [264, 1024] (Q K^T over 64-column chunks; TMA zero-fills
                the last chunk's columns past D)
    causal:     causal masking (the diagonal offset is a runtime argument: both alignments)
    head_dim_v: Dv when it differs from D (MLA-absorbed 576 / 512), else None
    qk_stages:  depth of the QK ring ([128 x 64] Q and K chunks per stage)
    v_stages:   depth of the V ring ([64 x acc_cta] per stage)
    multicast:  the o_split CTAs of a row tile form a cluster and share their (identical) Q and
                K chunks: chunk c of each block is loaded by CTA c % o_split and multicast to
                every CTA of the cluster, so L2 serves Q and K once per row tile instead of
                o_split times; a stage is refilled only after every CTA's MMAs released it
                (each MMA thread's tcgen05.commit arrives on all the cluster's qk_empty)
    window:     a sliding window's left edge (a runtime argument; blocks left of it skipped,
                the crossing ones masked); the right edge is `causal` at min(offset, right).
                Every form's field (16-bit, e4m3, NVFP4 forwards; the backward).
    sinks:      a per-query-head sink logit in each row's denominator and LSE (a runtime [Hq]
                fp32 tensor). The forwards' field; the backward reads the sinks through the
                LSE.
    varlen:     one launch over packed sequences (q / k / v / o as [1, H, total, D] views and
                their int32 cumulative lengths): each CTA finds its sequence's row tile by a
                walk over them (common/scheduler.py's `varlen_tile`), its TMA views start at
                the sequence's first rows, and the causal offset and window edge add the
                sequence's bottom-right frame. The 16-bit forward's and gradient kernels'
                field (their statistics read at the columns' sequence rows).
    """

    arch: str
    dtype: str
    head_dim: int
    causal: bool
    head_dim_v: int | None = None
    qk_stages: int = 3
    v_stages: int = 2
    multicast: bool = False
    window: bool = False
    sinks: bool = False
    varlen: bool = False

    KERNEL: ClassVar[str] = "ffpa_cute.sm100.fwd_sm100:FFPAFwdSm100"

    # ------------------------------------------------------------------ geometry
    @property
    def tile_m(self) -> int:
        return TILE_M

    @property
    def tile_n(self) -> int:
        """Keys per block: the N of the QK MMA and the K of the PV MMA (two V stages)."""
        return 128

    @property
    def elem_bytes(self) -> int:
        """Bytes per element of the operands (Q, K, V, P)."""
        return ELEM_BYTES[self.dtype]

    @property
    def k_chunk(self) -> int:
        """Head-dim columns per QK-ring stage: 64 at 16 bits, 128 at 8."""
        return CHUNK_BYTES // self.elem_bytes

    @property
    def mma_k(self) -> int:
        """K of one tcgen05.mma: 16 at 16 bits, 32 at 8."""
        return MMA_K_BYTES // self.elem_bytes

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    # ------------------------------------------------------------------ the kernel's shape
    # (the backward's configs below change these: which products score a block, what the
    # accumulator holds)
    @property
    def products(self) -> tuple[int, ...]:
        """Contraction dims of the score products of a block, in ring order: S = Q K^T over D
        here (dK / dQ add dP over Dv)."""
        return (self.head_dim,)

    @property
    def acc_dim(self) -> int:
        """Columns of the accumulator (and of the output): O's Dv here."""
        return self.dv

    @property
    def rows_are_keys(self) -> bool:
        """Whether the CTA's 128 rows are keys and the blocks queries (dV, dK)."""
        return False

    @property
    def rescales_acc(self) -> bool:
        """Whether the softmax threads rescale the accumulator in TMEM between blocks (the
        forward's online softmax; the gradients take P from the LSE)."""
        return not isinstance(self, tuple(BWD_CONFIGS.values()))

    @property
    def lookahead(self) -> int:
        """Blocks the MMA thread scores ahead of its accumulator MMAs: 1 with one product (S
        double-buffered: QK[n+1] runs while the softmax works on S[n]), 0 with two (S and dP
        of one block fill both score buffers)."""
        return 1 if len(self.products) == 1 else 0

    @property
    def score_bufs(self) -> int:
        """Blocks in flight in the score buffers (the s_full / p_full barriers)."""
        return 2 if len(self.products) == 1 else 1

    @property
    def product_chunks(self) -> tuple[int, ...]:
        """QK-ring stages of each product per block ([128 x 64] chunks of its two operands;
        TMA zero-fills the last chunk's columns past the dim)."""
        return tuple(-(-d // self.k_chunk) for d in self.products)

    @property
    def num_k_chunks(self) -> int:
        """QK-ring stages per block."""
        return sum(self.product_chunks)

    @property
    def o_split(self) -> int:
        """CTAs per row tile, each owning `acc_cta` of the accumulator's columns (TMEM holds
        <= 256 beside the two score buffers)."""
        return -(-self.acc_dim // MAX_MMA_N)

    @property
    def acc_cta(self) -> int:
        """Accumulator columns per CTA: acc_dim / o_split rounded up to a multiple of 16 (the
        accumulator MMA's N; 32 at 8 bits, the narrowest swizzle atom of the N-major B
        operand); the last CTA's columns past acc_dim are computed from TMA's zeros and not
        stored."""
        step = 16 if self.elem_bytes == 2 else 32
        return -(-self.acc_dim // (step * self.o_split)) * step

    @property
    def v_blocks_per_tile(self) -> int:
        """V-ring stages per block of keys."""
        return self.tile_n // V_ROWS

    @property
    def ctas_per_tile(self) -> int:
        return self.o_split

    @property
    def cluster_size(self) -> int:
        """CTAs per cluster: the row tile's o_split with `multicast`, else 1."""
        return self.o_split if self.multicast else 1

    # ------------------------------------------------------------------ TMEM
    def tmem_regions(self) -> list[tuple[str, int, int]]:
        """(name, first column, columns) of every TMEM tensor; P[i] (16-bit) lies inside S[i]
        (two products: dS inside S, and dP in the second buffer)."""
        n, p = self.tile_n, self.tile_n * self.elem_bytes // 4
        (s0, s1), (p0, p1) = self.s_offset, self.p_offset
        if len(self.products) == 2:
            return [("S", s0, n), ("dS", p0, p), ("dP", s1, n),
                    ("acc", self.o_offset, self.acc_cta)]
        return [("S0", s0, n), ("P0", p0, p), ("S1", s1, n), ("P1", p1, p),
                ("acc", self.o_offset, self.acc_cta)]

    @property
    def tmem_columns_used(self) -> int:
        return max(c + w for _, c, w in self.tmem_regions())

    @property
    def tmem_alloc_columns(self) -> int:
        """What the MMA warp allocates (and frees): a power of two >= 32 covering every region."""
        cols = 32
        while cols < self.tmem_columns_used:
            cols *= 2
        return cols

    @property
    def s_offset(self) -> tuple[int, int]:
        return 0, self.tile_n

    @property
    def p_offset(self) -> tuple[int, int]:
        """P[i] over the second half of S[i]'s columns (S is all in registers when P is
        written, so either half would do)."""
        return tuple(s + self.tile_n // 2 for s in self.s_offset)

    @property
    def o_offset(self) -> int:
        return 2 * self.tile_n

    # ------------------------------------------------------------------ shared memory
    @property
    def qk_stage_bytes(self) -> int:
        return (TILE_M + self.tile_n) * CHUNK_BYTES

    @property
    def v_stage_bytes(self) -> int:
        return V_ROWS * self.acc_cta * self.elem_bytes

    def barriers(self) -> dict[str, tuple[int, int]]:
        """name -> (mbarriers, arrivals that complete a phase). The kernel allocates and
        initialises exactly these; `protocol.py` models them.

        qk_full / v_full: the load thread's expect-tx arrival (the bytes complete the phase;
        `multicast`: a QK stage's bytes come from the CTA that owns its chunk);
        qk_empty / v_empty: the MMA warp's tcgen05.commit once the stage's MMAs have read it
        (`multicast`: every CTA of the cluster commits to every CTA's qk_empty);
        s_full: tcgen05.commit after the last score MMA of a block (one per score buffer in
        flight, `score_bufs`);
        p_full: one arrival per softmax thread once P (dS; and any O rescale) is in TMEM; it
        also frees the score buffers for the next block that uses them;
        o_done: tcgen05.commit after each block's accumulator MMAs (the softmax threads wait on
        it to rescale O, and once for the epilogue)."""
        softmax_threads = 32 * _role("softmax")[1]
        return {"qk_full": (self.qk_stages, 1),
                "qk_empty": (self.qk_stages, self.cluster_size),
                "v_full": (self.v_stages, 1), "v_empty": (self.v_stages, 1),
                "s_full": (self.score_bufs, 1), "p_full": (self.score_bufs, softmax_threads),
                "o_done": (1, 1)}

    @property
    def col_stats(self) -> int:
        """Per-query statistics the softmax threads stage in smem for each block when the
        blocks are queries (dV: LSE; dK, which has dP too: LSE and Delta); 0 when rows are
        queries (their statistics stay in registers)."""
        return len(self.products) if self.rows_are_keys else 0

    def smem_regions(self) -> list[tuple[str, int]]:
        """(name, bytes) of the storage struct in order, each 1 KB aligned: the header
        (barriers, the TMEM base address, two blocks' column statistics), the row and column
        halves of the QK ring, the V ring (the accumulator's B operand)."""
        header = -(-(sum(n for n, _ in self.barriers().values()) * BARRIER_BYTES + 4) // 16) * 16
        header += 2 * self.col_stats * self.tile_n * 4
        return [("header", header), ("rows", self.qk_stages * TILE_M * CHUNK_BYTES),
                ("cols", self.qk_stages * self.tile_n * CHUNK_BYTES),
                ("acc_b", self.v_stages * self.v_stage_bytes)]

    def smem_bytes(self) -> int:
        return sum(_align(b) for _, b in self.smem_regions())


@dataclass(frozen=True)
class FwdFP8ConfigSm100(FwdConfigSm100):
    """Compile key of the FP8 forward (`FFPAFwdSm100FP8`): the forward's fields with dtype
    "e4m3" (Q, K, V and P in e4m3, tcgen05.mma kind::f8f6f4 with K = 32, fp32 accumulation;
    QK-ring chunks of 128 columns) and the output's dtype. P <= 2^RESCALE_THRESHOLD = 256 by
    the frame rule (e4m3's largest finite value is 448: no saturation).

    out_dtype: "bf16" | "fp16", the dtype of O (LSE stays fp32).
    """

    out_dtype: str = "bf16"

    KERNEL: ClassVar[str] = "ffpa_cute.sm100.fwd_sm100:FFPAFwdSm100FP8"


@dataclass(frozen=True)
class FwdFP4ConfigSm100(FwdFP8ConfigSm100):
    """Compile key of the NVFP4 forward (`FFPAFwdSm100FP4`): dtype "nvfp4" (Q, K, V^T and P in
    E2M1 with E4M3 scales per 16 elements along K, tcgen05.mma kind::mxf4nvf4, K = 64; fp32
    accumulation) and the output's dtype. D a multiple of 64, Dv == D.

    Its plan differs from the 16-bit / e4m3 one (module docstring) where the format needs:
      TMEM     S[0] [0, 128), S[1] [128, 256); the scale factors the MMAs read (copied from
               shared memory by tcgen05.cp before each use): QK's [256, 288) (a stage's Q and
               K scales, 4 K-blocks x 4 columns each), P V's [288, 304) (P's 2 K-blocks x 4,
               V^T's two atoms x 4); O [320, 512): `acc_cta` = 192 columns, so o_split =
               ceil(Dv / 192) (D = 320: 2 CTAs, 512: 3, 1024: 6).
      smem     a QK stage: [128 x 256] E2M1 codes of Q and of K (16 KB each) and their scales
               (2 KB each); a V stage: V^T's [192 rows x 64 keys] (6 KB) and its two scale atoms
               (1 KB); P of two blocks ([128 x 128] codes, 8 KB, and scales, 1 KB, each): P V's
               A operand is read from shared memory (the softmax threads write it there).
    """

    KERNEL: ClassVar[str] = "ffpa_cute.sm100.fwd_sm100:FFPAFwdSm100FP4"

    @property
    def elem_bytes(self) -> int:
        raise AttributeError("NVFP4 has half-byte elements: use the FP4 plan's sizes")

    @property
    def k_chunk(self) -> int:
        return 2 * CHUNK_BYTES  # 256 E2M1 per 128-byte row

    @property
    def mma_k(self) -> int:
        return FP4_MMA_K

    @property
    def o_split(self) -> int:
        return -(-self.acc_dim // FP4_ACC_CTA)

    @property
    def acc_cta(self) -> int:
        return FP4_ACC_CTA

    @property
    def sf_qk_offset(self) -> int:
        return 2 * self.tile_n

    @property
    def sf_pv_offset(self) -> int:
        """P's scales (two K-blocks: 8 columns), then V^T's (two atoms: 8 columns)."""
        return self.sf_qk_offset + 2 * (self.k_chunk // FP4_MMA_K) * 4

    @property
    def o_offset(self) -> int:
        return TMEM_COLUMNS - FP4_ACC_CTA

    def tmem_regions(self) -> list[tuple[str, int, int]]:
        n, sfqk = self.tile_n, 2 * (self.k_chunk // FP4_MMA_K) * 4
        return [("S0", 0, n), ("S1", n, n), ("SF_QK", self.sf_qk_offset, sfqk),
                ("SF_PV", self.sf_pv_offset, 16), ("acc", self.o_offset, self.acc_cta)]

    @property
    def sf_stage_bytes(self) -> int:
        """One operand's scales in a QK stage: 4 K-blocks of one 128-row atom."""
        return (self.k_chunk // FP4_MMA_K) * SF_ATOM_BYTES

    @property
    def qk_stage_bytes(self) -> int:
        return (TILE_M + self.tile_n) * CHUNK_BYTES + 2 * self.sf_stage_bytes

    @property
    def v_sf_bytes(self) -> int:
        return 2 * SF_ATOM_BYTES

    @property
    def v_stage_bytes(self) -> int:
        return V_ROWS * self.acc_cta // 2 + self.v_sf_bytes

    @property
    def p_bytes(self) -> int:
        """P's codes of one block (one of two buffers)."""
        return TILE_M * self.tile_n // 2

    @property
    def p_sf_bytes(self) -> int:
        return (self.tile_n // FP4_MMA_K) * SF_ATOM_BYTES

    def smem_regions(self) -> list[tuple[str, int]]:
        """The forward's regions (the V stages' codes as acc_b) and the scales of each ring
        stage, then P's codes and scales (two buffers)."""
        regions = super().smem_regions()
        regions[-1] = ("acc_b", self.v_stages * V_ROWS * self.acc_cta // 2)
        return regions + [("sf_rows", self.qk_stages * self.sf_stage_bytes),
                          ("sf_cols", self.qk_stages * self.sf_stage_bytes),
                          ("sf_b", self.v_stages * self.v_sf_bytes),
                          ("p", 2 * self.p_bytes), ("sf_p", 2 * self.p_sf_bytes)]

    def vt_scale_rows(self) -> int:
        """Rows of V^T's scales the kernel may read: the two atoms of every 192-row slice
        (the host zero-pads V^T's scales to this)."""
        last = (self.o_split - 1) * self.acc_cta // SF_ATOM_ROWS + 1
        return (last + 1) * SF_ATOM_ROWS


def _role(name: str) -> tuple[int, int, int]:
    """(first warp, warps, registers) of a warp role."""
    return next(r[1:] for r in WARP_ROLES if r[0] == name)


def num_threads() -> int:
    return 32 * sum(w for _, _, w, _ in WARP_ROLES)


def _align(nbytes: int, to: int = 1024) -> int:
    return -(-nbytes // to) * to


def can_implement(cfg: FwdConfigSm100) -> str | None:
    """None when the kernel can be built for cfg, else the reason."""
    if cfg.arch != ARCH:
        return f"arch {cfg.arch!r}: tcgen05 and TMEM need {ARCH}"
    if isinstance(cfg, FwdFP4ConfigSm100):
        if cfg.dtype != FP4_DTYPE or cfg.out_dtype not in DTYPES:
            return (f"dtype {cfg.dtype!r} / out_dtype {cfg.out_dtype!r}: the NVFP4 forward "
                    f"takes {FP4_DTYPE!r} in and gives {DTYPES}")
        if cfg.head_dim % FP4_MMA_K or cfg.head_dim_v is not None:
            return (f"head_dim={cfg.head_dim}, head_dim_v={cfg.dv}: the NVFP4 forward needs D "
                    f"a multiple of {FP4_MMA_K} (whole scale K-blocks) and Dv == D")
    elif isinstance(cfg, FwdFP8ConfigSm100):
        if cfg.dtype not in FP8_DTYPES or cfg.out_dtype not in DTYPES:
            return (f"dtype {cfg.dtype!r} / out_dtype {cfg.out_dtype!r}: the FP8 forward takes "
                    f"{FP8_DTYPES} in and gives {DTYPES}")
        if cfg.head_dim % 16 or cfg.dv % 16:
            return (f"head_dim={cfg.head_dim}, head_dim_v={cfg.dv}: the FP8 forward needs "
                    "multiples of 16 (16-byte rows for TMA)")
    elif cfg.dtype not in DTYPES:
        return f"dtype {cfg.dtype!r} not in {DTYPES}"
    if cfg.head_dim % 8 or not MIN_HEAD_DIM <= cfg.head_dim <= MAX_HEAD_DIM:
        return f"head_dim={cfg.head_dim}: need a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    if cfg.head_dim_v is not None and (cfg.head_dim_v == cfg.head_dim or cfg.head_dim_v % 8
                                       or not 64 <= cfg.head_dim_v <= MAX_HEAD_DIM):
        return (f"head_dim_v={cfg.head_dim_v}: None when equal to head_dim, else a multiple of "
                f"8 in [64, {MAX_HEAD_DIM}]")
    if cfg.multicast and cfg.o_split < 2:
        return "multicast needs the accumulator split over >= 2 CTAs (its width > 256)"
    if cfg.qk_stages < 2 or cfg.v_stages < 2:
        return "qk_stages and v_stages must be >= 2"
    if cfg.acc_cta > MAX_MMA_N:
        return f"acc_cta={cfg.acc_cta} > {MAX_MMA_N} (the accumulator MMA's N)"
    if cfg.tmem_columns_used > TMEM_COLUMNS:
        return f"TMEM plan needs {cfg.tmem_columns_used} columns, an SM has {TMEM_COLUMNS}"
    if cfg.smem_bytes() > SMEM_CAPACITY:
        return f"needs {cfg.smem_bytes()} B of smem, {ARCH} has {SMEM_CAPACITY}"
    if sum(32 * w * r for _, _, w, r in WARP_ROLES) > REGISTER_FILE:
        return "the warp roles' registers exceed the register file"
    if cfg.sinks and type(cfg) not in (FwdConfigSm100, FwdFP8ConfigSm100, FwdFP4ConfigSm100):
        return "sinks are the forwards' field (the backward reads them through the LSE)"
    if cfg.varlen and isinstance(cfg, FwdFP8ConfigSm100):
        return "one-launch varlen is the 16-bit kernels' field (FP8 / NVFP4: per sequence)"
    return None


def plan_fwd(problem: AttnProblem, arch: str = ARCH, multicast: bool = True) -> FwdConfigSm100:
    """The config for `problem` (16-bit, e4m3 or NVFP4, with a sliding window and sinks;
    one-launch varlen at 16 bits); raises ValueError with the reason when this kernel cannot
    run it. Ring depths: the deepest V ring (4, 3, 2) beside a 3-deep QK ring, then the
    deepest QK ring beside it. `multicast`: share Q and K over the row tile's cluster (the
    default: the design's prediction says the unshared form is L2-bound, docs/design.md
    section 7)."""
    quantized = problem.dtype in FP8_DTYPES or problem.dtype == FP4_DTYPE
    if problem.varlen and quantized:
        raise ValueError("the sm100 FP8 / NVFP4 forwards have no one-launch varlen")
    dv = problem.head_dim_v
    cls = {FP4_DTYPE: FwdFP4ConfigSm100}.get(
        problem.dtype, FwdFP8ConfigSm100 if quantized else FwdConfigSm100)
    extra = dict(out_dtype=problem.out_dtype or "bf16") if quantized else {}
    base = dict(arch=arch, dtype=problem.dtype, head_dim=problem.head_dim,
                causal=problem.right_bounded, **extra,
                head_dim_v=None if dv == problem.head_dim else dv,
                window=problem.window_lo is not None, sinks=problem.has_sinks,
                varlen=problem.varlen)
    base["multicast"] = multicast and cls(**base).o_split > 1  # a cluster needs o_split >= 2
    return deepest_rings(lambda qk, v: cls(**base, qk_stages=qk, v_stages=v), can_implement,
                         min_k=3)


# ==================================================================================== backward
# The gradient kernels run on the forward's skeleton with other operands in its roles (rows R,
# columns C, the accumulator's B): dV = P^T dO with rows = keys (one product, S^T = K Q^T, and
# P^T from each query's LSE), dK = dS^T Q and dQ = dS K with two products (S and dP = dO V^T,
# dS = P (dP - Delta)) filling both score buffers, so a block's scores are not overlapped with
# the previous block's accumulator MMAs (lookahead 0: no TMEM is left for a second pair).


class _TwoProducts:
    """dK's and dQ's shape: the scores S (over D) and dP (over Dv) per block, the
    accumulator as wide as D."""

    @property
    def products(self) -> tuple[int, ...]:
        return (self.head_dim, self.dv)

    @property
    def acc_dim(self) -> int:
        return self.head_dim


class _KeyRows:
    """dV's and dK's walk: the CTA's rows are keys, the blocks queries."""

    @property
    def rows_are_keys(self) -> bool:
        return True


@dataclass(frozen=True)
class BwdDVConfigSm100(_KeyRows, FwdConfigSm100):
    """dV[keys, Dv] = sum over query blocks of P^T dO: rows = a 128-key tile of the KV head,
    blocks = 128-query blocks of each of its query heads, accumulator = dV's columns."""

    KERNEL: ClassVar[str] = "ffpa_cute.sm100.bwd_sm100:FFPABwdDVSm100"


@dataclass(frozen=True)
class BwdDKConfigSm100(_KeyRows, _TwoProducts, FwdConfigSm100):
    """dK[keys, D] = scale * sum of dS^T Q: rows = keys, blocks = query blocks of the group's
    heads; products S^T (K Q^T over D) and dP^T (V dO^T over Dv); accumulator = dK's columns."""

    KERNEL: ClassVar[str] = "ffpa_cute.sm100.bwd_sm100:FFPABwdDKSm100"


@dataclass(frozen=True)
class BwdDQConfigSm100(_TwoProducts, FwdConfigSm100):
    """dQ[queries, D] = scale * sum of dS K: rows = queries, blocks = key blocks (as the
    forward's); products S (Q K^T over D) and dP (dO V^T over Dv); accumulator = dQ's
    columns."""

    KERNEL: ClassVar[str] = "ffpa_cute.sm100.bwd_sm100:FFPABwdDQSm100"


BWD_CONFIGS = {"dq": BwdDQConfigSm100, "dk": BwdDKConfigSm100, "dv": BwdDVConfigSm100}


def plan_bwd(problem: AttnProblem, arch: str = ARCH, multicast: bool = True) -> list:
    """The dQ, dK and dV configs for `problem` (16-bit; a sliding window, sinks through the
    LSE, one-launch varlen; the deepest rings that fit); raises ValueError with the reason."""
    dv = problem.head_dim_v
    out = []
    for kind in ("dq", "dk", "dv"):
        cls = BWD_CONFIGS[kind]
        base = dict(arch=arch, dtype=problem.dtype, head_dim=problem.head_dim,
                    causal=problem.right_bounded,
                    head_dim_v=None if dv == problem.head_dim else dv,
                    window=problem.window_lo is not None, varlen=problem.varlen)
        base["multicast"] = multicast and cls(**base).acc_dim > MAX_MMA_N
        out.append(deepest_rings(lambda qk, v, base=base, cls=cls: cls(
            **base, qk_stages=qk, v_stages=v), can_implement, min_k=3))
    return out


__all__ = ["BWD_CONFIGS", "BwdDKConfigSm100", "BwdDQConfigSm100", "BwdDVConfigSm100",
           "FwdConfigSm100", "FwdFP4ConfigSm100", "FwdFP8ConfigSm100", "WARP_ROLES",
           "can_implement", "num_threads", "plan_bwd", "plan_fwd"]
