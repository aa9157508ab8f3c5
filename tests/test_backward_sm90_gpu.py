"""The sm90 backward kernels on a GPU (every test is @gpu; sm_90 only).

First kernel: dV (`ffpa_cute/sm90/bwd_sm90.py`), checked against float64 autograd of the reference
attention with the same criterion as the forward: rel_err(kernel) <= 2 * rel_err(same-dtype torch)
+ 1e-3. The LSE it consumes comes from our own forward, as in training.
"""

import pytest
import torch

from ffpa_cute import dispatch
from ffpa_cute.problem import AttnProblem
from ffpa_cute.reference import attention_ref, attention_same_dtype, rel_err

pytestmark = pytest.mark.gpu

CASES = [(512, False, 1000, 1000, 1), (512, True, 129, 1000, 4), (320, True, 1000, 129, 1),
         (384, False, 7, 300, 16), (448, True, 4097, 4097, 1), (264, False, 1, 129, 4),
         (512, True, 1000, 1000, 8)]


@pytest.mark.parametrize("d,causal,nq,nkv,ratio", CASES)
def test_dv_matches_reference(seed, d, causal, nq, nkv, ratio):
    """dV summed over each KV head's query heads (GQA ratio `ratio`) inside the kernel."""
    if dispatch.current_arch() != "sm_90a":
        pytest.skip("WGMMA kernels: sm_90 only")
    from ffpa_cute import sm90
    from ffpa_cute.sm90.bwd_sm90 import run_dv

    hkv, dt = 2, torch.bfloat16
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=dt)
                   for h, n in ((hkv * ratio, nq), (hkv, nkv), (hkv, nkv), (hkv * ratio, nq)))
    off = nkv - nq
    problem = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=off)
    cfg = sm90.plan_fwd(problem, "sm_90a")
    plan = dispatch.Plan(problem, "sm_90a", "sm90", cfg=cfg)
    _, lse = dispatch.run_fwd(plan, q, k, v)
    dv = run_dv(q, k, do, lse, problem.softmax_scale, causal, off)
    torch.cuda.synchronize()

    def grad_v(dtype_fn, math):
        qq, kk, vv = (t.detach().clone().to(dtype_fn).requires_grad_() for t in (q, k, v))
        out, _ = math(qq, kk, vv, causal=causal, causal_offset=off)
        out.backward(do.to(dtype_fn))
        return vv.grad

    ref = grad_v(torch.float64, attention_ref)
    base = grad_v(dt, attention_same_dtype)
    err, base_err = rel_err(dv, ref), rel_err(base, ref)
    assert err <= 2 * base_err + 1e-3, f"dV err {err:.3g} vs torch {base_err:.3g}"
