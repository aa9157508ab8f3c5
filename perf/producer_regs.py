"""Does a producer warpgroup fit beside the sm90 forward's three warpgroups? (issue 20)

    python -m perf.producer_regs                    # CPU: ptxas's registers / spills per variant
    python -m perf.producer_regs --precompile DIR   # CPU: compile the timed variants into DIR
    python -m perf.producer_regs --time [--out F]   # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

The session-15 trace bounds the D=512 forward by the L2 -> SM stream, and its remedy (K / V
multicast over a CTA pair) measured 2x slower with refills driven by the consumers; FA3's
answer is a producer that waits on the rings' empty barriers and issues the loads. With more
than 384 threads the launch gives each thread at most 128 registers, and ptxas compiles every
instruction against that number: `setmaxnreg` moves registers between warpgroups at run time
and lets a warpgroup's code hold more values in total, but no single instruction may need more
than the launch's count. So an O warpgroup's m64n256 accumulation (128 fp32 registers plus its
operands: ptxas asks for 154) cannot compile beside a fourth warpgroup (`WithProducerWarp`:
refused at D=448 and 512). Issued as two m64n128 WGMMAs per k-step (the same accumulator
registers and the same sums per column, each instruction needing 64 of them) it does:
`ProducerIdle` (512 threads; `setmaxnreg` S 152, O 168 + 168, the fourth warpgroup 24 and idle)
compiles at D=512 with 0 spills. Variants (the 16-bit forward, sm_90a, bf16, not causal):

  WithProducerWarp  the forward plus one idle warp (416 threads), m64n{share} PV as planned;
  SplitO            the forward with each O share a multiple of 128 wider than 128 issued as
                    m64n128 WGMMAs (384 threads): what the split itself costs;
  ProducerIdle      SplitO with a fourth, idle warpgroup and the registers moved by
                    `setmaxnreg`: what the producer's register budget costs the consumers.

`--time` runs the plan, SplitO and ProducerIdle on the same inputs (`launch.run_fwd`, L2
flushed, interleaved rounds; B=1, H=32, N=8K) at D=384 / 448 / 512 and checks their out / lse
against the plan's bits (each column is the same sequence of k-steps). Prediction: SplitO reads
P (A) twice from smem per k-step (12 KB against 10 KB per 64 x 256 x 16 MACs) and issues twice
the PV instructions: 0 to -3% at D=512 / 448, 0 at 384 (no share is split there);
ProducerIdle: the S warpgroup at 152 registers (0 spills) and an idle warpgroup: 0 +- 2%. If
both hold, a producer warpgroup (then multicast K / V over a CTA pair) can be built on the
split accumulation. Measured (H100, perf-log 2026-12-06; plan / split / producer, TFLOPS, the
same bits): D=512 536 / 543 / 534, 448 524 / 533 / 517, 384 554 / 564 / 509 (at 384 split is
the plan's kernel: its +2% is the rounds' order). The split costs nothing; the producer's
budget 0.4% at 512, 1.3% at 448, 8% at 384.
"""

from __future__ import annotations

import dataclasses
import re
import sys

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32

from ffpa_cute.sm90.fwd_sm90 import FFPAFwdSm90
from ffpa_cute.sm90.skeleton_sm90 import WG_THREADS
from perf import experiment

HEAD_DIMS = (320, 384, 448, 512)
TIMED_HEAD_DIMS = (384, 448, 512)
# setmaxnreg with four warpgroups: S, O lo, O hi, the producer (sum 512 x 128 = the 64K file)
S_REGS, O_REGS, P_REGS = 152, 168, 24
ATOM_N = 128   # the split PV WGMMA's N


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


class SplitO(FFPAFwdSm90):
    """The forward with each O share that is a multiple of ATOM_N wider than ATOM_N issued
    as m64n{ATOM_N} WGMMAs (the tiled MMA repeats the atom along N)."""

    def _mma(self, n: int, b_major):
        if (b_major == cute.nvgpu.OperandMajorMode.MN and n > ATOM_N and n % ATOM_N == 0):
            return sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, b_major, Float32,
                (1, 1, 1), (self.cfg.tile_m, ATOM_N))
        return super()._mma(n, b_major)


class ProducerIdle(SplitO):
    """SplitO with a fourth warpgroup that only gives its registers back (`setmaxnreg`): the
    budget a producer warpgroup leaves the consumers."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.num_threads = 4 * WG_THREADS

    @cute.jit
    def _warpgroups(self, ops, scalars, mmas, smem, work, extra, wg, tidx):
        if wg == 0:
            cute.arch.warpgroup_reg_alloc(S_REGS)
            self._score_wg(mmas.s, ops, scalars, smem, work, extra, tidx)
        elif wg == 1:
            cute.arch.warpgroup_reg_alloc(O_REGS)
            self._acc_wg(mmas.o_lo, ops, scalars, smem, 0, work, extra, tidx - WG_THREADS)
        elif wg == 2:
            cute.arch.warpgroup_reg_alloc(O_REGS)
            self._acc_wg(mmas.o_hi, ops, scalars, smem, 1, work, extra, tidx - 2 * WG_THREADS)
        else:
            cute.arch.warpgroup_reg_dealloc(P_REGS)


def _cfg(d: int):
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.sm90.config import plan_fwd

    p = AttnProblem(dtype="bf16", batch=1, heads_q=8, heads_kv=8, seqlen_q=1000,
                    seqlen_kv=1000, head_dim=d, head_dim_v=d, causal=False)
    return plan_fwd(p, "sm_90a")


def probe(cls, d: int) -> str:
    """ptxas's verdict on `cls` at head dim d: registers and spills, or what it refused."""
    try:
        ptx = cls.compile(_cfg(d), options="--keep-ptx").__ptx__
    except Exception as e:  # ptxas refused the PTX: the registers it asked for
        m = re.search(r"Insufficient registers \((\d+)\).*?register target of (\d+)", str(e),
                      re.S)
        return (f"refused: {m.group(1)} registers per thread, an instruction needs {m.group(2)}"
                if m else f"refused: {str(e)[:200]}")
    return experiment.ptxas_summary(ptx)


def _with_kernel(plan, cls):
    """`plan` run by the kernel class `cls` (a subclass of its own) on the same config."""
    from ffpa_cute.dispatch import Plan

    @dataclasses.dataclass(frozen=True)
    class VariantPlan(Plan):
        @property
        def kernel_cls(self):
            return cls

    return VariantPlan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)})


def variants(d: int) -> dict:
    """{name: forward plan} at D=d: the plan, SplitO and ProducerIdle on its config."""
    plan = experiment.routed_fwd(experiment.self_problem(d))
    return {"plan": plan, "split": _with_kernel(plan, SplitO),
            "producer": _with_kernel(plan, ProducerIdle)}


def jobs() -> list:
    return experiment.forward_jobs(p for d in TIMED_HEAD_DIMS for p in variants(d).values())


def run(dev, flush) -> dict:
    return experiment.time_forward_variants(TIMED_HEAD_DIMS, variants, dev, flush,
                                            shape=lambda c: c.dv_halves)


def main(argv=None) -> int:
    return experiment.probe_main("perf.producer_regs", __doc__, jobs, run,
                                 lambda: (f"D={d} {cls.__name__}: {probe(cls, d)}"
                                          for d in HEAD_DIMS
                                          for cls in (WithProducerWarp, SplitO, ProducerIdle)),
                                 argv)


if __name__ == "__main__":
    sys.exit(main())
