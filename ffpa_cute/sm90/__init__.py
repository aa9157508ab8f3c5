"""Hopper (sm_90a) kernels: warp-specialised WGMMA + TMA (verified on the H200)."""

from .config import FwdConfigSm90, can_implement, plan_fwd
from .fwd_sm90 import FFPAFwdSm90

__all__ = ["FFPAFwdSm90", "FwdConfigSm90", "can_implement", "plan_fwd"]
