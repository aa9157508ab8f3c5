"""The expected error of FP8 and NVFP4 attention at large D, computed in torch on the CPU with
the kernels' quantization (`reference.attention_quantized`): relative error and RMSE of the
output against float64 attention on the dequantised inputs (the kernel's own error) and on the
original inputs (the total), for N(0, 1) inputs and FlashAttention-3's outlier test (N(0, 1)
plus 0.1% of entries from N(0, 10)); bf16 torch beside them.

    python -m perf.quant_error [--d 512] [--n 1024] [--heads 2]
"""

from __future__ import annotations

import argparse

import torch

from ffpa_cute.reference import attention_quantized, attention_ref, rel_err


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
