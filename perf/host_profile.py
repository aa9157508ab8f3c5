"""Where a cached call's host time goes: cProfile over many tiny-shape `attention()` calls.

    python -m perf.host_profile [D] [calls]

Prints the wall time per call and the top functions by own time (GPU machine; the tiny shape
makes the kernel negligible, so the profile is the host path: checks, routing, launch).
"""

from __future__ import annotations

import cProfile
import pstats
import sys


def main() -> None:
    import torch

    from ffpa_cute import attention
    from perf.smoke import us_per_call

    d = int(sys.argv[1]) if len(sys.argv) > 1 else 512
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    q, k, v = (torch.randn(1, 1, 1, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    us = us_per_call(lambda: attention(q, k, v, strict=True), n)
    print(f"D={d}: {us:.1f} us per call (unprofiled)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        attention(q, k, v, strict=True)
    torch.cuda.synchronize()
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
