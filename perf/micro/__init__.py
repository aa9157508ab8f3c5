"""Hopper (sm_90a) microbenchmarks that decide the WGMMA forward design (kernel-design.md §8).

`python -m perf.micro --help`. Each benchmark module has the kernel, `fake_args` + `compile`
(CPU, compile-only, tests/test_micro_compile.py) and `run(iters)` (GPU) returning table rows.
"""

from __future__ import annotations

import statistics

DEVICE = "cuda"  # where run() allocates; the CPU dry-run test swaps this and the helpers below
CHECKPOINT = None  # the runner's child process sets a path: partial results survive a hang


def row(bench: str, variant: str, metric: str, value, unit: str) -> dict:
    return {"benchmark": bench, "variant": variant, "metric": metric, "value": value,
            "unit": unit}


def checkpoint(rows: list, notes: list) -> None:
    """Save what a benchmark has measured so far (called after every variant)."""
    if CHECKPOINT:
        import json

        with open(CHECKPOINT, "w") as f:
            json.dump({"rows": rows, "notes": notes}, f)


def median(xs) -> float:
    xs = [float(x) for x in xs]
    return statistics.median(xs) if xs else float("nan")


def sm_count() -> int:
    import torch

    return torch.cuda.get_device_properties(0).multi_processor_count


def sync() -> None:
    import torch

    torch.cuda.synchronize()


def stream():
    """The current torch stream as a CUstream (what the compiled kernels take)."""
    import cuda.bindings.driver as cuda
    import torch

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def timed(call, reps: int = 3) -> float:
    """Median milliseconds of `reps` calls after one untimed call; raises on a CUDA error."""
    import torch

    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)
