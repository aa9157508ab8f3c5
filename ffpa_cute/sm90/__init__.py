"""Hopper (sm_90a) kernels: warp-specialised WGMMA + TMA.

The forward (D up to 1024; O split over two CTAs above 512) and the backward kernels
(bwd_sm90.py: dV, dQ, dK, D up to 1024) are run and tested on the H200 (perf/NOTES.md). The
forward's `kv_pair` mode (config.KV_PAIR) is compile-verified only and off.
"""

from .config import FwdConfigSm90, can_implement, plan_fwd
from .fwd_sm90 import FFPAFwdSm90

__all__ = ["FFPAFwdSm90", "FwdConfigSm90", "can_implement", "plan_fwd"]
