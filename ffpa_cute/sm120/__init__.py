"""sm_120 family: the Split-D mma.sync kernel under a 99 KB smem budget (compile-verified only)."""

from .config import plan_fwd
from .fwd_sm120 import FFPAFwdSm120

__all__ = ["FFPAFwdSm120", "plan_fwd"]
