"""The forward's cost on the autograd path: the same D=512 call timed with and without
`requires_grad` inputs, L2 flushed before each call (perf.timing), so host latency the GPU
would wait for shows; the two are timed interleaved (no grad, grad, grad, no grad) so clock
drift cancels. Issue 20 asks for the autograd-path forward within 2% of the no-grad one.

    python -m perf.grad_overhead --precompile DIR   # CPU box: the kernel it times
    python -m perf.grad_overhead --out FILE         # GPU: ms and the ratio per shape
"""

from __future__ import annotations

from ffpa_cute import dispatch
from ffpa_cute.problem import AttnProblem

from .experiment import main, median_ms

SHAPES = [(512, 8192, False), (512, 8192, True), (320, 8192, False), (1024, 8192, False)]


def _problem(d, n, causal):
    return AttnProblem(dtype="bf16", batch=1, heads_q=32, heads_kv=32, seqlen_q=n, seqlen_kv=n,
                       head_dim=d, head_dim_v=d, causal=causal, requires_grad=True)


def jobs():
    out = []
    for d, n, causal in SHAPES:
        plan = dispatch.plan_fwd(_problem(d, n, causal), target="sm_90a")
        out.append((plan.kernel_cls, plan.cfg))
    return out


def run(dev, flush):
    import torch

    import ffpa_cute

    res = {}
    for d, n, causal in SHAPES:
        q, k, v = (torch.randn(1, 32, n, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        samples = {False: [], True: []}
        for grad in (False, True, True, False):  # interleaved: clock drift cancels
            qq, kk, vv = (t.detach().requires_grad_(grad) for t in (q, k, v))
            samples[grad].append(median_ms(
                lambda: ffpa_cute.attention(qq, kk, vv, is_causal=causal), dev, flush))
        times = {g: sum(x) / len(x) for g, x in samples.items()}
        name = f"D={d} N={n}{' causal' if causal else ''}"
        res[name] = {"no_grad_ms": times[False], "grad_ms": times[True],
                     "ratio": times[True] / times[False]}
        print(f"{name:22s} no grad {times[False]:.3f} ms, requires_grad {times[True]:.3f} ms "
              f"({times[True] / times[False]:.3f}x)")
    return res


if __name__ == "__main__":
    raise SystemExit(main("perf.grad_overhead", __doc__, jobs, run))
