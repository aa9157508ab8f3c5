"""Planners of the sm120 family: the sm80 Split-D configs under sm_12x's 99 KB budget.

`plan_fwd` / `plan_bwd` are the sm80 planners with the target checked: the budget itself comes
from the target (`sm80.config.SMEM_CAPACITY`), so a config planned here differs from the sm_80
one only where 99 KB forces it (ring depth, warp layout). Compile-verified only, never run.
"""

from __future__ import annotations

from ..problem import AttnProblem
from ..sm80 import config as sm80_config


def _check(arch: str) -> None:
    if not arch.startswith("sm_12"):
        raise ValueError(f"sm120 planner got arch {arch!r}; expected sm_120a or sm_121a")


def plan_fwd(problem: AttnProblem, arch: str = "sm_120a", warp_layout: str | None = None):
    _check(arch)
    return sm80_config.plan_fwd(problem, arch, warp_layout)


def plan_bwd(kind: str, problem: AttnProblem, arch: str = "sm_120a",
             warp_layout: str | None = None):
    _check(arch)
    return sm80_config.plan_bwd(kind, problem, arch, warp_layout)


__all__ = ["plan_bwd", "plan_fwd"]
