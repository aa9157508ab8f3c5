"""Hopper (sm_90a) kernels: warp-specialised WGMMA + TMA.

The forward (D <= 512) is run and tested on the H200; its D > 512 mode (O split over two CTAs)
and the backward kernels (bwd_sm90.py: dV, dQ, dK) are compile-verified only (perf/NOTES.md).
"""

from .config import FwdConfigSm90, can_implement, plan_fwd
from .fwd_sm90 import FFPAFwdSm90

__all__ = ["FFPAFwdSm90", "FwdConfigSm90", "can_implement", "plan_fwd"]
