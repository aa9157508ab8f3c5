"""The NVFP4 quantizer / dequantizer (ffpa_cute/nvfp4.py) on the CPU: bit-exact with the format
(E2M1 codes, ties to even, saturation, nibble order, E4M3 block scales over 16 elements, the fp32
tensor scale), round trips, and the error bound a block's quantization can have. No FP4 kernel
exists yet; these are the reference the FP4 kernels' GPU tests will use."""

import pytest
import torch

import ffpa_cute
from ffpa_cute import nvfp4


def test_every_code_decodes_and_encodes_back():
    codes = torch.arange(16, dtype=torch.uint8)
    values = nvfp4.decode_e2m1(codes)
    assert values[:8].tolist() == list(nvfp4.E2M1_VALUES)
    assert values[8:].tolist() == [-v for v in nvfp4.E2M1_VALUES]
    back = nvfp4.encode_e2m1(values).tolist()
    assert back[:8] == list(range(8)) and back[9:] == list(range(9, 16))
    assert back[8] == 0  # -0 encodes as +0


@pytest.mark.parametrize("y,code", [
    (0.24, 0), (0.25, 0), (0.26, 1), (0.75, 2), (1.25, 2), (1.26, 3), (1.75, 4), (2.5, 4),
    (2.51, 5), (3.5, 6), (5.0, 6), (5.01, 7), (6.0, 7), (100.0, 7), (-0.75, 10), (-7.0, 15)])
def test_rounding_is_nearest_ties_to_even_and_saturates(y, code):
    assert nvfp4.encode_e2m1(torch.tensor([y])).item() == code


def test_packing_puts_element_0_in_the_low_nibble():
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, -1.0  # block amax 6: block_scale * tensor_scale = 1
    t = nvfp4.quantize_nvfp4(x)
    assert t.data[0, 0].item() == 0x7 | (0xA << 4)
    assert torch.equal(t.dequantize(), x)


def test_representable_values_round_trip_exactly():
    """Codes times a power-of-two block scale are exact: quantize(dequantize(t)) == t."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (4, 8, 64), generator=g, dtype=torch.uint8)
    codes[..., ::16] = 7  # every block holds 6: its scale is exactly its power of two
    scales = 2.0 ** torch.randint(-6, 6, (4, 8, 4), generator=g).float()
    x = (nvfp4.decode_e2m1(codes).reshape(4, 8, 4, 16) * scales[..., None]).reshape(4, 8, 64)
    t = nvfp4.quantize_nvfp4(x)
    assert torch.equal(t.dequantize(), x)
    assert torch.equal(nvfp4.quantize_nvfp4(t.dequantize()).data, t.data)


def test_block_scales_tensor_scale_and_error_bound():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 33, 512, generator=g) * 3
    x[0, 0, 0, :16] = 0.0  # an all-zero block: scale 0, values 0
    t = nvfp4.quantize_nvfp4(x)
    assert t.block_scale.dtype == torch.float8_e4m3fn and t.block_scale.shape == (2, 4, 33, 32)
    assert t.tensor_scale.item() == pytest.approx(x.abs().max().item() / (6 * 448))
    assert (t.block_scale.float() >= 0).all() and t.block_scale.float().max() <= 448
    d = t.dequantize()
    assert torch.equal(d[0, 0, 0, :16], torch.zeros(16))
    # per element: at most half of E2M1's widest step (2, between 4 and 6) times the block's
    # scale, plus what rounding the scale to E4M3 (3 mantissa bits) moves a 6 by
    scale = (t.block_scale.float() * t.tensor_scale)[..., None].expand(2, 4, 33, 32, 16)
    err = (d - x).abs().reshape(2, 4, 33, 32, 16)
    assert (err <= scale * (1.0 + 6 * 2 ** -4) + 1e-6).all()
    rel = ((d - x).norm() / x.norm()).item()
    assert 0.05 < rel < 0.12, rel  # E2M1 on N(0, 1) blocks: ~9% relative


def test_bad_input_and_no_kernel():
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize_nvfp4(torch.randn(4, 24))
    with pytest.raises(TypeError):
        nvfp4.quantize_nvfp4(torch.arange(16))
    t = nvfp4.quantize_nvfp4(torch.randn(1, 2, 8, 64))
    with pytest.raises(NotImplementedError, match="NVFP4 attention has kernels only on sm_100"):
        ffpa_cute.attention(t, t, nvfp4.quantize_nvfp4(torch.randn(1, 2, 64, 8 + 8)))
    with pytest.raises(ValueError, match="V\\^T"):  # v not given transposed
        ffpa_cute.attention(t, t, t)
    vt = nvfp4.quantize_nvfp4(torch.randn(1, 2, 64, 8 + 8))
    # arguments are checked, never ignored: a window and sinks reach the planner (no kernel
    # on the CPU), bad ones and what NVFP4 cannot take are refused by name
    for kw, exc, pattern in ((dict(window=(4, 0)), NotImplementedError, "kernels only on"),
                             (dict(sinks=torch.zeros(2)), NotImplementedError, "kernels only on"),
                             (dict(window=(-1, 0)), ValueError, "window left=-1"),
                             (dict(sinks=torch.zeros(3)), ValueError, "sinks must have shape"),
                             (dict(sinks=torch.zeros(2, requires_grad=True)),
                              NotImplementedError, "forward-only"),
                             (dict(q_descale=1.0), TypeError, "FP8 inputs")):
        with pytest.raises(exc, match=pattern):
            ffpa_cute.attention(t, t, vt, **kw)
    t1 = nvfp4.quantize_nvfp4(torch.randn(1, 1, 8, 64))
    v1 = nvfp4.quantize_nvfp4(torch.randn(1, 1, 64, 8 + 8))
    with pytest.raises(ValueError, match="enable_gqa=True"):
        ffpa_cute.attention(t, t1, v1)


def test_quantized_attention_reference_errors():
    """The emulated kernels' errors at D=512 (perf.quant_error has the full table): e4m3's own
    ~2.5% (the sm90 FP8 kernel measures 1.7-2.3%), NVFP4's ~9%; both finite, and each worse
    than bf16 torch's."""
    from perf.quant_error import rows

    res = {(name, fmt): vals for name, fmt, *vals in rows(512, 256, 1)}
    bf16 = res[("N(0,1)", "bf16 (torch)")][2]
    e4m3, fp4 = res[("N(0,1)", "e4m3")], res[("N(0,1)", "nvfp4")]
    assert 0.01 < e4m3[0] < 0.04 and 0.05 < fp4[0] < 0.15
    assert bf16 < e4m3[2] < fp4[2]
    assert res[("N(0,1) + 0.1% N(0,10)", "e4m3")][1] < 9.1e-3  # FA3's FP8 RMSE, own error


@pytest.mark.parametrize("target,d,layout", [("sm_120a", 320, "m4n2"), ("sm_120a", 512, "m4n2"),
                                             ("sm_121a", 1024, "m2n4")])
def test_nvfp4_planner_and_budget(target, d, layout):
    """(sm120, fp4) plans the Split-D NVFP4 forward inside 99 KB (P through shared memory:
    never M8N1); D not a multiple of 64 and every other family refuse it with a reason."""
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.sm80 import config as sm80_config

    p = AttnProblem(dtype="nvfp4", batch=1, heads_q=4, heads_kv=1, seqlen_q=7, seqlen_kv=7,
                    head_dim=d, head_dim_v=d, causal=True, out_dtype="bf16")
    plan = dispatch.plan_fwd(p, target=target, opts=Options())
    assert plan.reason is None and plan.kernel_cls.__name__ == "FFPAFwdSm80FP4"
    assert plan.cfg.warp_layout == layout
    assert plan.cfg.smem_bytes() <= sm80_config.SMEM_CAPACITY[target]
    for dd in range(320, 1025, 64):  # every D the kernel takes fits 99 KB
        q = AttnProblem(**{**p.__dict__, "head_dim": dd, "head_dim_v": dd})
        assert dispatch.plan_fwd(q, target=target, opts=Options()).reason is None, dd
    bad = AttnProblem(**{**p.__dict__, "head_dim": 336, "head_dim_v": 336})
    assert "multiple of 64" in dispatch.plan_fwd(bad, target=target, opts=Options()).reason
    for other in ("sm_80", "sm_89", "sm_90a"):
        assert "no nvfp4 forward" in dispatch.plan_fwd(p, target=other, opts=Options()).reason


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx next to the working directory


@pytest.mark.parametrize("d,causal", [(320, True), (512, False), (1024, True)])
def test_nvfp4_kernel_compiles_with_block_scaled_mma(in_tmp, d, causal):
    """The NVFP4 forward for sm_120a: only the block-scaled mma.sync kind::mxf4nvf4 with E4M3
    scales (scale_vec::4X: one per 16 elements), P rounded to E2M1 and its scales to E4M3 by
    cvt, scale words by 4-byte cp.async, no local memory, no ptxas spills."""
    import re

    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem
    from test_kernels_compile import _no_spills

    p = AttnProblem(dtype="nvfp4", batch=1, heads_q=2, heads_kv=2, seqlen_q=1, seqlen_kv=1,
                    head_dim=d, head_dim_v=d, causal=causal, out_dtype="bf16")
    plan = dispatch.plan_fwd(p, target="sm_120a", opts=Options())
    ptx = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__
    assert ".target sm_120a" in ptx
    mmas = set(re.findall(r"mma\.sync\.aligned\.\S+", ptx))
    assert mmas == {"mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col"
                    ".f32.e2m1.e2m1.f32.ue4m3"}, mmas
    assert "cvt.rn.satfinite.e2m1x2.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert re.search(r"cp\.async\.ca\.shared\.global \[[^\]]*\], \[[^\]]*\], 4", ptx)
    assert "wgmma" not in ptx and "tcgen05" not in ptx and ".local" not in ptx
    _no_spills(ptx, "sm_120a", max_regs=255)


@pytest.mark.parametrize("d,causal", [(320, True), (512, False), (1024, True)])
def test_sm100_nvfp4_kernel_compiles_with_block_scaled_tcgen05(in_tmp, d, causal):
    """The NVFP4 forward for sm_100a: only tcgen05.mma kind::mxf4nvf4 with 16-element E4M3
    scale blocks (QK: 4 per 256-element chunk; PV: one per 64-key V stage, A = P from shared
    memory), each stage's scales copied to TMEM by tcgen05.cp before its MMAs (Q's and K's 4
    K-blocks per chunk, P's 2 per block, V^T's 2 atoms per stage), scales loaded by bulk
    copies beside the TMA codes (multicast over the cluster with them), P rounded to E2M1
    and its scales to E4M3 by cvt and fenced for the async proxy; no local memory, no
    spills."""
    import re

    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem
    from test_kernels_compile import _no_spills

    p = AttnProblem(dtype="nvfp4", batch=1, heads_q=2, heads_kv=2, seqlen_q=1000,
                    seqlen_kv=1000, head_dim=d, head_dim_v=d, causal=causal, out_dtype="bf16")
    plan = dispatch.plan_fwd(p, target="sm_100a", opts=Options())
    assert plan.reason is None and plan.kernel_cls.__name__ == "FFPAFwdSm100FP4"
    cfg = plan.cfg
    ptx = plan.kernel_cls.compile(cfg, options="--keep-ptx").__ptx__
    assert ".target sm_100a" in ptx
    mmas = re.findall(r"tcgen05\.mma\.\S+", ptx)
    assert set(mmas) == {"tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16"
                         ".collector::a::discard"}, set(mmas)
    # the chunk loop is a loop (unrolled, every chunk's scale pointers would not fit the
    # registers at D = 1024): one chunk's 4 QK MMAs, the two V stages' PV MMAs
    chunks = -(-d // 256)
    assert len(mmas) == 4 + 2
    assert ptx.count("tcgen05.cp.cta_group::1.32x128b.warpx4") == 8 + 2 + 2 * 2
    bulk = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
    assert ptx.count(bulk + ".multicast::cluster") == 2 * chunks  # Q's, K's scales
    assert ptx.count(bulk + " ") + ptx.count(bulk + ";") >= 2  # V^T's two atoms
    assert "cvt.rn.satfinite.e2m1x2.f32" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "fence.proxy.async.shared::cta" in ptx
    assert "wgmma" not in ptx and "mma.sync" not in ptx and ".local" not in ptx
    _no_spills(ptx, "sm_100a", max_regs=255)


def test_blocked_scales_is_the_tcgen05_atom_layout():
    """`blocked_scales`: row r, scale s of a [.., R, K / 16] tensor at byte 16 (r % 32) +
    4 (r // 32 % 4) + s % 4 of the 512-byte block (r // 128, s // 4) (CUTLASS's
    BlockScaledBasicChunk ((32, 4), (16, 4)):((16, 4), (0, 1)), K-blocks innermost), zero
    where padded (rows to `rows`, K-blocks to a multiple of k_multiple)."""
    g = torch.Generator().manual_seed(3)
    s = torch.randint(1, 120, (2, 3, 300, 20), dtype=torch.uint8, generator=g)
    b = nvfp4.blocked_scales(s, k_multiple=4)
    assert b.shape == (2, 3, 3, 8 * 512) and b.dtype == torch.uint8
    r, k = torch.meshgrid(torch.arange(300), torch.arange(20), indexing="ij")
    off = (k // 4) * 512 + 16 * (r % 32) + 4 * (r // 32 % 4) + k % 4
    assert torch.equal(b[:, :, r // 128, off], s)
    assert int(b.sum()) == int(s.sum())  # every other byte is padding, zero
    assert nvfp4.blocked_scales(s, rows=640).shape == (2, 3, 5, 5 * 512)
    with pytest.raises(ValueError, match="multiple of 128"):
        nvfp4.blocked_scales(s, rows=200)


@pytest.mark.parametrize("target,kernel", [("sm_120a", "FFPAFwdSm80FP4"),
                                           ("sm_100a", "FFPAFwdSm100FP4")])
def test_precompile_jobs_for_fp4(target, kernel):
    """--dtypes fp4: the NVFP4 forward, no transpose job (the host quantises V^T)."""
    from ffpa_cute import precompile

    names = [cls.__name__ for cls, _ in precompile.jobs_for(target, [512], ["nvfp4"],
                                                            (False,))]
    assert names == [kernel]
    assert precompile.DTYPE_ALIASES["fp4"] == "nvfp4"


@pytest.mark.parametrize("features", [False, True])
@pytest.mark.parametrize("target", ["sm_120a", "sm_100a"])
def test_nvfp4_canary_passes_the_reference_and_catches_garbage(monkeypatch, target, features):
    """`nvfp4.canary` (the first-use self-check of the never-run NVFP4 kernel) on the CPU with
    the kernel replaced: float32 attention of the dequantised inputs passes, a wrong result
    (keys shifted by one) fails with the reason; with a window and sinks the canary runs
    them (the kernel is handed the sinks, and the reference applies both)."""
    import dataclasses

    from ffpa_cute import dispatch, selfcheck
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.reference import attention_ref

    p = AttnProblem(dtype="nvfp4", batch=1, heads_q=4, heads_kv=1, seqlen_q=300,
                    seqlen_kv=300, head_dim=512, head_dim_v=512, causal=True, causal_offset=0,
                    out_dtype="bf16")
    if features:
        p = dataclasses.replace(p, window_lo=-100, has_sinks=True)
    plan = dispatch.plan_fwd(p, target=target, opts=Options())
    assert plan.reason is None and plan.cfg.window == plan.cfg.sinks == features
    cplan = dispatch.plan_fwd(selfcheck.canary_problem(plan), target=target, opts=Options())
    assert cplan.cfg == plan.cfg
    cp = cplan.problem

    def fake(shift):
        def run(plan_, q4, k4, v4, out_dtype, sinks=None):
            assert (sinks is not None) == features
            vd = v4.dequantize().transpose(-1, -2)[..., : k4.shape[2], :]
            vd = torch.roll(vd, shift, dims=2)
            out, lse = attention_ref(q4.dequantize(), k4.dequantize(), vd, causal=cp.causal,
                                     causal_offset=cp.causal_offset, upcast=torch.float32,
                                     window_lo=cp.window_lo, sinks=sinks)
            return out.to(out_dtype), lse
        return run

    cpu = torch.device("cpu")
    monkeypatch.setattr(nvfp4, "run_kernel", fake(0))
    assert nvfp4.canary(plan, cplan, cpu) is None
    monkeypatch.setattr(nvfp4, "run_kernel", fake(1))
    assert "canary error" in nvfp4.canary(plan, cplan, cpu)


def _host_operands(b, hq, hkv, nq, nkv, d):
    """NVFP4 q, k, v (V^T of 12-key-padded V: Nkv = 100 is no multiple of 16) and the
    problem, for the host-feeding tests."""
    from ffpa_cute.problem import AttnProblem

    q4 = nvfp4.quantize_nvfp4(torch.randn(b, hq, nq, d))
    k4 = nvfp4.quantize_nvfp4(torch.randn(b, hkv, nkv, d))
    v4 = nvfp4.quantize_nvfp4(torch.nn.functional.pad(torch.randn(b, hkv, nkv, d),
                                                      (0, 0, 0, -nkv % 16)).transpose(-1, -2))
    p = AttnProblem(dtype="nvfp4", batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=nq,
                    seqlen_kv=nkv, head_dim=d, head_dim_v=d, out_dtype="bf16")
    return q4, k4, v4, p


def test_nvfp4_host_feeds_the_kernel_its_operands(monkeypatch):
    """`nvfp4.run_kernel` (CPU, the launch replaced): every operand the kernel names, with the
    dtype, shape and stride divisibility its compile-time stand-ins assume (codes uint8 with
    16-byte rows, scales uint8 with 4-byte rows, V^T's keys padded to 64 with zeros, descales
    [B, Hkv] fp32), GQA rows packed where the plan packs them."""
    from ffpa_cute import dispatch, launch
    from ffpa_cute.options import Options

    b, hq, hkv, nq, nkv, d = 2, 8, 2, 3, 100, 320
    q4, k4, v4, p = _host_operands(b, hq, hkv, nq, nkv, d)
    plan = dispatch.plan_fwd(p, target="sm_120a", opts=Options())
    seen = {}
    monkeypatch.setattr(launch, "run_job", lambda cls, cfg, t, s: seen.update(t, **s))
    out, lse = nvfp4.run_kernel(plan, q4, k4, v4, torch.bfloat16)
    assert out.shape == (b, hq, nq, d) and lse.shape == (b, hq, nq)
    assert set(plan.kernel_cls.OPERANDS) <= set(seen)
    rows = hq // hkv * nq if plan.packed else nq
    heads = hkv if plan.packed else hq
    expect = {"q": (b, heads, rows, d // 2), "q_sf": (b, heads, rows, d // 16),
              "k": (b, hkv, nkv, d // 2), "k_sf": (b, hkv, nkv, d // 16),
              "v": (b, hkv, d, 64), "v_sf": (b, hkv, d, 8)}
    for name, shape in expect.items():
        t = seen[name]
        assert t.dtype == torch.uint8 and tuple(t.shape) == shape, (name, t.shape)
        div = 16 if name in ("q", "k", "v") else 4
        assert t.stride(-1) == 1 and all(s % div == 0 for s in t.stride()[:-1]), name
    assert (seen["v"][..., 56:] == 0).all() and (seen["v_sf"][..., 7:] == 0).all()
    for name in ("q_descale", "k_descale", "v_descale"):
        assert seen[name].dtype == torch.float32 and seen[name].shape == (b, hkv)
    assert seen["softmax_scale"] == pytest.approx(d ** -0.5)


def test_sm100_nvfp4_host_feeds_the_kernel_blocked_scales(monkeypatch):
    """`nvfp4.run_kernel` for the sm_100 kernel (CPU, the launch replaced): the scales in the
    blocked layout (Q's and K's K-blocks padded to whole 256-element chunks, V^T's rows to
    the config's `vt_scale_rows`), V^T's keys padded to whole 128-key blocks with zeros, the
    strides the stand-ins assume (16-byte rows), GQA rows packed where the plan packs them."""
    from ffpa_cute import dispatch, launch
    from ffpa_cute.options import Options

    b, hq, hkv, nq, nkv, d = 2, 4, 2, 130, 100, 320
    q4, k4, v4, p = _host_operands(b, hq, hkv, nq, nkv, d)
    plan = dispatch.plan_fwd(p, target="sm_100a", opts=Options())
    assert plan.kernel_cls.__name__ == "FFPAFwdSm100FP4"
    rows, heads = (hq // hkv * nq, hkv) if plan.packed else (nq, hq)
    seen = {}
    monkeypatch.setattr(launch, "run_job", lambda cls, cfg, t, s: seen.update(t, **s))
    nvfp4.run_kernel(plan, q4, k4, v4, torch.bfloat16)
    assert set(plan.kernel_cls.OPERANDS) <= set(seen)
    rows_v = plan.cfg.vt_scale_rows()
    expect = {"q": (b, heads, rows, d // 2), "q_sf": (b, heads, -(-rows // 128), 8 * 512),
              "k": (b, hkv, nkv, d // 2), "k_sf": (b, hkv, 1, 8 * 512),
              "v": (b, hkv, d, 64), "v_sf": (b, hkv, rows_v // 128, 2 * 512)}
    for name, shape in expect.items():
        t = seen[name]
        assert t.dtype == torch.uint8 and tuple(t.shape) == shape, (name, t.shape)
        assert t.stride(-1) == 1 and all(s % 16 == 0 for s in t.stride()[:-1]), name
    q_sf = q4.block_scale.reshape(b, heads, rows, d // 16)
    assert torch.equal(seen["q_sf"], nvfp4.blocked_scales(q_sf, k_multiple=4))
    assert (seen["v"][..., 56:] == 0).all()
    vs = torch.zeros(b, hkv, d, 8, dtype=torch.uint8)
    vs[..., :7] = v4.block_scale.view(torch.uint8)
    assert torch.equal(seen["v_sf"], nvfp4.blocked_scales(vs, rows=rows_v))


def test_sm100_nvfp4_blocked_scales_are_kept_per_tensor(monkeypatch):
    """A reused K / V (the same NVFP4Tensor) is re-tiled into the blocked layout once; an
    in-place write to its scales, or another tensor, re-tiles (CPU, the launch replaced)."""
    from ffpa_cute import dispatch, launch
    from ffpa_cute.options import Options

    q4, k4, v4, p = _host_operands(1, 2, 2, 70, 100, 320)
    plan = dispatch.plan_fwd(p, target="sm_100a", opts=Options())
    seen, calls = {}, []
    monkeypatch.setattr(launch, "run_job", lambda cls, cfg, t, s: seen.update(t))
    real = nvfp4.blocked_scales
    monkeypatch.setattr(nvfp4, "blocked_scales", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    nvfp4.run_kernel(plan, q4, k4, v4, torch.bfloat16)
    first = {n: seen[n].clone() for n in ("q_sf", "k_sf", "v_sf")}
    assert len(calls) == 3
    nvfp4.run_kernel(plan, q4, k4, v4, torch.bfloat16)
    assert len(calls) == 3 and all(torch.equal(seen[n], first[n]) for n in first)
    k4.block_scale.view(torch.uint8)[0, 0, 0, 0] ^= 1   # in place: K's scales re-tiled
    nvfp4.run_kernel(plan, q4, k4, v4, torch.bfloat16)
    assert len(calls) == 4 and not torch.equal(seen["k_sf"], first["k_sf"])
    q5 = nvfp4.NVFP4Tensor(q4.data, q4.block_scale.clone(), q4.tensor_scale)
    nvfp4.run_kernel(plan, q5, k4, v4, torch.bfloat16)
    assert len(calls) == 5 and torch.equal(seen["q_sf"], first["q_sf"])


@pytest.mark.parametrize("target,kernel", [("sm_120a", "FFPAFwdSm80FP4"),
                                           ("sm_100a", "FFPAFwdSm100FP4")])
def test_nvfp4_kernels_compile_with_window_and_sinks(in_tmp, target, kernel):
    """Both NVFP4 forwards with a sliding window (a left edge, the right one as the causal rule)
    and sinks: planned with the fields, `window_lo` and `sinks` among the kernel's arguments,
    the same block-scaled MMA kind, no local memory, no spills."""
    import dataclasses

    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem
    from test_kernels_compile import _no_spills

    p = AttnProblem(dtype="nvfp4", batch=1, heads_q=2, heads_kv=2, seqlen_q=1000,
                    seqlen_kv=1000, head_dim=512, head_dim_v=512, causal=True,
                    out_dtype="bf16")
    p = dataclasses.replace(p, window_lo=-300, window_hi=0, has_sinks=True)
    plan = dispatch.plan_fwd(p, target=target, opts=Options())
    assert plan.reason is None and plan.kernel_cls.__name__ == kernel
    assert plan.cfg.window and plan.cfg.sinks
    assert "window_lo" in plan.kernel_cls.SCALARS and "sinks" in plan.kernel_cls.OPERANDS
    ptx = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__
    assert "kind::mxf4nvf4" in ptx and ".local" not in ptx
    _no_spills(ptx, target, max_regs=255)


def test_blocked_scales_of_an_inference_tensor():
    """Scales made under torch.inference_mode have no version counter: their blocked layout
    is computed at every call (never a stale cache entry), the same bytes as for a normal
    tensor."""
    x = torch.randn(1, 2, 128, 64)
    with torch.inference_mode():
        frozen = nvfp4.quantize_nvfp4(x)
    plain = nvfp4.quantize_nvfp4(x)
    scales = frozen.block_scale.view(torch.uint8)
    a = nvfp4._blocked_once(frozen, scales, k_multiple=4)
    b = nvfp4._blocked_once(plain, plain.block_scale.view(torch.uint8), k_multiple=4)
    assert torch.equal(a, b) and torch.equal(nvfp4._blocked_once(frozen, scales, k_multiple=4), a)
