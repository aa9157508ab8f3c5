"""Split-D backward for sm_120 / sm_121: the sm80 dV, dQ and dK kernels planned for 99 KB.

Compared with `sm80/bwd_sm80.py`: nothing in the kernels changes (mma.sync m16n8k16 + ldmatrix
+ cp.async is sm_120's native path); `sm80.config.plan_bwd` with an sm_12x target applies the
99 KB shared-memory budget: shallower rings, and M2N4 (tile_m 32) for dQ / dK at D = 512, where
M4N2's row ring does not fit.

Status: **compile-verified only**. We have no sm_120 GPU; tests/test_backward_sm80_compile.py
compiles these kernels for sm_120a and checks that the PTX holds mma.sync and no local memory.
They have never been run.
"""

from __future__ import annotations

from ..problem import AttnProblem
from ..sm80.bwd_sm80 import FFPABwdDKSm80, FFPABwdDQSm80, FFPABwdDVSm80
from ..sm80.config import plan_bwd as _plan_bwd_sm80


class FFPABwdDVSm120(FFPABwdDVSm80):
    """`FFPABwdDVSm80` planned for sm_12x's 99 KB shared memory (compile-verified only)."""

    arch_family = "sm120"


class FFPABwdDQSm120(FFPABwdDQSm80):
    """`FFPABwdDQSm80` planned for sm_12x's 99 KB shared memory (compile-verified only)."""

    arch_family = "sm120"


class FFPABwdDKSm120(FFPABwdDKSm80):
    """`FFPABwdDKSm80` planned for sm_12x's 99 KB shared memory (compile-verified only)."""

    arch_family = "sm120"


KERNELS = {"dv": FFPABwdDVSm120, "dq": FFPABwdDQSm120, "dk": FFPABwdDKSm120}


def plan_bwd(kind: str, problem: AttnProblem, arch: str = "sm_120a",
             warp_layout: str | None = None):
    if not arch.startswith("sm_12"):
        raise ValueError(f"sm120 planner got arch {arch!r}; expected sm_120a or sm_121a")
    return _plan_bwd_sm80(kind, problem, arch, warp_layout)


__all__ = ["FFPABwdDKSm120", "FFPABwdDQSm120", "FFPABwdDVSm120", "KERNELS", "plan_bwd"]
