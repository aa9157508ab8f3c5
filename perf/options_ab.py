"""A/B of one `Options` field on the forward: `ffpa_cute.attention` timed with the field on
and off in alternating rounds (so drift in the lent GPU's clock hits both alike), L2 flushed
before every call; the median over rounds of each side's median, in TFLOPS on visible pairs.

    python -m perf.options_ab --field persistent --shapes 512:8192,320:8192:c,512:16384:c:32/32:1024

A shape is D:N[:c (causal)[:Hq/Hkv[:left (a sliding window's left reach)]]], B=1, bf16,
no grad; Hq/Hkv defaults to 32/32. Each round times both sides once (timing.bench).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from .timing import L2Flusher, bench


def _shape(text: str) -> dict:
    parts = text.split(":")
    hq, hkv = (int(x) for x in (parts[3] if len(parts) > 3 else "32/32").split("/"))
    return dict(d=int(parts[0]), n=int(parts[1]), causal=len(parts) > 2 and parts[2] == "c",
                hq=hq, hkv=hkv, left=int(parts[4]) if len(parts) > 4 else None)


def _visible_pairs(n: int, causal: bool, left: int | None) -> int:
    if left is not None:  # causal rows see keys i - left .. i
        w = min(n, left)
        return w * (w + 1) // 2 + (n - w) * (left + 1)
    return n * (n + 1) // 2 if causal else n * n


def run(field: str, shapes: list[str], rounds: int) -> list[dict]:
    import ffpa_cute
    from ffpa_cute import options

    dev = torch.device("cuda")
    flush = L2Flusher(dev)
    out = []
    for text in shapes:
        s = _shape(text)
        q = torch.randn(1, s["hq"], s["n"], s["d"], device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(1, s["hkv"], s["n"], s["d"], device=dev, dtype=torch.bfloat16)
                for _ in range(2))
        kw = dict(is_causal=s["causal"], enable_gqa=s["hq"] != s["hkv"], strict=True)
        if s["left"] is not None:
            kw["window"] = (s["left"], 0)
        flop = 4 * s["hq"] * _visible_pairs(s["n"], s["causal"], s["left"]) * s["d"]
        ms = {True: [], False: []}
        with torch.no_grad():
            for _ in range(rounds):
                for value in (True, False):
                    with options.use(**{field: value}):
                        fn = lambda: ffpa_cute.attention(q, k, v, **kw)  # noqa: E731
                        fn()
                        ms[value].append(bench(fn, dev, flush=flush).median_ms)
        row = {"shape": text, **{f"{field}={v}": flop / statistics.median(ms[v]) / 1e9
                                 for v in (True, False)}}
        row["ratio"] = row[f"{field}=True"] / row[f"{field}=False"]
        print(f"{text:28s} on {row[f'{field}=True']:6.1f}  off {row[f'{field}=False']:6.1f}  "
              f"TFLOPS  on/off {row['ratio']:.3f}  (ms on {min(ms[True]):.3f}-"
              f"{max(ms[True]):.3f}, off {min(ms[False]):.3f}-{max(ms[False]):.3f})", flush=True)
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.options_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--field", required=True, help="a bool field of ffpa_cute.Options")
    ap.add_argument("--shapes", required=True, help="comma list of D:N[:c[:Hq/Hkv[:left]]]")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    run(a.field, a.shapes.split(","), a.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
