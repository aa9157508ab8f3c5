"""Where a B=1 decode step's time goes: the split-KV decode kernel and the split combine timed
apart, the decode kernel on rows of no keys (its launch, prologue and epilogue only), and the
whole `attention_with_kvcache(..., validate=False)` step replayed from a CUDA graph.

    python -m perf.decode_fixed --precompile DIR     # CPU: compile the kernels into a cache
    python -m perf.decode_fixed                      # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

Cases: B=1, Hq 32 / Hkv 4, D=512, page 64, N = 4K and 32K keys, a bf16 cache (the row-tiled
kernel) and an e4m3 cache (the keys-as-rows kernel); the splits `decode.num_splits` picks.
Times are medians with L2 flushed before each call (perf.timing.bench), so the graph's
number is one decode step as a serving loop replays it.
"""

from __future__ import annotations

import sys

from ffpa_cute.common.config import CombineConfig
from perf import experiment

B, HQ, HKV, D, PAGE = 1, 32, 4, 512, 64
SEQLENS = (4096, 32768)
CACHES = ("bf16", "e4m3")


def _plan(kv):
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    p = AttnProblem(dtype="bf16", batch=B, heads_q=HKV, heads_kv=HKV, seqlen_q=HQ // HKV,
                    seqlen_kv=4096, head_dim=D, head_dim_v=D)
    plan = dispatch.plan_decode(p, PAGE, target="sm_90a", opts=Options(),
                                kv_dtype=None if kv == "bf16" else kv)
    assert plan.reason is None, plan.reason
    return plan


def jobs() -> list:
    """The decode kernel of each cache and the combine."""
    from ffpa_cute import dispatch

    combine = CombineConfig("sm_90a", "bf16", D)
    return [(p.kernel_cls, p.cfg) for p in map(_plan, CACHES)] + [
        (dispatch.kernel_class(combine), combine)]


def run(dev, flush) -> dict:
    import torch

    import ffpa_cute
    from ffpa_cute import decode, dispatch, launch
    from perf.experiment import median_ms

    out = {}
    combine = CombineConfig("sm_90a", "bf16", D)
    for kv in CACHES:
        plan = _plan(kv)
        for n in SEQLENS:
            pages = B * n // PAGE
            kc, vc = (torch.randn(pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
                      for _ in "kv")
            scales = {}
            if kv == "e4m3":
                kc, vc = (x.to(torch.float8_e4m3fn) for x in (kc, vc))
                scales = dict(k_descale=1.0, v_descale=1.0)
            table = torch.randperm(pages, device=dev, dtype=torch.int32).view(B, -1)
            q = torch.randn(B, 1, HQ, D, device=dev, dtype=torch.bfloat16)
            lens = torch.full((B,), n, dtype=torch.int32, device=dev)
            s = decode.num_splits(plan, B, HKV, n, dev)
            m = HQ // HKV
            ones = torch.ones(B, HKV, device=dev)
            t = decode.kernel_operands(q, kc, vc, lens, table, s,
                                       (ones, ones) if scales else None)
            none = dict(t, seqlens_k=torch.zeros_like(lens))
            sc = dict(softmax_scale=D ** -0.5, num_splits=s, nq=1)
            res = torch.empty(B, HKV, m, D, dtype=torch.bfloat16, device=dev)
            rl = torch.empty(B, HKV, m, dtype=torch.float32, device=dev)
            ct = dict(o_part=t["o"].view(B, HKV, s, m, D), lse_part=t["lse"].view(B, HKV, s, m),
                      out=res, lse=rl)
            cls, comb = plan.kernel_cls, dispatch.kernel_class(combine)

            def step():
                return ffpa_cute.attention_with_kvcache(q, kc, vc, lens, table, validate=False,
                                                        **scales)

            with torch.no_grad():
                step()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                row = {
                    "splits": s,
                    "kernel_us": 1e3 * median_ms(lambda: launch.run_job(cls, plan.cfg, t, sc),
                                                 dev, flush),
                    "kernel_no_keys_us": 1e3 * median_ms(
                        lambda: launch.run_job(cls, plan.cfg, none, sc), dev, flush),
                    "combine_us": 1e3 * median_ms(lambda: launch.run_job(comb, combine, ct, {}),
                                                  dev, flush),
                    "graph_us": 1e3 * median_ms(graph.replay, dev, flush),
                }
            nbytes = 2 * B * n * HKV * D * (1 if kv == "e4m3" else 2)
            row["graph_gbps"] = nbytes / (row["graph_us"] * 1e-6) / 1e9
            out[f"{kv} N={n}"] = row
            print(f"{kv} N={n}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()),
                  flush=True)
    return out


def main(argv=None) -> int:
    return experiment.main("perf.decode_fixed", __doc__, jobs, run, argv)


if __name__ == "__main__":
    sys.exit(main())
