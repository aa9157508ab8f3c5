"""Split-D forward for sm_120 / sm_121 (RTX 50xx, RTX PRO 6000 Blackwell, DGX Spark).

Compared with `sm80/fwd_sm80.py`: nothing in the main loop changes. sm_120 has no WGMMA and no
tcgen05, so mma.sync m16n8k16 + ldmatrix + cp.async is its native path; what differs is the
99 KB shared-memory budget, which `config.plan_fwd` applies through the compile target
(`sm_120a`): M8N1's 128-row resident Q does not fit, so D <= 320 also runs M4N2.

Status: **compile-verified only**. We have no sm_120 GPU; CI compiles this kernel for sm_120a
and checks that the PTX holds mma.sync and no local memory. It has never been run.
"""

from __future__ import annotations

from ..sm80.fwd_sm80 import FFPAFwdSm80


class FFPAFwdSm120(FFPAFwdSm80):
    """`FFPAFwdSm80` planned for the 99 KB shared memory of sm_120 (compile-verified only)."""

    arch_family = "sm120"
