"""Do rows that are not a whole number of 128-byte lines slow the forward? (issue 20)

    python -m perf.row_stride --precompile DIR     # CPU: compile the planned configs into DIR
    python -m perf.row_stride [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

At D % 64 != 0 a contiguous [B, H, N, D] bf16 tensor's rows start 2 D bytes apart, so most of
the 128-byte TMA box rows of a Q / K / V chunk straddle two 128-byte lines (D=520: 1040-byte
rows). The same planned kernel is timed on contiguous inputs and on inputs whose rows are
padded to a multiple of 64 elements (a [..., :D] view of a wider buffer: same values, same
kernel, rows 128-byte aligned). If the padded rows are much faster, a host-side repack of such
inputs would pay for itself. B=1, H=32, N=8K, bf16, not causal; the kernel alone (run_fwd), L2
flushed, median of 3 benches. D=320 and 576 are the aligned controls.
"""

from __future__ import annotations

from perf import experiment

HEAD_DIMS = (264, 320, 328, 336, 520, 576, 712, 1016)
HEADS, N = 32, 8192


def _plan(d: int):
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    p = AttnProblem(dtype="bf16", batch=1, heads_q=HEADS, heads_kv=HEADS, seqlen_q=N,
                    seqlen_kv=N, head_dim=d, head_dim_v=d, causal=False)
    return dispatch.plan_fwd(p, target="sm_90a", opts=Options())


def jobs() -> list:
    return [(plan.kernel_cls, plan.cfg) for plan in map(_plan, HEAD_DIMS)]


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch

    res = {}
    for d in HEAD_DIMS:
        plan = _plan(d)
        padded = -(-d // 64) * 64
        for width in sorted({d, padded}):
            q, k, v = (torch.randn(1, HEADS, N, width, device=dev, dtype=torch.bfloat16)[..., :d]
                       for _ in range(3))
            assert launch.kernel_ready(q) is q  # the kernel reads the strided view as it is
            fn = lambda: launch.run_fwd(plan, q, k, v)  # noqa: E731
            fn()
            ms = experiment.median_ms(fn, dev, flush)
            tf = 4 * HEADS * N * N * d / ms / 1e9
            print(f"D={d:4d} row {2 * width:5d} B: {ms:7.3f} ms {tf:6.1f} TFLOPS", flush=True)
            res[f"{d}-{width}"] = dict(d=d, row_bytes=2 * width, ms=ms, tflops=tf)
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.row_stride", __doc__, jobs, run))
