"""Test helpers that run one kernel family's planned kernels directly (no autograd, no routing
fallbacks): what the GPU tests compare against float64."""

from __future__ import annotations

import torch

from ffpa_cute import dispatch, launch
from ffpa_cute.common.config import DeltaConfig
from ffpa_cute.options import Options
from ffpa_cute.problem import dtype_name


def forward(problem, q, k, v, family: str):
    """(out, lse) from `family`'s forward kernel for `problem` (on q's device)."""
    plan = dispatch.plan_fwd(problem, q.device, opts=Options(family=family))
    assert plan.reason is None, plan.reason
    return launch.run_fwd(plan, q, k, v)


def backward_plan(problem, device, family: str) -> dispatch.BwdPlan:
    """`family`'s atomic-free backward plan (`deterministic`; the fused kernel's tests plan it
    themselves)."""
    plan = dispatch.plan_bwd(problem, device, opts=Options(family=family, deterministic=True))
    assert plan.reason is None and plan.family == family, (plan.family, plan.reason)
    return plan


def backward(problem, q, k, v, out, lse, do, family: str, plan=None):
    """(dq, dk, dv) from `family`'s backward kernels (Delta first), or from `plan`."""
    plan = plan or backward_plan(problem, q.device, family)
    return launch.run_bwd(plan, q, k, v, out, lse, do)


def delta(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Delta = rowsum(dout * out) [B, H, N] fp32 by the Delta kernel alone."""
    cfg = DeltaConfig(dispatch.current_arch(out.device), dtype_name(out.dtype), out.shape[-1])
    d = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
    launch.run_job(dispatch.kernel_class(cfg), cfg,
                   dict(do=launch.kernel_ready(dout), o=launch.kernel_ready(out), delta=d), {})
    return d
