"""The fused sm90 backward (sm90/bwd_fused_sm90.py) on the CPU: its config, planner and route
(`Options.deterministic`), its compile for sm_90a (the instructions it is made of, no spills,
no serialised WGMMAs), the host path `launch.run_bwd` takes for it (a zeroed fp32 dq_acc, cast
to dQ after) with the kernel replaced by a torch emulation of its decomposition, and the
executable model of its hand-overs (sm90/fused_protocol.py). Its GPU tests are in
test_backward_sm90_gpu.py (`test_fused_*`).
"""

import dataclasses
import math
import re

import pytest
import torch

from ffpa_cute import dispatch, launch
from ffpa_cute.common.config import DeltaConfig
from ffpa_cute.problem import AttnProblem
from ffpa_cute.options import Options
from ffpa_cute.reference import attention_grads, attention_ref, rel_err
from ffpa_cute.sm90 import config as c90
from ffpa_cute.sm90 import fused_config as f90
from test_kernels_compile import _no_spills, _ptxas_log, _ptxas_spills


def _problem(d, causal=False, dtype="bf16", **kw):
    return AttnProblem(dtype=dtype, batch=1, heads_q=4, heads_kv=2, seqlen_q=300, seqlen_kv=300,
                       head_dim=d, head_dim_v=kw.pop("dv", d), causal=causal, **kw)


def test_plan_and_constraints():
    """Two Q stages; two dO stages up to D=384, one from 448 (what fits 227 KB beside the 16 KB
    of dQ staging); the dQ share
    in chunks of whole swizzle atoms; D a multiple of 64 in (256, 576]; a window's left edge as
    a field; no Dv != D, no varlen."""
    for d, ds, chunks in ((320, 2, (160,)), (384, 2, (128, 64)), (448, 1, (128, 96)),
                          (512, 1, (128, 128))):
        cfg = f90.plan_bwd_fused(_problem(d))
        assert (cfg.q_stages, cfg.do_stages, cfg.dq_chunks) == (2, ds, chunks)
        assert cfg.smem_bytes() <= c90.SMEM_CAPACITY and sum(chunks) == d // 2
        assert all(w % cfg.atom_cols == 0 for w in chunks)
    assert f90.plan_bwd_fused(_problem(512, causal=True)).causal
    assert f90.plan_bwd_fused(_problem(512, window_lo=-8)).window
    for d in (264, 288, 640, 256):
        assert "head_dim" in f90.can_implement_fused(
            f90.BwdFusedConfigSm90("sm_90a", "bf16", d, False))
    assert "sm_90a" in f90.can_implement_fused(f90.BwdFusedConfigSm90("sm_80", "bf16", 512,
                                                                        False))
    assert "shared memory" in f90.can_implement_fused(
        f90.BwdFusedConfigSm90("sm_90a", "bf16", 512, False, do_stages=2))
    for kw in (dict(dv=256), dict(varlen=True)):
        with pytest.raises(ValueError):
            f90.plan_bwd_fused(_problem(512, **kw))
    assert "dq_grads" in f90.can_implement_fused(
        f90.BwdFusedConfigSm90("sm_90a", "bf16", 512, False, do_stages=1, dq_grads=3))


def test_dq_staging_fields(monkeypatch):
    """The dQ staging fields: three buffers with dq_grads 1 only, 8 KB more (not at D=512
    beside one dO stage), four with dq_grads 2; pairs with dq_grads 1 / 2; the next atom ahead
    where `dq_ahead_fits` (D=320's halves); planned where they build with FUSED_DQ_STAGING,
    else two buffers, 4-byte stores, one atom at a time (the code verified before them)."""
    def bare(d):
        return dataclasses.replace(f90.plan_bwd_fused(_problem(d)), dq_buffers=2,
                                   dq_pairs=False, dq_ahead=False)

    for grads, d, why in ((0, 320, "dq_buffers"), (2, 320, "dq_buffers"),
                          (1, 512, "shared memory"), (1, 320, None), (1, 448, None)):
        cfg = dataclasses.replace(bare(d), dq_grads=grads, dq_buffers=3)
        got = f90.can_implement_fused(cfg)
        assert (got is None) if why is None else why in got, (grads, d, got)
    # four with dq_grads 2 (two for each warpgroup), not with 1; D=512 has no room
    for grads, d, why in ((1, 320, "dq_buffers"), (0, 320, "dq_buffers"),
                          (2, 512, "shared memory"), (2, 320, None), (2, 448, None)):
        cfg = dataclasses.replace(bare(d), dq_grads=grads, dq_buffers=4)
        got = f90.can_implement_fused(cfg)
        assert (got is None) if why is None else why in got, (grads, d, got)
    assert "dq_buffers" in f90.can_implement_fused(dataclasses.replace(bare(320), dq_buffers=5))
    assert "dq_pairs" in f90.can_implement_fused(dataclasses.replace(bare(320), dq_grads=0,
                                                                     dq_pairs=True))
    for d, grads, ok in ((320, 1, True), (320, 2, False), (384, 1, False), (512, 1, False)):
        got = f90.can_implement_fused(dataclasses.replace(bare(d), dq_grads=grads,
                                                          dq_ahead=True))
        assert (got is None) == ok and (ok or "dq_ahead" in got), (d, grads, got)
    # planned: three buffers where they fit (D=320 / 384 with dq_grads 1; not 448, which
    # plans 2, nor 512, no room), pairs wherever the dV / dK warpgroups stage, ahead at 320
    staging = [(c.dq_buffers, c.dq_pairs, c.dq_ahead)
               for c in (f90.plan_bwd_fused(_problem(d)) for d in (320, 384, 448, 512))]
    assert staging == [(3, True, True), (3, True, False), (2, True, False), (2, True, False)]
    assert f90.fit_dq_staging(dataclasses.replace(f90.plan_bwd_fused(_problem(320)),
                                                  dq_grads=2)) == dataclasses.replace(
        bare(320), dq_grads=2, dq_pairs=True)
    assert f90.fit_dq_staging(dataclasses.replace(bare(320), dq_grads=0)) == \
        dataclasses.replace(bare(320), dq_grads=0)
    expect = [bare(d) for d in (320, 384, 448, 512)]
    monkeypatch.setattr(f90, "FUSED_DQ_STAGING", False)
    assert [f90.plan_bwd_fused(_problem(d)) for d in (320, 384, 448, 512)] == expect


def test_wide_pair_plan():
    """D=576 over the pair (`wide`: 288 columns a CTA): one Q and one dO stage (two Q stages
    do not fit 227 KB), dQ by the dV warpgroup, the registers `reg_split`'s wide row gives
    (dK / dV 192, S 120: what compiled without spills), no window (its masks spill the S
    warpgroup); GPU-tested and sanitizer-clean in bf16 and fp16 (VERIFIED), routed by
    default."""
    cfg = f90.plan_bwd_fused(_problem(576, causal=True))
    assert cfg.wide and (cfg.q_stages, cfg.do_stages, cfg.dq_grads) == (1, 1, 1)
    assert cfg.smem_bytes() <= c90.SMEM_CAPACITY
    assert "shared memory" in f90.can_implement_fused(dataclasses.replace(cfg, q_stages=2))
    assert cfg.reg_split == (120, 192, 192) and cfg.dq_widths == (32,)
    assert cfg.VERIFIED and f90.plan_bwd_fused(_problem(576, True, "fp16")).VERIFIED
    for fields in (dict(window=True), dict(dq_grads=2), dict(dq_grads=0)):
        assert "256 columns" in f90.can_implement_fused(dataclasses.replace(cfg, **fields))
    with pytest.raises(ValueError):
        f90.plan_bwd_fused(_problem(576, window_lo=-8))
    assert not f90.plan_bwd_fused(_problem(512)).wide
    assert f90.fused_pays(_problem(576)) and not f90.fused_pays(_problem(640))


def test_planned_variants_follow_their_switches(monkeypatch):
    """`plan_bwd_fused` plans `dq_grads` FUSED_DQ_GRADS (1: measured fastest; 2 at D=448,
    FUSED_DQ_GRADS_BY_DIM) and `group_split` only with FUSED_GROUP_SPLIT on (off: measured
    not worth it) and where `group_parts` splits the problem (MQA 64:1 at 8K: yes; MHA: no),
    except where `row_units` splits the groups' sums (MQA causal)."""
    mqa = AttnProblem(dtype="bf16", batch=1, heads_q=64, heads_kv=1, seqlen_q=8192,
                      seqlen_kv=8192, head_dim=512, head_dim_v=512, causal=True)
    mha = dataclasses.replace(mqa, heads_q=32, heads_kv=32)
    cfg = f90.plan_bwd_fused(mqa)
    assert (cfg.dq_grads, cfg.group_split) == (1, False)
    monkeypatch.setattr(f90, "FUSED_DQ_GRADS", 2)
    monkeypatch.setattr(f90, "FUSED_GROUP_SPLIT", True)
    full = dataclasses.replace(mqa, causal=False)
    assert (f90.plan_bwd_fused(full).dq_grads, f90.plan_bwd_fused(full).group_split) == (2, True)
    assert f90.plan_bwd_fused(mqa).row_units and not f90.plan_bwd_fused(mqa).group_split
    assert not f90.plan_bwd_fused(mha).group_split
    monkeypatch.setattr(f90, "FUSED_DQ_GRADS", 1)
    d448 = dataclasses.replace(mha, head_dim=448, head_dim_v=448)
    assert f90.plan_bwd_fused(d448).dq_grads == f90.FUSED_DQ_GRADS_BY_DIM[448] == 2


def test_row_units_rule():
    """`row_units` (one CTA pair per (query block row, key tile), dK / dV added into fp32
    workspaces) for causal head groups of FUSED_ROW_UNITS_MIN_GROUP (16) or more, as measured:
    not below it, not without causal masking, not under a window (its walks are of one length),
    never with `group_split` or `scatter`; VERIFIED (GPU-tested, sanitizer-clean on an H100)."""
    mqa = AttnProblem(dtype="bf16", batch=1, heads_q=64, heads_kv=1, seqlen_q=8192,
                      seqlen_kv=8192, head_dim=512, head_dim_v=512, causal=True)
    assert f90.FUSED_ROW_UNITS_MIN_GROUP == 16
    for hq, hkv, fields, rows in ((64, 1, {}, True), (32, 1, {}, True), (64, 2, {}, True),
                                  (16, 1, {}, True), (64, 4, {}, True), (32, 4, {}, False),
                                  (8, 1, {}, False),
                                  (64, 1, dict(causal=False), False),
                                  (64, 1, dict(window_lo=-1000), False),
                                  (64, 1, dict(head_dim=320, head_dim_v=320), True),
                                  (64, 1, dict(head_dim=576, head_dim_v=576), True),
                                  (64, 1, dict(head_dim=336, head_dim_v=336), True)):
        p = dataclasses.replace(mqa, heads_q=hq, heads_kv=hkv, **fields)
        cfg = f90.plan_bwd_fused(p)
        assert cfg.row_units == rows, (hq, hkv, fields)
        assert not cfg.group_split
        assert cfg.VERIFIED
        routed = dispatch.plan_bwd(p, target="sm_90a", opts=Options(family="sm90"))
        assert routed.cfgs[-1] == cfg
    assert not f90.plan_bwd_fused(mqa, cluster_d=4, scatter=True).row_units
    # above FUSED_MAX_GROUP (64) routed by row units only: causal without a window
    for fields, fused in ((dict(), True), (dict(causal=False), False),
                          (dict(window_lo=-1000), False)):
        p = dataclasses.replace(mqa, heads_q=128, **fields)
        routed = dispatch.plan_bwd(p, target="sm_90a", opts=Options(family="sm90"))
        assert (type(routed.cfgs[-1]).__name__ == "BwdFusedConfigSm90") == fused, fields
        assert not fused or routed.cfgs[-1].row_units
    cfg = f90.plan_bwd_fused(mqa)
    for fields in (dict(group_split=True), dict(scatter=True, cluster_d=4)):
        assert "row_units" in f90.can_implement_fused(dataclasses.replace(cfg, **fields))


def test_row_units_compile_to_reductions(tmp_path, monkeypatch):
    """`row_units`: sm_90a PTX that adds dK / dV with fp32 reductions from registers (column
    pairs, red.global.add.v2.f32) and stores no 16-bit dK / dV, WGMMAs not serialised, at D=320
    (the dK warpgroup's 48 spare registers, `reg_split`), 512 and 576 (`wide`); no spills but
    at 576, whose 32 B (44 B reloaded) no register split removed (`reg_split`; measured 160 ->
    273 TFLOPS at MQA 64:1 with them): bounded here."""
    monkeypatch.chdir(tmp_path)
    for d in (320, 512, 576):
        p = AttnProblem(dtype="bf16", batch=1, heads_q=64, heads_kv=1, seqlen_q=4096,
                        seqlen_kv=4096, head_dim=d, head_dim_v=d, causal=True)
        cfg = f90.plan_bwd_fused(p)
        assert cfg.row_units
        ptx = dispatch.kernel_class(cfg).compile(cfg, options="--keep-ptx").__ptx__
        assert re.search(r"red\.relaxed\.gpu\.global\.add\.v2\.f32", ptx), "no fp32 red"
        assert "st.global.b16" not in ptx and "wgmma.mma_async" in ptx
        if d == 576:
            stores, loads, regs = _ptxas_spills(ptx, "sm_90a") or (0, 0, 0)
            assert stores <= 32 and loads <= 48 and regs <= 168, (stores, loads, regs)
        else:
            _no_spills(ptx)
        log = _ptxas_log(ptx, "sm_90a")
        if log is not None:
            assert "serialized" not in log, log


@pytest.mark.parametrize("d", [320, 384, 448, 512])
def test_dq_shares_and_registers(d):
    """`dq_grads`: the dV / dK warpgroups' shares of dQ are whole swizzle atoms that cover this
    CTA's half once (all in the dV warpgroup with 1; the dV warpgroup the larger with 2); the
    three warpgroups' setmaxnreg counts are multiples of 8 in [24, 256] summing to 504."""
    for g in (0, 1, 2):
        cfg = dataclasses.replace(f90.plan_bwd_fused(_problem(d)), dq_grads=g)
        regs = cfg.reg_split
        assert sum(regs) == 504 and all(r % 8 == 0 and 24 <= r <= 256 for r in regs), regs
        if g == 0:
            assert cfg.dq_widths == cfg.dq_chunks
            with pytest.raises(ValueError, match="dq_grads"):
                cfg.dq_shares
            continue
        (a0, w0), (a1, w1) = cfg.dq_shares
        assert cfg.dq_widths == (cfg.atom_cols,)
        assert a0 == 0 and a1 == w0 and w0 + w1 == cfg.half
        assert w0 % cfg.atom_cols == 0 and w1 % cfg.atom_cols == 0
        assert (w1 == 0) if g == 1 else (0 <= w0 - w1 <= cfg.atom_cols)


# dq_grads 2 at D=512 leaves the S warpgroup 104 registers, which causal / window masks spill
# past: it is compiled there without masks only
@pytest.mark.parametrize("d,causal,dtype,window,dq_grads", [
    (320, True, "bf16", False, 0), (384, False, "bf16", False, 0), (448, False, "bf16", True, 0),
    (512, True, "fp16", False, 0), (512, True, "bf16", True, 0),
    (320, True, "bf16", False, 1), (384, False, "bf16", False, 1), (448, False, "bf16", True, 1),
    (512, True, "fp16", False, 1), (512, True, "bf16", True, 1),
    (320, True, "bf16", False, 2), (448, False, "bf16", True, 2), (512, False, "bf16", False, 2),
    (576, True, "bf16", False, 1), (576, False, "fp16", False, 1)])
def test_compiles_to_its_instructions(tmp_path, monkeypatch, d, causal, dtype, window,
                                      dq_grads):
    """sm_90a PTX: the score products m64n64k16 and dV / dK m64n{D/2}k16 (m64n96 at D=576)
    WGMMAs, the dQ chunks (or with `dq_grads` its swizzle atoms), TMA loads, the partials sent
    by 16-byte st.async into the peer's smem, dQ reduced by TMA reductions from smem (bulk
    groups committed and waited), cluster barriers; no local memory, setmaxnreg as
    `reg_split`, no spills, and ptxas does not serialise the WGMMAs (none is issued under a
    runtime branch or left in flight across one)."""
    monkeypatch.chdir(tmp_path)
    cfg = f90.plan_bwd_fused(_problem(d, causal, dtype, window_lo=-100 if window else None))
    cfg = f90.fit_dq_staging(dataclasses.replace(cfg, dq_grads=dq_grads))
    assert cfg.window == window
    cls = dispatch.kernel_class(cfg)
    ptx = cls.compile(cfg, options="--keep-ptx").__ptx__
    ab = "bf16.bf16" if dtype == "bf16" else "f16.f16"
    for w in {64, c90.pv_atom_n(d // 2), *cfg.dq_widths}:   # dK / dV at D=576: m64n96
        assert f"wgmma.mma_async.sync.aligned.m64n{w}k16.f32.{ab}" in ptx
    red = "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add"
    assert "red.global" not in ptx and "cp.async.bulk.wait_group.read" in ptx
    for op in ("cp.async.bulk.tensor.4d", "st.async.shared::cluster.mbarrier::complete_tx::bytes"
               ".v4.b32", red, "barrier.cluster.arrive",
               "mbarrier.arrive.release.cluster.shared::cluster", "stmatrix.sync.aligned"):
        assert op in ptx, op
    assert ".local" not in ptx
    # registers where dQ is formed: `reg_split`, each above the launch's 168 an .inc
    for regs in cfg.reg_split:
        kind = "inc" if regs > 168 else "dec"
        assert re.search(rf"setmaxnreg\.{kind}\.sync\.aligned\.u32\s+{regs};", ptx), regs
    # the dV / dK warpgroups' pieces: their own barriers (2, 3) with dq_grads
    for which in range(2):
        forms = dq_grads and cfg.dq_shares[which][1]
        assert bool(re.search(rf"bar\.sync\s+{2 + which}, 128", ptx)) == bool(forms)
    _no_spills(ptx)
    log = _ptxas_log(ptx, "sm_90a")
    if log is not None:
        assert "serialized" not in log, log


def test_one_barrier_dq_buffers_compile(tmp_path, monkeypatch):
    """One barrier per staged piece (D=320): `dq_buffers` 3 with dq_grads 1, the dV
    warpgroup's barrier 5 times a block against 10 with two buffers; 4 with dq_grads 2, the dV
    warpgroup's (3 pieces) and the dK warpgroup's (2) 3 and 2 times against 6 and 4 with one
    buffer each; the bulk waits unchanged in number; no spills, no serialised WGMMAs."""
    monkeypatch.chdir(tmp_path)
    base = f90.plan_bwd_fused(_problem(320))
    counts = {}
    for grads, bufs in ((1, 2), (1, 3), (2, 2), (2, 4)):
        cfg = dataclasses.replace(base, dq_grads=grads, dq_buffers=bufs, dq_ahead=False)
        ptx = dispatch.kernel_class(cfg).compile(cfg, options="--keep-ptx").__ptx__
        counts[grads, bufs] = (len(re.findall(r"bar\.sync\s+2, 128", ptx)),
                               len(re.findall(r"bar\.sync\s+3, 128", ptx)),
                               ptx.count("cp.async.bulk.wait_group.read"))
        _no_spills(ptx)
        log = _ptxas_log(ptx, "sm_90a")
        if log is not None:
            assert "serialized" not in log, log
    assert counts[1, 2] == (10, 0, counts[1, 3][2]) and counts[1, 3][:2] == (5, 0), counts
    assert counts[2, 2] == (6, 4, counts[2, 4][2]) and counts[2, 4][:2] == (3, 2), counts


@pytest.mark.parametrize("dq_grads", [0, 1])
def test_group_split_compiles(tmp_path, monkeypatch, dq_grads):
    """`group_split` (head groups over S CTA pairs, partial dK / dV in fp32): sm_90a PTX with
    32-bit dK / dV stores and no 16-bit ones, no spills, WGMMAs not serialised; the config
    gives `group_parts` the pair (o_split 2)."""
    monkeypatch.chdir(tmp_path)
    cfg = f90.fit_dq_staging(dataclasses.replace(f90.plan_bwd_fused(_problem(512, True)),
                                                 group_split=True, dq_grads=dq_grads))
    assert cfg.o_split == 2
    assert c90.group_parts(1, 64, 1, 8192, cfg.o_split) == 2   # MQA 64:1 at 8K: 512 CTAs
    ptx = dispatch.kernel_class(cfg).compile(cfg, options="--keep-ptx").__ptx__
    assert "st.global.b32" in ptx and "st.global.b16" not in ptx
    assert ".local" not in ptx
    _no_spills(ptx)
    log = _ptxas_log(ptx, "sm_90a")
    if log is not None:
        assert "serialized" not in log, log


def _emulate_fused(t: dict, scalars: dict, causal: bool, window: bool):
    """The fused kernel's arithmetic in torch: per KV head and 64-key tile, the query blocks of
    its G query heads (under causal from the block of the first query that sees the tile's
    first key, under a window up to the block of the last query that sees its last key); S^T
    and dP^T as the sum of the two D halves' fp32 partials; the transposed mask (keys past the
    causal edge or left of the window); P^T and dS^T * scale rounded to the 16-bit dtype; dK,
    dV summed in fp32 and stored in their tensors' dtype; dQ added into dq_acc (fp32). dK / dV
    with more heads than K (`group_split`'s fp32 workspaces, S parts per KV head): head y sums
    the query heads of part y % S of KV head y // S."""
    q, k, v, do = (t[n].float() for n in ("q", "k", "v", "do"))
    lse, delta, dq_acc = t["lse"], t["delta"], t["dq_acc"]
    dt = t["q"].dtype
    scale, offset = scalars["softmax_scale"], scalars["causal_offset"]
    b, hq, nq, d = q.shape
    hkv, nkv, half, T = k.shape[1], k.shape[2], d // 2, 64
    heads_out = t["dk"].shape[1]
    parts = heads_out // hkv
    g = hq // heads_out   # query heads per dK / dV head
    for bi in range(b):
        for y in range(heads_out):
            h = y // parts
            for m in range(-(-nkv // T)):
                keys = torch.arange(m * T, min(m * T + T, nkv))
                dk = torch.zeros(len(keys), d)
                dv = torch.zeros(len(keys), d)
                n_top = -(-nq // T)
                if window:
                    seen = max((m + 1) * T - scalars["window_lo"], 0)
                    n_top = min(n_top, -(-seen // T))
                n_low = max(m * T - offset, 0) // T if causal else 0
                for hh in range(y * g, y * g + g):
                    for n in range(n_top - 1, n_low - 1, -1):
                        qs = torch.arange(n * T, min(n * T + T, nq))
                        halves = [slice(0, half), slice(half, d)]
                        st = sum(k[bi, h, keys][:, c] @ q[bi, hh, qs][:, c].T for c in halves)
                        dpt = sum(v[bi, h, keys][:, c] @ do[bi, hh, qs][:, c].T for c in halves)
                        if causal:
                            st = st.masked_fill(keys[:, None] > qs[None, :] + offset,
                                                -math.inf)
                        if window:
                            st = st.masked_fill(
                                keys[:, None] < qs[None, :] + scalars["window_lo"], -math.inf)
                        lse_q = lse[bi, hh, qs].float()
                        lse_q = torch.where(lse_q == -math.inf, math.inf, lse_q)
                        p = torch.exp2(st * scale * math.log2(math.e)
                                       - lse_q[None, :] * math.log2(math.e))
                        ds = p * (dpt - delta[bi, hh, qs][None, :]) * scale
                        p, ds = p.to(dt).float(), ds.to(dt).float()
                        dv += p @ do[bi, hh, qs]
                        dk += ds @ q[bi, hh, qs]
                        dq_acc[bi, hh, qs] += ds.T @ k[bi, h, keys]
                t["dk"][bi, y, keys] = dk.to(t["dk"].dtype)
                t["dv"][bi, y, keys] = dv.to(t["dv"].dtype)


@pytest.mark.parametrize("causal,nq,nkv,left,variant", [
    (True, 129, 200, None, ""), (False, 70, 7, None, ""), (True, 300, 64, None, ""),
    (True, 200, 260, 70, ""), (False, 150, 150, 100, ""), (True, 129, 200, None, "split"),
    (False, 150, 150, 100, "split"), (True, 129, 200, None, "rows"), (True, 300, 64, None, "rows")])
def test_host_path_with_the_kernel_emulated(monkeypatch, causal, nq, nkv, left, variant):
    """`launch.run_bwd` on a plan of the Delta kernel and the fused one: dq_acc zeroed, the
    kernel fed by its OPERANDS names and SCALARS, dQ cast from dq_acc. With the kernel emulated
    (`_emulate_fused`) all three gradients meet the GPU tests' bound against float64, a window
    (`left` keys behind the bottom-right diagonal) included; "split": with `group_split`, dK
    and dV come from fp32 workspaces of 2 parts per KV head, summed by the host; "rows": with
    `row_units`, from zeroed fp32 workspaces of their shapes (the kernel adds into them), cast
    by the host."""
    torch.manual_seed(0)
    d, dt = 320, torch.bfloat16
    q = torch.randn(1, 4, nq, d, dtype=dt)
    k, v = (torch.randn(1, 2, nkv, d, dtype=dt) for _ in range(2))
    do = torch.randn(1, 4, nq, d, dtype=dt)
    offset = nkv - nq
    lo = None if left is None else offset - left
    problem = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=offset,
                                       bounds=None if lo is None else (lo, None))
    s = q.float() @ k.float().repeat_interleave(2, 1).transpose(-1, -2) / math.sqrt(d)
    if causal:
        s = s.masked_fill(torch.arange(nkv)[None, :] > torch.arange(nq)[:, None] + offset,
                          -math.inf)
    if lo is not None:
        s = s.masked_fill(torch.arange(nkv)[None, :] < torch.arange(nq)[:, None] + lo,
                          -math.inf)
    lse = torch.logsumexp(s, -1)
    out = (torch.softmax(s, -1).nan_to_num() @ v.float().repeat_interleave(2, 1)).to(dt)
    split, rows = variant == "split", variant == "rows"
    cfg = dataclasses.replace(f90.plan_bwd_fused(problem), group_split=split, row_units=rows)
    plan = dispatch.BwdPlan(problem, "sm_90a", "sm90",
                            cfgs=(DeltaConfig("sm_90a", "bf16", d), cfg))
    ran = []

    def fake_run_job(cls, cfg, tensors, scalars):
        ran.append(cls.__name__)
        if cls.__name__ == "RowDot":
            tensors["delta"].copy_((tensors["do"].float() * tensors["o"].float()).sum(-1))
        else:
            assert list(cls.OPERANDS) == ["q", "k", "v", "do", "dq_acc", "dk", "dv", "lse",
                                          "delta"]
            assert tensors["dq_acc"].dtype == torch.float32
            assert not tensors["dq_acc"].any()
            heads = tensors["dk"].shape[1]
            assert heads == (4 if split else 2), heads   # S = group_parts = 2: G = 2
            assert tensors["dv"].shape[1] == heads
            assert (tensors["dk"].dtype == torch.float32) == (split or rows)
            if rows:   # added into: zeroed
                assert not tensors["dk"].any() and not tensors["dv"].any()
            assert cfg.window == (lo is not None)
            assert set(cls.SCALARS) <= set(scalars)
            _emulate_fused(tensors, scalars, cfg.causal, cfg.window)

    monkeypatch.setattr(launch, "run_job", fake_run_job)
    dq, dk, dv = launch.run_bwd(plan, q, k, v, out, lse, do)
    assert ran == ["RowDot", "FFPABwdFusedSm90"]
    ref = attention_grads(q, k, v, do, causal, offset, dtype=torch.float64, window_lo=lo)
    base = attention_grads(q, k, v, do, causal, offset, dtype=dt, window_lo=lo)
    for name, x, r, bb in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, base):
        assert x.dtype == dt
        err, base_err = rel_err(x, r), rel_err(bb, r)
        assert err <= 2 * base_err + 1e-3, f"{name} err {err:.3g} vs torch {base_err:.3g}"


@pytest.mark.parametrize("d,causal,nq,nkv,left", [(336, True, 129, 200, None),
                                                   (264, False, 150, 150, 100),
                                                   (520, True, 70, 130, None)])
def test_padded_host_path_with_the_kernel_emulated(monkeypatch, d, causal, nq, nkv, left):
    """D % 64 != 0 on the fused kernel at the next multiple of 64 (`pad`): its config at that
    width, Delta at D on dout and out as they are, the fused kernel (emulated) on q, k, v and
    dout zero-padded to the width, dQ / dK / dV cut back to D: all three meet the GPU tests'
    bound against float64, with the softmax scale of D."""
    torch.manual_seed(1)
    dt = torch.bfloat16
    q, do = (torch.randn(1, 4, nq, d, dtype=dt) for _ in range(2))
    k, v = (torch.randn(1, 2, nkv, d, dtype=dt) for _ in range(2))
    offset = nkv - nq
    lo = None if left is None else offset - left
    problem = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=offset,
                                       bounds=None if lo is None else (lo, None))
    out, lse = attention_ref(q, k, v, causal=causal, causal_offset=offset, window_lo=lo,
                             upcast=torch.float32)
    cfg = f90.plan_bwd_fused(problem, pad=True)
    width = -(-d // 64) * 64
    assert cfg.head_dim == width == f90.fused_head_dim(problem, pad=True)
    plan = dispatch.BwdPlan(problem, "sm_90a", "sm90",
                            cfgs=(DeltaConfig("sm_90a", "bf16", d), cfg))
    assert launch.fused_width(plan) == width
    seen = []

    def fake_run_job(cls, cfg, tensors, scalars):
        seen.append((cls.__name__, tensors["do"].shape[-1]))
        if cls.__name__ == "RowDot":
            tensors["delta"].copy_((tensors["do"].float() * tensors["o"].float()).sum(-1))
            return
        for n in ("q", "k", "v", "do", "dq_acc", "dk", "dv"):
            assert tensors[n].shape[-1] == width, n
        for n in ("q", "k", "v", "do"):
            assert not tensors[n][..., d:].any(), n
        assert scalars["softmax_scale"] == pytest.approx(1 / math.sqrt(d))
        _emulate_fused(tensors, scalars, cfg.causal, cfg.window)

    monkeypatch.setattr(launch, "run_job", fake_run_job)
    dq, dk, dv = launch.run_bwd(plan, q, k, v, out.to(dt), lse, do)
    assert seen == [("RowDot", d), ("FFPABwdFusedSm90", width)]
    ref = attention_grads(q, k, v, do, causal, offset, dtype=torch.float64, window_lo=lo)
    base = attention_grads(q, k, v, do, causal, offset, dtype=dt, window_lo=lo)
    for name, x, r, bb in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, base):
        assert x.shape == r.shape and x.dtype == dt
        err, base_err = rel_err(x, r), rel_err(bb, r)
        assert err <= 2 * base_err + 1e-3, f"{name} err {err:.3g} vs torch {base_err:.3g}"


def test_padded_plan(monkeypatch):
    """`FUSED_PAD` (on by default): the default route plans D % 64 != 0 from 264 on the fused
    kernel at the next multiple of 64 (Delta at D), up to 576 and not with a window at 576;
    with it off those D keep the atomic-free kernels."""
    fast = Options()
    dispatch.clear_plans()
    for d, width in ((264, 320), (336, 384), (520, 576), (568, 576), (512, 512)):
        plan = dispatch.plan_bwd(_problem(d, True), target="sm_90a", opts=fast)
        delta, fused = plan.cfgs
        assert (delta.head_dim, fused.head_dim, launch.fused_width(plan)) == (d, width, width)
    for p in (_problem(520, window_lo=-8), _problem(584), _problem(336, dv=320)):
        assert "BwdFusedConfigSm90" not in [type(c).__name__ for c in dispatch.plan_bwd(
            p, target="sm_90a", opts=fast).cfgs], p
    monkeypatch.setattr(f90, "FUSED_PAD", False)
    dispatch.clear_plans()
    try:
        for d in (264, 336, 520):
            assert "BwdFusedConfigSm90" not in [type(c).__name__ for c in dispatch.plan_bwd(
                _problem(d, True), target="sm_90a", opts=fast).cfgs]
    finally:
        monkeypatch.undo()
        dispatch.clear_plans()


def test_routed_unless_deterministic(monkeypatch):
    """By default (`Options.deterministic` False) the sm90 backward is the fused kernel where it
    builds and measured faster (D 264-576, D % 64 != 0 padded, up to 64 query heads per KV head;
    else the atomic-free kernels); `deterministic=True`, FFPA_CUTE_DETERMINISTIC=1 or torch's
    `use_deterministic_algorithms(True)` keep the atomic-free ones. The canary runs before a
    fused config only while it is not VERIFIED (run, tested, sanitizer-clean)."""
    import torch

    from ffpa_cute import selfcheck
    from ffpa_cute.options import Options, for_backward, from_env

    fast, exact = Options(), Options(deterministic=True)
    assert from_env({"FFPA_CUTE_DETERMINISTIC": "1"}) == exact
    atomic_free = ["BwdDQConfigSm90", "BwdDKConfigSm90", "BwdDVConfigSm90"]
    for d, causal, hkv in ((512, True, 4), (384, False, 4), (320, False, 4), (512, True, 1),
                           (576, True, 4), (336, True, 4), (520, False, 4)):
        p = dataclasses.replace(_problem(d, causal), heads_q=64, heads_kv=hkv)
        plan = dispatch.plan_bwd(p, target="sm_90a")
        assert [type(c).__name__ for c in plan.cfgs] == ["DeltaConfig", "BwdFusedConfigSm90"]
        assert selfcheck.needed(plan, fast) == (not plan.cfgs[-1].VERIFIED)
        kept = dispatch.plan_bwd(p, target="sm_90a", opts=exact)
        assert [type(c).__name__ for c in kept.cfgs[1:]] == atomic_free
        assert not selfcheck.needed(kept, exact) and not selfcheck.unverified(kept)
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        assert for_backward(fast) == exact
        assert dispatch.plan_bwd(p, target="sm_90a").cfgs == kept.cfgs
        monkeypatch.undo()
    for p in (_problem(640), _problem(584), _problem(512, dv=256), _problem(512, varlen=True),
              _problem(576, window_lo=-8),
              dataclasses.replace(_problem(512), heads_q=128, heads_kv=1)):
        plan = dispatch.plan_bwd(p, target="sm_90a", opts=fast)
        assert plan.reason is None and "BwdFusedConfigSm90" not in [
            type(c).__name__ for c in plan.cfgs], p
    # False permits run-to-run variation, it does not require it: the other families keep
    # their (atomic-free) kernels
    assert dispatch.plan_bwd(_problem(512), target="sm_100a", opts=fast).cfgs == \
        dispatch.plan_bwd(_problem(512), target="sm_100a", opts=exact).cfgs


@pytest.mark.parametrize("q_stages,do_stages", [(2, 2), (2, 1), (1, 1), (1, 2)])
def test_protocol_model_runs_clean(q_stages, do_stages):
    """The executable model of the kernel's hand-overs (sm90/fused_protocol.py: both CTAs'
    three warpgroups, TMA and st.async landing in any order, WGMMAs reading until their
    wait_group) finishes without a hang or a hazard for every ring depth, 0-8 query blocks,
    many interleavings."""
    from ffpa_cute.sm90 import fused_protocol

    cfg = f90.BwdFusedConfigSm90("sm_90a", "bf16", 512, True, q_stages=q_stages,
                                 do_stages=do_stages)
    for blocks in (0, 1, 2, 3, 5, 8):
        for seed in range(20):
            fused_protocol.run(cfg, blocks, seed)


@pytest.mark.parametrize("order", ["chunks", "alternating", "dq_grads 1", "dq_grads 2",
                                   "three buffers", "four buffers"])
@pytest.mark.parametrize("d", [320, 384, 448, 512])
def test_protocol_model_dq_staging(d, order):
    """dQ's staging buffers in the model (pieces written by the forming warpgroup, read by TMA
    reductions that finish in any order): clean at every D's chunking (S warpgroup: one chunk
    of 5 pieces at 320, 4 + 2, 4 + 3, 4 + 4) in the kernel's per-chunk order, in the
    "alternating" one (each piece waits only for the group two back), and with dQ formed by
    the dV warpgroup (both buffers in turn, or three with one barrier a piece: its wait after
    its stores) or by the dV and dK warpgroups (one buffer each, or two each with one barrier
    a piece; odd atom counts at 320 and 448), one or two dO stages."""
    from ffpa_cute.sm90 import fused_protocol

    base = f90.plan_bwd_fused(_problem(d, causal=True))
    grads, bufs = {"three buffers": (1, 3), "four buffers": (2, 4)}.get(
        order, (int(order[-1]) if order.startswith("dq_grads") else 0, 2))
    for do_stages in {1, base.do_stages}:
        cfg = dataclasses.replace(base, dq_grads=grads, do_stages=do_stages, dq_buffers=bufs)
        for blocks in (1, 2, 3, 6):
            for seed in range(8):
                fused_protocol.run(cfg, blocks, seed, alternating=order == "alternating")


def test_protocol_model_wide():
    """D=576 over the pair (`wide`): one Q and one dO stage, dQ formed by the dV warpgroup in
    nine 32-column atoms a block through both staging buffers: the model runs clean."""
    from ffpa_cute.sm90 import fused_protocol

    cfg = f90.plan_bwd_fused(_problem(576, causal=True))
    assert cfg.wide and cfg.half // cfg.atom_cols == 9
    for blocks in (0, 1, 2, 3, 6):
        for seed in range(12):
            fused_protocol.run(cfg, blocks, seed)


@pytest.mark.parametrize("fault,needles", [
    ("no_x_empty_wait", (":x",)),            # partials sent before the peer read the last
    # P^T / dS^T rewritten under dV / dK's WGMMAs (or the S warpgroup two phases ahead)
    ("no_p_empty_wait", ("writes", "p_full")),
    ("p_empty_count", ("deadlock",)),        # one arrival short: the S warpgroup waits forever
    ("refill_before_wait", ("writes",)),     # a ring stage refilled under its last WGMMA
    ("no_dq_wait", (":dq",)),                # a staging buffer rewritten under its reduction
    ("chunk_wait_one", (":dq",)),            # D=320's 5-piece chunk: no drain at its start
    # dQ in the dV / dK warpgroups: a staging buffer rewritten under its reduction, one
    # bulk group too few waited for; dS^T released before the last dQ WGMMA read it
    (("no_dq_wait", 1), (":dq",)), (("grad_wait_lax", 1), (":dq",)),
    (("grad_wait_lax", 2), (":dq",)), (("grad_release_early", 1), (":dst",)),
    (("grad_release_early", 2), (":dst",)),
    # three staging buffers, one barrier a piece: no wait, or one group too few waited for
    (("no_dq_wait", 1, 3), (":dq",)), (("grad_wait_lax", 1, 3), (":dq",)),
    (("no_dq_wait", 2, 4), (":dq",)), (("grad_wait_lax", 2, 4), (":dq",))])
def test_protocol_model_catches_faults(fault, needles):
    """Each injected fault is caught (a hazard or a hang) in some interleaving (a tile of four
    blocks; D=512, or D=320 where a chunk's odd piece count makes its start's drain needed, or
    with three or four staging buffers (they fit there); (fault, n[, b]): with `dq_grads` n
    and b buffers)."""
    from ffpa_cute.common.protocol import ProtocolError
    from ffpa_cute.sm90 import fused_protocol

    fault, grads, bufs = (*fault, 2)[:3] if isinstance(fault, tuple) else (fault, 0, 2)
    d = 320 if fault == "chunk_wait_one" or bufs > 2 else 512
    cfg = f90.BwdFusedConfigSm90("sm_90a", "bf16", d, True, do_stages=1, dq_grads=grads,
                                 dq_buffers=bufs)
    errors = []
    for seed in range(150):
        try:
            fused_protocol.run(cfg, 4, seed, faults=(fault,))
        except ProtocolError as e:
            errors.append(str(e))
            break
    assert errors and any(n in errors[0] for n in needles), errors


# --------------------------------------------------------------- D over C CTAs (`scatter`)
def _scatter(d, c, causal=False, **kw):
    return f90.BwdFusedConfigSm90("sm_90a", "bf16", d, causal, do_stages=1, dq_grads=1,
                                  cluster_d=c, scatter=True, **kw)


def test_scatter_constraints():
    """`cluster_d` CTAs split D (2-4; above 2 with `scatter`, which needs dQ formed by the dV /
    dK warpgroups), D / cluster_d a multiple of 32 up to 256, D up to 1024; the exchange
    buffer holds one slot per peer of the largest owned share, and the D > 512 configs of
    design section 4 fit the smem budget; run only on an H100, so not VERIFIED (canaried) and
    not planned (it measured slower)."""
    for d, c, smem in ((1024, 4, 222208), (768, 3, 222208), (576, 3, 181248),
                       (640, 4, 160768), (512, 2, 214016)):
        cfg = _scatter(d, c)
        assert f90.can_implement_fused(cfg) is None and cfg.smem_bytes() == smem
        assert cfg.half == d // c and not cfg.VERIFIED and cfg.o_split == c
    assert [_scatter(1024, 4).owned_groups(r) for r in range(4)] == [2, 2, 2, 2]
    assert [_scatter(576, 3).owned_groups(r) for r in range(3)] == [3, 3, 2]
    assert _scatter(576, 3).x_floats == 2 * 2 * 3 * 4 * 128
    assert f90.BwdFusedConfigSm90("sm_90a", "bf16", 512, False).VERIFIED
    assert f90.BwdFusedConfigSm90("sm_90a", "bf16", 512, False, window=True).VERIFIED
    for cfg, needle in ((dataclasses.replace(_scatter(1024, 4), scatter=False), "cluster_d"),
                        (_scatter(1024, 5), "cluster_d"), (_scatter(704, 4), "head_dim"),
                        (_scatter(1024, 2), "head_dim"),
                        (dataclasses.replace(_scatter(1024, 4), dq_grads=0), "dq_grads")):
        assert needle in f90.can_implement_fused(cfg), cfg
    assert f90.plan_bwd_fused(_problem(512)).cluster_d == 2
    with pytest.raises(ValueError):
        f90.plan_bwd_fused(_problem(1024))


@pytest.mark.parametrize("d,c,causal", [(1024, 4, False), (576, 3, True), (512, 2, False)])
def test_scatter_compiles(tmp_path, monkeypatch, d, c, causal):
    """sm_90a PTX of the reduce-scatter / all-gather form: the score products m64n64k16 and
    the dV / dK m64n{D/C}k16 WGMMAs, 16-byte st.async into peers' exchange buffers at mapped
    addresses (`peer_address`, `st_async_v4`) beside the cluster barriers; no local memory,
    no spills, WGMMAs not serialised."""
    monkeypatch.chdir(tmp_path)
    cfg = _scatter(d, c, causal)
    ptx = dispatch.kernel_class(cfg).compile(cfg, options="--keep-ptx").__ptx__
    for w in (64, d // c):
        assert f"wgmma.mma_async.sync.aligned.m64n{w}k16.f32.bf16.bf16" in ptx
    for op in ("mapa.shared::cluster.u32",
               "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32",
               "mbarrier.arrive.release.cluster.shared::cluster", "stmatrix.sync.aligned"):
        assert op in ptx, op
    assert ".local" not in ptx
    _no_spills(ptx)
    log = _ptxas_log(ptx, "sm_90a")
    if log is not None:
        assert "serialized" not in log, log


@pytest.mark.parametrize("d,c", [(512, 2), (576, 3), (1024, 4)])
def test_protocol_model_scatter(d, c):
    """The model with `scatter` (every CTA of the cluster; the exchange buffers' two phases
    per block: the partials, then the gathered P^T / dS^T groups in the same smem) runs clean
    for ring depths, dQ in one or both accumulator warpgroups, 0-5 blocks; sending the groups
    before the peers read our partials is caught."""
    from ffpa_cute.common.protocol import ProtocolError
    from ffpa_cute.sm90 import fused_protocol

    for grads in (1, 2):
        for q_stages in (1, 2):
            cfg = dataclasses.replace(_scatter(d, c), dq_grads=grads, q_stages=q_stages)
            for blocks in (0, 1, 2, 5):
                for seed in range(6):
                    fused_protocol.run(cfg, blocks, seed)
    with pytest.raises(ProtocolError):
        for seed in range(50):
            fused_protocol.run(_scatter(d, c), 4, seed, faults=("gather_before_read",))
