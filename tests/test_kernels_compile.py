"""Compile-only kernel tests (no GPU): every family builds for its targets, with the
instructions we meant and no local memory.

sm_80 and sm_120a are the Split-D mma.sync kernels' own targets; on sm_90a the Split-D kernel
serves D > 512 (and any D under FFPA_CUTE_ARCH=sm80), the WGMMA kernel D <= 512. sm_120a builds
are compile-verified only (no such GPU here).
"""

import re
import shutil
import subprocess

import pytest

from ffpa_cute.dispatch import plan_fwd
from ffpa_cute.problem import AttnProblem

HEAD_DIMS = (320, 512, 1024)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx next to the working directory


def _plan(target, d, causal=False, dtype="bf16", family=None, monkeypatch=None):
    if family is not None:
        monkeypatch.setenv("FFPA_CUTE_ARCH", family)
    p = AttnProblem(dtype=dtype, batch=1, heads_q=1, heads_kv=1, seqlen_q=1, seqlen_kv=1,
                    head_dim=d, head_dim_v=d, causal=causal)
    plan = plan_fwd(p, target=target)
    assert plan.reason is None, plan.reason
    return plan


def _ptxas_spills(ptx: str, arch: str):
    """(spill store bytes, spill load bytes, registers) from ptxas -v, or None without ptxas."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    r = subprocess.run([ptxas, f"-arch={arch}", "-v", "-", "-o", "/dev/null"], input=ptx,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return None  # an older ptxas than the DSL's own may not know the target
    st = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    return int(st.group(1)), int(st.group(2)), int(regs.group(1))


CASES = [("sm_80", d, False) for d in HEAD_DIMS] + [("sm_120a", d, False) for d in HEAD_DIMS] + [
    ("sm_90a", 320, True), ("sm_90a", 512, True), ("sm_90a", 1024, False), ("sm_80", 576, True),
    ("sm_90a", 328, False)]  # 328: padded last head-dim chunk (column predicates)


@pytest.mark.parametrize("target,d,causal", CASES)
def test_splitd_compiles_with_mma_sync_and_no_spills(target, d, causal, monkeypatch):
    plan = _plan(target, d, causal, family="sm80" if target == "sm_90a" else None,
                 monkeypatch=monkeypatch)
    assert plan.kernel_cls.__name__ in ("FFPAFwdSm80", "FFPAFwdSm120")
    fn = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx")
    ptx = fn.__ptx__
    assert f".target {target}" in ptx
    assert "mma.sync.aligned.m16n8k16" in ptx
    assert "ldmatrix" in ptx and "cp.async" in ptx
    assert "wgmma" not in ptx and "tcgen05" not in ptx
    assert ".local" not in ptx, "local memory in PTX"
    res = _ptxas_spills(ptx, target)
    if res is not None:
        stores, loads, regs = res
        assert stores == 0 and loads == 0, f"{plan.cfg}: spills {stores}/{loads} B, {regs} regs"


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_sm120_family_is_the_sm80_kernel_under_99kb(d):
    plan = _plan("sm_120a", d)
    assert plan.family == "sm120"
    assert plan.kernel_cls.__name__ == "FFPAFwdSm120"
    assert plan.cfg.smem_bytes() <= 101376


def test_fp16_compiles():
    plan = _plan("sm_80", 384, dtype="fp16")
    fn = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in fn.__ptx__


SM90_CASES = [(264, True), (320, False), (384, True), (448, False), (512, True), (512, False),
              (576, True), (768, False), (1024, True)]  # > 512: O split over two CTAs


@pytest.mark.parametrize("d,causal", SM90_CASES)
def test_sm90_compiles_with_wgmma_tma_and_no_spills(d, causal):
    """The WGMMA forward: m64n128k16 QK and m64nNk16 PV WGMMAs, TMA loads, stmatrix for P,
    no mma.sync, no local memory, no ptxas spills (384 threads: at most 168 registers)."""
    from ffpa_cute import sm90

    p = AttnProblem(dtype="bf16", batch=1, heads_q=1, heads_kv=1, seqlen_q=1, seqlen_kv=1,
                    head_dim=d, head_dim_v=d, causal=causal)
    cfg = sm90.plan_fwd(p, "sm_90a")
    assert cfg.o_split == (1 if d <= 512 else 2)
    ptx = sm90.FFPAFwdSm90.compile(cfg, options="--keep-ptx").__ptx__
    dlo, dhi = cfg.dv_halves
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{dlo}k16" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{dhi}k16" in ptx
    assert "cp.async.bulk.tensor" in ptx and "stmatrix" in ptx
    assert "mma.sync" not in ptx and "tcgen05" not in ptx
    assert ".local" not in ptx, "local memory in PTX"
    res = _ptxas_spills(ptx, "sm_90a")
    if res is not None:
        stores, loads, regs = res
        assert stores == 0 and loads == 0, f"{cfg}: spills {stores}/{loads} B, {regs} regs"
        assert regs <= 168


def test_sm90_streamed_q_below_512_compiles():
    """stream_q at D <= 512 (a tuning variant: Q's smem goes to the V rings) builds spill-free."""
    import dataclasses

    from ffpa_cute import sm90

    p = AttnProblem(dtype="bf16", batch=1, heads_q=1, heads_kv=1, seqlen_q=1, seqlen_kv=1,
                    head_dim=512, head_dim_v=512, causal=True)
    cfg = dataclasses.replace(sm90.plan_fwd(p, "sm_90a"), stream_q=True, v_stages=3)
    assert sm90.can_implement(cfg) is None
    ptx = sm90.FFPAFwdSm90.compile(cfg, options="--keep-ptx").__ptx__
    assert "cp.async.bulk.tensor" in ptx and ".local" not in ptx
    res = _ptxas_spills(ptx, "sm_90a")
    if res is not None:
        assert res[0] == 0 and res[1] == 0 and res[2] <= 168


@pytest.mark.parametrize("d,causal", [(320, False), (512, True)])
def test_sm90_dv_kernel_compiles(d, causal):
    """The backward's dV kernel (the forward's skeleton, other roles): wgmma + TMA, no spills."""
    from ffpa_cute.sm90.bwd_sm90 import FFPABwdDVSm90, plan_dv

    p = AttnProblem(dtype="bf16", batch=1, heads_q=2, heads_kv=2, seqlen_q=1, seqlen_kv=1,
                    head_dim=d, head_dim_v=d, causal=causal)
    cfg = plan_dv(p)
    ptx = FFPABwdDVSm90.compile(cfg, options="--keep-ptx").__ptx__
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and ".local" not in ptx
    res = _ptxas_spills(ptx, "sm_90a")
    if res is not None:
        assert res[0] == 0 and res[1] == 0 and res[2] <= 168


@pytest.mark.parametrize("d,causal", [(264, True), (512, False)])
@pytest.mark.parametrize("grad", ["dq", "dk"])
def test_sm90_dq_dk_kernels_compile(d, causal, grad):
    """The backward's dQ and dK kernels: two score products on one S ring (dQ: m64n64k16 into
    two accumulators; dK with `seq_scores`: m64n128k16 into one), the gradient accumulated by
    m64nNk16 WGMMAs; no spills."""
    from ffpa_cute.sm90 import bwd_sm90

    p = AttnProblem(dtype="bf16", batch=1, heads_q=4, heads_kv=2, seqlen_q=1, seqlen_kv=1,
                    head_dim=d, head_dim_v=d, causal=causal)
    cls = bwd_sm90.FFPABwdDQSm90 if grad == "dq" else bwd_sm90.FFPABwdDKSm90
    cfg = (bwd_sm90.plan_dq if grad == "dq" else bwd_sm90.plan_dk)(p)
    assert cfg.tile_n == (128 if grad == "dk" and bwd_sm90.SEQ_SCORES else 64)
    ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k16" in ptx and ".local" not in ptx
    res = _ptxas_spills(ptx, "sm_90a")
    if res is not None:
        assert res[0] == 0 and res[1] == 0 and res[2] <= 168


@pytest.mark.parametrize("grad", ["dv", "dq", "dk"])
def test_sm90_backward_prefetch_variant_compiles(grad):
    """`prefetch_stats`: each block's LSE / Delta loaded before its WGMMAs (global loads ahead
    of the first wgmma in the PTX); no spills."""
    import dataclasses

    from ffpa_cute.sm90 import bwd_sm90

    p = AttnProblem(dtype="bf16", batch=1, heads_q=4, heads_kv=2, seqlen_q=1, seqlen_kv=1,
                    head_dim=512, head_dim_v=512, causal=True)
    plan = {"dv": bwd_sm90.plan_dv, "dq": bwd_sm90.plan_dq, "dk": bwd_sm90.plan_dk}[grad]
    cls = {"dv": bwd_sm90.FFPABwdDVSm90, "dq": bwd_sm90.FFPABwdDQSm90,
           "dk": bwd_sm90.FFPABwdDKSm90}[grad]
    cfg = dataclasses.replace(plan(p), prefetch_stats=True)
    ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
    lines = ptx.splitlines()
    first_load = min(i for i, ln in enumerate(lines) if "ld.global" in ln)
    first_wgmma = min(i for i, ln in enumerate(lines) if "wgmma.mma_async" in ln)
    assert first_load < first_wgmma and ".local" not in ptx
    res = _ptxas_spills(ptx, "sm_90a")
    if res is not None:
        assert res[0] == 0 and res[1] == 0 and res[2] <= 168


@pytest.mark.parametrize("d,causal", [(512, True), (320, False)])
def test_sm90_dk_seq_scores_variant_compiles(d, causal, monkeypatch):
    """dK `seq_scores`: m64n128k16 score WGMMAs into one accumulator, no spills (up to
    `SEQ_SCORES_MAX_HEAD_DIM`; at D = 1024, split over two CTAs, it spills 148 B)."""
    from ffpa_cute.sm90 import bwd_sm90

    monkeypatch.setattr(bwd_sm90, "SEQ_SCORES", True)
    p = AttnProblem(dtype="bf16", batch=1, heads_q=4, heads_kv=2, seqlen_q=1, seqlen_kv=1,
                    head_dim=d, head_dim_v=d, causal=causal)
    cfg = bwd_sm90.plan_dk(p)
    assert cfg.tile_n == 128 and cfg.seq_scores and cfg.prefetch_stats
    ptx = bwd_sm90.FFPABwdDKSm90.compile(cfg, options="--keep-ptx").__ptx__
    assert "wgmma.mma_async.sync.aligned.m64n128k16" in ptx and ".local" not in ptx
    res = _ptxas_spills(ptx, "sm_90a")
    if res is not None:
        assert res[0] == 0 and res[1] == 0 and res[2] <= 168


def test_sm90_dv_not_d_compiles(monkeypatch):
    """MLA-absorbed D = 576, Dv = 512: QK over nine 64-wide chunks (Q streamed), O 512 wide."""
    from ffpa_cute import dispatch

    monkeypatch.setattr(dispatch, "DV_NOT_D_KERNELS", True)
    p = AttnProblem(dtype="bf16", batch=1, heads_q=128, heads_kv=1, seqlen_q=1, seqlen_kv=1,
                    head_dim=576, head_dim_v=512, causal=True)
    plan = plan_fwd(p, target="sm_90a")
    assert plan.cfg.head_dim_v == 512 and plan.cfg.stream_q
    ptx = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and ".local" not in ptx
    res = _ptxas_spills(ptx, "sm_90a")
    if res is not None:
        assert res[0] == 0 and res[1] == 0 and res[2] <= 168


@pytest.mark.parametrize("d,causal", [(1024, True), (576, False)])
def test_sm90_kv_pair_compiles(d, causal, monkeypatch):
    """`kv_pair` (D > 512): a 2-CTA cluster that exchanges row statistics (st.async) and P
    (a shared::cluster bulk copy), with cluster barriers; wgmma, no spills. On by default
    (`config.KV_PAIR`); switched off, the planner does not pair."""
    from ffpa_cute.sm90 import config

    p = AttnProblem(dtype="bf16", batch=1, heads_q=4, heads_kv=2, seqlen_q=1, seqlen_kv=1,
                    head_dim=d, head_dim_v=d, causal=causal)
    monkeypatch.setattr(config, "KV_PAIR", False)
    assert not config.plan_fwd(p, "sm_90a").kv_pair
    monkeypatch.setattr(config, "KV_PAIR", True)
    cfg = config.plan_fwd(p, "sm_90a")
    assert cfg.kv_pair and cfg.o_split == 2 and cfg.p_slots == 4
    from ffpa_cute.sm90 import FFPAFwdSm90

    ptx = FFPAFwdSm90.compile(cfg, options="--keep-ptx").__ptx__
    for needle in ("wgmma.mma_async", "st.async", "cp.async.bulk.shared::cluster.shared::cta",
                   "barrier.cluster.arrive", "mapa"):
        assert needle in ptx, needle
    assert ".local" not in ptx
    res = _ptxas_spills(ptx, "sm_90a")
    if res is not None:
        assert res[0] == 0 and res[1] == 0 and res[2] <= 168


def test_kv_pair_config_rules():
    import dataclasses

    from ffpa_cute.sm90 import config

    c = config.FwdConfigSm90(arch="sm_90a", dtype="bf16", head_dim=512, causal=False,
                             kv_pair=True)
    assert "kv_pair" in config.can_implement(c)  # one CTA per tile: nothing to pair
    big = dataclasses.replace(c, head_dim=1024, stream_q=True, k_stages=4, v_stages=3,
                              publish_after=16)
    assert "smem" in config.can_implement(big)  # four P slots: V rings must shrink
    assert config.can_implement(dataclasses.replace(big, v_stages=2)) is None


@pytest.mark.parametrize("arch,d", [("sm_90a", 512), ("sm_80", 264), ("sm_120a", 1024)])
def test_fused_delta_compiles(arch, d):
    """Delta = rowsum(dO * O) (`common/delta.py`): 16-byte loads, a warp butterfly, no local
    memory, on every arch."""
    from ffpa_cute.common.delta import DeltaConfig, RowDot

    ptx = RowDot.compile(DeltaConfig(arch, "bf16", d), options="--keep-ptx").__ptx__
    assert "ld.global" in ptx and ".v4" in ptx and "shfl.sync.bfly" in ptx
    assert ".local" not in ptx


def test_sm90_backward_dv_not_d_compiles(monkeypatch):
    """MLA 576 / 512 backward (`dispatch.DV_NOT_D_BWD`): dQ / dK with the second score product
    over Dv (8 chunks after the 9 of D), dV accumulating Dv columns; wgmma, no spills. On by
    default; switched off, the SDPA recompute takes it."""
    from ffpa_cute import dispatch

    p = AttnProblem(dtype="bf16", batch=1, heads_q=128, heads_kv=1, seqlen_q=1, seqlen_kv=1,
                    head_dim=576, head_dim_v=512, causal=True)
    monkeypatch.setattr(dispatch, "DV_NOT_D_BWD", False)
    assert "head_dim_v" in dispatch.bwd_reason(p, target="sm_90a")
    monkeypatch.setattr(dispatch, "DV_NOT_D_BWD", True)
    monkeypatch.setattr(dispatch, "FUSED_DELTA", False)  # the three gradient kernels only
    assert dispatch.bwd_reason(p, target="sm_90a") is None
    assert "head_dim_v" in dispatch.bwd_reason(p, target="sm_80")  # Split-D: equal D only
    jobs = dispatch.bwd_kernels(p, target="sm_90a")
    assert [c.second_dim for _, c in jobs[:2]] == [512, 512] and jobs[2][1].head_dim_v == 512
    for cls, cfg in jobs:
        ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
        assert "wgmma.mma_async" in ptx and ".local" not in ptx
        res = _ptxas_spills(ptx, "sm_90a")
        if res is not None:
            assert res[0] == 0 and res[1] == 0 and res[2] <= 168


def test_sm90_backward_above_512_compiles(monkeypatch):
    """D = 1024 backward: dQ with its gradient split over two CTAs; wgmma, no spills."""
    from ffpa_cute.sm90 import bwd_sm90

    p = AttnProblem(dtype="bf16", batch=1, heads_q=4, heads_kv=2, seqlen_q=1, seqlen_kv=1,
                    head_dim=1024, head_dim_v=1024, causal=True)
    monkeypatch.setattr(bwd_sm90, "MAX_HEAD_DIM", 512)
    with pytest.raises(ValueError, match="MAX_HEAD_DIM"):
        bwd_sm90.plan_dq(p)
    monkeypatch.setattr(bwd_sm90, "MAX_HEAD_DIM", 1024)
    cfg = bwd_sm90.plan_dq(p)
    assert cfg.o_split == 2
    ptx = bwd_sm90.FFPABwdDQSm90.compile(cfg, options="--keep-ptx").__ptx__
    assert "wgmma.mma_async" in ptx and ".local" not in ptx
    res = _ptxas_spills(ptx, "sm_90a")
    if res is not None:
        assert res[0] == 0 and res[1] == 0 and res[2] <= 168


def test_sm90_dkdv_pair_compiles():
    """The dK + dV pair (bwd_pair_sm90.py): a 2-CTA cluster (barrier.cluster), P^T sent by one
    shared::cluster bulk copy and read back by ldmatrix, wgmma + TMA, no spills."""
    from ffpa_cute.sm90.bwd_pair_sm90 import FFPABwdPairSm90, plan_pair

    p = AttnProblem(dtype="bf16", batch=1, heads_q=4, heads_kv=2, seqlen_q=1, seqlen_kv=1,
                    head_dim=512, head_dim_v=512, causal=True)
    cfg = plan_pair(p)
    ptx = FFPABwdPairSm90.compile(cfg, options="--keep-ptx").__ptx__
    for needle in ("wgmma.mma_async.sync.aligned.m64n128k16", "cp.async.bulk.tensor",
                   "cp.async.bulk.shared::cluster", "ldmatrix", "stmatrix", "barrier.cluster"):
        assert needle in ptx, needle
    assert ".local" not in ptx
    res = _ptxas_spills(ptx, "sm_90a")
    if res is not None:
        assert res[0] == 0 and res[1] == 0 and res[2] <= 168
