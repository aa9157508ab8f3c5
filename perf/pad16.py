"""Why the D % 16 == 8 sizes up to 512 stay under their neighbours on padded rows: the score
side (QK over D) or the output side (PV over Dv)? (issue 20's cliffs)

    python -m perf.pad16 --precompile DIR     # CPU: compile the variants into DIR
    python -m perf.pad16 [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

The curve across D (H100, 5f8668e) flags D=280, 328, 344, 360, 376: 15-20% under the mean of
their D % 16 == 0 neighbours, after their rows are copied into 128-byte padded rows. perf.pad_d
timed the kernels on rows padded beforehand (no copy counted): still D=280 437 TFLOPS against
272 472 and 288 498, 376 473 against 368 504 and 384 (~570). The WGMMA work is the same as at
D + 8 (QK's last k-step covers 16 columns, 8 of them TMA's zeros; O's hi share is computed 64
wide either way), so the difference is in how the operands reach shared memory. Variants per D
(B=1, H=32, N=8K, bf16, not causal; every operand in padded rows made beforehand, nothing
copied inside the timing; L2 flushed; `interleaved_ms`):
  d       the planned kernel at (D, Dv=D);
  v16     (D, Dv=D+8): V and O D+8 wide, V's last 8 columns zero (the score side as `d`, the
          output side as at D+8);
  qk16    (D+8, D+8) at D's softmax scale: q, k, v zero-padded to D+8 (the kernel of D+8;
          scores, P and O's first D columns the same sums as `d`'s; the first run, 125b356,
          used D+8's default scale, so its out differed);
each with `d`'s `lazy_rescale`;
TFLOPS on D's FLOPs, and whether v16's and qk16's first D columns of out (and lse) are the
same bits as d's. Prediction: if v16 reads like qk16, the output side (V boxes, O stores) holds
D % 16 == 8 back and a Dv = D + 8 route (V padded, out sliced) is worth building; if v16 reads
like d, the score side does (Q / K boxes), and padding q, k alone would do.
"""

from __future__ import annotations

import dataclasses

from perf import experiment

HEAD_DIMS = (280, 328, 376, 440, 504)
HEADS, N = 32, 8192


def _plans(d: int) -> dict:
    """{variant: forward plan} at D=d."""
    p = experiment.self_problem(d, HEADS, N)
    plans = {"d": experiment.routed_fwd(p),
             "v16": experiment.routed_fwd(dataclasses.replace(p, head_dim_v=d + 8)),
             "qk16": experiment.routed_fwd(dataclasses.replace(
                 p, head_dim=d + 8, head_dim_v=d + 8, scale=p.softmax_scale))}
    lazy = plans["d"].cfg.lazy_rescale   # rescaled as d is (D+8 may be lazy where D is not)
    return {n: dataclasses.replace(x, cfg=dataclasses.replace(x.cfg, lazy_rescale=lazy))
            for n, x in plans.items()}


def jobs() -> list:
    return experiment.forward_jobs(p for d in HEAD_DIMS for p in _plans(d).values())


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch

    own = launch.repack_rows   # the inputs are padded beforehand (run_fwd's copy off)
    launch.repack_rows = lambda *a: False
    try:
        res = {}
        for d in HEAD_DIMS:
            plans = _plans(d)
            q, k, v = (torch.randn(1, HEADS, N, d, device=dev, dtype=torch.bfloat16)
                       for _ in range(3))
            rows = [launch.row_aligned(t) for t in (q, k, v)]
            v16 = launch.zero_padded(v, d + 8)
            wide = [launch.zero_padded(t, d + 8) for t in (q, k, v)]
            fns = {"d": lambda p=plans["d"]: launch.run_fwd(p, *rows),
                   "v16": lambda p=plans["v16"]: launch.run_fwd(p, rows[0], rows[1], v16),
                   "qk16": lambda p=plans["qk16"]: launch.run_fwd(p, *wide)}
            ref_o, ref_l = fns["d"]()
            same = {}
            for name in ("v16", "qk16"):
                o, lse = fns[name]()
                same[name] = (torch.equal(o[..., :d], ref_o) and torch.equal(lse, ref_l)
                              and not o[..., d:].any().item())
            ms = experiment.interleaved_ms(fns, dev, flush)
            tf = {n: 4 * HEADS * N * N * d / t / 1e9 for n, t in ms.items()}
            print(f"D={d:4d} " + "  ".join(f"{n} {ms[n]:6.3f} ms {tf[n]:5.0f}" for n in ms)
                  + f"  same bits as d: {same}", flush=True)
            res[str(d)] = dict(ms=ms, tflops=tf, same_bits=same,
                               configs={n: repr(p.cfg) for n, p in plans.items()})
        return res
    finally:
        launch.repack_rows = own


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.pad16", __doc__, jobs, run))
