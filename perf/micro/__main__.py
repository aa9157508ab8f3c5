"""python -m perf.micro [--which smem_port,wgmma_order,dsmem] [--iters N] [--out results.json]

Compiles (JIT, sm_90a) and runs each microbenchmark of kernel-design.md §8 on the current GPU
and prints one markdown table (benchmark, variant, metric, value, unit) plus notes.

Each benchmark runs in its own child process with a time limit (--timeout): a kernel that
deadlocks or faults costs that benchmark only (the variants it finished are kept), and is
reported as an `error` row. Exit status 1 if any row is an error.

On the H200 (one device call, carry [".device"]; the device copy has no .git, so pass the
commit):
  source .device/setup.sh && PERF_COMMIT=<sha> PYTHONUNBUFFERED=1 python -m perf.micro
      --out $OUT/micro.json 2>&1 | tee $OUT/micro.log      (one line)
About 2-3 minutes, most of it JIT compiles (about 30 kernels); at most 3 x --timeout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from perf.micro import row

BENCHES = ("smem_port", "wgmma_order", "dsmem")


def _run_one(name: str, iters: int) -> tuple[list, list]:
    """In the child: run one benchmark module, check for CUDA errors."""
    import importlib

    import torch

    assert torch.cuda.is_available(), "perf.micro needs a CUDA GPU"
    mod = importlib.import_module(f"perf.micro.{name}")
    if name == "smem_port":
        rows, notes = mod.run(iters=iters)
    elif name == "wgmma_order":
        rows, notes = mod.run()
    else:
        rows, notes = mod.run(steps=iters, rounds=min(iters, 10000))
    torch.cuda.synchronize()  # surfaces any asynchronous fault of the last launch
    return rows, notes


def _child(name: str, iters: int, out: str) -> None:
    import perf.micro

    perf.micro.CHECKPOINT = out + ".partial"
    t0 = time.time()
    rows, notes = _run_one(name, iters)
    notes.append(f"{name}: {time.time() - t0:.1f} s including JIT compiles")
    with open(out, "w") as f:
        json.dump({"rows": rows, "notes": notes}, f)


def _load(path: str) -> tuple[list, list]:
    if not os.path.exists(path):
        return [], []
    with open(path) as f:
        res = json.load(f)
    return res["rows"], res["notes"]


def _spawn(name: str, iters: int, timeout: int) -> tuple[list, list]:
    """Run one benchmark in a child; on a hang or crash keep the variants it finished."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "perf.micro", "--child", name, "--iters", str(iters),
               "--child-out", out]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            rows, notes = _load(out + ".partial")
            msg = f"timed out after {timeout} s (deadlock?) after {len(rows)} rows"
            return rows + [row(name, "-", "error", msg, "")], notes
        if p.returncode != 0 or not os.path.exists(out):
            tail = (p.stderr or p.stdout).strip().splitlines()[-12:]
            sys.stderr.write(f"--- {name} failed (rc {p.returncode}) ---\n" + "\n".join(tail)
                             + "\n")
            rows, notes = _load(out + ".partial")
            last = tail[-1] if tail else f"rc {p.returncode}"
            return rows + [row(name, "-", "error", last[:160], "")], notes
        return _load(out)


def _table(rows: list) -> str:
    lines = ["| benchmark | variant | metric | value | unit |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['benchmark']} | {r['variant']} | {r['metric']} | {r['value']} | "
                     f"{r['unit']} |")
    return "\n".join(lines)


def _env() -> dict:
    import torch

    env = {"torch": torch.__version__, "argv": sys.argv[1:]}
    try:
        import cutlass

        env["cutlass_dsl"] = getattr(cutlass, "__version__", "?")
    except ImportError:
        pass
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    env["commit"] = os.environ.get("PERF_COMMIT", "")  # the device copy has no .git
    if not env["commit"]:
        try:
            env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                           capture_output=True, text=True).stdout.strip()
        except OSError:
            pass
    return env


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.micro", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--which", default=",".join(BENCHES),
                    help="comma-separated subset of " + ",".join(BENCHES))
    ap.add_argument("--iters", type=int, default=20000,
                    help="WGMMA k-tiles per CTA (smem_port), DSMEM steps (dsmem)")
    ap.add_argument("--timeout", type=int, default=150, help="seconds per benchmark")
    ap.add_argument("--out", help="write rows, notes and environment as JSON here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child, args.iters, args.child_out)
        return 0
    which = [w.strip() for w in args.which.split(",") if w.strip()]
    unknown = set(which) - set(BENCHES)
    if unknown:
        ap.error(f"unknown benchmark(s): {sorted(unknown)}")
    rows, notes = [], []
    for name in which:
        r, n = _spawn(name, args.iters, args.timeout)
        rows += r
        notes += n
    env = _env()
    print(f"# perf.micro on {env.get('gpu', '?')} ({env.get('sms', '?')} SMs), "
          f"commit {env.get('commit', '?')}\n")
    print(_table(rows))
    if notes:
        print("\nNotes:\n" + "\n".join(f"- {n}" for n in notes))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": env, "rows": rows, "notes": notes}, f, indent=1)
    return 1 if any(r["metric"] == "error" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
