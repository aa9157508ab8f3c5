"""What holds the forward's D % 64 != 0 sizes below their neighbours? (issue 20's cliffs)

    python -m perf.pad_d --precompile DIR     # CPU: compile the planned configs into DIR
    python -m perf.pad_d [--out FILE]         # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

The curve across D (perf.sweep --head-dims all) reads D % 16 == 8 sizes 25-50% below the
multiples of 64 next to them (D=504 11.4 ms against D=512's 7.3 with the same O halves and the
same WGMMA work), while padding the rows to whole 128-byte lines (perf.row_stride) bought only
2-10% below 512. What is left of the difference is the width itself: the last K chunk and the
last V box end inside a 32-byte sector, and TMA zero-fills the columns past D. Each D is timed
(B=1, H=32, N=8K, bf16, not causal; L2 flushed; `interleaved_ms`) as:
  contig   the planned D kernel on contiguous inputs;
  rows     the same kernel on rows padded to 128 bytes (a [..., :D] view of a wider buffer);
  pad16    zero-padded copies of q, k, v to the next multiple of 16 and its planned kernel, the
           copies and the [..., :D] copy of O counted (when D % 16 != 0);
  pad64    the same to the next multiple of 64 (its planned kernel: persistent, lazy);
  k64      that kernel alone on already-padded inputs (what the copies cost is pad64 - k64).
"""

from __future__ import annotations

from perf import experiment

HEAD_DIMS = (264, 312, 328, 376, 440, 504)
HEADS, N = 32, 8192


def _plan(d: int):
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    p = AttnProblem(dtype="bf16", batch=1, heads_q=HEADS, heads_kv=HEADS, seqlen_q=N,
                    seqlen_kv=N, head_dim=d, head_dim_v=d, causal=False)
    return dispatch.plan_fwd(p, target="sm_90a", opts=Options())


def _widths(d: int) -> list:
    return sorted({d, -(-d // 16) * 16, -(-d // 64) * 64})


def jobs() -> list:
    return experiment.forward_jobs(_plan(w) for d in HEAD_DIMS for w in _widths(d))


def run(dev, flush) -> dict:
    import torch
    import torch.nn.functional as F

    from ffpa_cute import launch

    res = {}
    for d in HEAD_DIMS:
        plan = _plan(d)
        qkv = [torch.randn(1, HEADS, N, d, device=dev, dtype=torch.bfloat16) for _ in range(3)]
        wide = -(-d // 64) * 64
        rows = [torch.empty(1, HEADS, N, wide, device=dev, dtype=torch.bfloat16)[..., :d]
                .copy_(t) for t in qkv]
        fns = {"contig": lambda: launch.run_fwd(plan, *qkv),
               "rows": lambda rows=rows: launch.run_fwd(plan, *rows)}
        for w in _widths(d)[1:]:
            pw = _plan(w)
            name = "pad64" if w == wide else "pad16"

            def padded(pw=pw, w=w):
                q, k, v = (F.pad(t, (0, w - d)) for t in qkv)
                return launch.run_fwd(pw, q, k, v)[0][..., :d].contiguous()

            fns[name] = padded
            if w == wide:
                ready = [F.pad(t, (0, w - d)) for t in qkv]
                fns["k64"] = lambda pw=pw, ready=ready: launch.run_fwd(pw, *ready)
        for fn in fns.values():
            fn()
        ms = experiment.interleaved_ms(fns, dev, flush)
        tf = {n: 4 * HEADS * N * N * d / t / 1e9 for n, t in ms.items()}
        print(f"D={d:4d} " + "  ".join(f"{n} {ms[n]:6.3f} ms {tf[n]:5.0f}" for n in ms),
              flush=True)
        res[str(d)] = dict(ms=ms, tflops=tf)
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.pad_d", __doc__, jobs, run))
