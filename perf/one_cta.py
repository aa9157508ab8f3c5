"""The 16-bit forward above D=512 in one CTA per row tile (issue 20's cliffs at 520 and 576).

    python -m perf.one_cta                    # CPU: ptxas's registers / spills per variant
    python -m perf.one_cta --precompile DIR   # CPU: compile the timed variants into DIR
    python -m perf.one_cta --time [--out F]   # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

Above D=512 the planner splits O over a CTA pair (`o_split` 2, `kv_pair`): O[64 x D] fp32 does
not fit the two O warpgroups' 168 registers a thread. The pair runs far below the one-CTA
forward (H100, N=8K: D=512 561 TFLOPS, 520 280, 576 348): each CTA scores every other block,
the pair trades row maxima and P over DSMEM once per block, and at D % 128 == 8 it computes
10-13% of O past D. In one CTA at D=520-576 each O warpgroup holds a 288-column share
(144 fp32 registers a thread), which fits when the registers move by `setmaxnreg` (S 144-152,
O 176-184: the S warpgroup's scores need 64) and each PV product is issued as narrower
WGMMAs (m64n96 over a 64-byte swizzled share, m64n128 over a 128-byte one), so that no single
instruction needs more than the launch's 168. Q stays resident ([64 x 576], 72 KB), the K
ring is 3 deep and each V ring 2 deep, as MLA's 576 / 512 plan.

Variants (the 16-bit forward, sm_90a, bf16, not causal): `pair` the routed plan; `one` the
one-CTA kernel (`OneCta`, `OneCtaConfig`: the plan's config with O in one CTA, Q resident,
shares split_align 8 / half_align 32). Out and lse are compared with the pair's (max abs
difference: the two walk the blocks in different orders).

Prediction (before the first run): per block the one-CTA kernel streams 128 x (D + Dv) x 2 B
(268 KB at 520, 288 KB at 576) for 4 x 64 x 128 x D FLOPs, D=512's bytes per FLOP, with a K
ring of 3 where 512 has 4: 85-95% of D=512's rate, 470-530 TFLOPS at 520-576 on the H100,
against the pair's 280-350.
"""

from __future__ import annotations

import dataclasses
import re
import sys

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32

from ffpa_cute.sm90.config import SMEM_CAPACITY, FwdConfigSm90
from ffpa_cute.sm90.fwd_sm90 import FFPAFwdSm90
from ffpa_cute.sm90.skeleton_sm90 import WG_THREADS, RingSkeletonSm90
from perf import experiment

HEAD_DIMS = (520, 528, 544, 560, 576, 592)
TIMED_HEAD_DIMS = (520, 528, 536, 544, 552, 560, 568, 576)
S_REGS, O_REGS = 152, 176    # setmaxnreg: S + 2 O <= 512 (128 threads each: the 64K file)
SWIZZLE_COLS = {128: 64, 64: 32, 32: 16}   # bytes of a row's swizzle -> bf16 columns


@dataclasses.dataclass(frozen=True)
class OneCtaFwdConfigSm90(FwdConfigSm90):
    """FwdConfigSm90 with O in one CTA whatever Dv (`o_split` 1)."""

    @property
    def o_split(self) -> int:
        return 1


@dataclasses.dataclass(frozen=True)
class LineSplitFwdConfigSm90(OneCtaFwdConfigSm90):
    """OneCtaFwdConfigSm90 with the hi share starting on a 128-byte line (column 256) where
    the rest fits one warpgroup's 288 columns, else on a half line (288)."""

    @property
    def dv_split(self) -> tuple[int, int]:
        lo = 256 if self.dv - 256 <= 288 else 288
        return lo, self.dv - lo


# `launch.repack_rows` copies K and V into 128-byte rows for configs whose class name ends in
# "Sm90" (at D > 512 when a row is not whole lines); these two are read as they are
@dataclasses.dataclass(frozen=True)
class OneCtaNoCopy(OneCtaFwdConfigSm90):
    """OneCtaFwdConfigSm90, K and V read in their own rows."""


@dataclasses.dataclass(frozen=True)
class LineSplitNoCopy(LineSplitFwdConfigSm90):
    """LineSplitFwdConfigSm90, K and V read in their own rows."""


def atom_n(width: int) -> int:
    """The PV WGMMA's N for an O share `width` columns wide: the share itself up to 256
    columns, else the widest divisor of it that is a whole number of the V stage's swizzle
    atoms (bf16) and at most 128."""
    if width <= 256:
        return width
    row = width * 2
    sw = next(b for b in (128, 64, 32) if row % b == 0)
    step = SWIZZLE_COLS[sw]
    return max(n for n in range(step, 129, step) if width % n == 0)


class OneCta(FFPAFwdSm90):
    """The forward with O in one CTA above D=512: `setmaxnreg` S_REGS / O_REGS, and each O
    share wider than 256 issued as m64n`atom_n` WGMMAs (the tiled MMA repeats the atom along
    N: the same accumulator registers, the same k-step order per column)."""

    def __init__(self, cfg):
        RingSkeletonSm90.__init__(self, cfg)   # FFPAFwdSm90's check caps Dv at 512

    def _mma(self, n: int, b_major):
        if b_major == cute.nvgpu.OperandMajorMode.MN and n > 256:
            return sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, b_major, Float32,
                (1, 1, 1), (self.cfg.tile_m, atom_n(n)))
        return super()._mma(n, b_major)

    @cute.jit
    def _warpgroups(self, ops, scalars, mmas, smem, work, extra, wg, tidx):
        if wg == 0:
            cute.arch.warpgroup_reg_dealloc(S_REGS)
            self._score_wg(mmas.s, ops, scalars, smem, work, extra, tidx)
        elif wg == 1:
            cute.arch.warpgroup_reg_alloc(O_REGS)
            self._acc_wg(mmas.o_lo, ops, scalars, smem, 0, work, extra, tidx - WG_THREADS)
        else:
            cute.arch.warpgroup_reg_alloc(O_REGS)
            self._acc_wg(mmas.o_hi, ops, scalars, smem, 1, work, extra, tidx - 2 * WG_THREADS)


def one_cta_config(plan_cfg, cls=OneCtaFwdConfigSm90) -> OneCtaFwdConfigSm90:
    """The routed config with O in one CTA: Q resident, no pair, even shares (split_align 8)
    computed in multiples of 32 columns (a 64-byte swizzle at least), the deepest rings that
    fit (K >= 3)."""
    fields = {f.name: getattr(plan_cfg, f.name) for f in dataclasses.fields(plan_cfg)}
    fields.update(stream_q=False, kv_pair=False, cta_align=8, split_align=8, half_align=32,
                  lazy_rescale=False)
    for v in (4, 3, 2):
        for k in range(8, 2, -1):
            cfg = cls(**{**fields, "k_stages": k, "v_stages": v})
            if cfg.smem_bytes() <= SMEM_CAPACITY:
                return cfg
    raise ValueError(f"no ring fits at D={plan_cfg.head_dim}")


def _with(plan, cls, cfg):
    """`plan` run by the kernel class `cls` on `cfg`."""
    from ffpa_cute.dispatch import Plan

    @dataclasses.dataclass(frozen=True)
    class VariantPlan(Plan):
        @property
        def kernel_cls(self):
            return cls

    return VariantPlan(**{**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)},
                          "cfg": cfg})


def variants(d: int) -> dict:
    """{name: forward plan} at D=d: the routed plan; O in one CTA with even shares (`even`)
    and with the hi share from a line (`line`, where that differs), each with K and V copied
    into 128-byte rows as the routed plan is where its rows are not whole lines, and (`-nc`)
    read in their own rows."""
    plan = experiment.routed_fwd(experiment.self_problem(d))
    out = {"pair": plan}
    for name, cls, nc in (("even", OneCtaFwdConfigSm90, OneCtaNoCopy),
                          ("line", LineSplitFwdConfigSm90, LineSplitNoCopy)):
        cfg = one_cta_config(plan.cfg, cls)
        if name == "line" and cfg.dv_split == out["even"].cfg.dv_split:
            continue
        out[name] = _with(plan, OneCta, cfg)
        if (2 * d) % 128:
            out[name + "-nc"] = _with(plan, OneCta, one_cta_config(plan.cfg, nc))
    return out


def probe(d: int) -> str:
    """ptxas's verdict on the one-CTA kernel at D=d: registers, spills, the PV atoms."""
    from tests.test_kernels_compile import _ptxas_log

    cfg = one_cta_config(experiment.routed_fwd(experiment.self_problem(d)).cfg)
    shape = (f"halves {cfg.dv_halves} atoms {[atom_n(w) for w in cfg.dv_halves]} "
             f"K {cfg.k_stages} V {cfg.v_stages} smem {cfg.smem_bytes()}")
    try:
        ptx = OneCta.compile(cfg, options="--keep-ptx").__ptx__
    except Exception as e:  # ptxas refused the PTX
        return f"{shape}: refused: {str(e)[:300]}"
    log = _ptxas_log(ptx, "sm_90a") or ""
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    atoms = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k16)", ptx)))
    return (f"{shape}: {regs.group(1) if regs else '?'} registers, "
            f"{spills.group(1) if spills else '?'} B of spill stores, WGMMAs {atoms}")


def jobs() -> list:
    return experiment.forward_jobs(p for d in TIMED_HEAD_DIMS for p in variants(d).values())


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch

    res = experiment.time_forward_variants(TIMED_HEAD_DIMS, variants, dev, flush,
                                           shape=lambda c: (c.dv_halves, c.k_stages,
                                                            c.v_stages))
    for d in TIMED_HEAD_DIMS:   # the one-CTA result against a float32 reference
        q, k, v = (torch.randn(1, 4, 1000, d, device=dev, dtype=torch.bfloat16)
                   for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float())
        errs = {name: (launch.run_fwd(p, q, k, v)[0].float() - ref).abs().max().item()
                for name, p in variants(d).items()}
        bf = (ref.bfloat16().float() - ref).abs().max().item()
        print(f"D={d} max abs error vs fp32: {errs} (bf16 rounding of the reference {bf:.2e})",
              flush=True)
        res[str(d)]["max_err"] = errs
    return res


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--time" in argv or "--precompile" in argv:
        return experiment.main("perf.one_cta", __doc__, jobs, run,
                               [a for a in argv if a != "--time"])
    for d in HEAD_DIMS:
        print(f"D={d} one CTA: {probe(d)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
