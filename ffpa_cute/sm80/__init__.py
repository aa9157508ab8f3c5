"""mma.sync Split-D kernels (sm_80 / 86 / 89; also compiled for sm_90a and sm_120a).

config.py     compile keys and planners (imports no cutlass)
fwd_sm80.py   the forward, D 264-1024, M8N1 / M4N2 / M2N4 warp layouts
bwd_sm80.py   the dV, dQ and dK kernels on the forward's skeleton

Run and tested on the H200 (compiled for sm_90a). Importing this package loads no kernel
module: configs name their kernel classes (`cfg.KERNEL`), which load on first use.
"""
