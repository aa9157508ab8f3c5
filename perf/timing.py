"""Timing that does not flatter: warm-up outside the timed region, CUDA events around each call,
L2 flushed (a 256 MB write) before every timed call, median of many, first call timed apart.

On CPU (smoke tests only) the same loop runs with `time.perf_counter`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch


@dataclass
class Timing:
    """Milliseconds per call over `reps` timed calls."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    min_ms: float
    reps: int

    def to_dict(self) -> dict:
        return asdict(self)


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(times_ms: list[float]) -> Timing:
    if not times_ms:
        raise ValueError("no timings")
    return Timing(statistics.median(times_ms), _quantile(times_ms, 0.2),
                  _quantile(times_ms, 0.8), min(times_ms), len(times_ms))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class L2Flusher:
    """Writes a buffer larger than L2 (H200: 60 MB) so no input stays cached between calls."""

    def __init__(self, device: torch.device, mb: int = 256):
        self.device = device
        self.buf = None
        if device.type == "cuda" and mb > 0:
            self.buf = torch.empty(mb * 2**20, dtype=torch.int8, device=device)

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


def first_call(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Wall-clock seconds of one call, synchronized on both sides (the JIT-compile cost)."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def _timed_calls(fn, n: int, device: torch.device, flush: L2Flusher | None) -> list[float]:
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            if flush is not None:
                flush()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    out = []
    for _ in range(n):
        if flush is not None:
            flush()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def bench(fn: Callable[[], object], device: torch.device, *, flush: L2Flusher | None = None,
          warmup_ms: float = 25.0, rep_ms: float = 100.0, min_reps: int = 3,
          max_reps: int = 100) -> Timing:
    """Median time of `fn()` in ms. Call `fn` once before this (the first call is not timed here).

    The number of warm-up and timed calls follows from one estimating call:
    warm-up ~ warmup_ms (at least 1 call), timed ~ rep_ms, clamped to [min_reps, max_reps].
    """
    est = statistics.median(_timed_calls(fn, 1, device, flush))
    est = max(est, 1e-3)
    n_warm = max(1, min(int(warmup_ms / est), 50))
    _timed_calls(fn, n_warm, device, flush)
    n = max(min_reps, min(int(rep_ms / est), max_reps))
    return summarize(_timed_calls(fn, n, device, flush))


def matmul_tflops(device: torch.device, n: int = 8192, dtype=torch.bfloat16, reps: int = 20,
                  flush: L2Flusher | None = None) -> float:
    """bf16 n^3 matmul TFLOP/s on random data (the compute ceiling of this run)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    fn = lambda: torch.mm(a, b, out=c)  # noqa: E731
    fn()
    t = bench(fn, device, flush=flush, warmup_ms=50, rep_ms=200, min_reps=reps, max_reps=reps)
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def matmul_fp8_tflops(device: torch.device, n: int = 8192, reps: int = 20) -> float:
    """e4m3 n^3 matmul TFLOP/s (torch._scaled_mm, bf16 out): the FP8 rows' compute ceiling."""
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major B
    one = torch.ones((), device=device)
    fn = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)  # noqa: E731
    fn()
    t = bench(fn, device, warmup_ms=50, rep_ms=200, min_reps=reps, max_reps=reps)
    return 2 * n**3 / (t.median_ms * 1e-3) / 1e12


def copy_gbps(device: torch.device, mb: int = 2048, reps: int = 20) -> float:
    """Device-to-device copy GB/s, counting bytes read + written (the memory ceiling)."""
    src = torch.empty(mb * 2**20, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)  # noqa: E731
    fn()
    t = bench(fn, device, warmup_ms=20, rep_ms=100, min_reps=reps, max_reps=reps)
    return 2 * src.numel() / (t.median_ms * 1e-3) / 1e9


def measure_ceilings(device: torch.device) -> dict:
    """{'matmul_bf16_8192_tflops', 'matmul_fp8_8192_tflops', 'copy_gbps'} for the header;
    errors become notes."""
    out: dict = {}
    for key, f in (("matmul_bf16_8192_tflops", lambda: matmul_tflops(device)),
                   ("matmul_fp8_8192_tflops", lambda: matmul_fp8_tflops(device)),
                   ("copy_gbps", lambda: copy_gbps(device))):
        try:
            out[key] = round(f(), 1)
        except Exception as e:  # noqa: BLE001 - a ceiling that fails is reported, not fatal
            out[key] = None
            out[key + "_error"] = f"{type(e).__name__}: {e}"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out
