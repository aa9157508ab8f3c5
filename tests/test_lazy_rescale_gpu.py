"""The sm90 forwards with `lazy_rescale` (common/softmax.py, Note [Lazy rescaling]; routed for
the plain 16-bit forward at D=320 / 328 / 336 / 368 / 456 / 512 and the FP8 one at 320 / 512,
planned here by a patched planner wherever it builds) against float64: the 16-bit forward on the fast grid's shapes up to D=512 and on scores that
grow along the keys (so rows rescale late, by more than the kept margin), the FP8 forward on
its cases, its sink columns and FlashAttention-3's outlier experiment."""

import dataclasses

import pytest
import torch

import ffpa_cute
from ffpa_cute import dispatch, interface
from ffpa_cute.reference import attention_ref, attention_same_dtype, rel_err
from ffpa_cute.sm90 import config as sm90_config
from test_attention_gpu import call, check_forward, make_qkv, offset_of
import test_fp8_gpu as fp8_gpu
from test_fp8_gpu import TOL, errors, quantized, run

pytestmark = pytest.mark.gpu
BF16, FP16 = torch.bfloat16, torch.float16


@pytest.fixture(autouse=True)
def lazy(monkeypatch):
    """Plan every sm90 forward that can take it with `lazy_rescale` (the 16-bit and FP8
    forwards, one CTA per row tile)."""
    if dispatch.current_arch() != "sm_90a":
        pytest.skip("lazy_rescale is an sm90 forward field")
    planner = sm90_config.plan_fwd

    def with_lazy(*args, **kwargs):
        cfg = planner(*args, **kwargs)
        lazy_cfg = dataclasses.replace(cfg, lazy_rescale=True)
        return lazy_cfg if sm90_config.can_implement(lazy_cfg) is None else cfg

    monkeypatch.setattr(sm90_config, "plan_fwd", with_lazy)
    interface._clear_caches()
    yield
    monkeypatch.undo()
    interface._clear_caches()


def _planned_lazy(q, k, v, **kw):
    """The call's plan (explain names its config) has `lazy_rescale`."""
    return "lazy_rescale=True" in ffpa_cute.explain(q, k, v, **kw)


SHAPES = [(1, 129, 1), (7, 7, 4), (129, 1000, 16), (1000, 129, 1), (4097, 4097, 4)]


@pytest.mark.parametrize("d,dt", [(320, BF16), (512, BF16), (448, FP16), (328, BF16)])
@pytest.mark.parametrize("mode", ["none", "bottom_right", "upper_left"])
@pytest.mark.parametrize("nq,nkv,ratio", SHAPES)
def test_lazy_16bit_forward(seed, d, dt, mode, nq, nkv, ratio):
    """The 16-bit forward: error <= 2x torch's + 1e-3, LSE within 2e-3 (check_forward)."""
    q, k, v = make_qkv(1, 2 * ratio, 2, 8, 8, d, dt)
    assert _planned_lazy(q, k, v, enable_gqa=ratio > 1)
    check_forward(d, dt, mode, nq, nkv, ratio)


@pytest.mark.parametrize("mode", ["none", "bottom_right"])
def test_lazy_growing_scores(seed, mode):
    """Scores growing along the keys (key j scaled by 1 + 6 j / N): a row's max grows by far
    more than the kept margin over its blocks, so it rescales late and often."""
    d, nq, nkv = 512, 1000, 3000
    q, k, v = make_qkv(1, 4, 4, nq, nkv, d, BF16)
    grow = 1 + 6 * torch.arange(nkv, device="cuda", dtype=torch.float32) / nkv
    k = (k.float() * grow[:, None]).to(BF16)
    assert _planned_lazy(q, k, v, is_causal=mode != "none")
    out = call(q, k, v, mode)
    causal, off = mode != "none", offset_of(mode, nq, nkv)
    ref, _ = attention_ref(q, k, v, causal=causal, causal_offset=off)
    base, _ = attention_same_dtype(q, k, v, causal=causal, causal_offset=off)
    err, base_err = rel_err(out, ref), rel_err(base, ref)
    assert err <= 2 * base_err + 1e-3, f"err {err:.3g} vs torch {base_err:.3g}"


@pytest.mark.parametrize("d,mode,nq,nkv,ratio", [
    (512, "none", 1000, 1000, 1), (512, "bottom_right", 129, 1000, 4),
    (320, "none", 65, 1100, 1), (384, "upper_left", 1000, 1000, 2)])
def test_lazy_fp8_forward(seed, d, mode, nq, nkv, ratio):
    """The FP8 forward: within the FP8 bound of float64 (D=320 unmasked: `overlap`)."""
    with ffpa_cute.options.use(family="sm90"):
        hkv = 2
        q8, k8, v8, ds, (qr, kr, vr) = quantized(1, hkv * ratio, hkv, nq, nkv, d)
        assert _planned_lazy(q8, k8, v8, enable_gqa=ratio > 1)
        off = {"none": 0, "bottom_right": nkv - nq, "upper_left": 0}[mode]
        ref, _ = attention_ref(qr, kr, vr, causal=mode != "none", causal_offset=off)
        err, rmse = errors(run(q8, k8, v8, ds, mode), ref)
    print(f"fp8 lazy d{d} {mode}: rel err {err:.3g}, RMSE {rmse:.3g}")
    assert err <= TOL


@pytest.mark.parametrize("gap", [30.0, 12.0, 4.0])
def test_lazy_fp8_sink_columns(seed, gap):
    """test_fp8_sink_columns (a few keys `gap` above the rest; 4: inside the kept frame's
    margin) under the lazy frame: finite, within the FP8 bound."""
    with ffpa_cute.options.use(family="sm90"):
        fp8_gpu.test_fp8_sink_columns(seed, "sm90 lazy", gap)


def test_lazy_fp8_outlier_experiment_rmse(seed):
    """test_fp8_outlier_experiment_rmse (FlashAttention-3's outlier experiment at D=512, RMSE
    <= 9.1e-3) under the lazy frame."""
    with ffpa_cute.options.use(family="sm90"):
        fp8_gpu.test_fp8_outlier_experiment_rmse(seed, "sm90 lazy")
