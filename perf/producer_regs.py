"""Does a producer warp fit beside the sm90 forward's three warpgroups? (issue 20; CPU only)

    python -m perf.producer_regs

The session-15 trace bounds the D=512 forward by the L2 -> SM stream, and its remedy (K / V
multicast over a CTA pair) measured 2x slower with refills driven by the consumers; FA3's
answer is a producer warp that waits on the rings' empty barriers and issues the loads. This
compiles the forward (`FFPAFwdSm90`, sm_90a, bf16, not causal) with one more warp (416
threads, idle) at D 320-512 and reports ptxas's registers and spills, or the registers its
instructions would need when it refuses (C7602): with more than 384 threads the launch gives
each thread at most 128 registers, and every instruction, including an O warpgroup's
m64n256 accumulation, must fit that (setmaxnreg cannot raise what ptxas compiles against).
"""

from __future__ import annotations

import re
import sys

import cutlass.cute as cute

from ffpa_cute.sm90.fwd_sm90 import FFPAFwdSm90
from ffpa_cute.sm90.skeleton_sm90 import WG_THREADS

HEAD_DIMS = (320, 384, 448, 512)


class WithProducerWarp(FFPAFwdSm90):
    """The forward with a fourth, partial warpgroup of one warp that does nothing: the
    register budget a producer warp would leave the three warpgroups."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.num_threads = 3 * WG_THREADS + 32

    @cute.jit
    def _warpgroups(self, ops, scalars, mmas, smem, work, extra, wg, tidx):
        if wg == 0:
            self._score_wg(mmas.s, ops, scalars, smem, work, extra, tidx)
        elif wg == 1:
            self._acc_wg(mmas.o_lo, ops, scalars, smem, 0, work, extra, tidx - WG_THREADS)
        elif wg == 2:
            self._acc_wg(mmas.o_hi, ops, scalars, smem, 1, work, extra, tidx - 2 * WG_THREADS)


def probe(d: int) -> str:
    """ptxas's verdict on the forward at head dim d with the extra warp."""
    from ffpa_cute.sm90.config import plan_fwd
    from ffpa_cute.problem import AttnProblem
    from tests.test_kernels_compile import _ptxas_log

    p = AttnProblem(dtype="bf16", batch=1, heads_q=8, heads_kv=8, seqlen_q=1000,
                    seqlen_kv=1000, head_dim=d, head_dim_v=d, causal=False)
    cfg = plan_fwd(p, "sm_90a")
    try:
        ptx = WithProducerWarp.compile(cfg, options="--keep-ptx").__ptx__
    except Exception as e:  # ptxas refused the PTX: the registers it asked for
        m = re.search(r"Insufficient registers \((\d+)\).*?register target of (\d+)", str(e),
                      re.S)
        return (f"refused: {m.group(1)} registers per thread, an instruction needs {m.group(2)}"
                if m else f"refused: {str(e)[:200]}")
    log = _ptxas_log(ptx, "sm_90a") or ""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return (f"{regs.group(1) if regs else '?'} registers, "
            f"{spills.group(1) if spills else '?'} B of spill stores")


def main() -> int:
    for d in HEAD_DIMS:
        print(f"D={d}: {probe(d)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
