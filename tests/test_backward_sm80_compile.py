"""Compile-only tests (no GPU) of the Split-D mma.sync backward kernels (ffpa_cute/sm80/bwd_sm80.py)
and their planners: every kernel at D in {320, 512, 1024}, causal and not, for sm_80 and sm_90a
(sm_120a: the sm120 family's backward, compile-verified only, canaried on first use), with
mma.sync in the PTX, no local memory and no ptxas spills.

The grid is a documented subset (CI has 2 cores): each kernel (dV, dQ, dK) meets each D and
each causal mode on sm_80, and each kernel once on sm_90a and sm_120a; a padded D (328, last
head-dim chunk zero-filled) and fp16 once each. 17 compiles, about 1.5 minutes here.
"""

import pytest

from ffpa_cute.dispatch import kernel_class
from ffpa_cute.problem import AttnProblem
from ffpa_cute.sm80 import config
from test_kernels_compile import _ptxas_spills

ARCHES = ("sm_80", "sm_90a", "sm_120a")


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx next to the working directory


def _problem(d, causal=False, dtype="bf16"):
    return AttnProblem(dtype=dtype, batch=1, heads_q=4, heads_kv=2, seqlen_q=1, seqlen_kv=1,
                       head_dim=d, head_dim_v=d, causal=causal)


CASES = [
    ("dv", "sm_80", 320, True), ("dv", "sm_80", 512, False), ("dv", "sm_80", 1024, True),
    ("dq", "sm_80", 320, False), ("dq", "sm_80", 512, True), ("dq", "sm_80", 1024, False),
    ("dk", "sm_80", 320, True), ("dk", "sm_80", 512, False), ("dk", "sm_80", 1024, True),
    ("dv", "sm_90a", 512, True), ("dq", "sm_90a", 1024, True), ("dk", "sm_90a", 320, False),
    ("dv", "sm_120a", 1024, False), ("dq", "sm_120a", 512, False), ("dk", "sm_120a", 1024, True),
    ("dk", "sm_80", 328, True),  # padded last head-dim chunk (column predicates)
]


def _compile_checked(kind, target, d, causal, dtype="bf16"):
    cfg = config.plan_bwd(kind, _problem(d, causal, dtype), target)
    cls = kernel_class(cfg)
    ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
    assert f".target {target}" in ptx
    assert "mma.sync.aligned.m16n8k16" in ptx
    assert "ldmatrix" in ptx and "cp.async" in ptx and "ex2.approx" in ptx
    assert "wgmma" not in ptx and "tcgen05" not in ptx
    assert ".local" not in ptx, "local memory in PTX"
    res = _ptxas_spills(ptx, target)
    if res is not None:
        stores, loads, regs = res
        assert stores == 0 and loads == 0, f"{cfg}: spills {stores}/{loads} B, {regs} regs"
    return cfg, ptx


@pytest.mark.parametrize("kind,target,d,causal", CASES)
def test_bwd_kernel_compiles_with_mma_sync_and_no_spills(kind, target, d, causal):
    cfg, _ = _compile_checked(kind, target, d, causal)
    assert type(cfg) is config.BWD_CONFIGS[kind]


def test_bwd_fp16_compiles():
    _, ptx = _compile_checked("dq", "sm_80", 384, False, "fp16")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx


# ---------------------------------------------------------------- planners (no compiles)
@pytest.mark.parametrize("target", ARCHES)
@pytest.mark.parametrize("kind", ["dv", "dq", "dk"])
def test_plan_bwd_covers_every_head_dim(kind, target):
    """Every D the forward covers gets a backward config that fits the target's smem and
    keeps the gradient within the register budget (the planner never returns one that
    `can_implement` rejects)."""
    for d in range(config.MIN_HEAD_DIM, config.MAX_HEAD_DIM + 1, 8):
        for causal in (False, True):
            cfg = config.plan_bwd(kind, _problem(d, causal), target)
            assert config.can_implement(cfg) is None
            assert cfg.smem_bytes() <= config.SMEM_CAPACITY[target]
            assert cfg.o_registers() <= 128
            assert cfg.tile_n == 64 and cfg.num_stages >= 2


def test_plan_bwd_follows_the_tuning_table():
    for kind in ("dv", "dq", "dk"):
        assert config.plan_bwd(kind, _problem(512), "sm_90a").warp_layout == "m4n2"
        assert config.plan_bwd(kind, _problem(1024), "sm_90a").warp_layout == "m2n4"
        assert config.plan_bwd(kind, _problem(320), "sm_80").warp_layout == "m4n2"
    # sm_120's 99 KB: M4N2's row ring does not fit at D = 512 for the two-product kernels
    assert config.plan_bwd("dq", _problem(512), "sm_120a").warp_layout == "m2n4"


def test_bwd_configs_are_distinct_compile_keys():
    """Same fields, three kernels: the config types (and kernel classes) keep keys apart."""
    p = _problem(512)
    cfgs = {k: config.plan_bwd(k, p, "sm_90a") for k in ("dv", "dq", "dk")}
    assert len(set(cfgs.values())) == 3
    assert cfgs["dq"].smem_bytes() > cfgs["dv"].smem_bytes()  # the row ring
    assert len({kernel_class(c).__qualname__ for c in cfgs.values()}) == 3


def test_sm120_plans_the_sm80_kernels_for_sm12x_only():
    from ffpa_cute.sm120 import config as sm120_config

    cfg = sm120_config.plan_bwd("dv", _problem(512), "sm_120a")
    assert kernel_class(cfg) is kernel_class(config.plan_bwd("dv", _problem(512), "sm_90a"))
    with pytest.raises(ValueError):
        sm120_config.plan_bwd("dv", _problem(512), "sm_90a")
