"""Compile-only kernel tests (no GPU): every family builds for its targets, with the
instructions we meant and no local memory.

sm_80 and sm_120a are the Split-D mma.sync kernels' own targets; on sm_90a the Split-D kernel
serves any D under `Options(family="sm80")`, the WGMMA kernels every D otherwise. sm_120a
builds are compile-verified only (no such GPU here).
"""

import dataclasses
import re
import shutil
import subprocess

import pytest

from ffpa_cute import dispatch
from ffpa_cute.options import Options
from ffpa_cute.problem import AttnProblem
from ffpa_cute.sm90 import config as sm90_config

HEAD_DIMS = (320, 512, 1024)


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx next to the working directory


def _plan(target, d, causal=False, dtype="bf16", family=None):
    p = AttnProblem(dtype=dtype, batch=1, heads_q=1, heads_kv=1, seqlen_q=1, seqlen_kv=1,
                    head_dim=d, head_dim_v=d, causal=causal)
    plan = dispatch.plan_fwd(p, target=target, opts=Options(family=family))
    assert plan.reason is None, plan.reason
    return plan


def _problem(d, causal, hq=4, hkv=2, dv=None, dtype="bf16"):
    return AttnProblem(dtype=dtype, batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=1, seqlen_kv=1,
                       head_dim=d, head_dim_v=dv or d, causal=causal)


def _no_spills(ptx, arch="sm_90a", max_regs=168):
    """ptxas reports no spills (and, on sm_90a's 384-thread kernels, at most 168 registers)."""
    res = _ptxas_spills(ptx, arch)
    if res is not None:
        stores, loads, regs = res
        assert stores == 0 and loads == 0, f"spills {stores}/{loads} B, {regs} regs"
        assert regs <= max_regs


def _ptxas_log(ptx: str, arch: str):
    """ptxas -v's report on the PTX, or None without ptxas (or one too old for the target)."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    r = subprocess.run([ptxas, f"-arch={arch}", "-v", "-", "-o", "/dev/null"], input=ptx,
                       capture_output=True, text=True, timeout=300)
    return r.stderr if r.returncode == 0 else None


def _ptxas_spills(ptx: str, arch: str):
    """(spill store bytes, spill load bytes, registers) from ptxas -v, or None without ptxas."""
    log = _ptxas_log(ptx, arch)
    if log is None:
        return None
    st = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.search(r"Used (\d+) registers", log)
    return int(st.group(1)), int(st.group(2)), int(regs.group(1))


CASES = [("sm_80", d, False) for d in HEAD_DIMS] + [("sm_120a", d, False) for d in HEAD_DIMS] + [
    ("sm_90a", 320, True), ("sm_90a", 512, True), ("sm_90a", 1024, False), ("sm_80", 576, True),
    ("sm_90a", 328, False)]  # 328: padded last head-dim chunk (column predicates)


@pytest.mark.parametrize("target,d,causal", CASES)
def test_splitd_compiles_with_mma_sync_and_no_spills(target, d, causal):
    plan = _plan(target, d, causal, family="sm80" if target == "sm_90a" else None)
    assert plan.kernel_cls.__name__ == "FFPAFwdSm80"
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


@pytest.mark.parametrize("target,d,causal,window,sinks", [
    ("sm_80", 512, True, False, False), ("sm_90a", 320, False, True, True),
    ("sm_89", 1024, True, False, False), ("sm_120a", 512, True, True, False)])
def test_splitd_varlen_compiles(target, d, causal, window, sinks):
    """The Split-D forward and dQ / dK / dV over packed sequences (`varlen`): the CTA's tile
    from a walk over cu_seqlens, mma.sync / ldmatrix / cp.async as the dense kernels, no local
    memory, no spills (sm_90a's are the GPU-tested code, tests/ptx_guard.py; the other targets
    canary them before their first use); FP8 has no varlen form."""
    p = dataclasses.replace(_problem(d, causal), varlen=True, has_sinks=sinks,
                            window_lo=-64 if window else None)
    opts = Options(family="sm80" if target == "sm_90a" else None)
    plan = dispatch.plan_fwd(p, target=target, opts=opts)
    assert plan.reason is None and plan.cfg.varlen
    bwd = dispatch.plan_bwd(p, target=target, opts=opts)
    assert bwd.reason is None
    grads = [(c, g) for c, g in bwd.jobs if hasattr(g, "varlen")]
    assert len(grads) == 3 and all(g.varlen for _, g in grads)
    for cls, cfg in [(plan.kernel_cls, plan.cfg)] + grads:
        ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
        assert "mma.sync.aligned.m16n8k16" in ptx and "ldmatrix" in ptx and "cp.async" in ptx
        assert ".local" not in ptx, f"{cls.__name__}: local memory in PTX"
        res = _ptxas_spills(ptx, target)
        if res is not None:
            assert res[0] == 0 and res[1] == 0, f"{cfg}: spills {res}"
    fp8 = dispatch.plan_fwd(dataclasses.replace(p, dtype="e4m3", out_dtype="bf16"),
                            target=target, opts=opts)
    assert fp8.reason is not None and "varlen" in fp8.reason


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_sm120_family_is_the_sm80_kernel_under_99kb(d):
    plan = _plan("sm_120a", d)
    assert plan.family == "sm120"
    assert plan.kernel_cls.__name__ == "FFPAFwdSm80"
    assert plan.cfg.smem_bytes() <= 101376


def test_fp16_compiles():
    plan = _plan("sm_80", 384, dtype="fp16")
    fn = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in fn.__ptx__


SM90_CASES = [(264, True), (320, False), (384, True), (448, False), (512, True), (512, False),
              (520, False), (552, True), (576, True),   # 520-576: O in one CTA (`wide_o`)
              (640, False), (768, False), (1024, True)]  # > 576: O split over two CTAs


@pytest.mark.parametrize("d,causal,window,sinks,dtype", [
    (512, True, True, True, "bf16"), (320, False, False, False, "bf16"),
    (448, False, True, False, "fp16")])
def test_sm90_persistent_compiles(d, causal, window, sinks, dtype):
    """Persistent CTAs (one per SM walking the row tiles; the planner's choice without a right
    bound or with a sliding window): the grid size read in the kernel (%nctaid.x), WGMMA and
    TMA, no local memory, no spills: the accumulator warpgroups carry their ring position and
    hand-over count from tile to tile within the 168 registers."""
    p = dataclasses.replace(_problem(d, causal, dtype=dtype),
                            window_lo=-64 if window else None, has_sinks=sinks)
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options())
    assert plan.reason is None and plan.cfg.persistent
    ptx = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__
    assert "%nctaid.x" in ptx and "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    assert ".local" not in ptx, "local memory in PTX"
    _no_spills(ptx)


@pytest.mark.parametrize("d,dv,causal,window,sinks", [
    (512, 512, True, False, False), (320, 320, True, True, True), (576, 576, True, False, False),
    (576, 512, False, False, False)])
def test_sm90_varlen_compiles(d, dv, causal, window, sinks):
    """One launch over packed sequences (`varlen`): the forward and the dQ / dK / dV kernels
    take cu_seqlens (the CTA's tile is found by a walk over them: a loop in the kernel), WGMMA
    and TMA, no local memory, no spills; D=576 on the CTA pair (varlen keeps it: no `wide_o`)
    and Dv != D too."""
    p = dataclasses.replace(_problem(d, causal, dv=dv), varlen=True, has_sinks=sinks,
                            window_lo=-64 if window else None)
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options())
    assert plan.reason is None and plan.cfg.varlen and not plan.cfg.persistent
    bwd = dispatch.plan_bwd(p, target="sm_90a", opts=Options())
    assert bwd.reason is None
    jobs = [(plan.kernel_cls, plan.cfg)] + [(c, g) for c, g in bwd.jobs if hasattr(g, "varlen")]
    assert len(jobs) == 4 and all(g.varlen for _, g in jobs)
    for cls, cfg in jobs:
        ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx, cls.__name__
        assert ".local" not in ptx, f"{cls.__name__}: local memory in PTX"
        _no_spills(ptx)


@pytest.mark.parametrize("d,hq", [(512, 64), (1024, 8)])
def test_sm90_group_split_compiles(d, hq):
    """dV and dK with the head group split over CTAs (`group_split`): fp32 partial sums stored
    (st.global.b32), WGMMA and TMA, no local memory, no spills."""
    p = AttnProblem(dtype="bf16", batch=1, heads_q=hq, heads_kv=1, seqlen_q=1024,
                    seqlen_kv=1024, head_dim=d, head_dim_v=d, causal=True)
    plan = dispatch.plan_bwd(p, target="sm_90a", opts=Options(deterministic=True))
    jobs = [(c, g) for c, g in plan.jobs if getattr(g, "group_split", False)]
    assert [c.__name__ for c, _ in jobs] == ["FFPABwdDKSm90", "FFPABwdDVSm90"]
    for cls, cfg in jobs:
        ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
        assert "st.global.b32" in ptx and "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
        assert ".local" not in ptx, "local memory in PTX"
        _no_spills(ptx)


@pytest.mark.parametrize("d,causal", SM90_CASES)
def test_sm90_compiles_with_wgmma_tma_and_no_spills(d, causal):
    """The WGMMA forward: m64n128k16 QK and m64nNk16 PV WGMMAs (a share wider than 256
    columns as m64n96: `wide_o`, with `setmaxnreg` S 152 / O 176), TMA loads, stmatrix for
    P, no mma.sync, no local memory, no ptxas spills (384 threads: at most 168 registers at
    launch)."""
    plan = _plan("sm_90a", d, causal)
    cfg = plan.cfg
    assert plan.kernel_cls.__name__ == "FFPAFwdSm90" and cfg.o_split == (1 if d <= 576 else 2)
    assert cfg.wide_o == (512 < d <= 576)
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    for w in cfg.dv_halves:
        assert f"wgmma.mma_async.sync.aligned.m64n{sm90_config.pv_atom_n(w)}k16" in ptx
    assert ("setmaxnreg.inc.sync.aligned.u32 176" in ptx.replace("\t", "")) == cfg.wide_o
    assert ("setmaxnreg.dec.sync.aligned.u32 152" in ptx.replace("\t", "")) == cfg.wide_o
    assert "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16" in ptx
    assert "cp.async.bulk.tensor" in ptx and "stmatrix" in ptx
    assert "mma.sync" not in ptx and "tcgen05" not in ptx
    assert ".local" not in ptx, "local memory in PTX"
    _no_spills(ptx)


def test_sm90_streamed_q_below_512_compiles():
    """stream_q at D <= 512 (a tuning variant: Q's smem goes to the V rings) builds spill-free."""
    plan = _plan("sm_90a", 512, True)
    cfg = dataclasses.replace(plan.cfg, stream_q=True, v_stages=3)
    assert sm90_config.can_implement(cfg) is None
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    assert "cp.async.bulk.tensor" in ptx and ".local" not in ptx
    _no_spills(ptx)


def _bwd_jobs(p, target="sm_90a"):
    """{kernel class name: (class, config)} of the atomic-free backward plan
    (`deterministic`)."""
    plan = dispatch.plan_bwd(p, target=target, opts=Options(deterministic=True))
    assert plan.reason is None, plan.reason
    return {cls.__name__: (cls, cfg) for cls, cfg in plan.jobs}


@pytest.mark.parametrize("d,causal", [(320, False), (512, True)])
def test_sm90_dv_kernel_compiles(d, causal):
    """The backward's dV kernel (the forward's skeleton, other roles): wgmma + TMA, no spills."""
    cls, cfg = _bwd_jobs(_problem(d, causal, 2, 2))["FFPABwdDVSm90"]
    ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and ".local" not in ptx
    _no_spills(ptx)


@pytest.mark.parametrize("d,causal", [(264, True), (512, False), (320, False)])
@pytest.mark.parametrize("grad", ["dq", "dk"])
def test_sm90_dq_dk_kernels_compile(d, causal, grad):
    """The backward's dQ and dK kernels: two score products on one S ring (dQ: m64n64k16 into
    two accumulators; dK at D <= 512 with `seq_scores`: m64n128k16 into one), the gradient
    accumulated by m64nNk16 WGMMAs; each block's LSE / Delta loaded before its first WGMMA;
    no spills."""
    name = "FFPABwdDQSm90" if grad == "dq" else "FFPABwdDKSm90"
    cls, cfg = _bwd_jobs(_problem(d, causal))[name]
    assert cfg.tile_n == (128 if grad == "dk" else 64) and cfg.seq_scores == (grad == "dk")
    ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.tile_n}k16" in ptx and ".local" not in ptx
    lines = ptx.splitlines()
    first_load = min(i for i, ln in enumerate(lines) if "ld.global" in ln)
    first_wgmma = min(i for i, ln in enumerate(lines) if "wgmma.mma_async" in ln)
    assert first_load < first_wgmma
    _no_spills(ptx)


def test_sm90_dv_not_d_compiles():
    """MLA-absorbed D = 576, Dv = 512: QK over nine 64-wide chunks (Q resident: K 3 / V 2
    stages), O 512 wide; D = 1024 with Dv = 512 streams Q (resident would not fit)."""
    p = _problem(576, True, 128, 1, dv=512)
    plan = dispatch.plan_fwd(p, target="sm_90a")
    assert plan.cfg.head_dim_v == 512 and not plan.cfg.stream_q
    assert (plan.cfg.k_stages, plan.cfg.v_stages) == (3, 2)
    assert dispatch.plan_fwd(_problem(1024, True, 8, 1, dv=512), target="sm_90a").cfg.stream_q
    ptx = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and ".local" not in ptx
    _no_spills(ptx)


@pytest.mark.parametrize("d,causal", [(1024, True), (640, False)])
def test_sm90_kv_pair_compiles(d, causal):
    """`kv_pair` (the forward above D=576): a 2-CTA cluster that exchanges row statistics (st.async) and P
    (a shared::cluster bulk copy), with cluster barriers; wgmma, no spills. On by default
    (`Options.kv_pair`); switched off, the planner does not pair."""
    p = _problem(d, causal, 2, 2)
    assert not dispatch.plan_fwd(p, target="sm_90a", opts=Options(kv_pair=False)).cfg.kv_pair
    plan = dispatch.plan_fwd(p, target="sm_90a")
    cfg = plan.cfg
    assert cfg.kv_pair and cfg.o_split == 2 and cfg.p_slots == 4
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    for needle in ("wgmma.mma_async", "st.async", "cp.async.bulk.shared::cluster.shared::cta",
                   "barrier.cluster.arrive", "mapa"):
        assert needle in ptx, needle
    assert ".local" not in ptx
    _no_spills(ptx)


@pytest.mark.parametrize("d,fields,cta", [(640, dict(cta_align=64, split_align=8), 320),
                                          (584, dict(cta_align=64, split_align=64), 320),
                                          (648, dict(cta_align=32, split_align=64), 352)])
def test_sm90_line_aligned_cta_share_compiles(d, fields, cta):
    """The CTA pair with the second CTA's columns from a 128-byte line (`cta_align` 64; with
    `split_align` 64 its hi share too: 192 + 128, as planned) or a 64-byte half line
    (`cta_align` 32, as planned at D % 128 == 8): wgmma of the planned widths, the pair's
    exchange, no spills."""
    p = _problem(d, False, 2, 2)
    plan = dispatch.plan_fwd(p, target="sm_90a")
    cfg = dataclasses.replace(plan.cfg, **fields)
    assert sm90_config.can_implement(cfg) is None and cfg.dv_cta == cta and cfg.kv_pair
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    for w in cfg.dv_halves:
        assert f"wgmma.mma_async.sync.aligned.m64n{w}k16" in ptx
    assert "st.async" in ptx and ".local" not in ptx
    _no_spills(ptx)


@pytest.mark.parametrize("d", [280, 504])
def test_sm90_widened_forward_compiles(d):
    """The forward `launch.widened_fwd` runs at D % 16 == 8: scores over D + 8 columns, V and O
    D wide (head_dim_v = D, allowed only as head_dim - 8): QK's wgmma k16 over D + 8, PV's at
    the planned O widths, no spills."""
    p = dataclasses.replace(_problem(d, False, 2, 2), head_dim=d + 8)
    plan = dispatch.plan_fwd(p, target="sm_90a")
    cfg = plan.cfg
    assert cfg.head_dim_v == d and cfg.dv == d and cfg.split_align == 64
    assert "head_dim_v" in sm90_config.can_implement(dataclasses.replace(cfg, head_dim_v=d - 16))
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    for w in cfg.dv_halves:
        assert f"wgmma.mma_async.sync.aligned.m64n{w}k16" in ptx
    assert ".local" not in ptx
    _no_spills(ptx)


def test_kv_pair_config_rules():
    c = sm90_config.FwdConfigSm90(arch="sm_90a", dtype="bf16", head_dim=512, causal=False,
                                  kv_pair=True)
    assert "kv_pair" in sm90_config.can_implement(c)  # one CTA per tile: nothing to pair
    big = dataclasses.replace(c, head_dim=1024, stream_q=True, k_stages=4, v_stages=3,
                              publish_after=16)
    assert "smem" in sm90_config.can_implement(big)  # four P slots: V rings must shrink
    assert sm90_config.can_implement(dataclasses.replace(big, v_stages=2)) is None


@pytest.mark.parametrize("arch,d", [("sm_90a", 512), ("sm_80", 264), ("sm_120a", 1024)])
def test_fused_delta_compiles(arch, d):
    """Delta = rowsum(dO * O) (`common/delta.py`): 16-byte loads, a warp butterfly, no local
    memory, on every arch."""
    from ffpa_cute.common.config import DeltaConfig

    cfg = DeltaConfig(arch, "bf16", d)
    ptx = dispatch.kernel_class(cfg).compile(cfg, options="--keep-ptx").__ptx__
    assert "ld.global" in ptx and ".v4" in ptx and "shfl.sync.bfly" in ptx
    assert ".local" not in ptx


def test_sm90_backward_dv_not_d_compiles():
    """MLA 576 / 512 backward: dQ / dK with the second score product over Dv (8 chunks after
    the 9 of D), dV accumulating Dv columns; wgmma, no spills. The Split-D backward (equal D
    only) does not take it."""
    p = _problem(576, True, 128, 1, dv=512)
    assert "head_dim_v" in dispatch.plan_bwd(p, target="sm_80").reason
    jobs = _bwd_jobs(p)
    assert jobs["FFPABwdDQSm90"][1].second_dim == 512 == jobs["FFPABwdDKSm90"][1].second_dim
    assert jobs["FFPABwdDVSm90"][1].head_dim_v == 512
    for name in ("FFPABwdDQSm90", "FFPABwdDKSm90", "FFPABwdDVSm90"):
        cls, cfg = jobs[name]
        ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
        assert "wgmma.mma_async" in ptx and ".local" not in ptx
        _no_spills(ptx)


@pytest.mark.parametrize("d", [640, 1024])
def test_sm90_backward_above_512_compiles(d):
    """D > 576 backward: dQ, dK and dV with the gradient split over a 2-CTA cluster that splits
    the column blocks (`kv_pair`: the P / dS tile crosses to the peer by a shared::cluster
    bulk copy); wgmma, no local memory, no spills. Above BWD_MAX_HEAD_DIM the planner
    refuses."""
    p = _problem(d, True)
    with pytest.raises(ValueError, match="sm90 backward"):
        sm90_config.plan_dq(dataclasses.replace(p, head_dim=1032, head_dim_v=1032))
    for name, (cls, cfg) in _bwd_jobs(p).items():
        if name == "RowDot":  # Delta
            continue
        assert cfg.o_split == 2 and cfg.kv_pair and cfg.cluster_pair, name
        assert cfg.pair_barriers == ("bar_pp",)  # no row statistics to join
        ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
        assert "wgmma.mma_async" in ptx and ".local" not in ptx, name
        assert "cp.async.bulk.shared::cluster" in ptx, name
        _no_spills(ptx)


@pytest.mark.parametrize("d,fields", [(512, dict(window_lo=-1024, causal=True)),
                                      (320, dict(window_lo=-100, window_hi=50, has_sinks=True)),
                                      (1024, dict(window_lo=-300, has_sinks=True))])
def test_sm90_window_and_sinks_compile(d, fields):
    """A sliding window (left edge: the `window` field, its runtime edge; right edge: the causal
    rule) and sinks in the forward, the window in the three gradient kernels: wgmma + TMA, no
    local memory, no spills; the left edge's blocks are skipped, so the forward's block count
    is the difference of two bounds (max.s32 of it in the PTX)."""
    p = dataclasses.replace(_problem(d, False, 2, 2), **fields)
    plan = dispatch.plan_fwd(p, target="sm_90a")
    assert plan.cfg.window == ("window_lo" in fields) and plan.cfg.sinks == p.has_sinks
    jobs = [(plan.kernel_cls, plan.cfg)] + list(_bwd_jobs(p).values())[1:]
    for cls, cfg in jobs:
        ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx, cls.__name__
        assert ".local" not in ptx, cls.__name__
        _no_spills(ptx)


@pytest.mark.parametrize("d,dv,page", [(512, None, None), (512, None, 64), (576, 512, 256),
                                       (1024, None, 128)])
def test_sm90_decode_compiles(d, dv, page):
    """The split-KV decode kernel (contiguous cache, or paged: the block table read for each
    K chunk and V stage): wgmma + TMA, O stored as fp32 partials (32-bit stores), no local
    memory, no spills;
    pages that a KV block would straddle are refused."""
    p = _problem(d, False, 4, 4, dv=dv)
    plan = dispatch.plan_decode(p, page, target="sm_90a")
    assert plan.reason is None, plan.reason
    cfg = plan.cfg
    assert cfg.tile_n == (64 if page == 64 else 128) and cfg.out_dtype == "fp32"
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and ".local" not in ptx
    assert "st.global.b32" in ptx
    _no_spills(ptx)
    assert "pages of a multiple" in dispatch.plan_decode(p, 96, target="sm_90a").reason
    window = dataclasses.replace(p, window_lo=-5)
    assert "no window or sinks" in dispatch.plan_decode(window, None, target="sm_90a").reason


@pytest.mark.parametrize("target", ["sm_90a", "sm_80"])
def test_split_combine_compiles(target):
    """The decode's split combine (common/combine.py): 16-byte loads of the fp32 partials,
    warp shuffles, exp2 / log2; compiles for any arch; bad configs are refused."""
    from ffpa_cute.common.combine import SplitCombine
    from ffpa_cute.common.config import CombineConfig

    ptx = SplitCombine.compile(CombineConfig(target, "bf16", 512), options="--keep-ptx").__ptx__
    assert "ld.global.v4" in ptx and "shfl.sync.bfly" in ptx and "ex2.approx" in ptx
    assert "lg2.approx" in ptx and ".local" not in ptx
    with pytest.raises(ValueError, match="head_dim_v"):
        SplitCombine(CombineConfig(target, "bf16", 510))


def test_sm90_decode_chunked_prefill_compiles():
    """The decode kernel with `causal` (chunked prefill: row r is query r % Nq at key
    position seqlen - Nq + r % Nq): the per-row mask (a remainder by the runtime Nq), no
    local memory, no spills; the mask-free kernels' code does not change with it."""
    p = dataclasses.replace(_problem(512, False, 4, 4), causal=True)
    plan = dispatch.plan_decode(p, 64, target="sm_90a")
    assert plan.reason is None and plan.cfg.causal
    ptx = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__
    assert "wgmma.mma_async" in ptx and "rem.s32" in ptx and ".local" not in ptx
    _no_spills(ptx)


@pytest.mark.parametrize("d,dv,page,dtype", [(512, None, 64, "bf16"), (576, 512, None, "bf16"),
                                             (1024, None, 128, "bf16"), (320, None, 64, "fp16")])
def test_sm90_decode_fp8_cache_compiles(d, dv, page, dtype):
    """The row-tiled decode kernel on an e4m3 cache under 16-bit queries (64 rows per KV head:
    fewer take the keys-as-rows kernel, tests/test_decode_keys.py): the TMA loads 8-bit
    stages, the warpgroups convert them by bits (prmt / lop3 and a packed multiply, no cvt
    from e4m3) into the 16-bit buffers of the bf16 / fp16 WGMMAs; no local memory, no spills.
    O halves that the conversion runs cannot tile (D=264) are refused."""
    p = dataclasses.replace(_problem(d, False, 4, 4, dv=dv, dtype=dtype), seqlen_q=64)
    plan = dispatch.plan_decode(p, page, target="sm_90a", kv_dtype="e4m3")
    assert plan.reason is None, plan.reason
    cfg = plan.cfg
    assert cfg.kv_dtype == "e4m3" and cfg.tile_n == 64
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    kind = {"bf16": "bf16", "fp16": "f16"}[dtype]
    assert f"wgmma.mma_async.sync.aligned.m64n64k16.f32.{kind}.{kind}" in ptx
    assert "prmt.b32" in ptx and f"mul.rn.{kind}x2" in ptx and "e4m3x2" not in ptx
    assert "cp.async.bulk.tensor" in ptx and ".local" not in ptx
    _no_spills(ptx)
    odd = dataclasses.replace(_problem(264, False, 4, 4), seqlen_q=64)
    assert "multiple of 32" in dispatch.plan_decode(odd, None, target="sm_90a",
                                                     kv_dtype="e4m3").reason


@pytest.mark.parametrize("target,d,fields", [
    ("sm_90a", 520, dict(window_lo=-200, causal=True, has_sinks=True)),
    ("sm_80", 320, dict(window_lo=-64, window_hi=16, has_sinks=True)),
    ("sm_120a", 1024, dict(window_lo=-100, causal=True))])
def test_splitd_window_and_sinks_compile(target, d, fields):
    """The Split-D family with a window and sinks: the forward (sinks in its epilogue) and the
    dQ / dK / dV kernels (the window's bounds and masks) build with mma.sync, no local memory
    and no spills (D=520 on sm_90a under `Options(family="sm80")`)."""
    p = dataclasses.replace(_problem(d, False, 2, 1), **fields)
    opts = Options(family="sm80") if target == "sm_90a" else Options()
    plan = dispatch.plan_fwd(p, target=target, opts=opts)
    assert plan.reason is None, plan.reason
    assert plan.kernel_cls.__name__ == "FFPAFwdSm80"
    assert plan.cfg.window == ("window_lo" in fields) and plan.cfg.sinks == p.has_sinks
    jobs = [(plan.kernel_cls, plan.cfg)]
    if not target.startswith("sm_12"):  # the sm120 family routes no backward
        bwd = dispatch.plan_bwd(p, target=target, opts=opts)
        assert bwd.reason is None, bwd.reason
        jobs += bwd.jobs[1:]
    for cls, cfg in jobs:
        ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
        assert "mma.sync.aligned.m16n8k16" in ptx and ".local" not in ptx, cls.__name__
        res = _ptxas_spills(ptx, target)
        if res is not None:
            assert res[0] == 0 and res[1] == 0, (cls.__name__, res)


@pytest.mark.parametrize("dtype,d,causal", [("bf16", 512, False), ("bf16", 320, True),
                                            ("e4m3", 512, True), ("e4m3", 320, False)])
def test_lazy_rescale_compiles(dtype, d, causal):
    """`lazy_rescale` (common/softmax.py, Note [Lazy rescaling]) on the 16-bit and FP8
    forwards (e4m3 D=320 unmasked: the `overlap` schedule): planned for both at D=320 / 512
    (LAZY_RESCALE_HEAD_DIMS); the O warpgroups test each row's factor against 1 before
    rescaling it, no spills, WGMMAs not serialised; refused by the gradient kernels and with
    `kv_pair`."""
    kw = dict(out_dtype="bf16") if dtype == "e4m3" else {}
    p = AttnProblem(dtype=dtype, batch=1, heads_q=2, heads_kv=2, seqlen_q=4096, seqlen_kv=4096,
                    head_dim=d, head_dim_v=d, causal=causal, **kw)
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options())
    assert plan.cfg.lazy_rescale   # routed: the plain forward at 320 / 512
    cfg = dataclasses.replace(plan.cfg, lazy_rescale=True)
    assert sm90_config.can_implement(cfg) is None
    ones = lambda ptx: len(re.findall(r"setp\.\w+\.f32\s+%p\d+, %r\d+, 0f3F800000;", ptx))  # noqa: E731
    base = plan.kernel_cls.compile(dataclasses.replace(plan.cfg, lazy_rescale=False),
                                   options="--keep-ptx").__ptx__
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    assert ones(ptx) > ones(base)
    assert ".local" not in ptx
    _no_spills(ptx)
    log = _ptxas_log(ptx, "sm_90a")
    assert log is None or "serialized" not in log, log
    wide = dispatch.plan_fwd(dataclasses.replace(p, head_dim=1024, head_dim_v=1024),
                             target="sm_90a", opts=Options()).cfg   # the CTA pair: kv_pair
    assert wide.kv_pair and "lazy_rescale" in sm90_config.can_implement(
        dataclasses.replace(wide, lazy_rescale=True))
    dq = sm90_config.plan_dq(p, "sm_90a") if dtype == "bf16" else None
    if dq is not None:
        assert "lazy_rescale" in sm90_config.can_implement(
            dataclasses.replace(dq, lazy_rescale=True))


@pytest.mark.parametrize("d", [520, 576])
def test_sm90_wide_gradient_kernels_compile(d):
    """The dQ, dK and dV kernels with their gradient in one CTA above 512 (`wide_o`, as
    planned: `WIDE_BWD`): 288-column shares as m64n96 WGMMAs, `setmaxnreg` S 152 / O 176,
    wgmma + TMA, no cluster, no spills."""
    jobs = _bwd_jobs(_problem(d, True))
    cfgs = [jobs[n][1] for n in ("FFPABwdDQSm90", "FFPABwdDKSm90", "FFPABwdDVSm90")]
    assert all(c.wide_o and c.o_split == 1 and not c.kv_pair for c in cfgs)
    for name in ("FFPABwdDQSm90", "FFPABwdDKSm90", "FFPABwdDVSm90"):
        cls, cfg = jobs[name]
        assert sm90_config.can_implement(cfg) is None
        ptx = cls.compile(cfg, options="--keep-ptx").__ptx__.replace("\t", "")
        assert "wgmma.mma_async.sync.aligned.m64n96k16" in ptx, name
        assert "setmaxnreg.inc.sync.aligned.u32 176" in ptx and "barrier.cluster" not in ptx
        assert ".local" not in ptx, name
        _no_spills(ptx)
