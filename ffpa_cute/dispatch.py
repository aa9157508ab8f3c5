"""The one arch selector: device -> compile target -> kernel family -> config -> launch.

Forward and backward consult the same table (`FAMILY_OF_TARGET`), so they cannot diverge.

| device (major, minor)  | compile target | family (kernels)                                    |
|------------------------|----------------|-----------------------------------------------------|
| 8.0 / 8.6 / 8.7 / 8.9  | sm_80 / ...    | sm80  (mma.sync Split-D)                             |
| 9.0                    | sm_90a         | sm90  (WGMMA + TMA up to SM90_WGMMA_MAX_HEAD_DIM;   |
|                        |                |        above: the sm80 Split-D kernel for sm_90a)   |
| 10.0 exactly           | sm_100a        | sm100 -> no kernels yet: SDPA fallback              |
| 12.0 / 12.1            | sm_120a/121a   | sm120 (compile-verified only, never run)            |

`FFPA_CUTE_ARCH` forces a family ("sm80", "sm90", "sm100", "sm120"), e.g. `FFPA_CUTE_ARCH=sm80`
runs the mma.sync kernels on an H200. The compile target always stays the device's own.
Kernels never query the device; only this module does.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch

from .problem import AttnProblem

FAMILIES = ("sm80", "sm90", "sm100", "sm120")
MIN_HEAD_DIM, MAX_HEAD_DIM = 264, 1024
MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y / gridDim.z


def target_of(major: int, minor: int) -> str | None:
    """cutlass-dsl compile target for a compute capability (None: no family serves it)."""
    if major == 8 and minor in (0, 6, 7, 9):
        return f"sm_8{minor}"
    if (major, minor) == (9, 0):
        return "sm_90a"
    if (major, minor) == (10, 0):
        return "sm_100a"
    if major == 12 and minor in (0, 1):
        return f"sm_12{minor}a"
    return None


def family_of_target(target: str) -> str:
    if target.startswith("sm_8"):
        return "sm80"
    return {"sm_90a": "sm90", "sm_100a": "sm100"}.get(target, "sm120")


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def current_arch(device: torch.device | None = None) -> str:
    """Compile target of `device` (default: the current CUDA device), e.g. "sm_90a"."""
    if device is None or device.index is None:
        index = torch.cuda.current_device()
    else:
        index = device.index
    major, minor = _capability(index)
    return target_of(major, minor) or f"sm_{major}{minor}"


def forced_family() -> str | None:
    v = os.environ.get("FFPA_CUTE_ARCH", "").strip().lower().replace("_", "")
    if not v:
        return None
    if v not in FAMILIES:
        raise ValueError(f"FFPA_CUTE_ARCH={v!r}: accepted values are {', '.join(FAMILIES)}")
    return v


def _kernel_family(family: str):
    """The planner of a family, or None when it has no kernels yet.

    A planner maps (problem, target) to a config; the config's type names its kernel class
    (`kernel_of_config`), so one family may serve different head dims with different kernels.
    """
    if family == "sm80":
        from .sm80 import plan_fwd
        return plan_fwd
    if family == "sm90":
        return _plan_sm90
    if family == "sm120":
        from .sm120 import plan_fwd
        return plan_fwd
    return None


# Head dims the sm90 family sends to the WGMMA kernel (D > 512: O split over two CTAs). Above
# it, and where the WGMMA kernel cannot run a D (D % 16 != 0 above 512): the Split-D mma.sync
# kernel compiled for sm_90a.
SM90_WGMMA_MAX_HEAD_DIM = 1024


def _plan_sm90(problem: AttnProblem, target: str):
    """WGMMA kernel up to SM90_WGMMA_MAX_HEAD_DIM when it can run the problem, else Split-D."""
    from . import sm80, sm90

    if problem.head_dim <= SM90_WGMMA_MAX_HEAD_DIM:
        try:
            return sm90.plan_fwd(problem, target)
        except ValueError:
            if problem.head_dim_v != problem.head_dim:
                raise  # Split-D needs Dv == D
    return sm80.plan_fwd(problem, target)


def kernel_of_config(cfg):
    """The forward kernel class a config compiles (one config dataclass per kernel)."""
    return _kernel_class(type(cfg), cfg.arch.startswith("sm_12"))


@functools.lru_cache(maxsize=None)
def _kernel_class(cfg_type, sm12: bool):
    from . import sm80, sm90, sm120

    if cfg_type is sm90.FwdConfigSm90:
        return sm90.FFPAFwdSm90
    if cfg_type is sm80.FwdConfigSm80:
        # the sm120 family is the Split-D kernel planned for sm_12x's smaller shared memory
        return sm120.FFPAFwdSm120 if sm12 else sm80.FFPAFwdSm80
    raise TypeError(f"no forward kernel compiles a {cfg_type.__name__}")


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
        return kernel_of_config(self.cfg)

    def describe(self) -> str:
        if self.reason is not None:
            return f"torch SDPA fallback: {self.reason}"
        pack = " (query heads of each KV head packed into the rows)" if self.packed else ""
        return f"{self.kernel_cls.__name__} for {self.target}{pack}: {self.cfg}"


TILE_ROWS = 64  # query rows per CTA tile of the WGMMA kernel (Split-D: 32-128); packing's rule

# GQA rows packing (`packed_problem`) and the WGMMA forward's Dv != D (MLA): both passed their
# GPU tests at e1f5101 (H200) and are on. Packing measured 1.4-3x faster at GQA / MQA / MLA
# decode (perf/NOTES.md, session 4). False restores one head per tile / SDPA for Dv != D.
PACK_GQA_ROWS = True
DV_NOT_D_KERNELS = True
# The sm90 backward kernels for Dv != D (dQ / dK with a second score product over Dv, dV
# accumulating Dv columns): GPU-tested at 8dd98be (test_dv_not_d, test_backward_dv_not_d) and
# on. False sends Dv != D backward to the SDPA recompute.
DV_NOT_D_BWD = True


def packed_problem(p: AttnProblem) -> AttnProblem | None:
    """The same attention with each KV head's G = Hq / Hkv query heads stacked along the query
    rows ([B, Hkv, G * Nq, D], one head per KV head), when that needs fewer row tiles (GQA / MQA
    decode and short queries) and no query row is masked (not causal, or every query sees every
    key); else None. A reshape on the host: the kernels see plain attention."""
    if not PACK_GQA_ROWS:
        return None
    g, nq = p.qhead_per_kvhead, p.seqlen_q
    mask_free = not p.causal or p.causal_offset >= p.seqlen_kv - 1
    if g == 1 or not mask_free or -(-g * nq // TILE_ROWS) >= g * -(-nq // TILE_ROWS):
        return None
    return dataclasses.replace(p, heads_q=p.heads_kv, seqlen_q=g * nq, causal=False,
                               causal_offset=0, scale=p.softmax_scale)


def problem_reason(p: AttnProblem) -> str | None:
    """Reasons no kernel family covers a problem, whatever the GPU."""
    if p.device_type != "cuda":
        return f"tensors on {p.device_type}: the kernels run on CUDA devices only"
    if p.dtype not in ("bf16", "fp16"):
        return f"dtype {p.dtype} has no kernel (bf16 and fp16 only)"
    if p.has_mask:
        return "a dense attn_mask has no kernel yet (causal and causal bias objects do)"
    if p.dropout_p > 0.0:
        return "dropout_p > 0 has no kernel yet"
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


@functools.lru_cache(maxsize=4096)
def _plan_cached(p: AttnProblem, target: str, family: str) -> Plan:
    fam = _kernel_family(family)
    if fam is None:
        return Plan(p, target, family, reason=f"{family} has no kernel family yet ({target})")
    packed = packed_problem(p)
    try:
        cfg = fam(packed or p, target)
    except ValueError as e:
        return Plan(p, target, family, reason=f"{family} kernels cannot run it: {e}")
    return Plan(p, target, family, cfg=cfg, packed=packed is not None)


def plan_fwd(problem: AttnProblem, device: torch.device | None = None,
             target: str | None = None) -> Plan:
    """Never raises for "unsupported": the Plan carries the reason instead."""
    reason = problem_reason(problem)
    if reason is not None:
        return Plan(problem, reason=reason)
    target = target or current_arch(device)
    family = forced_family()
    if family is None:
        if target_of(*_parse(target)) is None:
            return Plan(problem, target, reason=f"no kernel family for {target}")
        family = family_of_target(target)
    if problem.head_dim_v != problem.head_dim and not DV_NOT_D_KERNELS:
        return Plan(problem, target, family,
                    reason=f"head_dim_v={problem.head_dim_v} != head_dim={problem.head_dim}: "
                           "the WGMMA kernel's Dv != D mode awaits its GPU tests "
                           "(DV_NOT_D_KERNELS)")
    if problem.head_dim_v != problem.head_dim and (family != "sm90"
                                                   or target.startswith("sm_12")):
        return Plan(problem, target, family,
                    reason=f"head_dim_v={problem.head_dim_v} != head_dim={problem.head_dim}: "
                           "only the sm90 WGMMA kernel takes Dv != D (MLA); Split-D needs equal")
    if family in ("sm80", "sm90") and target.startswith("sm_12"):
        family = "sm120"  # the Split-D kernel on sm_12x is the sm120 subclass
    return _plan_cached(problem, target, family)


def _parse(target: str) -> tuple[int, int]:
    digits = target[3:].rstrip("a")
    return int(digits[:-1]), int(digits[-1])


def _kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """The kernels need unit stride on D, 16-byte aligned rows: copy only when that fails.

    A clone, not `.contiguous()`: a contiguous view at a misaligned offset would come back as is.
    """
    elems = 16 // t.element_size()
    if (t.stride(-1) != 1 or t.data_ptr() % 16
            or any(s % elems for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)):
        return t.clone(memory_format=torch.contiguous_format)
    return t


def run_fwd(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Run a kernel plan: returns (out [B, Hq, Nq, Dv] in q.dtype, lse [B, Hq, Nq] fp32)."""
    if plan.reason is not None:
        raise NotImplementedError(plan.reason)
    from .cache import jit_cache
    from .common.tensors import current_stream_handle

    p = plan.problem
    b, hq, nq, _ = q.shape
    out = torch.empty(b, hq, nq, p.head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if k.shape[2] == 0:  # no keys at all: every row is empty
        return out.zero_(), lse.fill_(float("-inf"))
    cls = plan.kernel_cls
    fn = jit_cache().get(cls, plan.cfg)
    stream = current_stream_handle(q.device)
    (q, k, v, qo, lo), offset = kernel_args(plan, _kernel_ready(q), k, v, out, lse)
    cls.launch(fn, _kernel_ready(q), _kernel_ready(k), _kernel_ready(v), qo, lo,
               p.softmax_scale, offset, stream)
    return out, lse


def kernel_args(plan: Plan, q, k, v, out, lse):
    """((q, k, v, o, lse) as the kernel sees them, causal offset) for a plan's call. Packed
    plans see [B, Hkv, G * Nq, .]: views of out / lse, and of q where its strides allow (a copy
    otherwise, which `_kernel_ready` then keeps), with no causal offset (no row is masked)."""
    if not plan.packed:
        return (q, k, v, out, lse), plan.problem.causal_offset
    b, hkv = out.shape[0], k.shape[1]
    return ((q.reshape(b, hkv, -1, q.shape[-1]), k, v, out.view(b, hkv, -1, out.shape[-1]),
             lse.view(b, hkv, -1)), 0)


# The per-signature launcher below for repeated no-grad calls: GPU-tested at 8dd98be
# (test_repeated_calls_take_the_fast_path) and on; host overhead of a cached call 70 -> 36 µs
# on the H200 (perf/NOTES.md, session 5). False sends every call through `run_fwd`.
FAST_LAUNCH = True


class FwdCall:
    """`run_fwd` for one call signature (plan, shapes, strides, dtype, device): what does not
    depend on the data pointers is decided once, so a repeated call allocates out / lse, writes
    five pointers and the stream, and launches (the per-signature fast path of `attention()`).

    `__call__` returns None whenever the general `run_fwd` must take the call: a misaligned
    data pointer, a layout that `_kernel_ready` would copy, an empty problem, the first calls
    of a kernel (before its `DirectLaunch` check passed), or another device being current.
    Per thread (the argument storage is written before each launch).
    """

    def __init__(self, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        import threading

        p = plan.problem
        b, hq, nq, _ = q.shape
        self.plan, self.dtype, self.device = plan, q.dtype, q.device
        self.out_shape, self.lse_shape = (b, hq, nq, p.head_dim_v), (b, hq, nq)
        ready = all(_kernel_ready(t) is t for t in (q, k, v))
        if plan.packed:
            packed_q = q.reshape(b, k.shape[1], -1, q.shape[-1])
            ready = ready and packed_q.data_ptr() == q.data_ptr() and (
                _kernel_ready(packed_q) is packed_q)
        self.usable = (plan.reason is None and ready and b * hq * nq > 0 and k.shape[2] > 0
                       and q.device.type == "cuda")
        self._tls = threading.local()

    def _direct(self, q, k, v, out, lse):
        """This thread's `DirectLaunch` with the signature's shapes and strides, once the
        kernel's argument layout has been checked; else None."""
        from .cache import jit_cache
        from .common import tensors

        direct = getattr(self._tls, "direct", None)
        if direct is None:
            fn = jit_cache().get(self.plan.kernel_cls, self.plan.cfg)
            if not tensors.direct_launch_ok(fn):
                return None
            direct = tensors.DirectLaunch(fn, 5, [4, 4, 4, 4, 3])
            tensors_, offset = kernel_args(self.plan, q, k, v, out, lse)
            direct.set(tensors_, self.plan.problem.softmax_scale, offset, 0)
            self._tls.direct = direct
        return direct

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(out, lse), or None: the general path takes this call."""
        from .common.tensors import current_stream_handle

        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if (not self.usable or (ptrs[0] | ptrs[1] | ptrs[2]) % 16
                or torch.cuda.current_device() != self.device.index):
            return None
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        direct = self._direct(q, k, v, out, lse)
        if direct is None:
            return None
        direct.launch_pointers((*ptrs, out.data_ptr(), lse.data_ptr()),
                               current_stream_handle(self.device))
        return out, lse


# Backward kernel families that replace the SDPA recompute, each added only after its GPU grid
# passed on the H200 (tests/test_backward_sm90_gpu.py, tests/test_backward_sm80_gpu.py):
#   sm90: WGMMA dQ / dK / dV (ffpa_cute/sm90/bwd_sm90.py), D <= 1024 (two CTAs above 512);
#   sm80: Split-D mma.sync dQ / dK / dV (ffpa_cute/sm80/bwd_sm80.py), D up to 1024; it also serves
#         the sm90 family where the WGMMA backward does not (D % 16 != 0 above 512; compiled
#         for sm_90a).
# sm120 (the sm80 kernels' subclass) is compile-verified only and never enabled.
BWD_KERNEL_FAMILIES: frozenset[str] = frozenset({"sm90", "sm80"})


def bwd_family(problem: AttnProblem, device: torch.device | None = None,
               target: str | None = None) -> tuple[str | None, str]:
    """(family, "") of the backward kernels that serve `problem`, else (None, why not)."""
    plan = plan_fwd(problem, device, target)
    if plan.reason is not None:
        return None, plan.reason
    if problem.head_dim_v != problem.head_dim and (plan.family != "sm90"
                                                   or not DV_NOT_D_BWD):
        return None, ("head_dim_v != head_dim: only the sm90 WGMMA backward takes it "
                      "(dispatch.DV_NOT_D_BWD is off)")
    if plan.target.startswith("sm_12") or plan.family not in ("sm80", "sm90"):
        return None, f"no backward kernels for the {plan.family} family"
    why = []
    if plan.family == "sm90":
        from .sm90 import bwd_sm90

        try:
            bwd_sm90.plan_dq(problem)
            bwd_sm90.plan_dv(problem)
            if "sm90" in BWD_KERNEL_FAMILIES:
                return "sm90", ""
            why.append("sm90 backward kernels not enabled (BWD_KERNEL_FAMILIES)")
        except ValueError as e:
            why.append(f"sm90 backward kernels cannot run it: {e}")
    from .sm80.config import plan_bwd as plan_bwd_sm80

    try:
        for kind in ("dv", "dq", "dk"):
            plan_bwd_sm80(kind, problem, plan.target)
        if "sm80" in BWD_KERNEL_FAMILIES:
            return "sm80", ""
        why.append("Split-D backward kernels not enabled (BWD_KERNEL_FAMILIES)")
    except ValueError as e:
        why.append(f"Split-D backward kernels cannot run it: {e}")
    return None, "; ".join(why)


def bwd_reason(problem: AttnProblem, device: torch.device | None = None,
               target: str | None = None) -> str | None:
    """None when backward kernels serve `problem` (same routing table as the forward)."""
    if not BWD_KERNEL_FAMILIES:
        return "backward kernels not enabled (BWD_KERNEL_FAMILIES is empty)"
    return bwd_family(problem, device, target)[1] or None


def bwd_kernels(problem: AttnProblem, device: torch.device | None = None,
                target: str | None = None) -> list[tuple[type, Any]]:
    """The (kernel class, config) pairs `run_bwd` compiles for `problem` (none when no
    backward kernel serves it): what `precompile --backward` fills the cache with."""
    family, _ = bwd_family(problem, device, target)
    if family is None:
        return []
    arch = plan_fwd(problem, device, target).target
    delta = []
    if FUSED_DELTA:
        from .common.delta import DeltaConfig, RowDot

        delta = [(RowDot, DeltaConfig(arch, problem.dtype, problem.head_dim_v))]
    if family == "sm90":
        from .sm90 import bwd_sm90 as b

        if _dkdv_pair(problem):
            from .sm90 import bwd_pair_sm90 as bp

            return [(b.FFPABwdDQSm90, b.plan_dq(problem)),
                    (bp.FFPABwdPairSm90, bp.plan_pair(problem)), *delta]
        return [(b.FFPABwdDQSm90, b.plan_dq(problem)), (b.FFPABwdDKSm90, b.plan_dk(problem)),
                (b.FFPABwdDVSm90, b.plan_dv(problem)), *delta]
    from .sm80.bwd_sm80 import kernel_class
    from .sm80.config import plan_bwd

    return [(kernel_class(kind, arch), plan_bwd(kind, problem, arch))
            for kind in ("dq", "dk", "dv")] + delta


# dK and dV of the sm90 family by one 2-CTA cluster that computes S^T once per block and sends
# P^T to the dK CTA (ffpa_cute/sm90/bwd_pair_sm90.py: 4 GEMM units where the dK and dV kernels
# execute 5); D <= 512 with Dv == D. GPU-tested (test_dkdv_pair) but off: measured no faster
# (D=512 25.5 vs 26.1 ms, D=320 22.9 vs 19.9; perf/NOTES.md session 6).
DKDV_PAIR = False


def _dkdv_pair(problem: AttnProblem) -> bool:
    """Whether the dK + dV pair serves `problem` (`DKDV_PAIR` on and its planner takes it)."""
    if not DKDV_PAIR:
        return False
    from .sm90 import bwd_pair_sm90

    try:
        bwd_pair_sm90.plan_pair(problem)
    except ValueError:
        return False
    return True


# Delta = rowsum(dO * O) by one kernel pass (`common/delta.py`) instead of torch's two fp32
# copies of [B, H, N, D]: 1.31 -> 0.24 ms and no 1 GB of temporaries at B=1, H=32, N=8K,
# D=512 (backward 238 -> 245 TFLOPS). GPU-tested at 8dd98be (test_fused_delta) and on.
FUSED_DELTA = True


def _delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Delta [B, H, N] fp32 = rowsum(dout * out) (`FUSED_DELTA`: one kernel pass)."""
    if FUSED_DELTA:
        from .common.delta import run_delta

        return run_delta(_kernel_ready(dout), _kernel_ready(out))
    return (dout.float() * out.float()).sum(-1)


def run_bwd(problem: AttnProblem, q, k, v, out, lse, dout):
    """(dq, dk, dv) from the backward kernels; the caller checked `bwd_reason` is None."""
    family, why = bwd_family(problem, q.device)
    if family is None:
        raise NotImplementedError(why)
    q, k, v, dout = (_kernel_ready(t) for t in (q, k, v, dout))
    delta = _delta(dout, out)
    if family == "sm80":
        from .sm80.bwd_sm80 import run_bwd_sm80

        return run_bwd_sm80(problem, q, k, v, out, lse, dout, delta,
                            arch=plan_fwd(problem, q.device).target)
    from .sm90 import bwd_sm90

    args = (problem.softmax_scale, problem.causal, problem.causal_offset)
    dq = bwd_sm90.run_dq(q, k, v, dout, lse, delta, *args)
    if _dkdv_pair(problem):
        from .sm90.bwd_pair_sm90 import run_dkdv

        dk, dv = run_dkdv(q, k, v, dout, lse, delta, *args)
    else:
        dk = bwd_sm90.run_dk(q, k, v, dout, lse, delta, *args)
        dv = bwd_sm90.run_dv(q, k, dout, lse, *args)
    return dq, dk, dv
