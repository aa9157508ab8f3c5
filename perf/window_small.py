"""Short sliding windows (DeepSeek-V4's 128 keys at D=512, MQA 64:1) forward and backward, by
route: the default backward (fused where it builds) against `deterministic=True` (the
atomic-free kernels), beside causal at the same shape; then where the default backward's time
goes (torch.profiler, CUDA kernel time per kernel name). TFLOPS on the visible pairs
(backward 2.5x). Kernels compile on first use (no precompile list: `jobs()` is empty).

    python -m perf.window_small --out FILE      # GPU
"""

from __future__ import annotations

from .experiment import interleaved_ms, main
from .flops import tflops
from .serving import _pairs_window

D = 512
SHAPES = [  # (left, B, Hq, Hkv, N)
    (128, 1, 64, 1, 8192), (128, 1, 64, 1, 16384), (128, 4, 32, 32, 8192),
    (512, 1, 64, 1, 8192), (1024, 1, 32, 32, 8192)]


def jobs():
    return []


def _profile(fn, n_iter: int = 5) -> dict:
    """{kernel name: mean CUDA ms per call} of fn, and the total."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n_iter):
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t > 0 and ev.count:
            out[ev.key[:90]] = t / 1e3 / n_iter
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def run(dev, flush):
    import torch

    import ffpa_cute

    res = {}
    for left, b, hq, hkv, n in SHAPES:
        q = torch.randn(b, hq, n, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, hkv, n, D, device=dev, dtype=torch.bfloat16,
                            requires_grad=True) for _ in range(2))
        kw = dict(is_causal=True, enable_gqa=hq != hkv)
        win = dict(kw, window=(left, 0))
        fwd = {"fwd window": lambda: ffpa_cute.attention(q, k, v, **win),   # run under no_grad
               "fwd causal": lambda: ffpa_cute.attention(q, k, v, **kw)}
        fns = {}
        for name, args in (("window", win), ("causal", kw)):
            out = ffpa_cute.attention(q, k, v, **args)
            do = torch.randn_like(out)
            fns[f"bwd {name}"] = (lambda o=out, g=do: torch.autograd.grad(
                o, (q, k, v), g, retain_graph=True))
        with ffpa_cute.options.use(deterministic=True):   # the graph keeps it for backward
            out_d = ffpa_cute.attention(q, k, v, **win)
            do_d = torch.randn_like(out_d)
        fns["bwd window det"] = lambda: torch.autograd.grad(out_d, (q, k, v), do_d,
                                                            retain_graph=True)
        allf = {**{k_: (lambda f=f: _nograd(f)) for k_, f in fwd.items()}, **fns}
        for f in allf.values():
            f()
        ms = interleaved_ms(allf, dev, flush)
        pw, pc = _pairs_window(n, left), n * (n + 1) // 2
        name = f"left {left} B={b} {hq}/{hkv} N={n}"
        row = {k_: {"ms": t, "tflops": tflops((2.5 if k_.startswith("bwd") else 1.0) * 4 * b
                                              * hq * (pc if "causal" in k_ else pw) * D, t)}
               for k_, t in ms.items()}
        row["route"] = ffpa_cute.explain(q, k, v, **win)
        if left == 128 and n == 8192:
            row["profile bwd window"] = _profile(fns["bwd window"])
            row["profile bwd window det"] = _profile(fns["bwd window det"])
        res[name] = row
        print(name, {k_: f"{r['ms']:.3f} ms {r['tflops']:.0f} TF" for k_, r in row.items()
                     if isinstance(r, dict) and "ms" in r})
        for key in ("profile bwd window", "profile bwd window det"):
            if key in row:
                print(" ", key, {k_: round(t, 3) for k_, t in list(row[key].items())[:8]})
    return res


def _nograd(f):
    import torch

    with torch.no_grad():
        return f()


if __name__ == "__main__":
    raise SystemExit(main("perf.window_small", __doc__, jobs, run))
