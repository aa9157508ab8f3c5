"""What bounds the FP8 forward (e4m3 WGMMA, `FFPAFwdSm90FP8`): the kernel timed beside variants
of itself that drop one piece of a block's work, so the difference is that piece's share.

    python -m perf.fp8_limits --precompile DIR     # CPU: compile the variants into a cache
    python -m perf.fp8_limits                      # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

Variants (each the real kernel's config; only the S warpgroup's score step changes):
  full      the shipping kernel: mask, row max, exp2 in the block's frame, row sums, P -> e4m3
  no-exp    P = S rounded to e4m3 (no max / exp2 / sums): the tensor-core work, the loads, the P
            hand-over and stores stay, the softmax arithmetic (MUFU exp2, FMNMX, FADD) goes
  The matmul ceiling (torch._scaled_mm, e4m3, 8192^3) is measured in the same run.

TFLOPS on the 16-bit FLOP count of the attention (4 B Hq N^2 D; causal: the visible pairs). The
kernel alone: V arrives pre-transposed (Vt), so the transpose kernel is not in the time.
Experiments only: the variants compute wrong attention and are never routed.
"""

from __future__ import annotations

import sys

import cutlass.cute as cute

from ffpa_cute.sm90.fwd_sm90 import FFPAFwdSm90FP8
from perf import experiment

SHAPES = [  # (D, N, causal)
    (512, 8192, False), (512, 16384, False), (512, 8192, True), (320, 8192, False)]
HEADS = 32


class FP8NoExp(FFPAFwdSm90FP8):
    """The FP8 forward with P = S (rounded to e4m3): no softmax arithmetic."""

    @cute.jit
    def _softmax_block(self, tile, frags, n_block):
        frags.rP.store(frags.acc_S.load().to(self.dtype))


VARIANTS = {"full": FFPAFwdSm90FP8, "no-exp": FP8NoExp}


def _plan(d: int, causal: bool):
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    p = AttnProblem(dtype="e4m3", batch=1, heads_q=HEADS, heads_kv=HEADS, seqlen_q=8192,
                    seqlen_kv=8192, head_dim=d, head_dim_v=d, causal=causal, out_dtype="bf16")
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options())
    assert plan.reason is None, plan.reason
    return plan.cfg


def jobs() -> list:
    """Every variant kernel at every shape's config."""
    return [(cls, _plan(d, causal)) for d, _, causal in SHAPES for cls in VARIANTS.values()]


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute.cache import jit_cache
    from perf.timing import bench

    out = {}
    a = torch.randn(8192, 8192, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)

    def mm():
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    mm()
    out["matmul_tflops"] = 2 * 8192 ** 3 / (bench(mm, dev, flush=flush).median_ms * 1e9)
    print(f"e4m3 matmul 8192^3: {out['matmul_tflops']:.0f} TFLOPS", flush=True)
    for d, n, causal in SHAPES:
        cfg = _plan(d, causal)
        q, k = (torch.randn(1, HEADS, n, d, device=dev).to(torch.float8_e4m3fn) for _ in "qk")
        vt = torch.randn(1, HEADS, d, n, device=dev).to(torch.float8_e4m3fn)
        o = torch.empty(1, HEADS, n, d, device=dev, dtype=torch.bfloat16)
        lse = torch.empty(1, HEADS, n, device=dev)
        ds = [torch.ones(1, HEADS, device=dev) for _ in range(3)]
        pairs = n * (n + 1) // 2 if causal else n * n
        flops = 4 * HEADS * pairs * d
        row = {}
        for name, cls in VARIANTS.items():
            fn = jit_cache().get(cls, cfg)

            def call(fn=fn, cls=cls):
                cls.launch(fn, q, k, vt, o, lse, *ds, d ** -0.5, 0)

            call()
            torch.cuda.synchronize()
            row[name] = flops / (bench(call, dev, flush=flush).median_ms * 1e9)
        key = f"D={d} N={n}{' causal' if causal else ''}"
        out[key] = row
        print(f"{key}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()), flush=True)
    return out


def main(argv=None) -> int:
    return experiment.main("perf.fp8_limits", __doc__, jobs, run, argv)


if __name__ == "__main__":
    sys.exit(main())
