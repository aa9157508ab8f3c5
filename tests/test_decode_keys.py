"""The keys-as-rows FP8-cache decode (sm90/decode_keys_sm90.py) on the CPU: where the planner
routes it, what it refuses, and that it compiles for sm_90a with the instructions it is built
from (e4m3 WGMMAs for S^T over Q's three terms, fp16 WGMMAs for P V, TMA loads, the exact
e4m3 -> fp16 bit conversion) and no spills. Numerics run on the H200
(tests/test_features_gpu.py::test_decode_fp8_cache)."""

import dataclasses
import re

import pytest
import torch

from ffpa_cute import dispatch
from ffpa_cute.options import Options
from ffpa_cute.problem import AttnProblem
from ffpa_cute.sm90 import config as sm90_config
from ffpa_cute.sm90.config import DecodeKeysConfigSm90, can_implement_decode_keys
from test_kernels_compile import _no_spills

E4M3 = torch.float8_e4m3fn


def _problem(g, d=512, dv=512, causal=False):
    """A packed decode problem: G query rows per KV head against a cache."""
    return AttnProblem(dtype="bf16", batch=8, heads_q=4, heads_kv=4, seqlen_q=g, seqlen_kv=4096,
                       head_dim=d, head_dim_v=dv, causal=causal)


def _plan(p, page=64):
    return dispatch.plan_decode(p, page, target="sm_90a", opts=Options(), kv_dtype="e4m3")


@pytest.mark.parametrize("g,d,dv,page,rows", [
    (8, 512, 512, 64, 8), (1, 512, 512, None, 8), (16, 512, 512, 256, 16),
    (8, 576, 512, 64, 8), (24, 576, 512, None, 24), (20, 384, 384, None, 24),
    (32, 256 + 64, 256, 64, 32)])
def test_fp8_cache_with_few_rows_takes_the_keys_kernel(g, d, dv, page, rows):
    """<= 32 rows per KV head, no mask, a shape whose smem fits: the keys-as-rows kernel, its
    rows padded to a multiple of 8, the deepest ring that fits."""
    plan = _plan(_problem(g, d, dv), page)
    assert plan.reason is None, plan.reason
    cfg = plan.cfg
    assert isinstance(cfg, DecodeKeysConfigSm90) and cfg.rows == rows and cfg.page_rows == page
    assert plan.kernel_cls.__name__ == "FFPADecodeKeysSm90"
    deeper = dataclasses.replace(cfg, stages=cfg.stages + 1)
    assert cfg.stages == 4 or can_implement_decode_keys(deeper) is not None


@pytest.mark.parametrize("p,why", [
    (_problem(64), "MQA 64:1: 64 rows, the row-tiled kernel's full M"),
    (_problem(8, causal=True), "a causal chunk"),
    (_problem(8, 1024, 1024), "D=1024: two K / V stages do not fit"),
    (_problem(8, 320, 320), "Dv=320: not two halves of 64-row tiles"),
])
def test_other_fp8_cache_shapes_take_the_row_tiled_kernel(p, why):
    plan = _plan(p)
    assert plan.reason is None, plan.reason
    assert plan.kernel_cls.__name__ == "FFPADecodeSm90" and plan.cfg.kv_dtype == "e4m3", why


def test_a_16bit_cache_never_takes_it(monkeypatch):
    plan = dispatch.plan_decode(_problem(8), 64, target="sm_90a", opts=Options())
    assert plan.kernel_cls.__name__ == "FFPADecodeSm90" and plan.cfg.kv_dtype is None
    monkeypatch.setattr(sm90_config, "KEYS_DECODE", False)
    dispatch.clear_plans()
    try:
        assert _plan(_problem(8)).kernel_cls.__name__ == "FFPADecodeSm90"
    finally:
        dispatch.clear_plans()


@pytest.mark.parametrize("field,value,pattern", [
    ("arch", "sm_80", "arch"), ("dtype", "e4m3", "dtype"), ("head_dim", 520, "head_dim=520"),
    ("head_dim_v", 320, "head_dim_v=320"), ("rows", 12, "rows=12"), ("rows", 40, "rows=40"),
    ("page_rows", 32, "page_rows=32"), ("stages", 1, "stages"), ("stages", 4, "shared memory")])
def test_config_refusals_name_the_field(field, value, pattern):
    cfg = dataclasses.replace(DecodeKeysConfigSm90("sm_90a", "bf16", 512, 8), **{field: value})
    reason = can_implement_decode_keys(cfg)
    assert reason is not None and pattern in reason
    from ffpa_cute.sm90.decode_keys_sm90 import FFPADecodeKeysSm90

    with pytest.raises(ValueError, match=re.escape(pattern)):
        FFPADecodeKeysSm90(cfg)


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx next to the working directory


@pytest.mark.parametrize("g,d,dv,page,dtype", [
    (8, 512, 512, 64, "bf16"), (8, 576, 512, None, "fp16"), (32, 384, 384, 128, "bf16")])
def test_keys_kernel_compiles(in_tmp, g, d, dv, page, dtype):
    """e4m3 m64n(3N)k32 WGMMAs for S^T, fp16 m64nNk16 for O^T, TMA loads, the bit conversion
    (no cvt from e4m3: the packed multiply of common/convert.py), Q's terms rounded by cvt to
    e4m3, no local memory, no spills (256 threads: <= 255 registers)."""
    p = dataclasses.replace(_problem(g, d, dv), dtype=dtype)
    plan = _plan(p, page)
    assert isinstance(plan.cfg, DecodeKeysConfigSm90), plan
    ptx = plan.kernel_cls.compile(plan.cfg, options="--keep-ptx").__ptx__
    n = plan.cfg.rows
    wgmma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+?)\s", ptx))
    assert wgmma == {f"m64n{3 * n}k32.f32.e4m3.e4m3", f"m64n{n}k16.f32.f16.f16"}, wgmma
    assert "cp.async.bulk.tensor" in ptx and "mul.rn.f16x2" in ptx
    # V^T's fragments come from registers (the P V WGMMA has a register list as its A), built
    # by 2-byte shared loads
    pv = [ln for ln in ptx.splitlines() if f"m64n{n}k16.f32.f16.f16" in ln]
    assert pv and all(re.search(r"\}, \{", ln) for ln in pv)
    assert "ld.shared.b16" in ptx
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and ".local" not in ptx
    _no_spills(ptx, max_regs=255)


def test_v_fragment_rows_map_onto_dv_columns():
    """`_dv_of` inverts `_v_operand`'s row order: M rows g and g + 8 of warp w's 16 are the
    column pair 8 w + g (bytes 2 (8 w + g) and + 1) of the tile, and each 64-row M tile maps
    onto its own 64 Dv columns exactly once."""
    from ffpa_cute.sm90.decode_keys_sm90 import FFPADecodeKeysSm90

    kern = FFPADecodeKeysSm90(DecodeKeysConfigSm90("sm_90a", "bf16", 512, 8))
    for mt in range(kern.half // 64):
        for w in range(4):
            for g in range(8):
                m = 64 * mt + 16 * w + g
                assert kern._dv_of(m) == 64 * mt + 2 * (8 * w + g)
                assert kern._dv_of(m + 8) == 64 * mt + 2 * (8 * w + g) + 1
    assert sorted(kern._dv_of(m) for m in range(kern.half)) == list(range(kern.half))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_three_e4m3_terms_carry_the_query(dtype):
    """Q written per row as s (Q_0 + Q_1 + Q_2), s = amax / 448, each term the e4m3 rounding of
    what the previous ones left (the kernel's `_split_q`, emulated in torch): within 2^-14 of
    the row's amax per element (measured 2^-14.8; bf16 keeps 8 significant bits, fp16 11); two
    terms leave 2^-9.8."""
    q = (torch.randn(64, 512) * torch.logspace(-3, 3, 64)[:, None]).to(dtype).float()
    s = q.abs().amax(-1, keepdim=True) / 448
    x, terms = q / s, []
    for _ in range(3):
        t = x.to(E4M3).float()
        terms.append(t)
        x = x - t
    err3 = ((s * sum(terms) - q).abs() / (s * 448)).amax()
    err2 = ((s * (terms[0] + terms[1]) - q).abs() / (s * 448)).amax()
    assert err3 <= 2.0 ** -14 and err2 > 2.0 ** -11
