"""Compile key and planner for the mma.sync Split-D forward (`FFPAFwdSm80`).

`FwdConfigSm80` is frozen and holds Python scalars only, so it pickles, hashes and reads well in
logs; `(qualname, cfg)` is the compile-cache key and `cfg.KERNEL` names the kernel class.
`plan_fwd(problem, arch)` never returns a config that `can_implement` rejects. The same kernels
serve sm_80/86/89, sm_90a (`Options.family="sm80"`, and the sm90 family's fallback where its
WGMMA planners raise) and sm_120a/121a (the sm120 family: the same configs under a 99 KB shared-memory
budget, picked by the compile target). This module imports no cutlass.

# === TUNING TABLE ===================================================================
# Warp layout (warp_m x warp_n warps; tile_m = 16 * warp_m rows of Q per CTA).
# O lives in registers for the whole KV loop: D / (2 * warp_n) fp32 registers per thread.
#   D <= 256*warp_n keeps that at <= 128, which leaves room for S, P and addresses without spills.
#   - M8N1 (FA-2 style, 8 warps, tile_m 128, tile_n 32): no cross-warp softmax exchange, P stays
#     in registers; O = D/2 registers, so only for D <= 320 (160 registers). tile_n 32 halves S,
#     P and K fragments so that 160 O registers fit without spills.
#     H200, D=320: 259 TFLOPS vs M4N2 201 (docs/perf-log.md).
#   - M4N2 (8 warps, tile_m 64): O split in two along D; row max/sum exchanged through smem.
#   - M2N4 (8 warps, tile_m 32): D > 512 (O = D/8 <= 128 registers at D = 1024).
# tile_n 64 (M4N2, M2N4), tile_hdim 64 (one 128-byte swizzled row per chunk), stages: as many
# K/V chunks (tile_n x 64) as fit beside Q (Q[tile_m, D] is resident: tile_m * D <= 32K elements = 64 KB).
# =====================================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..problem import AttnProblem

# Shared memory per CTA (bytes) by compile target, as cutlass-dsl names them.
SMEM_CAPACITY = {"sm_80": 166912, "sm_86": 101376, "sm_87": 166912, "sm_89": 101376,
                 "sm_90a": 232448, "sm_100a": 232448, "sm_120a": 101376, "sm_121a": 101376}
WARP_LAYOUTS = {"m8n1": (8, 1), "m4n2": (4, 2), "m2n4": (2, 4)}
DTYPES = ("bf16", "fp16")
MIN_HEAD_DIM, MAX_HEAD_DIM = 264, 1024


@dataclass(frozen=True)
class FwdConfigSm80:
    """Everything that changes the generated code of the Split-D forward.

    arch:        compile target ("sm_80", "sm_90a", "sm_120a", ...), sets the smem budget
    dtype:       "bf16" | "fp16" (q, k, v, o); accumulation is fp32
    head_dim:    D, a multiple of 8; chunks of tile_hdim, the last one zero-padded in smem
    causal:      causal masking (the diagonal offset is a runtime argument)
    warp_layout: "m8n1" | "m4n2" | "m2n4" (see the tuning table)
    tile_n:      KV rows per block
    tile_hdim:   head-dim chunk width for both QK^T (k-dim) and PV (n-dim)
    num_stages:  depth of the K/V chunk ring (cp.async groups in flight + 1)
    window:      a sliding window's left edge (a runtime argument; blocks left of it skipped,
                 the crossing ones masked); the right edge is `causal` at min(offset, right)
    sinks:       a per-query-head sink logit in each row's denominator and LSE (a runtime [Hq]
                 fp32 tensor; the forward's only: the gradient kernels read it through the LSE)
    varlen:      one launch over packed sequences (q / k / v / o as [1, H, total, D] views and
                 their int32 cumulative lengths): each CTA finds its sequence's row tile by
                 common/scheduler.py's `varlen_tile`, its tiles start at the sequence's first
                 rows, and the causal offset and window edge add the sequence's frame. The
                 16-bit forward's and gradient kernels' field.
    """

    arch: str
    dtype: str
    head_dim: int
    causal: bool
    warp_layout: str = "m4n2"
    tile_n: int = 64
    tile_hdim: int = 64
    num_stages: int = 3
    window: bool = False
    sinks: bool = False
    varlen: bool = False

    KERNEL: ClassVar[str] = "ffpa_cute.sm80.fwd_sm80:FFPAFwdSm80"

    @property
    def warp_m(self) -> int:
        return WARP_LAYOUTS[self.warp_layout][0]

    @property
    def warp_n(self) -> int:
        return WARP_LAYOUTS[self.warp_layout][1]

    @property
    def tile_m(self) -> int:
        return 16 * self.warp_m

    @property
    def num_threads(self) -> int:
        return 32 * self.warp_m * self.warp_n

    @property
    def num_hdim_chunks(self) -> int:
        return -(-self.head_dim // self.tile_hdim)

    @property
    def hdim_padded(self) -> int:
        return self.num_hdim_chunks * self.tile_hdim

    def smem_bytes(self) -> int:
        """Shared memory of one CTA: resident Q, the K/V chunk ring, P and row statistics."""
        elt = 2
        q = self.tile_m * self.hdim_padded * elt
        ring = self.num_stages * self.tile_n * self.tile_hdim * elt
        p = (self.tile_m if self.warp_n > 1 else 8) * 64 * elt
        stats = self.warp_n * self.tile_m * 4
        return q + ring + p + stats + 3 * 1024  # 1 KB alignment per region

    def o_registers(self) -> int:
        """fp32 registers per thread holding O for the whole KV loop."""
        return self.head_dim // (2 * self.warp_n)


@dataclass(frozen=True)
class FwdFP8ConfigSm80(FwdConfigSm80):
    """Compile key of the FP8 Split-D forward (`FFPAFwdSm80FP8`): the forward's fields with
    dtype "e4m3" (Q, K, Vt and P in e4m3, mma.sync m16n8k32, fp32 accumulation; sm_89 and up)
    and the output's dtype.

    out_dtype: "bf16" | "fp16", the dtype of O (LSE stays fp32).

    P goes through shared memory (warp_n > 1: the 8-bit A fragment's k order is not the C
    fragment's), so the layouts are M4N2 and M2N4. O is staged for its stores in the Q buffer,
    sized for O (out_dtype is twice e4m3's width)."""

    out_dtype: str = "bf16"

    KERNEL: ClassVar[str] = "ffpa_cute.sm80.fwd_sm80:FFPAFwdSm80FP8"

    def smem_bytes(self) -> int:
        """Q / O staging (tile_m x D in out_dtype), the ring of [64 x 64] e4m3 chunks (K, and
        Vt's [64 dims x 64 keys]), P (tile_m x 64 e4m3) and row statistics."""
        staging = self.tile_m * self.hdim_padded * 2
        ring = self.num_stages * self.tile_n * self.tile_hdim
        p = self.tile_m * 64
        return staging + ring + p + self.warp_n * self.tile_m * 4 + 3 * 1024


@dataclass(frozen=True)
class FwdFP4ConfigSm80(FwdFP8ConfigSm80):
    """Compile key of the NVFP4 Split-D forward (`FFPAFwdSm80FP4`, sm_120a / sm_121a: the
    block-scaled mma.sync kind::mxf4nvf4 m16n8k64, E2M1 operands with one E4M3 scale per 16
    elements along K): dtype "nvfp4" for Q, K, Vt and P, and the output's dtype.

    Per chunk of 64 elements each operand row carries 32 bytes of codes and one 4-byte word of
    scales (4 blocks), so the ring holds [64 x 64] code chunks beside [64] scale words, and Q's
    scales stay resident beside Q. Compile-verified only, never run."""

    KERNEL: ClassVar[str] = "ffpa_cute.sm80.fwd_sm80:FFPAFwdSm80FP4"

    def smem_bytes(self) -> int:
        """Q / O staging (tile_m x D in out_dtype), the ring's code chunks (half a byte per
        element) and scale words, Q's scales, P's codes and scales, row statistics; each region
        1 KB aligned at most."""
        staging = self.tile_m * self.hdim_padded * 2
        ring = self.num_stages * self.tile_n * self.tile_hdim // 2
        ring_scales = self.num_stages * self.tile_n * 4
        q_scales = self.tile_m * self.hdim_padded // 16
        p = self.tile_m * 64 // 2 + self.tile_m * 4
        return (staging + ring + ring_scales + q_scales + p + self.warp_n * self.tile_m * 4
                + 7 * 1024)


# the quantized forwards: (their mma.sync's archs, D's multiple and why) per dtype: e4m3 x
# e4m3 -> f32 m16n8k32 from sm_89 on; the block-scaled kind::mxf4nvf4 on sm_120a / sm_121a
FP8_ARCHS = ("sm_89", "sm_90a", "sm_120a", "sm_121a")
FP4_ARCHS = ("sm_120a", "sm_121a")
QUANTIZED = {"e4m3": ("FP8", FP8_ARCHS, 16, "its 16-byte row vectors"),
             "nvfp4": ("NVFP4", FP4_ARCHS, 64,
                       "one 4-byte word of block scales per 64-element chunk")}
QUANTIZED_OUT_DTYPES = ("bf16", "fp16")


def _quantized_reason(cfg: FwdFP8ConfigSm80) -> str | None:
    """The FP8 / NVFP4 forward's own constraints (None: met)."""
    want = "nvfp4" if isinstance(cfg, FwdFP4ConfigSm80) else "e4m3"
    name, archs, multiple, why = QUANTIZED[want]
    if cfg.dtype != want:
        return f"dtype {cfg.dtype!r}: the {name} Split-D forward reads {want}"
    if cfg.out_dtype not in QUANTIZED_OUT_DTYPES:
        return f"out_dtype {cfg.out_dtype!r} not in {QUANTIZED_OUT_DTYPES}"
    if cfg.arch not in archs:
        return f"arch {cfg.arch!r} has no {want} mma.sync (needs one of {archs})"
    if cfg.head_dim % multiple:
        return (f"head_dim={cfg.head_dim}: the {name} Split-D forward needs a multiple of "
                f"{multiple} ({why})")
    if cfg.warp_n == 1:
        return f"the {name} Split-D forward passes P through shared memory: warp_n must be > 1"
    return None


def can_implement(cfg: FwdConfigSm80) -> str | None:
    """None when the kernel can be built for cfg, else the reason (mirrors the docstring)."""
    if isinstance(cfg, FwdFP8ConfigSm80):
        reason = _quantized_reason(cfg)
        if reason:
            return reason
    elif cfg.dtype not in DTYPES:
        return f"dtype {cfg.dtype!r} not in {DTYPES}"
    if cfg.head_dim % 8 or not MIN_HEAD_DIM <= cfg.head_dim <= MAX_HEAD_DIM:
        return f"head_dim={cfg.head_dim}: need a multiple of 8 in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]"
    if cfg.warp_layout not in WARP_LAYOUTS:
        return f"warp_layout {cfg.warp_layout!r} not in {sorted(WARP_LAYOUTS)}"
    if cfg.tile_hdim != 64:
        return "tile_hdim must be 64 (one 128-byte swizzle atom per row)"
    if cfg.tile_n not in (32, 64) or (cfg.tile_n != 64 and cfg.warp_n > 1):
        return "tile_n must be 64 (or 32 with warp_n == 1, where P stays in registers)"
    if cfg.num_stages < 2:
        return "num_stages must be >= 2"
    if cfg.arch not in SMEM_CAPACITY:
        return f"arch {cfg.arch!r} not in {sorted(SMEM_CAPACITY)}"
    if cfg.smem_bytes() > SMEM_CAPACITY[cfg.arch]:
        return f"needs {cfg.smem_bytes()} B of smem, {cfg.arch} has {SMEM_CAPACITY[cfg.arch]}"
    if cfg.o_registers() > 160:
        return f"O needs {cfg.o_registers()} registers per thread with {cfg.warp_layout} (> 160)"
    if cfg.sinks and type(cfg) in BWD_CONFIGS.values():
        return "sinks is the forward's field (the gradient kernels read it through the LSE)"
    if cfg.varlen and isinstance(cfg, FwdFP8ConfigSm80):
        return "one-launch varlen is the 16-bit kernels' field (FP8 / NVFP4: per sequence)"
    return None


def pick_warp_layout(head_dim: int) -> str:
    """Measured crossover (docs/perf-log.md): see the tuning table above."""
    if head_dim <= 320:
        return "m8n1"
    if head_dim <= 512:
        return "m4n2"
    return "m2n4"


def plan_fwd(problem: AttnProblem, arch: str, warp_layout: str | None = None) -> FwdConfigSm80:
    """The config for `problem` on `arch`; raises ValueError with the reason if none can run."""
    if problem.head_dim_v != problem.head_dim:
        raise ValueError(f"head_dim_v={problem.head_dim_v} != head_dim={problem.head_dim}: "
                         "the Split-D kernels need equal head dims")
    quantized = {"e4m3": FwdFP8ConfigSm80, "nvfp4": FwdFP4ConfigSm80}.get(problem.dtype)
    layout = warp_layout or pick_warp_layout(problem.head_dim)
    if quantized and layout == "m8n1":
        layout = "m4n2"  # P through shared memory (FwdFP8ConfigSm80)
    cls, extra = ((quantized, dict(out_dtype=problem.out_dtype or "bf16")) if quantized
                  else (FwdConfigSm80, {}))
    cfg = None
    # The deepest ring that fits: 4 stages is worth +10% (D=512) to +30% (D=1024) over 3 on the
    # H200, and is spill-free on every target since loads stopped carrying per-vector predicates
    # (fwd_sm80.py, `_load_tile`); tests/test_kernels_compile.py checks ptxas's report.
    for stages in (4, 3, 2):
        cfg = cls(arch=arch, dtype=problem.dtype, head_dim=problem.head_dim,
                  causal=problem.right_bounded, warp_layout=layout, num_stages=stages,
                  tile_n=32 if layout == "m8n1" else 64,
                  window=problem.window_lo is not None, sinks=problem.has_sinks,
                  varlen=problem.varlen, **extra)
        if cfg.smem_bytes() <= SMEM_CAPACITY.get(arch, 0):
            break
    if warp_layout is None and can_implement(cfg) and layout == "m8n1":
        return plan_fwd(problem, arch, "m4n2")  # M8N1's 128-row Q does not fit this arch's smem
    reason = can_implement(cfg)
    if reason:
        raise ValueError(reason)
    return cfg


# ==================================================================================== backward
# === BACKWARD TUNING TABLE ===========================================================
# The three backward kernels (bwd_sm80.py) run on the forward's skeleton with other operands in
# its roles; each keeps its gradient (tile_m x D fp32) in registers like O: D / (2 * warp_n)
# registers per thread, so the same layouts apply (M4N2 up to D = 512, M2N4 above).
#   dV: one score product (S^T = K Q^T) + the P^T dO accumulation: the forward's budget.
#   dQ, dK: two score products (S and dP), so two tile_m x tile_n fp32 fragments plus the
#     per-row (dQ) or per-column (dK) LSE and Delta beside the gradient; the second product's
#     row operand (dO for dQ, V for dK) streams through a row ring of num_stages
#     tile_m x tile_hdim chunks beside the chunk ring (resident it would double the rows' smem).
# Where the preferred layout's smem does not fit the target (sm_120: 99 KB), M2N4 (tile_m 32).
# =====================================================================================
BWD_WARP_LAYOUTS = {"dv": ((512, "m4n2"), (1024, "m2n4")),
                    "dq": ((512, "m4n2"), (1024, "m2n4")),
                    "dk": ((512, "m4n2"), (1024, "m2n4"))}


@dataclass(frozen=True)
class BwdDVConfigSm80(FwdConfigSm80):
    """Compile key of the dV kernel: the forward's fields, read with a tile_m-row K tile as
    the resident rows and tile_n-query blocks (Q chunks, then dO chunks) through the ring."""

    KERNEL: ClassVar[str] = "ffpa_cute.sm80.bwd_sm80:FFPABwdDVSm80"


@dataclass(frozen=True)
class BwdDQConfigSm80(FwdConfigSm80):
    """Compile key of the dQ kernel: Q resident; per KV block the ring carries K chunks (S),
    V chunks with dO chunks in the row ring beside them (dP), then K chunks again (dS K)."""

    KERNEL: ClassVar[str] = "ffpa_cute.sm80.bwd_sm80:FFPABwdDQSm80"

    def smem_bytes(self) -> int:
        """The forward's budget plus the row ring (num_stages x tile_m x tile_hdim)."""
        return super().smem_bytes() + self.num_stages * self.tile_m * self.tile_hdim * 2 + 1024


@dataclass(frozen=True)
class BwdDKConfigSm80(BwdDQConfigSm80):
    """Compile key of the dK kernel: a K tile resident; per query block the ring carries Q
    chunks (S^T), dO chunks with V chunks in the row ring (dP^T), then Q chunks again (dS^T Q)."""

    KERNEL: ClassVar[str] = "ffpa_cute.sm80.bwd_sm80:FFPABwdDKSm80"


BWD_CONFIGS = {"dv": BwdDVConfigSm80, "dq": BwdDQConfigSm80, "dk": BwdDKConfigSm80}


def pick_bwd_warp_layout(kind: str, head_dim: int) -> str:
    """The backward tuning table above."""
    for max_d, layout in BWD_WARP_LAYOUTS[kind]:
        if head_dim <= max_d:
            return layout
    raise ValueError(f"head_dim={head_dim} above {MAX_HEAD_DIM}")


def plan_bwd(kind: str, problem: AttnProblem, arch: str, warp_layout: str | None = None):
    """Config of the backward kernel `kind` ("dv" | "dq" | "dk") for `problem` on `arch`: the
    table's layout (else M2N4 where its smem does not fit) with the deepest ring that fits;
    raises ValueError with the reason when none can run."""
    if problem.head_dim_v != problem.head_dim:
        raise ValueError("the Split-D backward needs head_dim_v == head_dim")
    cls = BWD_CONFIGS[kind]
    layouts = ([warp_layout] if warp_layout else
               dict.fromkeys([pick_bwd_warp_layout(kind, problem.head_dim), "m2n4"]))
    cfg = None
    for layout in layouts:
        for stages in (4, 3, 2):
            cfg = cls(arch=arch, dtype=problem.dtype, head_dim=problem.head_dim,
                      causal=problem.right_bounded, warp_layout=layout, num_stages=stages,
                      tile_n=64, window=problem.window_lo is not None, varlen=problem.varlen)
            if can_implement(cfg) is None:
                return cfg
    raise ValueError(f"{kind}: {can_implement(cfg)}")
