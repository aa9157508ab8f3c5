"""Routing: device -> compile target -> kernel family -> kernel configs, as data.

`TARGETS` maps a compute capability to the cutlass-dsl compile target, `FAMILY_OF_TARGET` a
target to its kernel family, and `FAMILIES` a family to its planners per direction ("fwd",
"bwd") and dtype class ("16bit": bf16 / fp16; "fp8"; "fp4"), with what was verified of it. A
planner maps (problem, target, options) to kernel configs; a config names its kernel class
(`cfg.KERNEL`), so one family may serve different head dims with different kernels. A cell that
is None has no kernel yet: the call falls back to SDPA with that reason.

| capability           | target          | family | kernels                                   |
|----------------------|-----------------|--------|-------------------------------------------|
| 8.0 / 8.6 / 8.7 / 8.9| sm_80 .. sm_89  | sm80   | mma.sync Split-D, fwd + bwd (e4m3 fwd on  |
|                      |                 |        | sm_89)                                    |
| 9.0                  | sm_90a          | sm90   | WGMMA + TMA fwd + bwd (Split-D compiled   |
|                      |                 |        | for sm_90a where they do not build);      |
|                      |                 |        | split-KV decode (`plan_decode`; 16-bit or |
|                      |                 |        | FP8 e4m3 cache under 16-bit queries)      |
| 10.0                 | sm_100a         | sm100  | tcgen05 + TMEM fwd (16-bit, e4m3, NVFP4), |
|                      |                 |        | dQ / dK / dV (compile-verified only, never|
|                      |                 |        | run: canaried on first use, selfcheck.py) |
| 12.0 / 12.1          | sm_120a/121a    | sm120  | Split-D fwd (16-bit, e4m3, NVFP4) + bwd,  |
|                      |                 |        | 99 KB plan (never run; canaried likewise) |

`Options.family` (env FFPA_CUTE_ARCH) forces a family on the device's own target, e.g. "sm80"
runs the mma.sync kernels on an H200. Kernels never query the device; only this module does.
Plans are cached per (problem, target, options): a changed option gives a new plan.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from . import options as _options
from .common.config import DeltaConfig
from .options import Options
from .problem import AttnProblem
from .sm80 import config as sm80_config
from .sm90 import config as sm90_config, fused_config as sm90_fused
from .sm100 import config as sm100_config
from .sm120 import config as sm120_config

MIN_HEAD_DIM, MAX_HEAD_DIM = 264, 1024
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y / gridDim.z
TILE_ROWS = 64  # query rows per tile of the WGMMA kernel: the GQA packing rule counts these

TARGETS = {(8, 0): "sm_80", (8, 6): "sm_86", (8, 7): "sm_87", (8, 9): "sm_89", (9, 0): "sm_90a",
           (10, 0): "sm_100a", (12, 0): "sm_120a", (12, 1): "sm_121a"}
FAMILY_OF_TARGET = {"sm_80": "sm80", "sm_86": "sm80", "sm_87": "sm80", "sm_89": "sm80",
                    "sm_90a": "sm90", "sm_100a": "sm100", "sm_120a": "sm120", "sm_121a": "sm120"}
DTYPE_CLASS = {"bf16": "16bit", "fp16": "16bit", "e4m3": "fp8", "e5m2": "fp8", "nvfp4": "fp4"}
PLAN_CACHES = []  # other modules' cached plans (launch's widened forward): clear_plans' too


# ------------------------------------------------------------------------------ planners
def _no_varlen(p: AttnProblem, family: str, sixteen_bit: bool = False):
    """Raise (the planners' "cannot run it") for a one-launch varlen problem in a family whose
    kernels (`sixteen_bit`: but its 16-bit ones) take no cu_seqlens: a call per sequence."""
    if p.varlen and not (sixteen_bit and p.dtype in ("bf16", "fp16")):
        raise ValueError(f"the {family} kernels have no one-launch varlen form")


def _sm80_fwd(p: AttnProblem, target: str, opts: Options):
    """The Split-D forward, 16-bit (one-launch varlen too) or (sm_89 and up) e4m3."""
    _no_varlen(p, "Split-D FP8 / NVFP4", sixteen_bit=True)
    return sm80_config.plan_fwd(p, target)


def _sm80_bwd(p: AttnProblem, target: str, opts: Options):
    """The Split-D dQ / dK / dV: the sm80 family's backward, and (compile-verified only,
    canaried on first use: selfcheck.bwd_reason) the sm120 family's."""
    _no_varlen(p, "Split-D", sixteen_bit=True)
    return [sm80_config.plan_bwd(kind, p, target) for kind in ("dq", "dk", "dv")]


def _sm90_fwd(p: AttnProblem, target: str, opts: Options):
    """The WGMMA kernel where it builds (every 16-bit D in [264, 1024]), else (Dv == D) the
    Split-D kernel on sm_90a."""
    try:
        return sm90_config.plan_fwd(p, target, kv_pair=opts.kv_pair,
                                    persistent=opts.persistent, shared=True, tuned=True)
    except ValueError:
        if p.head_dim_v != p.head_dim:
            raise  # Split-D needs Dv == D
        return _sm80_fwd(p, target, opts)


def _sm90_bwd(p: AttnProblem, target: str, opts: Options):
    """The fused kernel when not `deterministic`, where it builds and measured faster, else the
    WGMMA dQ / dK / dV where they build, else (Dv == D) the Split-D backward."""
    try:
        if not opts.deterministic and sm90_fused.fused_pays(p):
            with contextlib.suppress(ValueError):  # where it does not build: the others
                return [sm90_fused.plan_bwd_fused(p, target)]
        return sm90_config.plan_bwd(p, target, kv_pair=opts.kv_pair)
    except ValueError:
        if p.head_dim_v != p.head_dim:
            raise
        return _sm80_bwd(p, target, opts)


def _sm90_fp8_fwd(p: AttnProblem, target: str, opts: Options):
    """The WGMMA forward with e4m3 operands (D a multiple of 16: the Split-D FP8 kernel would
    need the same)."""
    return sm90_config.plan_fwd(p, target, kv_pair=opts.kv_pair, tuned=True)


def _sm90_decode(p: AttnProblem, target: str, page_rows: int | None, kv_dtype: str | None):
    """The split-KV decode kernel (a packed cache problem, causal for a chunk; pages of
    page_rows; an FP8 cache under 16-bit queries with kv_dtype "e4m3")."""
    return sm90_config.plan_decode(p, target, page_rows, kv_dtype)


def _sm100_fwd(p: AttnProblem, target: str, opts: Options):
    """The tcgen05 forward: 16-bit (window, sinks, one-launch varlen), e4m3 or NVFP4."""
    return sm100_config.plan_fwd(p, target)


def _sm100_bwd(p: AttnProblem, target: str, opts: Options):
    """The tcgen05 dQ / dK / dV (16-bit; window, sinks through the LSE, one-launch varlen)."""
    return sm100_config.plan_bwd(p, target)


def _sm120_fwd(p: AttnProblem, target: str, opts: Options):
    """The Split-D forward under 99 KB (one-launch varlen at 16 bits, as the sm80 family's)."""
    _no_varlen(p, "sm120 FP8 / NVFP4", sixteen_bit=True)
    return sm120_config.plan_fwd(p, target)


@dataclass(frozen=True)
class Family:
    """One kernel family: its planners per direction and dtype class (None: no kernel yet; the
    split-KV decode kernel is a direction of its own, `plan_decode`), what has been verified of
    it (shown by `explain()` and the README), and the compile targets its kernels have run on
    (elsewhere each configuration passes a canary first: selfcheck.py; the decode kernel has
    no canary, so it serves only those targets)."""

    name: str
    kernels: str
    verified: str
    fwd: dict[str, Callable | None]
    bwd: dict[str, Callable | None]
    verified_targets: tuple[str, ...] = ()
    decode: dict[str, Callable | None] = dataclasses.field(default_factory=dict)


FAMILIES = {
    "sm80": Family("sm80", "ffpa_cute/sm80: mma.sync Split-D",
                   "run and tested on an H200 (compiled for sm_90a)",
                   fwd={"16bit": _sm80_fwd, "fp8": _sm80_fwd}, bwd={"16bit": _sm80_bwd},
                   verified_targets=("sm_90a",)),
    "sm90": Family("sm90", "ffpa_cute/sm90: warp-specialised WGMMA + TMA",
                   "run and tested on an H200",
                   fwd={"16bit": _sm90_fwd, "fp8": _sm90_fp8_fwd}, bwd={"16bit": _sm90_bwd},
                   verified_targets=("sm_90a",), decode={"16bit": _sm90_decode}),
    "sm100": Family("sm100", "ffpa_cute/sm100: tcgen05 + TMEM forward and dQ / dK / dV",
                    "compile-verified only, never run",
                    fwd={"16bit": _sm100_fwd, "fp8": _sm100_fwd, "fp4": _sm100_fwd},
                    bwd={"16bit": _sm100_bwd}),
    "sm120": Family("sm120", "ffpa_cute/sm120: the Split-D kernels under a 99 KB plan",
                    "compile-verified only, never run",
                    fwd={"16bit": _sm120_fwd, "fp8": _sm120_fwd, "fp4": _sm120_fwd},
                    bwd={"16bit": _sm80_bwd}),
}


# ------------------------------------------------------------------------------ devices
def target_of(major: int, minor: int) -> str | None:
    """cutlass-dsl compile target for a compute capability (None: no family serves it)."""
    return TARGETS.get((major, minor))


def family_of_target(target: str) -> str | None:
    return FAMILY_OF_TARGET.get(target)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def current_arch(device: torch.device | None = None) -> str:
    """Compile target of `device` (default: the current CUDA device), e.g. "sm_90a"."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    major, minor = _capability(index)
    return target_of(major, minor) or f"sm_{major}{minor}"


def kernel_class(cfg) -> type:
    """The kernel class a config compiles (`cfg.KERNEL` = "module:Class", imported on use)."""
    return _import(cfg.KERNEL)


@functools.lru_cache(maxsize=None)
def _import(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


# ------------------------------------------------------------------------------ plans
@dataclass(frozen=True)
class Plan:
    """What would run for a problem: a kernel config, or the reason it goes to SDPA."""

    problem: AttnProblem
    target: str | None = None
    family: str | None = None
    cfg: Any = None
    reason: str | None = None
    packed: bool = False  # cfg runs `packed_problem(problem)`: query heads packed into rows

    @property
    def kernel_cls(self):
        return kernel_class(self.cfg)

    def describe(self) -> str:
        if self.reason is not None:
            return f"torch SDPA fallback: {self.reason}"
        pack = " (query heads of each KV head packed into the rows)" if self.packed else ""
        return (f"{self.kernel_cls.__name__} for {self.target}{pack} ({self.family} family: "
                f"{FAMILIES[self.family].verified}): {self.cfg}")


@dataclass(frozen=True)
class BwdPlan:
    """The backward's kernels for a problem (`cfgs`: Delta first, then dQ, dK, dV), or why the
    backward recomputes through SDPA instead."""

    problem: AttnProblem
    target: str | None = None
    family: str | None = None
    cfgs: tuple = ()
    reason: str | None = None

    @property
    def jobs(self) -> list[tuple[type, Any]]:
        """(kernel class, config) pairs: what `launch.run_bwd` runs and precompile compiles."""
        return [(kernel_class(c), c) for c in self.cfgs]


def feature_reason(p: AttnProblem) -> str | None:
    """The first semantic of `p` that no kernel implements yet (a dense mask, dropout), else
    None. `interface` checks it again after planning, so these never reach a kernel whatever a
    planner says. (A sliding window and sinks: every family's forward kernels have them, 16-bit,
    e4m3 and NVFP4.)"""
    if p.has_mask:
        return "a dense attn_mask has no kernel yet (causal and causal bias objects do)"
    if p.dropout_p > 0.0:
        return "dropout_p > 0 has no kernel yet"
    return None


def problem_reason(p: AttnProblem) -> str | None:
    """Reasons no kernel family covers a problem, whatever the GPU."""
    if p.device_type != "cuda":
        return f"tensors on {p.device_type}: the kernels run on CUDA devices only"
    if p.dtype not in DTYPE_CLASS:
        return f"dtype {p.dtype} has no kernel (bf16, fp16; e4m3 forward)"
    reason = feature_reason(p)
    if reason is not None:
        return reason
    if p.head_dim <= 256:
        return (f"head_dim={p.head_dim} <= 256: FlashAttention-class kernels (torch SDPA's "
                "flash/cuDNN backends) already cover it")
    if p.batch > MAX_GRID_YZ or p.heads_q > MAX_GRID_YZ:
        return (f"batch={p.batch} or heads={p.heads_q} above {MAX_GRID_YZ}: the kernels put "
                "heads and batch on the grid's y and z axes")
    if p.head_dim % 8 or p.head_dim > MAX_HEAD_DIM or p.head_dim < MIN_HEAD_DIM:
        return (f"head_dim={p.head_dim}: kernels cover multiples of 8 in "
                f"[{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    return None


def packed_problem(p: AttnProblem, opts: Options) -> AttnProblem | None:
    """The same attention with each KV head's G = Hq / Hkv query heads stacked along the query
    rows ([B, Hkv, G * Nq, D], one head per KV head), when that needs fewer row tiles (GQA / MQA
    decode and short queries) and no query row is masked (not causal, or every query sees every
    key; no window) and no row has its head's sink; else None. A reshape on the host: the
    kernels see plain attention."""
    if not opts.pack_gqa or p.has_window or p.has_sinks or p.varlen:
        return None
    g, nq = p.qhead_per_kvhead, p.seqlen_q
    mask_free = not p.causal or p.causal_offset >= p.seqlen_kv - 1
    if g == 1 or not mask_free or -(-g * nq // TILE_ROWS) >= g * -(-nq // TILE_ROWS):
        return None
    return dataclasses.replace(p, heads_q=p.heads_kv, seqlen_q=g * nq, causal=False,
                               causal_offset=0, scale=p.softmax_scale)


def _route(problem: AttnProblem, device, target, opts):
    """(target, family name, reason): where a problem would run, before any planner."""
    reason = problem_reason(problem)
    if reason is not None:
        return None, None, reason
    target = target or current_arch(device)
    family = opts.family
    if family is None:
        family = family_of_target(target)
        if family is None:
            return target, None, f"no kernel family for {target}"
    elif family in ("sm80", "sm90") and target.startswith("sm_12"):
        family = "sm120"  # the Split-D kernels on sm_12x are the sm120 family's
    return target, family, None


def plan_fwd(problem: AttnProblem, device: torch.device | None = None,
             target: str | None = None, opts: Options | None = None) -> Plan:
    """The forward's plan (never raises for "unsupported": the Plan carries the reason).
    `target` defaults to `device`'s, `opts` to `options.current()`."""
    opts = opts or _options.current()
    target, family, reason = _route(problem, device, target, opts)
    if reason is not None:
        return Plan(problem, target, family, reason=reason)
    return _plan_fwd(problem, target, family, opts)


@functools.lru_cache(maxsize=4096)
def _plan_fwd(p: AttnProblem, target: str, family: str, opts: Options) -> Plan:
    planner = FAMILIES[family].fwd.get(DTYPE_CLASS[p.dtype])
    if planner is None:
        return Plan(p, target, family, reason=f"the {family} family has no {p.dtype} forward "
                                              f"kernel yet ({target})")
    packed = packed_problem(p, opts)
    try:
        cfg = planner(packed or p, target, opts)
    except ValueError as e:
        return Plan(p, target, family, reason=f"{family} kernels cannot run it: {e}")
    return Plan(p, target, family, cfg=cfg, packed=packed is not None)


def plan_decode(problem: AttnProblem, page_rows: int | None,
                device: torch.device | None = None, target: str | None = None,
                opts: Options | None = None, kv_dtype: str | None = None) -> Plan:
    """The split-KV decode kernel's plan for a packed cache problem ([B, Hkv, G * Nq] rows
    against each row's cached keys; `causal`: a chunk of each row's last Nq queries;
    `page_rows` the page size, None for a contiguous cache; `kv_dtype` "e4m3" for an FP8 cache
    under the problem's 16-bit queries), or the reason there is none: the sm90 16-bit family on
    a target it was run on."""
    opts = opts or _options.current()
    target, family, reason = _route(problem, device, target, opts)
    if reason is not None:
        return Plan(problem, target, family, reason=reason)
    return _plan_decode(problem, page_rows, target, family, kv_dtype)


@functools.lru_cache(maxsize=1024)
def _plan_decode(p: AttnProblem, page_rows: int | None, target: str, family: str,
                 kv_dtype: str | None = None) -> Plan:
    planner = FAMILIES[family].decode.get(DTYPE_CLASS[p.dtype])
    if planner is None or target not in FAMILIES[family].verified_targets:
        return Plan(p, target, family, reason=f"no decode kernel for {p.dtype} on the {family} "
                    f"family ({target}): the split-KV decode is sm90 (bf16 / fp16, FP8 cache "
                    "under 16-bit queries) only")
    try:
        return Plan(p, target, family, cfg=planner(p, target, page_rows, kv_dtype))
    except ValueError as e:
        return Plan(p, target, family, reason=f"the decode kernel cannot run it: {e}")


def plan_bwd(problem: AttnProblem, device: torch.device | None = None,
             target: str | None = None, opts: Options | None = None) -> BwdPlan:
    """The backward's kernels for a problem whose forward runs a kernel (the same routing), or
    the reason it recomputes through SDPA."""
    opts = _options.for_backward(opts or _options.current())
    fwd = plan_fwd(problem, device, target, opts)
    if fwd.reason is not None:
        return BwdPlan(problem, fwd.target, fwd.family, reason=fwd.reason)
    return _plan_bwd(problem, fwd.target, fwd.family, opts)


@functools.lru_cache(maxsize=4096)
def _plan_bwd(p: AttnProblem, target: str, family: str, opts: Options) -> BwdPlan:
    planner = FAMILIES[family].bwd.get(DTYPE_CLASS[p.dtype])
    if planner is None:
        return BwdPlan(p, target, family, reason=f"no backward kernels for the {family} family"
                                                 f" ({FAMILIES[family].verified})")
    try:
        cfgs = planner(p, target, opts)
    except ValueError as e:
        return BwdPlan(p, target, family, reason=f"{family} backward kernels cannot run it: {e}")
    return BwdPlan(p, target, family, cfgs=(DeltaConfig(target, p.dtype, p.head_dim_v), *cfgs))


def clear_plans() -> None:
    """Forget every cached plan (tests that swap planners), PLAN_CACHES' too."""
    for cached in (_plan_fwd, _plan_bwd, _plan_decode, *PLAN_CACHES):
        cached.cache_clear()


__all__ = ["BwdPlan", "DTYPE_CLASS", "FAMILIES", "FAMILY_OF_TARGET", "Family", "MAX_HEAD_DIM",
           "MIN_HEAD_DIM", "Plan", "TARGETS", "clear_plans", "current_arch", "family_of_target",
           "feature_reason", "kernel_class", "packed_problem", "plan_bwd", "plan_decode", "plan_fwd",
           "problem_reason", "target_of"]
