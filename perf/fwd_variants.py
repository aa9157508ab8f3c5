"""Device-side check + timing of forward kernel variants (warp layouts, stages) in one call.

python -m perf.fwd_variants [--d 320,512,1024] [--quick]
Prints error vs an fp32 reference and TFLOPS for each variant, next to torch SDPA.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import torch

from ffpa_cute import dispatch
from ffpa_cute.cache import jit_cache
from ffpa_cute.reference import attention_ref, rel_err
from perf.smoke import _median_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", default="320,512,1024")
    ap.add_argument("--layouts", default="m8n1,m4n2,m2n4")
    ap.add_argument("--stages", default="")
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--h", type=int, default=32)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--causal", default="no,yes")
    args = ap.parse_args()
    dev = torch.device("cuda")
    target = dispatch.current_arch(dev)
    from ffpa_cute.sm80 import FFPAFwdSm80, can_implement
    from ffpa_cute.sm80.config import FwdConfigSm80
    rows = []
    for d in [int(x) for x in args.d.split(",")]:
        for lay in args.layouts.split(","):
            for causal in [c == "yes" for c in args.causal.split(",")]:
                stages = [int(s) for s in args.stages.split(",")] if args.stages else [None]
                for st in stages:
                    base = FwdConfigSm80(arch=target, dtype="bf16", head_dim=d, causal=causal,
                                         warp_layout=lay, tile_n=32 if lay == "m8n1" else 64)
                    cfg = base
                    if st is None:
                        for st2 in (4, 3, 2):
                            cfg = dataclasses.replace(base, num_stages=st2)
                            if can_implement(cfg) is None:
                                break
                    else:
                        cfg = dataclasses.replace(base, num_stages=st)
                    why = can_implement(cfg)
                    if why:
                        print(f"skip D={d} {lay} causal={causal}: {why}")
                        continue
                    t0 = time.time()
                    fn = jit_cache().get(FFPAFwdSm80, cfg)
                    ct = time.time() - t0
                    # correctness on an odd small shape (GQA 4, Nq != Nkv)
                    for (nq, nkv, hq, hkv) in ((129, 1000, 8, 2), (1000, 129, 4, 4), (7, 7, 2, 1)):
                        q = torch.randn(2, hq, nq, d, device=dev, dtype=torch.bfloat16)
                        k = torch.randn(2, hkv, nkv, d, device=dev, dtype=torch.bfloat16)
                        v = torch.randn(2, hkv, nkv, d, device=dev, dtype=torch.bfloat16)
                        off = nkv - nq
                        out = torch.full((2, hq, nq, d), float("nan"), device=dev,
                                         dtype=torch.bfloat16)
                        lse = torch.full((2, hq, nq), float("nan"), device=dev)
                        scale = d ** -0.5
                        FFPAFwdSm80.launch(fn, q, k, v, out, lse, scale, off,
                                           torch.cuda.current_stream().cuda_stream)
                        ro, rl = attention_ref(q, k, v, causal=causal, causal_offset=off,
                                               scale=scale, upcast=torch.float32)
                        err = rel_err(out, ro)
                        fin = torch.isfinite(rl)
                        lerr = (lse[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
                        ok_empty = bool((lse[~fin] == float("-inf")).all())
                        print(f"D={d} {lay} st={cfg.num_stages} causal={causal} "
                              f"{nq}x{nkv} h{hq}/{hkv}: err={err:.2e} lse_err={lerr:.2e} "
                              f"nan={torch.isnan(out).sum().item()} empty_ok={ok_empty}")
                    if args.check_only:
                        continue
                    n, h = args.n, args.h
                    q = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16)
                    k = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16)
                    v = torch.randn(1, h, n, d, device=dev, dtype=torch.bfloat16)
                    out = torch.empty_like(q)
                    lse = torch.empty(1, h, n, device=dev)
                    s = torch.cuda.current_stream().cuda_stream
                    ms = _median_ms(
                        lambda: FFPAFwdSm80.launch(fn, q, k, v, out, lse, d ** -0.5, 0, s), 20)
                    pairs = n * (n + 1) / 2 if causal else n * n
                    tf = 4 * h * pairs * d / ms / 1e9
                    msd = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                        q, k, v, is_causal=causal), 20)
                    tfs = 4 * h * pairs * d / msd / 1e9
                    rows.append((d, lay, cfg.num_stages, causal, ms, tf, tfs, ct))
                    print(f"PERF D={d} {lay} st={cfg.num_stages} causal={causal}: {ms:.2f} ms "
                          f"{tf:.0f} TFLOPS (SDPA {tfs:.0f}) compile {ct:.1f}s")
    print("\n| D | layout | stages | causal | ms | TFLOPS | SDPA TFLOPS | compile s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| %d | %s | %d | %s | %.2f | %.0f | %.0f | %.1f |" % r)
    print(jit_cache().info())


if __name__ == "__main__":
    os.environ.setdefault("FFPA_CUTE_ARCH", "sm80")
    main()
