"""What the first-use self-check costs (ffpa_cute/selfcheck.py): the canary of each forward
configuration and of each backward plan (Delta, dQ, dK, dV), timed on the device with the
kernels already compiled, and whether the real kernels pass it (no false alarm). On a target
the family never ran on, this is paid once per configuration and process, on its first call.

    python -m perf.selfcheck_cost --precompile DIR   # CPU box: the kernels the canaries run
    python -m perf.selfcheck_cost --out FILE         # GPU: the canary times (ms) and results
"""

from __future__ import annotations

import time

from ffpa_cute import dispatch, selfcheck
from ffpa_cute.options import Options
from ffpa_cute.problem import AttnProblem

from .experiment import main

TARGET = "sm_90a"


def _problems():
    """(name, problem): a spread of configurations (causal, D > 512 pair, packed GQA decode,
    fp16, Dv != D)."""
    def p(d=512, hq=32, hkv=32, nq=8192, nkv=8192, causal=False, dv=None, dtype="bf16"):
        return AttnProblem(dtype=dtype, batch=1, heads_q=hq, heads_kv=hkv, seqlen_q=nq,
                           seqlen_kv=nkv, head_dim=d, head_dim_v=dv or d, causal=causal,
                           causal_offset=nkv - nq if causal else 0)
    return [("D=512 causal", p(causal=True)), ("D=320", p(d=320)),
            ("D=1024 (CTA pair)", p(d=1024)), ("GQA 32/4 decode (packed)", p(hkv=4, nq=1)),
            ("fp16 D=576 / Dv=512", p(d=576, dv=512, dtype="fp16"))]


def _plans():
    return [(name, dispatch.plan_fwd(prob, target=TARGET, opts=Options(self_check="always")))
            for name, prob in _problems()]


def _bwd_plans():
    """The backward plans of the problems that train (not the decode)."""
    return [(name, dispatch.plan_bwd(prob, target=TARGET, opts=Options(self_check="always")))
            for name, prob in _problems() if prob.seqlen_q > 1]


def jobs():
    out = []
    for _, plan in _plans():
        canary = dispatch.plan_fwd(selfcheck.canary_problem(plan), target=TARGET)
        out += [(plan.kernel_cls, plan.cfg), (canary.kernel_cls, canary.cfg)]
    for _, plan in _bwd_plans():
        canary = dispatch.plan_bwd(
            selfcheck.canary_problem(plan, packed=False, requires_grad=True), target=TARGET)
        out += plan.jobs + canary.jobs
    return out


def run(dev, flush):
    import torch

    res = {}
    runs = [(name, plan, selfcheck._canary) for name, plan in _plans()] + [
        (f"{name} backward", plan, selfcheck._canary_bwd) for name, plan in _bwd_plans()]
    for name, plan, canary in runs:
        canary(plan, dev)  # warm: compile / load the kernels and the reference path
        torch.cuda.synchronize(dev)
        times, results = [], []
        for _ in range(5):
            t = time.perf_counter()
            results.append(canary(plan, dev))
            torch.cuda.synchronize(dev)
            times.append((time.perf_counter() - t) * 1e3)
        res[name] = {"canary_ms": sorted(times)[len(times) // 2], "min_ms": min(times),
                     "passed": all(r is None for r in results), "reason": results[0]}
        print(f"{name:37s} canary {res[name]['canary_ms']:.2f} ms (min {min(times):.2f}), "
              f"passed={res[name]['passed']}")
    return res


if __name__ == "__main__":
    raise SystemExit(main("perf.selfcheck_cost", __doc__, jobs, run))
