"""The expected error of FP8 and NVFP4 attention at large D, computed in torch on the CPU with
the kernels' quantization (`attention_quantized`): relative error and RMSE of the
output against float64 attention on the dequantised inputs (the kernel's own error) and on the
original inputs (the total), for N(0, 1) inputs and FlashAttention-3's outlier test (N(0, 1)
plus 0.1% of entries from N(0, 10)); bf16 torch beside them.

    python -m perf.quant_error [--d 512] [--n 1024] [--heads 2]
"""

from __future__ import annotations

import argparse
import math

import torch

from ffpa_cute import fp8, nvfp4
from ffpa_cute.reference import _expand_kv, attention_ref, rel_err


def attention_quantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str,
                        causal: bool = False, scale: float | None = None):
    """What an FP8 / NVFP4 attention kernel computes, emulated in float64: (out, (q, k, v)
    dequantised). fmt "e4m3": q, k, v quantised per tensor (`fp8.quantize_fp8`), P in e4m3 in
    the kernels' frame (P = exp(s - m) * 2^8 <= 256 < 448, the largest finite e4m3); "nvfp4":
    q, k quantised in 16-element blocks along D and V along the keys (the P V product's
    contraction), P as the sm_120 kernel (FFPAFwdSm80FP4) rounds it: in each 64-key block's own
    frame, P = exp(s - block max) * 2^8 <= 256, in NVFP4 blocks of 16 keys with tensor scale 1
    (block scales <= 256 / 6 < 448). The row sums are of the unrounded P, as the kernels keep
    them in fp32.
    Compare `out` with `attention_ref` on the dequantised inputs for the kernel's own error, on
    the original inputs for the total."""
    if fmt == "e4m3":
        deq = [(t8.double() * d.double()) for t8, d in (fp8.quantize_fp8(t) for t in (q, k, v))]
    elif fmt == "nvfp4":
        deq = [nvfp4.quantize_nvfp4(t).dequantize(torch.float64) for t in (q, k)]
        deq.append(nvfp4.quantize_nvfp4(v.transpose(-1, -2)).dequantize(torch.float64)
                   .transpose(-1, -2))
    else:
        raise ValueError(f"fmt must be 'e4m3' or 'nvfp4', got {fmt!r}")
    qd = deq[0]
    kd, vd = _expand_kv(*deq)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    s = torch.matmul(qd, kd.transpose(-1, -2)) * scale
    if causal:
        nq, nkv = q.shape[-2], k.shape[-2]
        rows = torch.arange(nq).unsqueeze(-1)
        s = s.masked_fill(torch.arange(nkv) > rows + nkv - nq, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True)).nan_to_num(0.0)
    rowsum = p.sum(-1, keepdim=True)
    if fmt == "e4m3":
        pq = (p * 256).to(torch.float8_e4m3fn).double() / 256
    else:
        pq = _nvfp4_p(p)
    out = torch.matmul(pq, vd) / torch.where(rowsum > 0, rowsum, 1.0)
    return out, tuple(deq)


def _nvfp4_p(p: torch.Tensor, block: int = 64) -> torch.Tensor:
    """P (row max 1) rounded as FFPAFwdSm80FP4 rounds it: each `block`-key block in its own
    frame scaled to 2^8 at its max, NVFP4 with tensor scale 1, back in the row's frame."""
    nkv = p.shape[-1]
    pad = -nkv % block
    blocks = torch.nn.functional.pad(p, (0, pad)).unflatten(-1, (-1, block))
    top = blocks.amax(-1, keepdim=True)
    framed = torch.where(top > 0, blocks / torch.where(top > 0, top, 1.0), 0.0) * 2.0 ** 8
    rounded = nvfp4.quantize_nvfp4(framed, tensor_scale=1.0).dequantize(torch.float64)
    return (rounded * top / 2.0 ** 8).flatten(-2)[..., :nkv]


def _draw(shape, outliers: float, gen):
    x = torch.randn(shape, generator=gen)
    if outliers:
        pick = torch.rand(shape, generator=gen) < outliers
        x = torch.where(pick, torch.randn(shape, generator=gen) * 10, x)
    return x


def rows(d: int, n: int, heads: int, causal: bool = False):
    """[(inputs, format, rel err own, rmse own, rel err total, rmse total)]."""
    out = []
    for name, outliers in (("N(0,1)", 0.0), ("N(0,1) + 0.1% N(0,10)", 1e-3)):
        gen = torch.Generator().manual_seed(0)
        q, k, v = (_draw((1, heads, n, d), outliers, gen) for _ in range(3))
        truth = attention_ref(q, k, v, causal=causal)[0]

        def rmse(a, b):
            return (a.double() - b).pow(2).mean().sqrt().item()

        bf = attention_ref(*(t.bfloat16() for t in (q, k, v)), causal=causal,
                           upcast=torch.bfloat16)[0]
        out.append((name, "bf16 (torch)", None, None, rel_err(bf, truth), rmse(bf, truth)))
        for fmt in ("e4m3", "nvfp4"):
            o, deq = attention_quantized(q, k, v, fmt, causal=causal)
            own = attention_ref(*deq, causal=causal)[0]
            out.append((name, fmt, rel_err(o, own), rmse(o, own), rel_err(o, truth),
                        rmse(o, truth)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.quant_error", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=2)
    a = ap.parse_args(argv)
    print(f"D={a.d}, N={a.n}, H={a.heads}, float64 reference\n")
    print("| inputs | format | rel err (own) | RMSE (own) | rel err (total) | RMSE (total) |")
    print("|---|---|---|---|---|---|")

    def f(x):
        return "-" if x is None else f"{x:.2e}"

    for name, fmt, *vals in rows(a.d, a.n, a.heads):
        print(f"| {name} | {fmt} | " + " | ".join(f(x) for x in vals) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
