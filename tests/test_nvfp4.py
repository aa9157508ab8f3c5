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
    with pytest.raises(NotImplementedError, match="NVFP4 attention has no kernel"):
        ffpa_cute.attention(t, t, t)


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
