"""Above D=576 the forward runs on a CTA pair, and D % 64 != 0 there reads far under the
multiples of 64 (issue 20's curve: H100, 4566bda, D=584 305, 592 334, 600 313 TFLOPS against
640's 404). Would the pair at the next multiple of 64, on zero-padded copies, do better?

    python -m perf.pad_pair --precompile DIR     # CPU: compile the plans into DIR
    python -m perf.pad_pair [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

Per D (B=1, H=32, N=8K, bf16, not causal; L2 flushed; `interleaved_ms`), TFLOPS on D's FLOPs:
  d       the routed forward (`launch.run_fwd` on contiguous q, k, v: its own row copies);
  pad64   q, k, v zero-padded to D' = the next multiple of 64 (copies timed), the routed plan
          of (D', Dv = D') at D's softmax scale (the padded columns add zeros to the scores
          and give zero columns of O), then out[..., :D] copied out (timed);
and how far pad64's out and lse are from d's (the same sums in another order).
Prediction: the pair's time tracks D' (640's 404 TFLOPS would read 369 at D=584 on D's
FLOPs), less the copies (q, k, v in, out back: ~5% at N=8K): +10-20% at 584-616, unknown
where D' itself is slow.
"""

from __future__ import annotations

import dataclasses

from perf import experiment

HEAD_DIMS = (584, 600, 616, 744, 808, 904, 1000)
HEADS, N = 32, 8192


def _padded(d: int) -> int:
    return -(-d // 64) * 64


def _plans(d: int) -> dict:
    """{"d": the routed plan at D=d, "pad64": the routed plan at D' at D's softmax scale}."""
    p = experiment.self_problem(d, HEADS, N)
    wide = _padded(d)
    return {"d": experiment.routed_fwd(p),
            "pad64": experiment.routed_fwd(dataclasses.replace(
                p, head_dim=wide, head_dim_v=wide, scale=p.softmax_scale))}


def jobs() -> list:
    return experiment.forward_jobs(p for d in HEAD_DIMS for p in _plans(d).values())


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch

    res = {}
    for d in HEAD_DIMS:
        plans, wide = _plans(d), _padded(d)
        q, k, v = (torch.randn(1, HEADS, N, d, device=dev, dtype=torch.bfloat16)
                   for _ in range(3))

        def pad64(p=plans["pad64"]):
            o, lse = launch.run_fwd(p, *(launch.zero_padded(t, wide) for t in (q, k, v)))
            return o[..., :d].contiguous(), lse

        fns = {"d": lambda p=plans["d"]: launch.run_fwd(p, q, k, v), "pad64": pad64}
        ref_o, ref_l = fns["d"]()
        o, lse = pad64()
        diff = dict(out=(o.float() - ref_o.float()).abs().max().item(),
                    out_scale=ref_o.float().abs().max().item(),
                    lse=(lse - ref_l).abs().max().item())
        ms = experiment.interleaved_ms(fns, dev, flush)
        tf = {n: 4 * HEADS * N * N * d / t / 1e9 for n, t in ms.items()}
        print(f"D={d:4d} (D'={wide}) " + "  ".join(f"{n} {ms[n]:6.3f} ms {tf[n]:5.0f}"
                                                    for n in ms) + f"  max diff {diff}",
              flush=True)
        res[str(d)] = dict(ms=ms, tflops=tf, diff=diff,
                           configs={n: repr(p.cfg) for n, p in plans.items()})
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.pad_pair", __doc__, jobs, run))
