"""Hopper (sm_90a) kernels: warp-specialised WGMMA + TMA.

config.py         compile keys and planners of every kernel here (imports no cutlass)
skeleton_sm90.py  the warp-specialised ring every kernel here runs on (`RingSkeletonSm90`)
fwd_sm90.py       the forward, D 264-1024 (O split over a 2-CTA cluster above 512), and FP8
bwd_sm90.py       the dV, dQ and dK kernels, siblings of the forward on the ring

Run and tested on the H200 (docs/design.md has the designs and numbers, docs/verification.md
how they are verified). Importing this package loads no kernel module: the planners name their
kernel classes (`cfg.KERNEL`), and those load on first use.
"""
