"""The sm100 forward's arithmetic (ffpa_cute/sm100/emulate.py, step for step as the kernel does
it: block order, the frame that moves only past RESCALE_THRESHOLD, P rounded for P V while the
row sum keeps it unrounded) against float64 on the CPU: the algorithm of a kernel that never
ran (no sm_100 GPU here) is right, and the FP8 form's P cannot saturate e4m3."""

import math

import pytest
import torch

from ffpa_cute.reference import attention_grads, attention_ref, attention_same_dtype, rel_err
from ffpa_cute.sm100 import emulate
from ffpa_cute.sm100.config import RESCALE_THRESHOLD
from ffpa_cute.sm100.emulate import LOG2_E

E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max


@pytest.mark.parametrize("nq,nkv,causal,hq,hkv", [
    (129, 129, False, 2, 2), (7, 1000, True, 4, 1), (300, 257, True, 2, 2), (1, 300, False, 2, 1),
    (200, 70, True, 2, 2)])  # causal with Nq > Nkv: the first rows see no key
def test_matches_float64_within_the_bf16_bound(nq, nkv, causal, hq, hkv):
    g = torch.Generator().manual_seed(nq + nkv)
    q = torch.randn(1, hq, nq, 64, generator=g).bfloat16()
    k = torch.randn(1, hkv, nkv, 64, generator=g).bfloat16()
    v = torch.randn(1, hkv, nkv, 64, generator=g).bfloat16()
    out, lse = emulate.forward(q, k, v, causal=causal)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    base, _ = attention_same_dtype(q, k, v, causal=causal)
    assert rel_err(out, ref) <= 2 * rel_err(base, ref) + 1e-3
    assert rel_err(lse, ref_lse) <= 1e-5  # -inf rows equal; the rest fp32-exact
    if causal and nq > nkv:
        assert torch.isinf(lse[..., : nq - nkv]).all() and (out[..., : nq - nkv, :] == 0).all()


@pytest.mark.parametrize("nq,nkv,causal,window_lo,sinks", [
    (300, 700, True, 400 - 100, True),    # window 100 behind the bottom-right frame, causal
    (129, 600, False, 300, False),        # left edge only: blocks skipped and masked
    (200, 70, True, -500, True),          # the window reaches past key 0; rows with no key
    (64, 300, False, None, True)])        # sinks alone
def test_window_and_sinks_match_float64(nq, nkv, causal, window_lo, sinks):
    """The window's block skipping and masks, and the sinks' final factors, as the sm100
    forward does them: within the bf16 bound of float64; a row with no key gives 0 and the
    sink as its LSE."""
    g = torch.Generator().manual_seed(nq * nkv)
    q = torch.randn(1, 2, nq, 64, generator=g).bfloat16()
    k, v = (torch.randn(1, 1, nkv, 64, generator=g).bfloat16() for _ in range(2))
    snk = torch.tensor([6.0, -1.0]) if sinks else None
    kw = dict(causal=causal, window_lo=window_lo, sinks=snk)
    out, lse = emulate.forward(q, k, v, **kw)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    base, _ = attention_same_dtype(q, k, v, **kw)
    assert rel_err(out, ref) <= 2 * rel_err(base, ref) + 1e-3
    assert rel_err(lse, ref_lse) <= 1e-5


@pytest.mark.parametrize("causal,window_lo", [(True, 300 - 100), (False, 200)])
def test_quantized_window_and_sinks_within_the_canary_bounds(causal, window_lo):
    """The e4m3 and NVFP4 forms with a window and sinks (the same walk, masks and final
    factors as at 16 bits, P rounded to e4m3 / NVFP4): on e4m3 operands within fp8.FP8_TOL,
    on NVFP4 operands within nvfp4.FP4_TOL of float64 on the dequantised inputs, P <= 2^8; a
    sink far above every score leaves the result finite."""
    from ffpa_cute import nvfp4
    from ffpa_cute.fp8 import FP8_TOL

    g = torch.Generator().manual_seed(5)
    e4m3 = torch.float8_e4m3fn
    x = [torch.randn(1, h, n, 128, generator=g) for h, n in ((2, 200), (1, 496), (1, 496))]
    forms = {e4m3: ([t.to(e4m3).float() for t in x], FP8_TOL),
             "nvfp4": ([nvfp4.quantize_nvfp4(t).dequantize() for t in x[:2]]
                       + [nvfp4.quantize_nvfp4(x[2].transpose(-1, -2)).dequantize()
                          .transpose(-1, -2)], nvfp4.FP4_TOL)}
    for p_dtype, ((q, k, v), tol) in forms.items():
        for snk in (torch.tensor([1.5, -2.0]), torch.tensor([40.0, 0.0])):
            kw = dict(causal=causal, window_lo=window_lo, sinks=snk)
            rec = {}
            out, lse = emulate.forward(q, k, v, p_dtype=p_dtype, record=rec, **kw)
            ref, ref_lse = attention_ref(q, k, v, **kw)
            assert rec["p_max"] <= 2 ** RESCALE_THRESHOLD < E4M3_MAX
            assert torch.isfinite(out).all() and rel_err(out, ref) <= tol, (p_dtype, snk)
            assert rel_err(lse, ref_lse) <= 1e-5  # the row sum keeps P unrounded


@pytest.mark.parametrize("nq,nkv,causal,window_lo,with_sinks,hq,hkv", [
    (300, 700, True, 400 - 100, True, 4, 2),   # window 100 behind the bottom-right frame
    (129, 600, False, 200, False, 2, 1),       # left edge only: query blocks cut per key tile
    (300, 700, False, 100, False, 2, 2),       # (the cut falls inside a query block)
    (200, 70, True, -500, True, 2, 2),         # past key 0; rows with no key (causal Nq > Nkv)
    (257, 513, True, None, False, 4, 1)])      # no window: the plain walks
def test_backward_walks_and_masks_match_float64(nq, nkv, causal, window_lo, with_sinks, hq,
                                                hkv):
    """The gradient kernels' walks (dQ over key blocks, dK / dV over query blocks bounded by
    causal and the window) and masks cover exactly the visible pairs: against float64 (the
    sinks through the lse, as the kernels read them)."""
    g = torch.Generator().manual_seed(nq + 3 * nkv)
    q = torch.randn(1, hq, nq, 64, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, hkv, nkv, 64, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(1, hq, nq, 64, generator=g, dtype=torch.float64)
    sinks = torch.randn(hq, generator=g, dtype=torch.float64) + 2 if with_sinks else None
    kw = dict(causal=causal, window_lo=window_lo)
    out, lse = attention_ref(q, k, v, sinks=sinks, **kw)
    delta = (out * dout).sum(-1)
    got = emulate.backward(q, k, v, dout, lse, delta, **kw)
    want = attention_grads(q, k, v, dout, sinks=sinks, **kw)
    for name, a, w in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(a, w) <= 1e-5, name


def _ramp(n, steps):
    """Scores rising by `steps` (log2 units of the scaled score) from the last key to the
    first: the kernel walks the blocks from the last, so each block's max exceeds the last
    one's (negated: falling along the walk, the max met first)."""
    return torch.linspace(steps, 0, n)


@pytest.mark.parametrize("pattern,min_p_max", [
    ("sink", 1.0), ("rising_along_walk", 128.0), ("max_first", 1.0), ("long", 200.0)])
def test_fp8_p_never_exceeds_the_threshold_bound(pattern, min_p_max):
    """P <= 2^RESCALE_THRESHOLD = 256 < 448 (e4m3's largest finite value) whatever the order
    in which the row's max appears: a few huge-score sink columns (40 above the rest) among
    the first keys (visited last), scores rising along the walk (the frame lags below the
    max by up to the threshold: P approaches 2^8; `min_p_max` checks that the case really
    reaches it), the max met first, and 64K keys rising along the walk (hundreds of frame
    moves). The FP8 result stays finite and within 4% of float64 (e4m3's P rounding, ~2-3%
    on flat rows of many keys)."""
    d, nkv = 64, 65536 if pattern == "long" else 4096
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 1, 4, d, generator=g)
    k = torch.randn(1, 1, nkv, d, generator=g) * 0.3
    v = torch.randn(1, 1, nkv, d, generator=g)
    scale = 1.0 / math.sqrt(d)
    # shape the scores through a key component along q's direction
    unit = q[0, 0].mean(0) / q[0, 0].mean(0).norm()
    bias = {"sink": torch.where(torch.arange(nkv) < 4, 40.0, 0.0),
            "rising_along_walk": _ramp(nkv, 60.0),
            "max_first": -_ramp(nkv, 60.0),
            "long": _ramp(nkv, 1000.0)}[pattern]
    k = k + (bias / (scale * LOG2_E * q[0, 0].mean(0).norm()))[None, None, :, None] * unit
    rec = {}
    out, _ = emulate.forward(q, k, v, p_dtype=torch.float8_e4m3fn, record=rec)
    assert min_p_max <= rec["p_max"] <= 2 ** RESCALE_THRESHOLD < E4M3_MAX
    ref, _ = attention_ref(q, k, v)
    assert torch.isfinite(out).all() and rel_err(out, ref) <= 4e-2



@pytest.mark.parametrize("pattern", ["flat", "sink", "rising_along_walk"])
def test_nvfp4_p_stays_in_range_and_within_the_canary_bound(pattern):
    """The NVFP4 form (P rounded per 16 keys with an E4M3 scale, tensor scale 1) on NVFP4
    operands: P <= 2^8, so every block scale amax / 6 <= 42.7 lies inside E4M3 and no code
    saturates; the result is finite and within nvfp4.FP4_TOL of float64 on the dequantised
    operands (N(0,1) at D=512: ~9-10%, what perf.quant_error predicts for P in NVFP4)."""
    from ffpa_cute import nvfp4

    d, nkv = 512, 1000
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 2, 130, d, generator=g)
    k = torch.randn(1, 2, nkv, d, generator=g)
    v = torch.randn(1, 2, nkv, d, generator=g)
    scale = 1.0 / math.sqrt(d)
    if pattern != "flat":  # sink columns 30 above the rest, or scores rising along the walk
        bias = (torch.where(torch.arange(nkv) < 3, 30.0, 0.0) if pattern == "sink"
                else _ramp(nkv, 40.0))
        unit = q[0].mean((0, 1)) / q[0].mean((0, 1)).norm()
        k = k + (bias / (scale * LOG2_E * q[0].mean((0, 1)).norm()))[None, None, :, None] * unit
    deq = [nvfp4.quantize_nvfp4(x).dequantize() for x in (q, k)]
    vpad = torch.nn.functional.pad(v, (0, 0, 0, -nkv % 16))  # V^T's blocks run along keys
    vt = nvfp4.quantize_nvfp4(vpad.transpose(-1, -2)).dequantize().transpose(-1, -2)[:, :, :nkv]
    rec = {}
    out, lse = emulate.forward(*deq, vt, causal=True, p_dtype="nvfp4", record=rec)
    assert rec["p_max"] <= 2 ** RESCALE_THRESHOLD and 2 ** RESCALE_THRESHOLD / 6 < E4M3_MAX
    ref, ref_lse = attention_ref(*deq, vt, causal=True)
    err = rel_err(out, ref)
    assert torch.isfinite(out).all() and err <= nvfp4.FP4_TOL, err
    assert rel_err(lse, ref_lse) <= 1e-5  # the row sum keeps P unrounded
