"""mma.sync Split-D kernels for sm_80/86/89 (verified on the H200, which also runs them)."""

from .config import FwdConfigSm80, can_implement, plan_fwd
from .fwd_sm80 import FFPAFwdSm80

__all__ = ["FFPAFwdSm80", "FwdConfigSm80", "can_implement", "plan_fwd"]
