"""Planner for sm_120: the sm80 Split-D config under sm_120's 99 KB shared-memory budget."""

from __future__ import annotations

from ..problem import AttnProblem
from ..sm80.config import FwdConfigSm80, can_implement
from ..sm80.config import plan_fwd as _plan_fwd_sm80

__all__ = ["FwdConfigSm80", "can_implement", "plan_fwd"]


def plan_fwd(problem: AttnProblem, arch: str = "sm_120a",
             warp_layout: str | None = None) -> FwdConfigSm80:
    if not arch.startswith("sm_12"):
        raise ValueError(f"sm120 planner got arch {arch!r}; expected sm_120a or sm_121a")
    return _plan_fwd_sm80(problem, arch, warp_layout)
