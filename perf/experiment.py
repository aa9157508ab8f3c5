"""What the kernel experiments share (perf.fp8_limits, perf.decode_limits, perf.half_align,
perf.half_align_bwd, perf.row_stride): the command line, which compiles the variants into a
cache on the CPU box (`--precompile DIR`) or times them on the GPU and optionally writes the
numbers as JSON (`--out FILE`); and their timing (`median_ms`)."""

from __future__ import annotations

import argparse
import json


def median_ms(fn, dev, flush, rounds: int = 3) -> float:
    """fn's time in ms: the median of `rounds` benches (perf.timing.bench, L2 flushed before
    each call by `flush`), each itself a median of many calls."""
    import statistics

    from perf.timing import bench

    return statistics.median(bench(fn, dev, flush=flush).median_ms for _ in range(rounds))


def main(prog: str, doc: str, precompile, run, argv=None) -> int:
    """Parse argv; `precompile(directory)` or `run() -> dict` (written to --out)."""
    ap = argparse.ArgumentParser(prog=f"python -m {prog}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precompile", metavar="DIR")
    ap.add_argument("--out", metavar="FILE", help="write the numbers as JSON")
    a = ap.parse_args(argv)
    if a.precompile:
        precompile(a.precompile)
        return 0
    res = run()
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


__all__ = ["main", "median_ms"]
