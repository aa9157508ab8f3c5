"""The command line the kernel experiments share (perf.fp8_limits, perf.decode_limits): compile
the variants into a cache on the CPU box (`--precompile DIR`), or time them on the GPU and
optionally write the numbers as JSON (`--out FILE`)."""

from __future__ import annotations

import argparse
import json


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


__all__ = ["main"]
