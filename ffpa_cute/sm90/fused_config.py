"""Compile key and planner of the fused 5-unit backward (`FFPABwdFusedSm90`, bwd_fused_sm90.py):
one pass over the (key tile, query block) pairs computes dQ, dK and dV, a 2-CTA cluster per
64-key tile with each CTA owning half of D. The router (`dispatch.plan_bwd`) takes it where
`fused_pays`; the constants below are the measurements that placed each boundary.

Like config.py (the forward's and the atomic-free gradient kernels' keys, whose sizes and
checks it shares), this module imports no cutlass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from ..problem import AttnProblem
from .config import (DTYPES, ELEM_BYTES, MAX_HEAD_DIM, SMEM_CAPACITY, WGMMA_MAX_N, _align,
                     _group_split)

FUSED_TILE = 64            # keys per tile and queries per block (every WGMMA's M or N)
FUSED_DQ_MAX_WIDTH = 160   # widest dQ accumulator the S warpgroup holds (80 fp32 registers;
#                            192 spilled 8 B at D=384)
FUSED_DQ_PIECE = 32        # columns of one staged dQ piece (64 x 32 fp32: 8 KB, a
#                            128-byte swizzled row each)
FUSED_MAX_HALF = 288       # D columns per CTA: its dK_r and dV_r (64 x 288 fp32 at most,
#                            144 registers a thread each) fill the accumulator warpgroups'
#                            registers; above 256 (`wide`: D=576) issued as m64n96 WGMMAs
FUSED_ROUTED_MAX_HEAD_DIM = 576   # the default route takes the fused kernel up to here (D=576,
#                                   `wide`: 282 against 196 TFLOPS, H100, 2026-12-06)


@dataclass(frozen=True)
class BwdFusedConfigSm90:
    """Compile key of the fused backward (`FFPABwdFusedSm90`; issue 17's 5-unit design,
    GPU-tested and sanitizer-clean, `VERIFIED`): the default backward (`Options.deterministic`
    False) where it measured faster than the atomic-free kernels).

    arch:       "sm_90a"
    dtype:      "bf16" | "fp16"
    head_dim:   D == Dv in (256, 1024]: each of the `cluster_d` CTAs owns D / cluster_d
                columns (`half`, at most FUSED_MAX_HALF: its dK / dV accumulators), a multiple
                of 32 so that its rows are whole 64-byte swizzle spans. A half above 256
                (`wide`: D=576 over the pair) takes one Q and one dO stage (227 KB), dQ by the
                dV warpgroup (`dq_grads` 1), no window (its masks spill the S warpgroup)
    causal:     causal masking (the offset is a runtime argument, bottom-right or upper-left)
    q_stages:   depth of the Q ring ([64 x D/2] stages; the dK warpgroup refills it)
    do_stages:  depth of the dO ring (the dV warpgroup refills it)
    window:     a sliding window's left edge (the runtime `window_lo`): a key tile walks only
                the query blocks up to the last query that sees its last key, masking the
                crossing ones, as the dK / dV kernels do
    dq_grads:   how many of the dV / dK warpgroups form and reduce dQ. 0: the S warpgroup, in
                `dq_chunks` between its score products. 1: the dV warpgroup (whose product is
                the shorter) after its product, through both staging buffers in turn. 2: each
                its share of the columns (`dq_shares`), each through one buffer. With 1 or 2 the
                S warpgroup runs only the score products, the exchange and the score step (the
                chain every block waits for) and the registers follow dQ (`reg_split`)
    group_split: the G = Hq / Hkv query heads a key tile's dK / dV sum over are split over S
                CTA pairs (S from `group_parts` at launch, as the dV / dK kernels do), each
                storing its partial dK / dV in fp32 to a workspace [B, Hkv S, Nkv, D] that
                the host adds up in a fixed order: few KV heads (MQA) otherwise leave one
                unbalanced wave of long causal tiles
    cluster_d:  the CTAs of the cluster that split D (2, 3 or 4; above 2 `scatter`)
    scatter:    the score partials summed by a reduce-scatter, then P^T / dS^T gathered,
                instead of every CTA receiving its peer's whole partials: CTA r adds up the
                16-byte fragment groups q with q % cluster_d == r and sends its bf16 P^T / dS^T
                values of them back through the peers' exchange buffers (docs/design.md
                section 4, "D over C CTAs"). Run on an H100 (float64 tests and sanitizers
                pass) and slower than the routed backward at D=768 / 1024: not planned
    dq_buffers: the fp32 dQ staging buffers (8 KB each): 2, or 3 with `dq_grads` 1, or 4 with
                `dq_grads` 2 (two for each warpgroup), whose pieces then take one barrier each
                instead of two (the wait for the buffer the next piece takes moves behind this
                piece's stores: `_grad_dq`)
    dq_pairs:   the dV / dK warpgroups (`dq_grads` 1 / 2) stage a thread's two adjacent columns
                of a row by one 8-byte st.shared instead of two 4-byte ones (not the S
                warpgroup's chunks: its registers spilled)
    dq_ahead:   the dV warpgroup (`dq_grads` 1) issues the next dQ atom's WGMMA before staging
                this one, where the registers allow it (`dq_ahead_fits`)
    row_units:  one CTA pair per (query block row, key tile) walking the row's block in the G
                query heads, rows outer, dK / dV partial sums added into zeroed fp32 workspaces
                [B, Hkv, Nkv, D] by red.global.add (the host casts): large causal head groups,
                whose key tiles' walks of different lengths otherwise revisit each (head,
                block) far apart in time, from DRAM (FUSED_ROW_UNITS_MIN_GROUP)
    """

    arch: str
    dtype: str
    head_dim: int
    causal: bool
    q_stages: int = 2
    do_stages: int = 2
    window: bool = False
    dq_grads: int = 0
    group_split: bool = False
    cluster_d: int = 2
    scatter: bool = False
    row_units: bool = False
    dq_buffers: int = 2
    dq_pairs: bool = False
    dq_ahead: bool = False

    KERNEL: ClassVar[str] = "ffpa_cute.sm90.bwd_fused_sm90:FFPABwdFusedSm90"

    @property
    def VERIFIED(self) -> bool:
        """Run, GPU-tested and clean under compute-sanitizer's four tools (dq_grads 0-2,
        group_split, window, `wide` in bf16 and fp16, `row_units` on an H100;
        docs/verification.md); `scatter` ran only on an H100 (its tests and the sanitizers pass
        there) and is not planned, so selfcheck canaries it."""
        return not self.scatter

    @property
    def elem_bytes(self) -> int:
        return ELEM_BYTES[self.dtype]

    @property
    def o_split(self) -> int:
        """CTAs per key tile (the cluster), for `group_parts`."""
        return self.cluster_d

    @property
    def half(self) -> int:
        """D columns of each CTA of the cluster (its dK, dV and dQ share; its K, V, Q, dO
        slices): D / cluster_d (the pair's half of D)."""
        return self.head_dim // self.cluster_d

    @property
    def wide(self) -> bool:
        """Whether a CTA's half is wider than one WGMMA (WGMMA_MAX_N columns): dK_r / dV_r
        issued as m64n`pv_atom_n(half)` WGMMAs, registers by `reg_split`'s wide row."""
        return self.half > WGMMA_MAX_N

    @property
    def x_groups(self) -> int:
        """16-byte groups of one score partial per S thread (64 x 64 fp32 over 128 threads)."""
        return FUSED_TILE * FUSED_TILE // (4 * 128)

    def owned_groups(self, rank):
        """With `scatter`: how many fragment groups q of a partial CTA `rank` owns (q %
        cluster_d == rank); arithmetic only, so the kernel calls it on its runtime rank."""
        return (self.x_groups - 1 - rank) // self.cluster_d + 1

    @property
    def x_slot_groups(self) -> int:
        """Groups per part of one sender's slot in the exchange buffer: the whole partial, or
        with `scatter` the largest owned share."""
        return -(-self.x_groups // self.cluster_d) if self.scatter else self.x_groups

    @property
    def x_floats(self) -> int:
        """fp32 values of the exchange buffer: per sender (the peer, or with `scatter` each of
        the cluster_d - 1 peers) both parts (S^T, dP^T) of its slot, 4 per group and S
        thread."""
        senders = self.cluster_d - 1 if self.scatter else 1
        return senders * 2 * self.x_slot_groups * 4 * 128

    @property
    def atom_cols(self) -> int:
        """Columns of a [64 x half] tile's swizzle atom: 64 (128-byte swizzle) when a row is a
        multiple of 128 bytes, else 32 (64-byte; half is a multiple of 32)."""
        return 64 if self.half * self.elem_bytes % 128 == 0 else 32

    @property
    def dq_ahead_fits(self) -> bool:
        """Whether the dV warpgroup (`dq_grads` 1, the pair) may issue the next dQ atom's WGMMA
        before staging this one's pieces (`dq_ahead`), so that its latency runs under the
        staging: where its accumulator and two [64 x atom] dQ ones fit in 112 of the 168
        registers ptxas gives every thread, i.e. halves of up to 160 columns with 32-column
        atoms (D=320 and the D it pads to 320); at D=384 (160 registers) and 512 (192) they
        spilled 288-584 B."""
        return (self.dq_grads == 1 and not self.scatter
                and self.half // 2 + self.atom_cols <= 112)

    @property
    def dq_chunks(self) -> tuple[int, ...]:
        """Widths of the dQ accumulators the S warpgroup forms its share of dQ in, one after
        the other: the whole share up to FUSED_DQ_MAX_WIDTH columns, else 128-column chunks
        and the rest (whole swizzle atoms each: a chunk's B starts on an atom)."""
        if self.half <= FUSED_DQ_MAX_WIDTH:
            return (self.half,)
        chunks = (128,) * (self.half // 128)
        return chunks + ((self.half % 128,) if self.half % 128 else ())

    @property
    def dq_widths(self) -> tuple[int, ...]:
        """Widths of the dQ accumulators the kernel forms dQ in: `dq_chunks` in the S
        warpgroup, or with `dq_grads` one swizzle atom at a time."""
        return (self.atom_cols,) if self.dq_grads else self.dq_chunks

    @property
    def dq_shares(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """With `dq_grads` 1 or 2: (first column, width) of the dQ columns of this CTA's half
        that the dV warpgroup and the dK warpgroup form, in whole swizzle atoms (formed an atom
        at a time: a B operand read N-major starts on an atom); with 2 the dV warpgroup takes
        the odd atom."""
        if self.dq_grads not in (1, 2):
            raise ValueError(f"dq_shares: dq_grads is {self.dq_grads}, not 1 or 2")
        if self.dq_grads == 1:
            return (0, self.half), (self.half, 0)
        atoms = self.half // self.atom_cols
        first = -(-atoms // 2) * self.atom_cols
        return (0, first), (first, self.half - first)

    @property
    def reg_split(self) -> tuple[int, int, int]:
        """setmaxnreg of the S, dV and dK warpgroups (their sum 504: 65536 registers over 384
        threads, rounded down to 8 per thread), found by compiling (tests/test_bwd_fused.py
        checks for spills; ptxas is not monotonic in them).
          0: the S warpgroup holds two 64 x 64 products and a dQ chunk: 184, the others 160.
          1: the dK warpgroup its [64 x D/2] fp32 accumulator (D/4 registers) and 32; the S
             warpgroup (two products, the score step and its masks) 168 where that leaves
             the dV warpgroup its accumulator, a [64 x atom] dQ one and 48, else what does
             (136 at D=512, which spills 4 B with a window and no causal mask); the dV
             warpgroup the rest. With `row_units` the dK warpgroup takes 48 beside its
             accumulator where the S warpgroup keeps 168 (D 320 / 384: the reductions'
             addresses spilled 12-20 B at D=320 with 32).
          2: each of dV / dK its accumulator, a dQ one and 40; the S warpgroup the rest (104
             at D=512: enough without masks only).
          `wide` (dq_grads 1): the dK warpgroup its accumulator and 48, the dV warpgroup its
             accumulator, a dQ one and 32, the S warpgroup the rest (192 / 192 / 120 at D=576:
             176 for dK or 184 for dV spilled 1 KB, 128 for S 8-24 B; with `row_units`
             32 B spill at every split tried, kept: measured 160 -> 273 TFLOPS at MQA 64:1)."""
        acc = self.half // 2
        if self.wide:
            dk, dv = acc + 48, acc + self.atom_cols // 2 + 32
            return 504 - dk - dv, dv, dk
        if self.dq_grads == 0:
            return 184, 160, 160
        if self.dq_grads == 1:
            dk = acc + 32
            if self.row_units and 504 - (acc + 48) - (acc + self.atom_cols // 2 + 48) >= 168:
                dk = acc + 48
            s = min(168, 504 - dk - (acc + self.atom_cols // 2 + 48))
            return s, 504 - s - dk, dk
        grads = acc + self.atom_cols // 2 + 40
        return 504 - 2 * grads, grads, grads

    def smem_bytes(self) -> int:
        """The storage struct of `FFPABwdFusedSm90`: barriers (K/V, Q ring, dO ring, P full /
        empty, exchange full / empty), the block's column statistics (64 LSE + 64 Delta),
        then, each 1 KB aligned: the exchange buffer (the peers' fp32 S^T and dP^T partials,
        with `scatter` then their bf16 P^T / dS^T groups: `x_floats`), K, V,
        the Q and dO rings, P^T and dS^T, the dQ staging pieces (`dq_buffers`)."""
        header = 8 * (1 + self.q_stages + self.do_stages + 4)
        header = _align(header, 16) + 2 * FUSED_TILE * 4
        tile = FUSED_TILE * self.half * self.elem_bytes
        regions = [self.x_floats * 4, tile, tile, self.q_stages * tile,
                   self.do_stages * tile, *(2 * [FUSED_TILE * FUSED_TILE * self.elem_bytes]),
                   self.dq_buffers * FUSED_TILE * FUSED_DQ_PIECE * 4]
        return sum(_align(x) for x in [header, *regions])


def can_implement_fused(cfg: BwdFusedConfigSm90) -> str | None:
    """None when the fused backward can be built for cfg, else the reason."""
    if cfg.arch != "sm_90a":
        return f"arch {cfg.arch!r}: WGMMA, TMA and clusters need sm_90a"
    if cfg.dtype not in DTYPES:
        return f"dtype {cfg.dtype!r}: the fused backward takes {DTYPES}"
    if cfg.cluster_d not in (2, 3, 4) or (cfg.cluster_d > 2 and not cfg.scatter):
        return (f"cluster_d={cfg.cluster_d}, scatter={cfg.scatter}: 2, or 3 / 4 with scatter "
                "(the score partials reduce-scattered)")
    if cfg.scatter and cfg.dq_grads not in (1, 2):
        return (f"scatter with dq_grads={cfg.dq_grads}: dQ must be formed by the dV / dK "
                "warpgroups (1 or 2), which wait for the peers' dS^T values")
    if (cfg.head_dim % (32 * cfg.cluster_d) or cfg.half > FUSED_MAX_HALF
            or not 256 < cfg.head_dim <= MAX_HEAD_DIM):
        return (f"head_dim={cfg.head_dim}: the fused backward needs D in (256, {MAX_HEAD_DIM}] "
                f"with D / cluster_d (cluster_d={cfg.cluster_d}) a multiple of 32 up to "
                f"{FUSED_MAX_HALF} (each CTA's columns: rows of whole 64-byte swizzle spans, "
                "dK / dV accumulators in registers)")
    if cfg.q_stages not in (1, 2) or cfg.do_stages not in (1, 2):
        return f"q_stages={cfg.q_stages}, do_stages={cfg.do_stages}: 1 or 2 each"
    if cfg.wide and (cfg.cluster_d != 2 or cfg.dq_grads != 1 or cfg.window):
        return (f"head_dim={cfg.head_dim} over {cfg.cluster_d} CTAs ({cfg.half} columns each, "
                f"wider than one WGMMA) with cluster_d={cfg.cluster_d}, dq_grads="
                f"{cfg.dq_grads}, window={cfg.window}: a CTA half above {WGMMA_MAX_N} columns "
                "is built for the pair only, with dQ by the dV warpgroup (dq_grads 1) and no "
                "window (the registers that fit)")
    if cfg.dq_grads not in (0, 1, 2):
        return f"dq_grads={cfg.dq_grads}: 0, 1 or 2"
    if cfg.dq_pairs and cfg.dq_grads not in (1, 2):
        return f"dq_pairs with dq_grads={cfg.dq_grads}: 1 or 2 (the dV / dK warpgroups' pieces)"
    if cfg.dq_ahead and not cfg.dq_ahead_fits:
        return (f"dq_ahead at head_dim={cfg.head_dim}, dq_grads={cfg.dq_grads}: the dV "
                "warpgroup's registers hold two dQ atoms beside dV_r only with dq_grads 1, "
                "halves up to 160 columns, no scatter (`dq_ahead_fits`)")
    if cfg.dq_buffers not in {1: (2, 3), 2: (2, 4)}.get(cfg.dq_grads, (2,)):
        return (f"dq_buffers={cfg.dq_buffers} with dq_grads={cfg.dq_grads}: 2, or 3 with "
                "dq_grads 1 (the dV warpgroup's pieces in turn), 4 with dq_grads 2 (two for "
                "each warpgroup)")
    if cfg.row_units and (cfg.group_split or cfg.scatter):
        return (f"row_units with group_split={cfg.group_split}, scatter={cfg.scatter}: row "
                "units split the head groups' sums themselves (over rows), for the pair only")
    if cfg.smem_bytes() > SMEM_CAPACITY:
        return (f"shared memory {cfg.smem_bytes()} B > {SMEM_CAPACITY} B (q_stages "
                f"{cfg.q_stages}, do_stages {cfg.do_stages}, dq_buffers {cfg.dq_buffers})")
    return None


# where the fused backward (dq_grads 1) measured faster than the atomic-free kernels (H100,
# bf16, N=8K, 2026-12-05; docs/design.md section 4): every D it builds (320: 270 against 204
# TFLOPS, 512: 308 against 238) and every group measured, up to MQA 64:1 (causal: 241
# against 216)
FUSED_MIN_HEAD_DIM = 320
FUSED_MAX_GROUP = 64
# D % 64 != 0 on the fused kernel at the next multiple of 64 (`fused_head_dim`: q, k, v and
# dout zero-padded by `launch.run_bwd`, the copies included), against the atomic-free kernels
# (H100, bf16, B=1, H=32, N=8K, TFLOPS, not causal / causal; perf.bwd_fused --padded,
# 2026-12-06): D=264 215 / 202 against 175 / 167, 336 257 / 235 against 195 / 187, 400 248 /
# 230 against 201 / 195, 480 284 / 262 against 214 / 210, 520 241 / 224 against 172 / 164,
# 544 251 / 229 against 190 / 178, GQA 32/4 causal at 336 230 against 189
FUSED_PAD = True


def fused_head_dim(problem: AttnProblem, pad: bool | None = None) -> int:
    """The head dim the fused backward runs a problem at: D, or with `pad` (default FUSED_PAD)
    and D % 64 != 0 the next multiple of 64 (the extra columns zeros: the same scores, their
    gradients dropped)."""
    pad = FUSED_PAD if pad is None else pad
    d = problem.head_dim
    return -(-d // 64) * 64 if pad and d % 64 and d == problem.head_dim_v else d


def fused_pays(problem: AttnProblem) -> bool:
    """Whether `Options(deterministic=False)` routes problem to the fused backward (where it
    also builds: `plan_bwd_fused`), judged at the head dim it runs at (`fused_head_dim`);
    groups above FUSED_MAX_GROUP by row units only (MQA 128:1 causal, D=512, H100: 220 -> 299
    TFLOPS at N=8K, 198 -> 296 at 4K against the atomic-free kernels)."""
    return (FUSED_MIN_HEAD_DIM <= fused_head_dim(problem) <= FUSED_ROUTED_MAX_HEAD_DIM
            and (problem.heads_q // problem.heads_kv <= FUSED_MAX_GROUP or _row_units(problem)))


def _row_units(problem: AttnProblem) -> bool:
    """Whether the fused backward walks `problem` by row units (FUSED_ROW_UNITS_MIN_GROUP)."""
    return (problem.causal and problem.window_lo is None
            and problem.heads_q // problem.heads_kv >= FUSED_ROW_UNITS_MIN_GROUP)


# Who forms dQ (`dq_grads`: FUSED_DQ_GRADS, or FUSED_DQ_GRADS_BY_DIM's at that D) and whether
# head groups split over CTA pairs where `group_parts` says so, as measured by perf.bwd_fused
# (bf16, N=8K, TFLOPS, 2026-12-05; docs/perf-log.md). H100, dq_grads 0 / 1 / 2: D=512 272 /
# 308 / 306, causal 262 / 307 / 293, 16K 264 / 312 / 316, D=320 206 / 270 / 267, 384 245 /
# 305 / 289, 448 248 / 269 / 281, MQA 64/1 causal 179 / 241 / 202. H200, dq_grads 1 / 2: D=512
# 314-319 / 318, causal 308-310 / 308, GQA 32/4 causal 286-298 / 286, MQA 64/1 causal 261-263
# / 274, 16K 318 / 324, D=320 267-269 / 284, 384 302-305 / 304, 448 266 / 288. So 1, and 2 at
# D=448 (ahead on both cards); the others' differences change sign between the cards.
# group_split with dq_grads 1 (H100 / H200): GQA 32/4 causal 272 / 294 against 275 / 286-298,
# MQA 64/1 causal 247 / 270 against 241 / 261-263: not worth its fp32 workspaces
FUSED_DQ_GRADS = 1
FUSED_DQ_GRADS_BY_DIM = {448: 2}
FUSED_GROUP_SPLIT = False
# `row_units` for causal head groups of at least this many query heads (no window), against
# the key-tile walk (H100, bf16, B=1, N=8K, TFLOPS with the workspaces' zeroing and cast;
# perf.bwd_fused --row-units, 2026-12-06): G=64 (MQA 64/1) at D=320
# 169 -> 268, 384 177 -> 306, 512 215-237 -> 316, 576 157 -> 273; G=32 at 512 237-257 ->
# 290-298; G=16 at 320 224 -> 230, 384 235 -> 266, 512 259-272 -> 264-268, 576 205 -> 239;
# G=8 loses (512 290 -> 219, 320 268 -> 191, 576 253 -> 199); not causal 323 -> 313
FUSED_ROW_UNITS_MIN_GROUP = 16
# the dQ staging of `fit_dq_staging` (8-byte stores, the next atom ahead, three buffers with
# one barrier a piece) planned: faster at D=320 / 384 (H100, bf16, N=8K, kernel alone and
# traced: 263 -> 301 and 279 -> 316 TFLOPS; docs/perf-log.md)
FUSED_DQ_STAGING = True


def plan_bwd_fused(problem: AttnProblem, arch: str = "sm_90a", cluster_d: int = 2,
                   scatter: bool = False, pad: bool | None = None) -> BwdFusedConfigSm90:
    """The fused backward's config: two Q stages, then two dO stages where they fit (D >= 448
    keeps one, D=576 one of each), then the dQ staging `fit_dq_staging` picks (8-byte stores,
    three buffers where they fit beside the stages with `dq_grads` 1: D=320, 384, 576; the
    next atom ahead at 320); `dq_grads` FUSED_DQ_GRADS (FUSED_DQ_GRADS_BY_DIM's where it
    names D), `group_split` where FUSED_GROUP_SPLIT is on and `group_parts` splits the
    problem's head groups, else `row_units` for causal groups of FUSED_ROW_UNITS_MIN_GROUP or
    more. Raises ValueError with the reason for problems it does not take:
    Dv != D, varlen, a window at D=576. `cluster_d`, `scatter`: D over that many CTAs by the
    reduce-scatter (tests and experiments ask for it; the router does not: it measured slower
    than the routed backward, H100). `pad` (default FUSED_PAD): D % 64 != 0 planned at
    `fused_head_dim` (its config's head_dim; `launch.run_bwd` pads the operands)."""
    if problem.head_dim_v != problem.head_dim:
        raise ValueError("the fused backward needs head_dim_v == head_dim")
    if problem.varlen:
        raise ValueError("the fused backward takes no varlen yet")
    d = fused_head_dim(problem, pad)
    if d != problem.head_dim:   # the scale stays 1 / sqrt(D) (or the caller's)
        problem = dataclasses.replace(problem, head_dim=d, head_dim_v=d,
                                      scale=problem.softmax_scale)
    base = dict(arch=arch, dtype=problem.dtype, head_dim=problem.head_dim,
                causal=problem.right_bounded, window=problem.window_lo is not None,
                dq_grads=FUSED_DQ_GRADS_BY_DIM.get(problem.head_dim, FUSED_DQ_GRADS),
                group_split=FUSED_GROUP_SPLIT and _group_split(problem, o_split=cluster_d),
                cluster_d=cluster_d, scatter=scatter)
    base["row_units"] = _row_units(problem) and not scatter
    base["group_split"] &= not base["row_units"]
    for q_stages, do_stages in ((2, 2), (2, 1), (1, 1)):
        cfg = BwdFusedConfigSm90(**base, q_stages=q_stages, do_stages=do_stages)
        if can_implement_fused(cfg) is None:
            return fit_dq_staging(cfg)
    raise ValueError(can_implement_fused(cfg))


def fit_dq_staging(cfg: BwdFusedConfigSm90) -> BwdFusedConfigSm90:
    """cfg with the dQ staging the planner picks for its `dq_grads` (what a config with
    another `dq_grads` swapped in takes too): with FUSED_DQ_STAGING, pairs where the dV / dK
    warpgroups stage (`dq_grads` 1 / 2), the next atom ahead where `dq_ahead_fits`, three
    buffers where they build (`dq_grads` 1 and the shared memory; not with `scatter`, which
    is not planned); else (and otherwise) two buffers, 4-byte stores, one atom at a time."""
    cfg = dataclasses.replace(cfg, dq_buffers=2, dq_pairs=False, dq_ahead=False)
    if not FUSED_DQ_STAGING or cfg.scatter:
        return cfg
    cfg = dataclasses.replace(cfg, dq_pairs=cfg.dq_grads in (1, 2), dq_ahead=cfg.dq_ahead_fits)
    three = dataclasses.replace(cfg, dq_buffers=3)
    return three if can_implement_fused(three) is None else cfg
