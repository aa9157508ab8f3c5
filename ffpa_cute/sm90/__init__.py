"""Hopper (sm_90a) kernels: warp-specialised WGMMA + TMA.

The forward (D up to 1024; O split over two CTAs above 512, the pair splitting the KV blocks:
`kv_pair`, config.KV_PAIR) and the backward kernels (bwd_sm90.py: dV, dQ, dK, D up to 1024) are
run and tested on the H200 (perf/NOTES.md). The dK + dV pair (bwd_pair_sm90.py) is
run and tested on the H200 too, and off (`dispatch.DKDV_PAIR`: measured no faster).
"""

from .config import FwdConfigSm90, can_implement, plan_fwd
from .fwd_sm90 import FFPAFwdSm90

__all__ = ["FFPAFwdSm90", "FwdConfigSm90", "can_implement", "plan_fwd"]
