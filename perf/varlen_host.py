"""Where the per-sequence varlen route's host time goes: `varlen_attention` with
`Options(varlen_launch=False)` on perf.serving's `varlen-short` sequences (32 causal sequences
of 64-1006 tokens, D=512, GQA 32/4, bf16, no grad), against the one launch on the same inputs.

Per route: the host time of one call (wall clock from the call to its return, GPU work queued
behind it; the GPU is idle at the start), the GPU-inclusive time (synchronised after the
call), and cProfile's top functions by cumulative time over 20 calls (docs/perf-log.md has the
H100 numbers: the per-sequence route is host-bound).

    python -m perf.varlen_host              # GPU: prints both routes
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time

CALLS = 20


def main() -> None:
    import torch

    import ffpa_cute
    from perf.serving import VARLEN_SHORT_LENS as lens

    dev = torch.device("cuda")
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=dev)
    q = torch.randn(total, 32, 512, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(total, 4, 512, device=dev, dtype=torch.bfloat16) for _ in range(2))

    def call():
        return ffpa_cute.varlen_attention(q, k, v, cu, cu, max(lens), max(lens),
                                          is_causal=True, enable_gqa=True)

    with torch.no_grad():
        for one in (True, False):
            with ffpa_cute.options.use(varlen_launch=one):
                for _ in range(3):   # plans, launchers, bounds cached
                    call()
                torch.cuda.synchronize()
                host, full = [], []
                for _ in range(CALLS):
                    t0 = time.perf_counter()
                    call()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    host.append(t1 - t0)
                    full.append(time.perf_counter() - t0)
                host.sort()
                full.sort()
                print(f"== {'one launch' if one else 'per sequence'}: host "
                      f"{1e3 * host[CALLS // 2]:.2f} ms a call, with the GPU "
                      f"{1e3 * full[CALLS // 2]:.2f} ms (medians of {CALLS})")
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(CALLS):
                    call()
                torch.cuda.synchronize()
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
                print("\n".join(s.getvalue().splitlines()[:60]))


if __name__ == "__main__":
    main()
