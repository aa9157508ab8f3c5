"""Dispatch table, planners and config invariants (no GPU)."""

import dataclasses
import pickle

import pytest
import torch

import ffpa_cute
from ffpa_cute import dispatch, launch
from ffpa_cute.options import Options
from ffpa_cute.problem import AttnProblem
from ffpa_cute.sm80.config import SMEM_CAPACITY, FwdConfigSm80, can_implement, plan_fwd


def prob(d=512, dtype="bf16", **kw):
    base = dict(dtype=dtype, batch=1, heads_q=4, heads_kv=4, seqlen_q=7, seqlen_kv=7,
                head_dim=d, head_dim_v=d)
    base.update(kw)
    return AttnProblem(**base)


@pytest.mark.parametrize("cap,target,family", [
    ((8, 0), "sm_80", "sm80"), ((8, 6), "sm_86", "sm80"), ((8, 9), "sm_89", "sm80"),
    ((9, 0), "sm_90a", "sm90"), ((10, 0), "sm_100a", "sm100"), ((12, 0), "sm_120a", "sm120"),
    ((12, 1), "sm_121a", "sm120")])
def test_arch_table(cap, target, family):
    assert dispatch.target_of(*cap) == target
    assert dispatch.family_of_target(target) == family


@pytest.mark.parametrize("cap", [(7, 5), (10, 3), (11, 0), (9, 1)])
def test_unlisted_archs_have_no_family(cap):
    assert dispatch.target_of(*cap) is None


def test_sm100_forward_routes_to_tcgen05_and_says_never_run():
    """sm_100a: the tcgen05 forward, described as compile-verified only; a window and sinks
    plan it with those fields (16-bit, e4m3 and NVFP4)."""
    plan = dispatch.plan_fwd(prob(), target="sm_100a")
    assert plan.reason is None and plan.kernel_cls.__name__ == "FFPAFwdSm100"
    assert "compile-verified only, never run" in plan.describe()
    windowed = dispatch.plan_fwd(prob(window_lo=-16, has_sinks=True), target="sm_100a")
    assert windowed.reason is None and windowed.cfg.window and windowed.cfg.sinks
    fp8 = dispatch.plan_fwd(prob(window_lo=-16, has_sinks=True, dtype="e4m3",
                                 out_dtype="bf16"), target="sm_100a")
    assert fp8.reason is None and fp8.cfg.window and fp8.cfg.sinks
    assert fp8.kernel_cls.__name__ == "FFPAFwdSm100FP8"
    fp4 = dispatch.plan_fwd(prob(window_lo=-16, has_sinks=True, dtype="nvfp4",
                                 out_dtype="bf16"), target="sm_100a")
    assert fp4.reason is None and fp4.cfg.window and fp4.cfg.sinks


def test_the_table_is_data():
    """Every target has a family, every family a row with both directions and the dtype
    classes it will serve (None: no kernel yet), and a verification status."""
    assert set(dispatch.FAMILY_OF_TARGET) == set(dispatch.TARGETS.values())
    for name, fam in dispatch.FAMILIES.items():
        assert fam.name == name and fam.verified and "16bit" in fam.fwd and "16bit" in fam.bwd
    assert dispatch.FAMILIES["sm120"].verified == "compile-verified only, never run"
    assert dispatch.FAMILIES["sm100"].verified == "compile-verified only, never run"
    # their backward kernels are canaried on first use (no verified targets)
    for fam in ("sm100", "sm120"):
        assert dispatch.FAMILIES[fam].bwd["16bit"] is not None
        assert not dispatch.FAMILIES[fam].verified_targets


@pytest.mark.parametrize("d,kernel", [(264, "FFPAFwdSm90"), (512, "FFPAFwdSm90"),
                                      (520, "FFPAFwdSm90"), (584, "FFPAFwdSm90"),
                                      (1024, "FFPAFwdSm90")])
def test_sm90_family_kernels(d, kernel):
    """sm_90a: the WGMMA kernel at every D in [264, 1024] (above 512 in one CTA up to 576,
    then over a CTA pair; D % 16 == 8 included)."""
    plan = dispatch.plan_fwd(prob(d=d), target="sm_90a")
    assert plan.reason is None and plan.family == "sm90"
    assert plan.kernel_cls.__name__ == kernel and plan.cfg.arch == "sm_90a"


def test_sm90_wgmma_range_and_o_split():
    """D > 576 goes to the WGMMA kernel with O split over a CTA pair that splits the KV blocks
    (`Options.kv_pair`; off: both CTAs score every block). With a window (or sinks, varlen)
    the shares are even: at D % 16 == 8 each CTA owns ceil(D / 16) * 8 columns, the second's
    last 8 past D (computed from zeros, not stored); the plain forward starts the second
    CTA's columns on a line (`cta_align` 64: 384 + 328 at D=712), at D % 128 == 8 on a half
    line (`cta_align` 32: 352 + 296 at D=648)."""
    plan = dispatch.plan_fwd(prob(d=1024), target="sm_90a")
    assert plan.kernel_cls.__name__ == "FFPAFwdSm90" and plan.cfg.o_split == 2
    assert plan.cfg.kv_pair
    plan = dispatch.plan_fwd(prob(d=1024), target="sm_90a", opts=Options(kv_pair=False))
    assert plan.cfg.o_split == 2 and not plan.cfg.kv_pair
    plan = dispatch.plan_fwd(prob(d=584, window_lo=-100), target="sm_90a")
    assert plan.kernel_cls.__name__ == "FFPAFwdSm90" and plan.cfg.kv_pair
    assert plan.cfg.dv_cta == 296 and plan.cfg.dv_split == (152, 144)
    plan = dispatch.plan_fwd(prob(d=648), target="sm_90a")
    assert plan.cfg.dv_cta == 352 and plan.cfg.cta_align == 32
    plan = dispatch.plan_fwd(prob(d=712), target="sm_90a")
    assert plan.cfg.dv_cta == 384 and plan.cfg.dv_split == (192, 192)


@pytest.mark.parametrize("d,split,halves", [(520, (256, 264), (256, 288)),
                                            (544, (256, 288), (256, 288)),
                                            (552, (288, 264), (288, 288)),
                                            (576, (288, 288), (288, 288))])
def test_sm90_wide_o(d, split, halves):
    """D = Dv in (512, 576], 16-bit: O in one CTA (`wide_o`), Q resident, K 3 / V 2 stages,
    shares of at most 288 columns with the hi share from a line (256) or a half line (288),
    issued as m64n96 WGMMAs past 256 columns; even shares under a window; the gradient
    kernels in one CTA too (`WIDE_BWD`: even shares) except under varlen; the FP8 forward
    keeps the CTA pair, and MLA's 576 / 512 its own plan (Dv <= 512)."""
    from ffpa_cute.sm90 import config as c

    cfg = dispatch.plan_fwd(prob(d=d), target="sm_90a").cfg
    assert cfg.wide_o and cfg.o_split == 1 and not cfg.kv_pair and not cfg.stream_q
    assert (cfg.dv_split, cfg.dv_halves, cfg.k_stages, cfg.v_stages) == (split, halves, 3, 2)
    assert [c.pv_atom_n(w) for w in halves] == [96 if w > 256 else w for w in halves]
    assert c.can_implement(cfg) is None
    even = dispatch.plan_fwd(prob(d=d, window_lo=-100), target="sm_90a").cfg
    assert even.wide_o and even.split_align == 8
    grads = (c.plan_dq(prob(d=d)), c.plan_dk(prob(d=d)), c.plan_dv(prob(d=d)))
    assert all(g.wide_o and g.o_split == 1 and not g.kv_pair and g.split_align == 8
               for g in grads)
    assert not c.plan_dv(prob(d=d, varlen=True)).wide_o
    varlen = dispatch.plan_fwd(prob(d=d, varlen=True), target="sm_90a").cfg
    assert not varlen.wide_o and varlen.kv_pair   # its S warpgroup spilled at 152 registers
    # setmaxnreg.inc draws on the CTA's pool (the launch's 168 x 384 threads)
    assert c.WIDE_O_REGS[0] + 2 * c.WIDE_O_REGS[1] <= 3 * 168
    fp8 = dispatch.plan_fwd(prob(d=d + d % 16, dtype="e4m3"), target="sm_90a").cfg
    assert fp8.o_split == 2 and not fp8.wide_o
    mla = dispatch.plan_fwd(prob(d=576, head_dim_v=512), target="sm_90a").cfg
    assert not mla.wide_o and mla.dv_halves == (256, 256)
    # the forward's checks: shares past 288 columns, persistent CTAs
    assert c.can_implement(dataclasses.replace(cfg, persistent=True)) is not None
    assert c.can_implement(dataclasses.replace(cfg, half_align=8, split_align=8)) is not None


def test_forced_family():
    plan = dispatch.plan_fwd(prob(), target="sm_90a", opts=Options(family="sm80"))
    assert plan.family == "sm80" and plan.cfg.arch == "sm_90a"
    plan = dispatch.plan_fwd(prob(), target="sm_120a", opts=Options(family="sm80"))
    assert plan.family == "sm120"  # the Split-D kernels on sm_12x are the sm120 family
    with pytest.raises(ValueError, match="family"):
        Options(family="sm70")


def test_an_option_changed_after_a_first_call_gives_the_new_plan():
    """Plans are cached per (problem, target, options): flipping a field after a first call
    must not return the old plan (it did with module-level switches)."""
    p = prob(heads_q=32, heads_kv=8, seqlen_q=1, seqlen_kv=4097)
    with ffpa_cute.options.use(pack_gqa=True):
        assert dispatch.plan_fwd(p, target="sm_90a").packed
        with ffpa_cute.options.use(pack_gqa=False):
            assert not dispatch.plan_fwd(p, target="sm_90a").packed
            with ffpa_cute.options.use(family="sm80"):
                assert dispatch.plan_fwd(p, target="sm_90a").family == "sm80"
        assert dispatch.plan_fwd(p, target="sm_90a").packed


@pytest.mark.parametrize("kw,needle", [
    (dict(device_type="cpu"), "cpu"), (dict(dtype="fp32"), "fp32"), (dict(has_mask=True), "mask"),
    (dict(dropout_p=0.1), "dropout"), (dict(head_dim=128, head_dim_v=128), "256"),
    (dict(head_dim=1032, head_dim_v=1032), "1024"), (dict(head_dim=516, head_dim_v=516), "8"),
    (dict(head_dim_v=264), "head_dim_v"), (dict(batch=70000), "grid"),
    (dict(heads_q=65536 * 2, heads_kv=2), "grid")])
def test_uncovered_problems_carry_a_reason(kw, needle):
    plan = dispatch.plan_fwd(prob(**kw), target="sm_90a")
    assert plan.reason is not None and needle in plan.reason


@pytest.mark.parametrize("target", ["sm_80", "sm_86", "sm_90a", "sm_120a"])
def test_planner_covers_every_head_dim(target):
    for d in range(264, 1025, 8):
        for causal in (False, True):
            cfg = plan_fwd(prob(d, causal=causal), target)
            assert can_implement(cfg) is None
            assert cfg.smem_bytes() <= SMEM_CAPACITY[target]
            assert cfg.o_registers() <= 160
            assert cfg.hdim_padded - d < cfg.tile_hdim


def test_config_is_a_stable_picklable_key():
    cfg = plan_fwd(prob(512), "sm_90a")
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert hash(cfg) == hash(dataclasses.replace(cfg))
    assert all(isinstance(v, (int, str, bool)) for v in dataclasses.asdict(cfg).values())
    assert cfg != dataclasses.replace(cfg, causal=not cfg.causal)


@pytest.mark.parametrize("bad,needle", [
    (dict(dtype="fp32"), "dtype"), (dict(head_dim=260), "head_dim"),
    (dict(warp_layout="m1n8"), "warp_layout"), (dict(tile_n=128), "tile_n"),
    (dict(num_stages=1), "num_stages"), (dict(arch="sm_70"), "arch"),
    (dict(head_dim=1024, warp_layout="m4n2"), "registers"),
    (dict(head_dim=1024, warp_layout="m8n1", arch="sm_80"), "smem")])
def test_can_implement_mirrors_the_docstring_constraints(bad, needle):
    base = dict(arch="sm_90a", dtype="bf16", head_dim=512, causal=False, warp_layout="m4n2")
    base.update(bad)
    reason = can_implement(FwdConfigSm80(**base))
    assert reason is not None and needle in reason


def test_warp_layout_crossover():
    # measured on the H200 (docs/perf-log.md): M8N1 wins at D=320, M4N2 at 512, M2N4 above 512
    assert plan_fwd(prob(320), "sm_90a").warp_layout == "m8n1"
    assert plan_fwd(prob(512), "sm_90a").warp_layout == "m4n2"
    assert plan_fwd(prob(1024), "sm_90a").warp_layout == "m2n4"


def test_kernel_ready_copies_only_what_the_kernels_cannot_take():
    import torch

    _kernel_ready = launch.kernel_ready

    base = torch.randn(1, 2, 9, 512, dtype=torch.bfloat16)
    assert _kernel_ready(base) is base
    bnhd = torch.randn(1, 9, 2, 512, dtype=torch.bfloat16).transpose(1, 2)  # strides fine
    assert _kernel_ready(bnhd) is bnhd
    flat = torch.randn(9 * 512 * 2 + 4, dtype=torch.bfloat16)
    shifted = flat[4:].view(1, 2, 9, 512)  # contiguous, but 8 bytes off a 16-byte boundary
    fixed = _kernel_ready(shifted)
    assert fixed.data_ptr() % 16 == 0 and torch.equal(fixed, shifted)
    odd = torch.randn(1, 2, 9, 520, dtype=torch.bfloat16)[..., :512]  # row stride 520: fine
    assert _kernel_ready(odd) is odd
    bad = torch.randn(1, 2, 9, 515, dtype=torch.bfloat16)[..., :512]  # row stride 515: copy
    assert _kernel_ready(bad).is_contiguous()
    t = torch.randn(1, 2, 512, 9, dtype=torch.bfloat16).transpose(-1, -2)  # D not unit-stride
    assert _kernel_ready(t).stride(-1) == 1


@pytest.mark.parametrize("d,target,family,grads", [
    (512, "sm_90a", "sm90", "FFPABwdDQSm90"), (1024, "sm_90a", "sm90", "FFPABwdDQSm90"),
    (520, "sm_90a", "sm90", "FFPABwdDQSm90"), (512, "sm_80", "sm80", "FFPABwdDQSm80"),
    (512, "sm_120a", "sm120", "FFPABwdDQSm80"), (512, "sm_100a", "sm100", "FFPABwdDQSm100")])
def test_backward_routing(d, target, family, grads):
    """The backward's kernels come from the same table as the forward: on sm_90a the WGMMA dQ /
    dK / dV at every D up to 1024 (D % 16 == 8 above 512 too: the second CTA of the pair owns 8
    columns past D, as in the forward), on sm_80 the Split-D backward, on sm_12x the Split-D
    backward and on sm_100 the tcgen05 dQ / dK / dV (both compile-verified only; canaried on
    first use). Delta runs first. With `deterministic` off (the default) the sm90 backward at
    D 264-576 is the fused kernel instead (test_bwd_fused)."""
    plan = dispatch.plan_bwd(prob(d=d), target=target, opts=Options(deterministic=True))
    if family is None:
        assert plan.reason and not plan.cfgs
        return
    assert plan.reason is None and plan.family == family
    names = [cls.__name__ for cls, _ in plan.jobs]
    assert names[0] == "RowDot" and names[1] == grads and len(names) == 4


def test_dv_not_d_routes_to_wgmma_only():
    """Dv != D (MLA 576 / 512): the WGMMA kernel with head_dim_v on sm_90a and the sm90
    backward kernels; the Split-D families (sm_80, sm_120) fall back with the reason."""
    p = prob(d=576, head_dim_v=512, heads_q=128, heads_kv=1)
    plan = dispatch.plan_fwd(p, target="sm_90a")
    assert plan.kernel_cls.__name__ == "FFPAFwdSm90" and plan.cfg.head_dim_v == 512
    assert plan.cfg.dv_halves == (256, 256) and plan.cfg.o_split == 1
    for target in ("sm_80", "sm_120a"):
        assert "head_dim_v" in dispatch.plan_fwd(p, target=target).reason
    assert dispatch.plan_bwd(p, target="sm_90a").reason is None
    assert dispatch.plan_fwd(prob(d=512), target="sm_90a").cfg.head_dim_v is None
    bad = prob(d=576, head_dim_v=520)  # not a multiple of 16: no kernel serves it
    assert dispatch.plan_fwd(bad, target="sm_90a").reason


@pytest.mark.parametrize("hq,hkv,nq,nkv,causal,offset,packed", [
    (128, 1, 1, 4097, False, 0, True),      # MQA decode: 128 tiles -> 2
    (128, 1, 1, 4097, True, 4096, True),    # bottom-right causal decode sees every key
    (128, 1, 1, 4097, True, 0, False),      # upper-left: a masked row
    (32, 8, 7, 129, False, 0, True),        # 4 tiles -> 1
    (32, 8, 8192, 8192, False, 0, False),   # prefill: no fewer tiles
    (32, 32, 1, 129, False, 0, False),      # MHA: nothing to pack
    (32, 8, 100, 129, True, 29, False)])    # causal prefill rows are masked
def test_gqa_rows_packing(hq, hkv, nq, nkv, causal, offset, packed):
    """GQA / MQA query heads go into the rows of one KV head's tiles when that needs fewer
    tiles and no row is masked; the plan's config is the packed (non-causal) problem's.
    On by default (`Options.pack_gqa`); switched off, nothing is packed."""
    p = prob(heads_q=hq, heads_kv=hkv, seqlen_q=nq, seqlen_kv=nkv, causal=causal,
             causal_offset=offset)
    assert dispatch.packed_problem(p, Options(pack_gqa=False)) is None
    pp = dispatch.packed_problem(p, Options())
    assert (pp is not None) == packed
    plan = dispatch.plan_fwd(p, target="sm_90a")
    assert plan.packed == packed and plan.problem == p
    if packed:
        assert (pp.heads_q, pp.seqlen_q, pp.causal) == (hkv, hq // hkv * nq, False)
        assert pp.softmax_scale == p.softmax_scale and not plan.cfg.causal
        assert "packed" in plan.describe()


@pytest.mark.parametrize("hq,hkv,nq,nkv,causal", [
    (32, 8, 1, 4097, False),     # packed (GQA decode)
    (8, 8, 129, 1000, True),     # plain, bottom-right causal
    (128, 1, 1, 300, True)])     # MQA decode, packed, causal sees every key
def test_fwd_call_passes_what_run_fwd_passes(monkeypatch, hq, hkv, nq, nkv, causal):
    """The per-signature launcher hands the kernel the same tensors (pointers, shapes,
    strides), scale and causal offset as `run_fwd` does for the same call."""
    from ffpa_cute import cache
    from ffpa_cute.sm90.fwd_sm90 import FFPAFwdSm90

    q = torch.randn(2, hq, nq, 512, dtype=torch.bfloat16)
    k, v = (torch.randn(2, hkv, nkv, 512, dtype=torch.bfloat16) for _ in range(2))
    p = dataclasses.replace(AttnProblem.from_tensors(q, k, v, causal=causal,
                                                     causal_offset=nkv - nq), device_type="cuda")
    plan = dispatch.plan_fwd(p, target="sm_90a")
    assert plan.packed == (hq != hkv)
    seen = []
    monkeypatch.setattr(cache.JitCache, "get", lambda self, cls, cfg: "fn")
    monkeypatch.setattr(FFPAFwdSm90, "launch", staticmethod(lambda fn, *a: seen.append(a)))
    out, lse = launch.run_fwd(plan, q, k, v)
    *ts, sinks, cu_q, cu_k, scale, offset, window_lo, num_ctas = seen[0]
    assert sinks is None and window_lo == 0  # no sinks; the edge is unread without a window
    assert cu_q is None and cu_k is None  # no varlen
    assert num_ctas == launch.sm_count()  # the grid of a persistent config (1 without CUDA)
    fc = launch.FwdCall(plan, q, k, v)
    *got, got_sinks, got_cq, got_ck, got_scale, got_offset, got_lo, got_ctas = fc.args(
        q, k, v, out, lse)
    assert (got_sinks, got_cq, got_ck, got_scale, got_offset, got_lo, got_ctas) == (
        None, None, None, scale, offset, 0, num_ctas)
    for a, b in zip(got, ts):
        assert (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())
    assert fc.out_shape == tuple(out.shape) and fc.lse_shape == tuple(lse.shape)
    assert not fc.usable  # CPU tensors: the general path (which raises on a CPU device)
    strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(D) != 1: copied
    assert not launch.FwdCall(plan, strided, k, v).usable


@pytest.mark.parametrize("hq,hkv,nq,a,in_place", [
    (8, 8, 64, 128, (True, True)),    # a run of rows of a larger out: both written in place
    (8, 8, 64, 130, (True, False)),   # lse's view 8 bytes off a 16-byte boundary: lse copied
    (32, 8, 1, 0, (False, False))])   # packed (GQA decode): row slices don't view as packed
def test_run_fwd_writes_into_given_out_and_lse(monkeypatch, hq, hkv, nq, a, in_place):
    """`launch.run_fwd(out=, lse=)` hands the kernel the caller's views where it can write them
    (unit stride on D, 16-byte aligned, not packed), else new tensors copied into the views;
    either way it returns the views, holding what the kernel wrote."""
    from ffpa_cute import cache
    from ffpa_cute.sm90.fwd_sm90 import FFPAFwdSm90

    rows = 300
    q = torch.randn(2, hq, nq, 512, dtype=torch.bfloat16)
    k, v = (torch.randn(2, hkv, 700, 512, dtype=torch.bfloat16) for _ in range(2))
    p = dataclasses.replace(AttnProblem.from_tensors(q, k, v), device_type="cuda")
    plan = dispatch.plan_fwd(p, target="sm_90a")
    assert plan.packed == (hq != hkv)
    seen = []

    def kernel(fn, q, k, v, o, lse, *rest):   # writes a known value, as the kernel would
        seen.append((o, lse))
        o.fill_(3.0)
        lse.fill_(-2.0)

    monkeypatch.setattr(cache.JitCache, "get", lambda self, cls, cfg: "fn")
    monkeypatch.setattr(FFPAFwdSm90, "launch", staticmethod(kernel))
    big_out = torch.zeros(2, hq, rows, 512, dtype=torch.bfloat16)
    big_lse = torch.zeros(2, hq, rows)
    out, lse = big_out[:, :, a:a + nq], big_lse[:, :, a:a + nq]
    got = launch.run_fwd(plan, q, k, v, out=out, lse=lse)
    assert got[0] is out and got[1] is lse
    o, m = seen[0]
    assert ((o.data_ptr() == out.data_ptr()), (m.data_ptr() == lse.data_ptr())) == in_place
    assert (out == 3).all() and (lse == -2).all()
    assert big_out.count_nonzero() == out.numel() and big_lse.count_nonzero() == lse.numel()


@pytest.mark.parametrize("hq", [2, 4])
def test_backward_launch_feeds_each_kernel_its_operands(monkeypatch, hq):
    """`launch.run_bwd` runs Delta, then dQ, dK, dV (the atomic-free plan), each with the tensors its `OPERANDS` name
    (dV's roles: K resident, Q streamed, dO the accumulator's B) and the problem's scalars;
    with GQA over few KV tiles dK and dV write fp32 workspaces of S parts per KV head
    (`group_split`)."""
    from ffpa_cute import cache
    from ffpa_cute.sm90.config import group_parts

    q = torch.randn(1, hq, 7, 512, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 129, 512, dtype=torch.bfloat16) for _ in range(2))
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.randn(1, 4, 7)
    p = dataclasses.replace(AttnProblem.from_tensors(q, k, v, causal=True), device_type="cuda")
    plan = dispatch.plan_bwd(p, target="sm_90a", opts=Options(deterministic=True))
    runs = []
    monkeypatch.setattr(cache.JitCache, "get", lambda self, cls, cfg: cls)
    for cls, _ in plan.jobs:
        monkeypatch.setattr(cls, "launch", staticmethod(lambda fn, *a: runs.append((fn, a))))
    dq, dk, dv = launch.run_bwd(plan, q, k, v, out, lse, dout)
    assert [fn.__name__ for fn, _ in runs] == ["RowDot", "FFPABwdDQSm90", "FFPABwdDKSm90",
                                              "FFPABwdDVSm90"]
    delta_args, dq_args, dk_args, dv_args = (a for _, a in runs)
    assert delta_args[0] is dout and delta_args[1] is out and len(delta_args) == 3
    assert dq_args[:4] == (q, k, v, dout) and dq_args[4] is dq and dq_args[6] is delta_args[2]
    assert dv_args[:3] == (k, q, dout)
    parts = group_parts(1, hq, 2, 129, 1)
    assert (parts > 1) == (hq > 2)
    if parts == 1:
        assert dk_args[4] is dk and dv_args[3] is dv
    else:
        for ws in (dk_args[4], dv_args[3]):
            assert ws.shape == (1, 2 * parts, 129, 512) and ws.dtype == torch.float32
    assert dq_args[-3:] == (p.softmax_scale, 129 - 7, 0) and dv_args[-3:] == dq_args[-3:]


def test_fused_delta_is_a_backward_job():
    """The backward's kernel list (what `precompile --backward` compiles) starts with the
    Delta kernel for the problem's arch, dtype and Dv."""
    from ffpa_cute.common.config import DeltaConfig

    p = prob(d=512)
    for target in ("sm_90a", "sm_80"):
        jobs = dispatch.plan_bwd(p, target=target, opts=Options(deterministic=True)).jobs
        assert len(jobs) == 4 and jobs[0][1] == DeltaConfig(target, "bf16", 512)
    fused = dispatch.plan_bwd(p, target="sm_90a").jobs   # the default: the fused kernel
    assert len(fused) == 2 and fused[0][1] == DeltaConfig("sm_90a", "bf16", 512)


@pytest.mark.parametrize("kw,persistent", [
    (dict(), True),                                        # no right bound: equal tiles
    (dict(causal=True, causal_offset=0), False),           # causal: the hardware balances
    (dict(causal=True, causal_offset=0, window_lo=-64), True),  # a sliding window
    (dict(window_lo=-64, window_hi=8), True),
    (dict(has_sinks=True), True),
    (dict(d=1024), False),                                 # O over two CTAs (kv_pair)
    (dict(d=576, head_dim_v=512), False),                  # Q streamed (D > 512): not yet
    (dict(d=264), True), (dict(d=328), True),              # D % 64 != 0: plain forwards
    (dict(d=328, window_lo=-64, window_hi=8), False),      # (with a window: not measured)
    (dict(d=328, causal=True, causal_offset=0), False),
    (dict(d=512, head_dim_v=320), True),
    (dict(dtype="e4m3", out_dtype="bf16"), False)])        # the FP8 forward: never
def test_persistent_rule(kw, persistent):
    """Persistent CTAs serve the 16-bit forward up to 512 (one CTA per row tile, Q resident)
    where the tiles are (nearly) equal: with no right bound at every D (no window or sinks
    unless D and Dv are multiples of 64), with a sliding window at D, Dv multiples of 64;
    `Options(persistent=False)` turns it off; the config refuses it where the kernel has no
    persistent mode."""
    from ffpa_cute.sm90 import config as sm90_config

    p = prob(**kw)
    plan = dispatch.plan_fwd(p, target="sm_90a")
    assert plan.reason is None and plan.cfg.persistent == persistent
    off = dispatch.plan_fwd(p, target="sm_90a", opts=Options(persistent=False))
    assert not off.cfg.persistent
    if not persistent:
        forced = dataclasses.replace(plan.cfg, persistent=True)
        reason = sm90_config.can_implement(forced)
        assert (reason is None) == (plan.cfg.ctas_per_tile == 1
                                    and type(plan.cfg) is sm90_config.FwdConfigSm90)


@pytest.mark.parametrize("kw", [
    dict(), dict(d=576), dict(d=320, head_dim_v=256), dict(heads_q=8, heads_kv=1, seqlen_q=3),
    dict(window_lo=-100, has_sinks=True)])
def test_varlen_rule(kw):
    """A one-launch varlen problem plans the sm90 kernels with `varlen` (never persistent,
    never query heads packed into rows), forward and backward; the Split-D family plans its
    `varlen` kernels (Dv == D), the FP8
    forward refuses it (varlen_attention then loops over the sequences)."""
    from ffpa_cute.sm90 import config as sm90_config

    window_sinks = {k: kw.pop(k) for k in ("window_lo", "has_sinks") if k in kw}
    p = dataclasses.replace(prob(causal=True, **kw), varlen=True, **window_sinks)
    plan = dispatch.plan_fwd(p, target="sm_90a")
    assert plan.reason is None and plan.cfg.varlen and not plan.cfg.persistent
    assert not plan.packed
    bwd = dispatch.plan_bwd(p, target="sm_90a")
    assert bwd.reason is None
    assert all(cfg.varlen for cfg in bwd.cfgs if hasattr(cfg, "varlen"))
    splitd = dispatch.plan_fwd(p, target="sm_90a", opts=Options(family="sm80"))
    if p.head_dim_v == p.head_dim:
        assert splitd.reason is None and splitd.cfg.varlen
    else:
        assert "equal head dims" in splitd.reason
    persistent = dataclasses.replace(plan.cfg, persistent=True)
    assert sm90_config.can_implement(persistent) is not None
    fp8 = sm90_config.FwdFP8ConfigSm90(arch="sm_90a", dtype="e4m3", head_dim=512, causal=True,
                                       varlen=True)
    assert "varlen" in sm90_config.can_implement(fp8)


@pytest.mark.parametrize("d,n,fwd,bwd", [
    (520, 8192, True, False), (520, 1024, False, False), (576, 8192, False, False),
    (544, 4096, False, False), (600, 4096, True, True), (1016, 4096, True, True),
    (264, 8192, True, False),
    (312, 4096, True, False), (312, 2048, False, False), (336, 8192, False, False),
    (320, 8192, False, False)])
def test_row_repack_rule(d, n, fwd, bwd):
    """Rows that are not whole 128-byte lines are copied into padded rows before the WGMMA
    kernels over a CTA pair at D > 512 (their TMA boxes straddle lines otherwise) and rows
    that do not start on 32-byte sectors (D % 16 == 8) at D <= 512 and before the kernels
    with O or the gradient in one CTA above it (`wide_o`, D <= 576), forward and backward,
    when the work is large enough (the fused backward at D % 64 != 0 copies into zeroed rows
    of the next multiple of 64 instead: no repack, `FUSED_PAD`); the Split-D kernels read them
    as they are; the copy holds the same values in [..., :D] of rows padded to 128 bytes, and
    an aligned tensor is kept."""
    p = prob(d=d, heads_q=32, heads_kv=32, seqlen_q=n, seqlen_kv=n)
    fp, bp = dispatch.plan_fwd(p, target="sm_90a"), dispatch.plan_bwd(p, target="sm_90a")
    assert launch.repack_rows(p, fp.cfg, n, n) == fwd
    assert launch.repack_rows(p, bp.cfgs[-1], n, n) == bwd
    exact = dispatch.plan_bwd(p, target="sm_90a", opts=Options(deterministic=True))
    if (d, n) in ((520, 8192), (264, 8192)):   # the atomic-free kernels still repack there
        assert launch.repack_rows(p, exact.cfgs[-1], n, n)
    sm80 = dispatch.plan_bwd(p, target="sm_90a", opts=Options(family="sm80"))
    assert not launch.repack_rows(p, sm80.cfgs[-1], n, n)
    assert not launch.repack_rows(p, fp.cfg, 64, n)  # short queries: the copy would not pay
    t = torch.randn(2, 3, 5, d, dtype=torch.bfloat16)
    a = launch.row_aligned(t)
    assert torch.equal(a, t) and a.stride(-1) == 1 and launch.kernel_ready(a) is a
    assert all(s * 2 % 128 == 0 for s in a.stride()[:-1])  # (a CUDA base is 512-aligned)
    if t.data_ptr() % 128 == 0 and (2 * d) % 128 == 0:
        assert a is t  # rows that are whole lines already: no copy


@pytest.mark.parametrize("d", [584, 648, 1024])
def test_backward_kv_pair_rule(d):
    """Above 576 the gradient kernels pair their CTAs over the column blocks (`kv_pair`,
    exchanging P / dS only: one exchange barrier, no peer statistics) unless
    `Options(kv_pair=False)`; up to 576 they hold the gradient in one CTA (`wide_o`), as the
    forward holds O (at 576 the fused kernel is the default: `deterministic` plans them)."""
    p = prob(d=d, causal=True)
    for w in (520, 576):
        wide = dispatch.plan_bwd(prob(d=w, causal=True), target="sm_90a",
                                 opts=Options(deterministic=True))
        assert all(c.wide_o and not c.kv_pair for c in wide.cfgs[1:])
    plan = dispatch.plan_bwd(p, target="sm_90a")
    cfgs = plan.cfgs[1:]
    assert [type(c).__name__ for c in cfgs] == ["BwdDQConfigSm90", "BwdDKConfigSm90",
                                                 "BwdDVConfigSm90"]
    assert all(c.kv_pair and not c.pair_stats and c.pair_barriers == ("bar_pp",) for c in cfgs)
    off = dispatch.plan_bwd(p, target="sm_90a", opts=Options(kv_pair=False))
    assert not any(c.kv_pair for c in off.cfgs[1:])
    fwd = dispatch.plan_fwd(p, target="sm_90a").cfg
    assert fwd.kv_pair and fwd.pair_stats and fwd.pair_barriers == ("bar_x", "bar_pp")
    small = dispatch.plan_bwd(prob(d=512, causal=True), target="sm_90a",
                              opts=Options(deterministic=True))
    assert not any(c.kv_pair for c in small.cfgs[1:])


@pytest.mark.parametrize("d,n,causal", [(584, 8192, False), (600, 4096, True),
                                         (1000, 8192, False)])
def test_padded_pair_rule(monkeypatch, d, n, causal):
    """Above 576 at the D of PADDED_PAIR_HEAD_DIMS (patched here), where the rows are copied
    anyway, the forward runs the pair at the next multiple of 64 on zero-padded q, k, v with
    D's softmax scale (`launch.padded_fwd`; explain names it); not causal (measured slower),
    not for short rows, a window, sinks, Dv != D or D outside the set."""
    monkeypatch.setattr(launch, "PADDED_PAIR_HEAD_DIMS", frozenset({d}))
    p = prob(d=d, heads_q=32, heads_kv=32, seqlen_q=n, seqlen_kv=n, causal=causal)
    plan = dispatch.plan_fwd(p, target="sm_90a")
    pad = launch.padded_fwd(plan, n, n)
    if causal:
        assert pad is None and "zero-padded" not in launch.describe_fwd(plan)
        return
    w = -(-d // 64) * 64
    assert pad is not None and pad.cfg.head_dim == pad.problem.head_dim_v == w
    assert pad.problem.softmax_scale == p.softmax_scale == 1 / d ** 0.5
    assert not pad.cfg.causal and pad.family == plan.family == "sm90"
    assert f"zero-padded from D={d} to {w}" in launch.describe_fwd(plan)
    assert launch.padded_fwd(plan, 64, n) is None   # short queries: no copy, no padding
    for other in (dict(window_lo=-100), dict(has_sinks=True), dict(head_dim_v=512)):
        alt = dispatch.plan_fwd(dataclasses.replace(p, **other), target="sm_90a")
        assert alt.reason is not None or launch.padded_fwd(alt, n, n) is None, other
    monkeypatch.setattr(launch, "PADDED_PAIR_HEAD_DIMS", frozenset())
    assert launch.padded_fwd(plan, n, n) is None


def test_padded_pair_routes_measured_head_dims():
    """The padded pair is routed at D % 16 == 8 from 584 to 1016 but 904 (where perf.pad_pair
    measured it faster), nowhere at D % 16 == 0."""
    assert launch.PADDED_PAIR_HEAD_DIMS == frozenset(range(584, 1024, 16)) - {904}
    p = prob(d=600, heads_q=32, heads_kv=32, seqlen_q=8192, seqlen_kv=8192)
    assert launch.padded_fwd(dispatch.plan_fwd(p, target="sm_90a"), 8192, 8192) is not None
    p = dataclasses.replace(p, head_dim=608, head_dim_v=608)
    assert launch.padded_fwd(dispatch.plan_fwd(p, target="sm_90a"), 8192, 8192) is None


@pytest.mark.parametrize("shape,dtype", [
    ((2, 3, 7, 584), torch.bfloat16), ((1, 2, 5, 600), torch.float16),
    ((1, 1, 3, 10), torch.bfloat16), ((2, 4, 9, 6), torch.float32)])
def test_copy_rows_is_a_copy(shape, dtype):
    """launch.copy_rows copies the values of a D-wide tensor into strided rows (and back) as
    torch's copy_ does, as 8-byte words where the rows allow it (584 / 600 bf16 / fp16) and
    element by element where not (10 bf16 columns: 20-byte rows; a transposed source)."""
    src, cut = torch.randn(shape).to(dtype), shape[-1]
    lined = launch.row_aligned(src)
    assert torch.equal(lined, src) and lined.stride(-2) * src.element_size() % 128 == 0
    padded = launch.zero_padded(src, cut + 24)
    assert torch.equal(padded[..., :cut], src) and not padded[..., cut:].any()
    back = launch.copy_rows(torch.empty(shape, dtype=dtype), padded[..., :cut])
    assert torch.equal(back, src)
    t = src.transpose(-1, -2).contiguous().transpose(-1, -2)   # unit stride on rows' axis
    assert torch.equal(launch.copy_rows(torch.empty(shape, dtype=dtype), t), src)


@pytest.mark.parametrize("d,n,causal,widened", [
    (280, 8192, False, True), (328, 4096, True, True), (392, 8192, False, True),
    (264, 8192, True, True), (312, 2048, False, False), (512, 8192, False, False),
    (336, 8192, False, False), (520, 8192, False, False), (408, 8192, False, False),
    (504, 8192, False, False)])
def test_widened_forward_rule(d, n, causal, widened):
    """At D % 16 == 8 up to WIDENED_MAX_HEAD_DIM (392, where it measured faster), where the
    rows are copied anyway, the widened forward runs the D + 8 kernel's score side (Dv = D) on q
    and k zero-padded to D + 8 columns, with D's softmax scale and D's lazy rescaling
    (`launch.widened_fwd`; explain names it); the padded copy holds the values, then zeros.
    `candidate` plans it up to 504 (the experiments' kernel lists)."""
    from ffpa_cute.sm90 import config as sm90_config

    p = prob(d=d, heads_q=32, heads_kv=32, seqlen_q=n, seqlen_kv=n, causal=causal)
    plan = dispatch.plan_fwd(p, target="sm_90a")
    wide = launch.widened_fwd(plan, n, n)
    assert (wide is not None) == widened
    if d % 16 == 8 and d <= 504 and n >= 4096:   # an experiment's candidate up to 504
        cand = launch.widened_fwd(plan, n, n, candidate=True)
        assert cand is not None and cand.cfg.lazy_rescale == plan.cfg.lazy_rescale
    if widened:
        assert (wide.cfg.head_dim, wide.cfg.dv) == (d + 8, d) and wide.cfg.head_dim_v == d
        assert wide.problem.softmax_scale == p.softmax_scale == 1 / d ** 0.5
        assert sm90_config.can_implement(wide.cfg) is None and wide.cfg.causal == causal
        assert f"zero-padded from D={d}" in launch.describe_fwd(plan)
        assert launch.widened_fwd(plan, 64, n) is None   # short queries: no copy, no widening
        win = dispatch.plan_fwd(dataclasses.replace(p, window_lo=-100), target="sm_90a")
        assert launch.widened_fwd(win, n, n) is None
    else:
        assert launch.describe_fwd(plan) == plan.describe()
    t = torch.randn(2, 3, 5, d, dtype=torch.bfloat16)
    z = launch.zero_padded(t, d + 8)
    assert torch.equal(z[..., :d], t) and not z[..., d:].any() and z.shape[-1] == d + 8
    assert all(s * 2 % 128 == 0 for s in z.stride()[:-1])


@pytest.mark.parametrize("hq,hkv,n,d,split", [
    (32, 32, 8192, 512, 1), (32, 4, 8192, 512, 1), (32, 4, 4096, 512, 2), (64, 1, 8192, 512, 4),
    (64, 1, 8192, 1024, 2), (8, 2, 1000, 512, 8 // 2), (64, 1, 128, 320, 64), (6, 2, 64, 512, 1)])
def test_group_split_rule(hq, hkv, n, d, split):
    """dV and dK split a KV tile's head group over S CTAs until the grid has ~4 waves of 132
    SMs (S a power of two dividing G = Hq / Hkv, so 1 for MHA and for an odd G; chosen at
    launch, the config says only whether); dQ and the forward never; the config refuses it
    elsewhere."""
    from ffpa_cute.sm90 import config as sm90_config

    p = prob(d=d, heads_q=hq, heads_kv=hkv, seqlen_q=n, seqlen_kv=n, causal=True)
    dq, dk, dv = sm90_config.plan_bwd(p)
    assert (dq.group_split, dk.group_split, dv.group_split) == (False, split > 1, split > 1)
    assert sm90_config.group_parts(1, hq, hkv, n, dv.o_split) == split
    tiles = -(-n // 64) * hkv * dv.o_split
    assert split == 1 or tiles * split // 2 < sm90_config.GROUP_SPLIT_TARGET_CTAS
    for cfg in (dq, sm90_config.plan_fwd(p, "sm_90a")):
        assert "group_split" in sm90_config.can_implement(
            dataclasses.replace(cfg, group_split=True))


@pytest.mark.parametrize("m_tiles,heads,batch,ctas", [
    (128, 32, 1, 132), (3, 48, 1, 132), (1, 1, 1, 132), (16, 96, 2, 132), (5, 7, 3, 4)])
def test_static_schedule_covers_every_tile_once(m_tiles, heads, batch, ctas):
    """The persistent kernels' schedule (common/scheduler.py): CTA c of min(tiles, ctas) takes
    tiles c, c + grid, ...; together they cover every (m_block, head, batch) once, and the
    linear order is the one-CTA-per-tile grid's (m fastest, the last row tile first)."""
    from ffpa_cute.common.scheduler import tile_coords, tile_count

    total = tile_count(m_tiles, heads, batch)
    grid = min(total, ctas)
    walked = [tile_coords(t, m_tiles, heads) for c in range(grid)
              for t in range(c, total, grid)]
    every = [(m_tiles - 1 - x, h, b) for b in range(batch) for h in range(heads)
             for x in range(m_tiles)]
    assert sorted(walked) == sorted(every) and len(walked) == len(set(walked))
    assert [tile_coords(t, m_tiles, heads) for t in range(total)] == every


@pytest.mark.parametrize("d,halves,split,cta", [
    (264, (192, 128), (192, 72), 264), (336, (192, 192), (192, 144), 336),
    (320, (192, 128), (192, 128), 320), (512, (256, 256), (256, 256), 512),
    (400, (256, 192), (256, 144), 400), (376, (192, 192), (192, 184), 376),
    (520, (256, 288), (256, 264), 520), (576, (288, 288), (288, 288), 576),
    (648, (192, 160), (192, 160), 352),
    (640, (192, 128), (192, 128), 320), (712, (192, 192), (192, 192), 384),
    (1016, (256, 256), (256, 256), 512), (768, (192, 192), (192, 192), 384)])
def test_o_halves_widened_to_a_swizzle(d, halves, split, cta):
    """Each O warpgroup computes `dv_halves` columns (its share rounded up to 64 with one CTA
    per tile, 32 over a CTA pair, so its V stages take the 128- or 64-byte swizzle) and stores
    its `dv_split` share; the hi share starts on a 128-byte line (`split_align` 64: the
    padding falls in the hi share), and over a CTA pair the second CTA's columns too
    (`cta_align` 64; set only where it moves a share, so D=768 and 1016 keep their compile
    keys). The FP8 forward keeps exact shares; so do the gradient kernels over a CTA pair,
    while with one CTA per tile they start their hi shares on lines (`line_shares_bwd`)."""
    from ffpa_cute.sm90 import config as sm90_config

    cfg = dispatch.plan_fwd(prob(d=d), target="sm_90a").cfg
    assert (cfg.dv_halves, cfg.dv_split, cfg.dv_cta) == (halves, split, cta)
    assert sm90_config.can_implement(dataclasses.replace(cfg, half_align=16)) is not None
    if d % 16 == 0:
        f8 = dispatch.plan_fwd(prob(d=d, dtype="e4m3", out_dtype="bf16"), target="sm_90a").cfg
        assert f8.half_align == 8 and f8.dv_halves == f8.dv_split and f8.split_align == 8
        assert sm90_config.can_implement(dataclasses.replace(f8, split_align=64)) is not None
    bwd = [c for c in dispatch.plan_bwd(prob(d=d), target="sm_90a").cfgs
           if hasattr(c, "split_align")]
    assert all(c.split_align == (64 if d <= 512 and d % 128 else 8) for c in bwd)
    if cfg.o_split > 1:  # the CTA pair: both boundaries on lines (perf.cta_align)
        half = d % 128 == 8   # the second CTA on a 64-byte half line (perf.cta_align)
        assert cfg.dv_cta % (32 if half else 64) == 0 and cfg.dv_split[0] % 64 == 0
        assert cfg.dv_cta * 2 >= cfg.dv and cfg.dv - cfg.dv_cta > 0
        assert cfg.cta_align == (8 if d in (768, 1016) else 32 if half else 64)
        even = dataclasses.replace(cfg, cta_align=8, split_align=8)
        assert sm90_config.can_implement(even) is None
        assert even.dv_cta * even.o_split - even.dv in (0, 8)
        causal = dispatch.plan_fwd(prob(d=d, causal=True), target="sm_90a").cfg
        assert (causal.dv_cta, causal.dv_split) == (cfg.dv_cta, cfg.dv_split)
    else:
        assert cfg.dv_cta == cfg.dv
        assert sm90_config.can_implement(dataclasses.replace(cfg, cta_align=64)) is not None
