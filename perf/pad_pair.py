"""Above D=576 the forward runs on a CTA pair, and D % 64 != 0 there reads far under the
multiples of 64 (issue 20's curve: H100, 4566bda, D=584 305, 592 334, 600 313 TFLOPS against
640's 404). Would the pair at the next multiple of 64, on zero-padded copies, do better, or the
D kernel with Q's rows on lines too?

    python -m perf.pad_pair --precompile DIR [--shard I/N]   # CPU: compile the plans into DIR
    python -m perf.pad_pair [--out FILE]                     # GPU: time them (FFPA_CUTE_CACHE_DIR)

Per D (B=1, H=32, N=8K, bf16; L2 flushed; `interleaved_ms`), TFLOPS on D's FLOPs:
  d         the D kernel as routed before the padded pair (`launch.run_fwd` on contiguous q,
            k, v, PADDED_PAIR_HEAD_DIMS emptied: it copies k and v into rows on 128-byte
            lines, `repack_rows`);
  qkv       q copied into such rows too (timed), then the same: the pair streams Q chunks
            through the ring with K's (`stream_q`), re-reading every Q row per key block, so
            Q's rows split across lines should cost what K's did before they were repacked;
  pad64     q, k, v zero-padded to D' = the next multiple of 64 (copies timed), the routed plan
            of (D', Dv = D') at D's softmax scale (the padded columns add zeros to the scores
            and give zero columns of O), then out[..., :D] copied out (timed);
and at DIAG_HEAD_DIMS also the kernels alone: `rows` (the D kernel on q, k, v already on
lines) and `pad_rows` (the D' kernel on operands padded beforehand): at D % 64 != 0 the pair
computes on 64-column chunks and 320-column CTA shares as at D' (the same O geometry, so the
same bits), so rows ~ pad_rows unless the partial TMA boxes cost. Every D % 64 != 0 in
(576, 1024) not causal, DIAG_HEAD_DIMS causal; out and lse of qkv and pad64 against
d's (the same sums: expected bit-equal).
The first run (7 D, H100, fa0d388) read pad64 +3-8% over d (904 even), half the predicted
+10-20%: its copies took 1.6 ms of 15.6 at D=584 (the D' kernel alone 14.0 ms).
Prediction for qkv: Q is a third of the streamed operand bytes per block (Q, K chunks and V),
so q's copy (~0.3 ms) buys back about the time the k copy did (the rows measured 8-23% at D <=
504 for K and V): d 16.1 -> ~15.0 ms at D=584, level with or ahead of pad64.
Measured (H100, 2dc5d28; docs/perf-log.md 2026-12-07): qkv 15.9 ms at 584 (+1-4% at D % 16 ==
8, -1-2% at D % 16 == 0: short of the prediction), pad64 +3-10% at D % 16 == 8 but 904 and
-1-3% at D % 16 == 0 or causal; the copies as 8-byte words 1.6x faster. Routed: pad64 at D %
16 == 8 not causal (`launch.PADDED_PAIR_HEAD_DIMS`), every row copy as words.
"""

from __future__ import annotations

import dataclasses

from perf import experiment

DIAG_HEAD_DIMS = (584, 600, 616, 744, 808, 904, 1000)
HEAD_DIMS = tuple(d for d in range(584, 1024, 8) if d % 64)
CAUSAL_HEAD_DIMS = DIAG_HEAD_DIMS
HEADS, N = 32, 8192


def _padded(d: int) -> int:
    return -(-d // 64) * 64


def _plans(d: int, causal: bool = False) -> dict:
    """{"d": the routed plan at D=d, "pad64": the routed plan at D' at D's softmax scale}."""
    p = dataclasses.replace(experiment.self_problem(d, HEADS, N), causal=causal)
    wide = _padded(d)
    return {"d": experiment.routed_fwd(p),
            "pad64": experiment.routed_fwd(dataclasses.replace(
                p, head_dim=wide, head_dim_v=wide, scale=p.softmax_scale))}


def cases(head_dims=None) -> list:
    """(D, causal) pairs timed: `head_dims` (default HEAD_DIMS) not causal, and those in
    CAUSAL_HEAD_DIMS causal."""
    dims = HEAD_DIMS if head_dims is None else head_dims
    return [(d, False) for d in dims] + [(d, True) for d in dims if d in CAUSAL_HEAD_DIMS]


def jobs(head_dims=None) -> list:
    return experiment.forward_jobs(p for d, c in cases(head_dims) for p in _plans(d, c).values())


def copies(dev, flush) -> dict:
    """{D: {name: ms}}: one [1, 32, 8K, D] bf16 operand's copy into rows on lines by torch's
    copy_ of 2-byte elements into the [..., :D] view (`lines`), the same bytes copied as 8-byte
    words (`lines_w`: `launch.copy_rows`), and its zero-padding to D' both ways (`pad`,
    `pad_w`: `launch.zero_padded`). Prediction:
    the strided copy of 2-byte elements runs far under the 3 TB/s the bytes allow (the pad64
    copies took 1.6 ms where ~0.85 would do), 8-byte words close to it."""
    import torch

    from ffpa_cute import launch

    res = {}
    for d in (584, 600, 1000):
        t, wide = torch.randn(1, HEADS, N, d, device=dev, dtype=torch.bfloat16), _padded(d)
        lined = launch.row_aligned(t)
        padded = launch.zero_padded(t, wide)

        def pad():
            padded[..., d:].zero_()
            padded[..., :d].copy_(t)

        fns = {"lines": lambda: lined.copy_(t), "lines_w": lambda: launch.copy_rows(lined, t),
               "pad": pad, "pad_w": lambda: launch.zero_padded(t, wide)}
        for f in fns.values():
            f()
        ms = experiment.interleaved_ms(fns, dev, flush, rounds=3)
        gb = 2 * t.numel() * 2 / 1e9
        print(f"copies D={d}: " + "  ".join(f"{n} {m:.3f} ms ({gb / m * 1e3:.0f} GB/s)"
                                            for n, m in ms.items()), flush=True)
        res[str(d)] = ms
    return res


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import launch

    # `d` is the D kernel: the padded pair, routed at some of these D, is timed as pad64
    launch.PADDED_PAIR_HEAD_DIMS = frozenset()
    res = {"copies": copies(dev, flush)}
    for d, causal in cases():
        plans, wide = _plans(d, causal), _padded(d)
        q, k, v = (torch.randn(1, HEADS, N, d, device=dev, dtype=torch.bfloat16)
                   for _ in range(3))

        def pad64(p=plans["pad64"]):
            o, lse = launch.run_fwd(p, *(launch.zero_padded(t, wide) for t in (q, k, v)))
            return o[..., :d].contiguous(), lse

        fns = {"d": lambda p=plans["d"]: launch.run_fwd(p, q, k, v),
               "qkv": lambda p=plans["d"]: launch.run_fwd(p, launch.row_aligned(q), k, v),
               "pad64": pad64}
        if d in DIAG_HEAD_DIMS and not causal:
            lined = [launch.row_aligned(t) for t in (q, k, v)]
            padded = [launch.zero_padded(t, wide) for t in (q, k, v)]
            fns["rows"] = lambda p=plans["d"]: launch.run_fwd(p, *lined)
            fns["pad_rows"] = lambda p=plans["pad64"]: launch.run_fwd(p, *padded)
        ref_o, ref_l = fns["d"]()
        diff = {}
        for name in ("qkv", "pad64"):
            o, lse = fns[name]()
            diff[name] = dict(out=(o[..., :d].float() - ref_o.float()).abs().max().item(),
                              lse=(lse - ref_l).abs().max().item())
        for name in fns.keys() - diff.keys() - {"d"}:
            fns[name]()
        ms = experiment.interleaved_ms(fns, dev, flush, rounds=3)
        pairs = N * (N + 1) // 2 if causal else N * N
        tf = {n: 4 * HEADS * pairs * d / t / 1e9 for n, t in ms.items()}
        print(f"D={d:4d}{' causal' if causal else ''} (D'={wide}) "
              + "  ".join(f"{n} {ms[n]:6.3f} ms {tf[n]:4.0f}" for n in ms)
              + f"  max diff {diff}", flush=True)
        res[f"{d}{'c' if causal else ''}"] = dict(
            ms=ms, tflops=tf, diff=diff, configs={n: repr(p.cfg) for n, p in plans.items()})
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.pad_pair", __doc__, jobs, run))
