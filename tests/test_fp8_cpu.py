"""FP8 on the CPU: the quantizer, the API's contract (through its dequantising fallback: CPU
tensors have no kernel), the planner, and the FP8 kernels' compile (sm90: e4m3 WGMMA in the
PTX; Split-D: e4m3 mma.sync for sm_89 / sm_90a / sm_120a; no spills) at several head dims."""

import re

import pytest
import torch

import ffpa_cute
from ffpa_cute import dispatch
from ffpa_cute.options import Options
from ffpa_cute.problem import AttnProblem
from ffpa_cute.reference import attention_ref, rel_err
from test_kernels_compile import _no_spills, _ptxas_log

E4M3 = torch.float8_e4m3fn


def deq(x8, d, g=1):
    """x8 * descale, the descale per tensor or [B, Hkv] (expanded to g query heads each)."""
    d = torch.as_tensor(d, dtype=torch.float32)
    if d.dim() == 2:
        d = d.repeat_interleave(g, dim=1)[..., None, None]
    return x8.float() * d


@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_quantize_round_trip(seed, granularity):
    x = torch.randn(2, 3, 77, 48) * torch.linspace(0.1, 10, 3)[None, :, None, None]
    x8, d = ffpa_cute.quantize_fp8(x, granularity)
    assert x8.dtype == E4M3 and d.dtype == torch.float32
    assert d.shape == (() if granularity == "tensor" else (2, 3))
    back = deq(x8, d)
    assert rel_err(back, x) < 0.04  # 3 mantissa bits: ~2^-4 relative per element, averaged
    assert x8.float().abs().max() <= torch.finfo(E4M3).max


def test_quantize_rejects_bad_input():
    with pytest.raises(ValueError, match="granularity"):
        ffpa_cute.quantize_fp8(torch.randn(4, 4), "row")
    with pytest.raises(ValueError, match="granularity='head'"):
        ffpa_cute.quantize_fp8(torch.randn(4, 4), "head")
    with pytest.raises(TypeError, match="x must be"):
        ffpa_cute.quantize_fp8(torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hq,hkv,nq,nkv", [(4, 4, 7, 129), (8, 2, 33, 17)])
def test_fp8_attention_is_the_attention_of_the_dequantised_inputs(seed, causal, hq, hkv, nq,
                                                                  nkv):
    """On CPU (no kernel) the call dequantises and runs the bf16 route: the result is the
    attention of x_fp8 * descale (bf16 precision), in out_dtype."""
    q, k, v = (torch.randn(2, h, n, 64) for h, n in ((hq, nq), (hkv, nkv), (hkv, nkv)))
    (q8, qd), (k8, kd), (v8, vd) = (ffpa_cute.quantize_fp8(t, "head") for t in (q, k, v))
    qd = qd.reshape(2, hkv, hq // hkv).amax(-1)  # q descale per (batch, KV head), requantised
    q8 = (q / qd.repeat_interleave(hq // hkv, 1)[..., None, None]).to(E4M3)
    out = ffpa_cute.attention(q8, k8, v8, is_causal=causal, enable_gqa=hq != hkv,
                              q_descale=qd, k_descale=kd, v_descale=vd, out_dtype=torch.float16)
    assert out.dtype == torch.float16 and out.shape == (2, hq, nq, 64)
    ref, _ = attention_ref(deq(q8, qd, hq // hkv), deq(k8, kd), deq(v8, vd), causal=causal)
    assert rel_err(out, ref) < 2e-2  # the bf16 route on bf16-rounded dequantised inputs


def test_fp8_contract_errors(seed):
    q8 = torch.randn(1, 2, 5, 64).to(E4M3)
    with pytest.raises(TypeError, match="FP8 inputs"):
        ffpa_cute.attention(torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64),
                            torch.randn(1, 2, 5, 64), q_descale=1.0)
    with pytest.raises(ValueError, match=r"q_descale must be .* \[B, Hkv\]"):
        ffpa_cute.attention(q8, q8, q8, q_descale=torch.ones(3))
    with pytest.raises(ValueError, match="out_dtype"):
        ffpa_cute.attention(q8, q8, q8, out_dtype=torch.float32)
    with pytest.raises(TypeError, match="one dtype"):
        ffpa_cute.attention(q8, q8, q8.float())
    with pytest.raises(NotImplementedError, match="cpu"):
        ffpa_cute.attention(q8, q8, q8, strict=True)


@pytest.mark.parametrize("d,kind", [(512, "FFPAFwdSm90FP8"), (1024, "FFPAFwdSm90FP8"),
                                    (264, None), (520, None), (528, "FFPAFwdSm90FP8")])
def test_fp8_planner(d, kind):
    """e4m3 plans the sm90 FP8 kernel (the CTA pair above 512); D must be a multiple of 16
    (16-byte rows): D=264 has no FP8 kernel and dequantises; e5m2 has none either."""
    p = AttnProblem(dtype="e4m3", batch=1, heads_q=4, heads_kv=4, seqlen_q=7, seqlen_kv=7,
                    head_dim=d, head_dim_v=d)
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options())
    if kind is None:
        assert plan.reason and "multiple of 16" in plan.reason
        return
    assert plan.reason is None and plan.kernel_cls.__name__ == kind
    assert plan.cfg.out_dtype == "bf16" and plan.cfg.kv_pair == (d > 512)
    e5 = AttnProblem(**{**p.__dict__, "dtype": "e5m2"})
    assert dispatch.plan_fwd(e5, target="sm_90a", opts=Options()).reason
    assert "e4m3" in dispatch.plan_fwd(p, target="sm_80", opts=Options()).reason


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx next to the working directory


@pytest.mark.parametrize("d,causal", [(320, True), (512, False), (1024, True), (320, False)])
def test_fp8_kernel_compiles_with_e4m3_wgmma(in_tmp, d, causal):
    """The FP8 forward: m64n128k32 e4m3 QK and m64nNk32 e4m3 PV WGMMAs, TMA, P rounded to e4m3
    (cvt ... e4m3x2) and stored by stmatrix as byte pairs (no 2-byte stores), no local memory,
    no ptxas spills; the `overlap` schedule (no mask: QK[i+1] under the score step, two score
    accumulators): setmaxnreg 184 / 160, and ptxas does not serialise its WGMMAs."""
    p = AttnProblem(dtype="e4m3", batch=1, heads_q=2, heads_kv=2, seqlen_q=1, seqlen_kv=1,
                    head_dim=d, head_dim_v=d, causal=causal, out_dtype="bf16")
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options())
    ptx = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__
    dlo, _ = plan.cfg.dv_halves
    assert "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3" in ptx
    assert f"wgmma.mma_async.sync.aligned.m64n{dlo}k32.f32.e4m3.e4m3" in ptx
    assert "cp.async.bulk.tensor" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "stmatrix.sync.aligned" in ptx and "st.shared.b16" not in ptx
    assert "bf16" not in " ".join(ln for ln in ptx.splitlines() if "wgmma" in ln)
    assert ".local" not in ptx
    _no_spills(ptx)
    assert bool(plan.cfg.overlap) == (d <= 384 and not causal)
    if plan.cfg.overlap:
        assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+184", ptx)
        assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+160", ptx)
        log = _ptxas_log(ptx, "sm_90a")
        assert log is None or "serialized" not in log, log


@pytest.mark.parametrize("n", [1, 16, 77])
def test_interleaved_vt_on_cpu(seed, n):
    """`_transposed_v(v, interleave=True)` (its torch path): byte p of each 16-key group of
    Vt holds key KEY_OF_BYTE[p] (zero past N), the padded N' is the extent."""
    from ffpa_cute.common.transpose import KEY_OF_BYTE
    from ffpa_cute.fp8 import _transposed_v

    v = torch.randn(2, 3, n, 32).to(torch.float8_e4m3fn)
    vt = _transposed_v(v, interleave=True).view(torch.uint8)
    n16 = -(-n // 16) * 16
    assert vt.shape == (2, 3, 32, n16)
    vb = v.view(torch.uint8)
    for pos in range(n16):
        key = 16 * (pos // 16) + KEY_OF_BYTE[pos % 16]
        want = vb[:, :, key, :] if key < n else torch.zeros_like(vb[:, :, 0, :])
        assert torch.equal(vt[..., pos], want), pos
    assert sorted(KEY_OF_BYTE) == list(range(16))


@pytest.mark.parametrize("interleave", [False, True])
def test_transpose_kernel_compiles(in_tmp, interleave):
    """The byte transpose that gives the FP8 kernel Vt (plain, or the sm90 kernel's interleaved
    keys): 16-byte global loads and stores, the tile through shared memory, no local memory."""
    from ffpa_cute.common.config import TransposeConfig

    cfg = TransposeConfig("sm_90a", 320, interleave)
    ptx = dispatch.kernel_class(cfg).compile(cfg, options="--keep-ptx").__ptx__
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx and "ld.shared" in ptx
    assert ".local" not in ptx


@pytest.mark.parametrize("target,d,layout", [("sm_89", 320, "m4n2"), ("sm_89", 1024, "m2n4"),
                                             ("sm_120a", 512, "m4n2"), ("sm_121a", 1024, "m2n4")])
def test_fp8_splitd_planner(target, d, layout):
    """sm_89 (sm80 family) and sm_120 / sm_121 (sm120 family) plan the Split-D FP8 forward (P
    through shared memory: never M8N1), inside the target's shared memory; D=264 (not a multiple
    of 16) has no FP8 kernel; a window and sinks plan the same kernel with those fields; sm_80
    has no e4m3 mma.sync."""
    from ffpa_cute.sm80 import config as sm80_config

    p = AttnProblem(dtype="e4m3", batch=1, heads_q=4, heads_kv=2, seqlen_q=7, seqlen_kv=7,
                    head_dim=d, head_dim_v=d, out_dtype="fp16")
    plan = dispatch.plan_fwd(p, target=target, opts=Options())
    assert plan.reason is None, plan.reason
    assert plan.kernel_cls.__name__ == "FFPAFwdSm80FP8"
    cfg = plan.cfg
    assert cfg.warp_layout == layout and cfg.out_dtype == "fp16"
    assert cfg.smem_bytes() <= sm80_config.SMEM_CAPACITY[target]
    q = AttnProblem(**{**p.__dict__, "head_dim": 264, "head_dim_v": 264})
    assert dispatch.plan_fwd(q, target=target, opts=Options()).reason
    q = AttnProblem(**{**p.__dict__, "window_lo": -128, "has_sinks": True})
    ws = dispatch.plan_fwd(q, target=target, opts=Options())
    assert ws.reason is None and ws.cfg.window and ws.cfg.sinks
    assert "e4m3" in dispatch.plan_fwd(p, target="sm_80", opts=Options()).reason


SPLITD_FP8_CASES = [("sm_89", 320, False), ("sm_90a", 512, True), ("sm_90a", 400, False),
                    ("sm_120a", 512, True), ("sm_120a", 1024, False)]


@pytest.mark.parametrize("target,d,causal", SPLITD_FP8_CASES)
def test_fp8_splitd_compiles_with_e4m3_mma_sync(in_tmp, target, d, causal):
    """The Split-D FP8 forward (sm_90a under `Options(family="sm80")`; D=400: a partial last
    64-column chunk): mma.sync m16n8k32 e4m3 for both products and no 16-bit MMA, ldmatrix and
    cp.async, P rounded to e4m3 by cvt, no local memory, no ptxas spills."""
    p = AttnProblem(dtype="e4m3", batch=1, heads_q=2, heads_kv=2, seqlen_q=1, seqlen_kv=1,
                    head_dim=d, head_dim_v=d, causal=causal, out_dtype="bf16")
    opts = Options(family="sm80") if target == "sm_90a" else Options()
    plan = dispatch.plan_fwd(p, target=target, opts=opts)
    assert plan.kernel_cls.__name__ == "FFPAFwdSm80FP8"
    ptx = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__
    assert f".target {target}" in ptx
    mmas = set(re.findall(r"mma\.sync\.aligned\.\S+", ptx))
    assert mmas == {"mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32"}, mmas
    assert "ldmatrix" in ptx and "cp.async" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "wgmma" not in ptx and "tcgen05" not in ptx and ".local" not in ptx
    _no_spills(ptx, target, max_regs=255)
