"""The sm100 tcgen05 forward compiles for sm_100a on the CPU with the instructions it was
designed around and no spills. **Compile-verified only, never run**: no sm_100 GPU exists here;
tests/test_sm100_plan.py proves its resource plan and mbarrier protocol."""

import re

import pytest

from ffpa_cute import dispatch
from ffpa_cute.problem import AttnProblem
from ffpa_cute.sm100 import config as c100
from test_kernels_compile import _ptxas_spills  # tests/ is on sys.path


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx next to the working directory


def _problem(d, causal=False, dv=None, dtype="bf16", hq=8, hkv=2):
    return AttnProblem(dtype=dtype, batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=1000,
                       seqlen_kv=1000, head_dim=d, head_dim_v=dv or d, causal=causal)


CASES = [(d, False, None, "bf16") for d in (264, 320, 512, 576, 768, 1024)] + [
    (512, True, None, "bf16"), (1000, True, None, "fp16"), (576, False, 512, "bf16")]


@pytest.mark.parametrize("d,causal,dv,dtype", CASES)
def test_sm100_forward_compiles_with_tcgen05(d, causal, dv, dtype):
    plan = dispatch.plan_fwd(_problem(d, causal, dv, dtype), target="sm_100a")
    assert plan.reason is None and plan.kernel_cls.__name__ == "FFPAFwdSm100"
    cfg = plan.cfg
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    assert ".target sm_100a" in ptx
    mmas = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16\S* (\[%r\d+\]), (\S+),", ptx)
    # QK: both operands from smem descriptors; PV: A (P) from TMEM ("[%r..]")
    ss = [m for m in mmas if not m[1].startswith("[")]
    ts = [m for m in mmas if m[1].startswith("[")]
    k_blocks = cfg.k_chunk // cfg.mma_k
    assert len(ss) == cfg.num_k_chunks * k_blocks, len(ss)
    assert len(ts) == cfg.v_blocks_per_tile * c100.V_ROWS // cfg.mma_k, len(ts)
    assert ptx.count("tcgen05.alloc.cta_group::1") == 1
    assert ptx.count("tcgen05.dealloc.cta_group::1") == 1
    assert "tcgen05.ld.sync.aligned.32x32b" in ptx and "tcgen05.st.sync.aligned.32x32b" in ptx
    assert "tcgen05.commit.cta_group::1.mbarrier::arrive::one" in ptx
    assert "cp.async.bulk.tensor.4d.shared::cta.global.tile.mbarrier::complete_tx" in ptx  # V
    # Q and K chunks: multicast over the row tile's cluster, released on every CTA
    assert cfg.multicast == (cfg.o_split > 1)
    if cfg.multicast:
        assert ptx.count(".global.tile.mbarrier::complete_tx::bytes.multicast::cluster") == 2 * (
            cfg.num_k_chunks)
        assert "tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.multicast" in ptx
        assert ptx.count("barrier.cluster.wait") == 2
    assert "wgmma" not in ptx and "mma.sync" not in ptx
    assert ".local" not in ptx, "local memory in PTX"
    res = _ptxas_spills(ptx, "sm_100a")
    if res is not None:
        stores, loads, regs = res
        assert stores == 0 and loads == 0, f"{cfg}: spills {stores}/{loads} B, {regs} regs"
        assert regs <= dict((r, n) for r, *_, n in c100.WARP_ROLES)["softmax"]


@pytest.mark.parametrize("d,window_hi,sinks", [(512, 0, True), (1024, None, True),
                                               (320, 16, False)])
def test_sm100_forward_with_window_and_sinks_compiles(d, window_hi, sinks):
    """The 16-bit tcgen05 forward with a sliding window's left edge (and a right edge as the
    causal rule) and sinks: builds with the same instructions, no local memory, no spills."""
    import dataclasses

    p = dataclasses.replace(_problem(d, window_hi is not None), window_lo=-100,
                            window_hi=window_hi, has_sinks=sinks)
    plan = dispatch.plan_fwd(p, target="sm_100a")
    assert plan.reason is None and plan.cfg.window and plan.cfg.sinks == sinks
    ptx = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__
    assert "tcgen05.mma.cta_group::1.kind::f16" in ptx and ".local" not in ptx
    res = _ptxas_spills(ptx, "sm_100a")
    if res is not None:
        assert res[0] == 0 and res[1] == 0, res


@pytest.mark.parametrize("d,dv,causal,window,sinks", [
    (512, None, True, False, False), (320, None, False, True, True), (576, 512, True, False,
                                                                      False)])
def test_sm100_varlen_forward_compiles(d, dv, causal, window, sinks):
    """One launch over packed sequences (`varlen`, 16-bit): the CTA finds its tile by a loop
    over cu_seqlens, the same tcgen05 / TMA instructions as the dense forward, no local
    memory, no spills. The FP8 / NVFP4 forwards have no varlen form (the host loop runs them
    per sequence)."""
    import dataclasses

    p = dataclasses.replace(_problem(d, causal, dv), varlen=True, has_sinks=sinks,
                            window_lo=-100 if window else None)
    plan = dispatch.plan_fwd(p, target="sm_100a")
    assert plan.reason is None and plan.cfg.varlen and plan.cfg.window == window
    cfg = plan.cfg
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    assert "tcgen05.mma.cta_group::1.kind::f16" in ptx and ".local" not in ptx
    assert "cp.async.bulk.tensor.4d" in ptx
    assert cfg.multicast == (cfg.o_split > 1)
    if cfg.multicast:
        assert ptx.count(".global.tile.mbarrier::complete_tx::bytes.multicast::cluster") == 2 * (
            cfg.num_k_chunks)
    res = _ptxas_spills(ptx, "sm_100a")
    if res is not None:
        assert res[0] == 0 and res[1] == 0, res
    fp8 = dispatch.plan_fwd(dataclasses.replace(p, dtype="e4m3", out_dtype="bf16"),
                            target="sm_100a")
    assert fp8.reason is not None and "varlen" in fp8.reason


@pytest.mark.parametrize("d,dv,causal,window", [(512, None, True, False),
                                                 (320, None, False, True)])
def test_sm100_varlen_backward_compiles(d, dv, causal, window):
    """dQ, dK and dV over packed sequences in one launch each (`varlen`): keys as rows walk
    their own sequence's query blocks; tcgen05 MMAs and TMA as the dense kernels, no local
    memory, no spills."""
    import dataclasses

    p = dataclasses.replace(_problem(d, causal, dv), varlen=True,
                            window_lo=-100 if window else None)
    plan = dispatch.plan_bwd(p, target="sm_100a")
    assert plan.reason is None
    jobs = [(c, g) for c, g in plan.jobs if hasattr(g, "varlen")]
    assert len(jobs) == 3 and all(g.varlen for _, g in jobs)
    for cls, cfg in jobs:
        ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
        assert "tcgen05.mma.cta_group::1.kind::f16" in ptx, cls.__name__
        assert "cp.async.bulk.tensor.4d" in ptx and ".local" not in ptx, cls.__name__
        res = _ptxas_spills(ptx, "sm_100a")
        if res is not None:
            assert res[0] == 0 and res[1] == 0, (cls.__name__, res)


def test_sm100_forward_without_multicast_compiles():
    """The unshared form (each CTA loads its own Q and K) stays buildable: one config key."""
    import dataclasses

    plan = dispatch.plan_fwd(_problem(512, True), target="sm_100a")
    cfg = dataclasses.replace(plan.cfg, multicast=False)
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    assert "multicast::cluster" not in ptx and "barrier.cluster" not in ptx
    assert "tcgen05.mma.cta_group::1.kind::f16" in ptx


BWD_CASES = [(264, True, None), (320, False, None), (512, False, None), (576, True, 512),
             (768, True, None), (1024, False, None)]


@pytest.mark.parametrize("d,causal,dv", BWD_CASES)
def test_sm100_backward_compiles_with_tcgen05(d, causal, dv):
    """dQ, dK, dV: the score MMAs per product (S; and dP for dQ / dK), the accumulator MMAs
    with P / dS from TMEM, column statistics through a named barrier (dK, dV), multicast Q / K
    chunks where the gradient is split over CTAs, no spills."""
    plan = dispatch.plan_bwd(_problem(d, causal, dv), target="sm_100a")
    assert plan.reason is None
    names = [cls.__name__ for cls, _ in plan.jobs]
    assert names == ["RowDot", "FFPABwdDQSm100", "FFPABwdDKSm100", "FFPABwdDVSm100"]
    for cls, cfg in plan.jobs[1:]:
        ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
        mmas = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f16\S* (\[%r\d+\]), (\S+),", ptx)
        ss = [m for m in mmas if not m[1].startswith("[")]
        ts = [m for m in mmas if m[1].startswith("[")]
        k_blocks = cfg.k_chunk // cfg.mma_k
        assert len(ss) == cfg.num_k_chunks * k_blocks and len(cfg.products) == (
            1 if cls.__name__ == "FFPABwdDVSm100" else 2)
        assert len(ts) == cfg.v_blocks_per_tile * c100.V_ROWS // cfg.mma_k
        assert ptx.count("tcgen05.alloc.cta_group::1") == 1
        assert ("bar.sync" in ptx) == bool(cfg.col_stats)  # the column statistics' barrier
        assert ("multicast::cluster" in ptx) == cfg.multicast
        assert ".local" not in ptx and "wgmma" not in ptx and "mma.sync" not in ptx
        res = _ptxas_spills(ptx, "sm_100a")
        if res is not None:
            assert res[:2] == (0, 0), f"{cfg}: spills {res}"


@pytest.mark.parametrize("d,window_hi,sinks", [(512, 0, True), (320, None, False),
                                               (1024, 16, False)])
def test_sm100_backward_with_window_compiles(d, window_hi, sinks):
    """dQ, dK and dV with a sliding window (and sinks, which reach them through the LSE only):
    the window's edge is a kernel argument of each, the key-row kernels (dK, dV) bound their
    query walk by it; the same tcgen05 MMAs, no local memory, no spills."""
    import dataclasses

    p = dataclasses.replace(_problem(d, window_hi is not None), window_lo=-100,
                            window_hi=window_hi, has_sinks=sinks)
    plan = dispatch.plan_bwd(p, target="sm_100a")
    assert plan.reason is None
    for cls, cfg in plan.jobs[1:]:
        assert cfg.window and not cfg.sinks and "window_lo" in cls.SCALARS
        ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
        assert "tcgen05.mma.cta_group::1.kind::f16" in ptx and ".local" not in ptx
        res = _ptxas_spills(ptx, "sm_100a")
        if res is not None:
            assert res[:2] == (0, 0), f"{cfg}: spills {res}"


@pytest.mark.parametrize("d,window_hi,sinks", [(512, 0, True), (320, None, False)])
def test_sm100_fp8_forward_with_window_and_sinks_compiles(d, window_hi, sinks):
    """The e4m3 tcgen05 forward with a sliding window (and a right edge as the causal rule)
    and sinks: kind::f8f6f4 as without them, the window and sinks reach the kernel's
    arguments (`window_lo`, `sinks`), no local memory, no spills."""
    import dataclasses

    problem = AttnProblem(dtype="e4m3", batch=1, heads_q=8, heads_kv=2, seqlen_q=1000,
                          seqlen_kv=1000, head_dim=d, head_dim_v=d, causal=window_hi is not None,
                          out_dtype="bf16")
    p = dataclasses.replace(problem, window_lo=-100, window_hi=window_hi, has_sinks=sinks)
    plan = dispatch.plan_fwd(p, target="sm_100a")
    assert plan.reason is None and plan.kernel_cls.__name__ == "FFPAFwdSm100FP8"
    assert plan.cfg.window and plan.cfg.sinks == sinks
    assert "window_lo" in plan.kernel_cls.SCALARS and "sinks" in plan.kernel_cls.OPERANDS
    ptx = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__
    assert "tcgen05.mma.cta_group::1.kind::f8f6f4" in ptx and "kind::f16" not in ptx
    assert ".local" not in ptx
    res = _ptxas_spills(ptx, "sm_100a")
    if res is not None:
        assert res[0] == 0 and res[1] == 0, res


@pytest.mark.parametrize("d,causal", [(320, False), (512, True), (1024, False)])
def test_sm100_fp8_forward_compiles_with_f8f6f4(d, causal):
    """The e4m3 forward: kind::f8f6f4 MMAs (K = 32) on 128-column chunks, P rounded to e4m3
    (satfinite) into TMEM, V read N-major (no transpose), bf16 out, no spills."""
    problem = AttnProblem(dtype="e4m3", batch=1, heads_q=8, heads_kv=2, seqlen_q=1000,
                          seqlen_kv=1000, head_dim=d, head_dim_v=d, causal=causal,
                          out_dtype="bf16")
    plan = dispatch.plan_fwd(problem, target="sm_100a")
    assert plan.reason is None and plan.kernel_cls.__name__ == "FFPAFwdSm100FP8"
    cfg = plan.cfg
    assert (cfg.k_chunk, cfg.mma_k) == (128, 32) and "v" in plan.kernel_cls.OPERANDS
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    mmas = re.findall(r"tcgen05\.mma\.cta_group::1\.kind::f8f6f4\S* (\[%r\d+\]), (\S+),", ptx)
    ss = [m for m in mmas if not m[1].startswith("[")]
    ts = [m for m in mmas if m[1].startswith("[")]
    assert len(ss) == cfg.num_k_chunks * cfg.k_chunk // cfg.mma_k
    assert len(ts) == cfg.v_blocks_per_tile * c100.V_ROWS // cfg.mma_k
    assert "kind::f16" not in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert ".local" not in ptx
    res = _ptxas_spills(ptx, "sm_100a")
    if res is not None:
        assert res[:2] == (0, 0), f"{cfg}: spills {res}"
