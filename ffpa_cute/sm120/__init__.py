"""sm_120 / sm_121 (RTX 50-series, RTX PRO 6000 Blackwell, DGX Spark): the sm80 family's
mma.sync Split-D kernels planned for sm_12x's 99 KB of shared memory (config.py).

sm_120 has no WGMMA and no tcgen05, so mma.sync m16n8k16 + ldmatrix + cp.async is its native
path; nothing in the kernels changes, the compile target sets the smem budget (shallower rings,
M4N2 where M8N1's 128-row Q does not fit). **Compile-verified only, never run**: there is no
sm_120 GPU here; CI compiles these kernels for sm_120a and checks the PTX. The backward kernels
compile for sm_120a too but the family does not route to them: a never-run backward stays off.
"""
