"""The Split-D mma.sync backward kernels on a GPU (every test is @gpu; any sm_80+ device).

dV, dQ and dK (`ffpa_cute/sm80/bwd_sm80.py`) against float64 with the forward's criterion:
rel_err(kernel) <= 2 * rel_err(same-dtype torch) + 1e-3, for each of the three gradients. The
LSE and O (for Delta = rowsum(dO * O)) they consume come from our own Split-D forward, as in
training. The reference is written out (not autograd): rows that see no key make autograd's
softmax gradient NaN, while the kernels give them P = 0.

Default tier: D in {320, 512, 1024}, bf16 and fp16, Nq / Nkv from {1, 7, 129, 1000}, GQA ratios
1 / 4 / 16, causal bottom-right with Nq < Nkv and with Nq > Nkv (rows that see no key), and
upper-left. Slow tier (`-m slow`): D 576 and 768 and a 4097 x 4097 case.

Run on a GPU machine (from the repository root):
    pytest -m gpu -q tests/test_backward_sm80_gpu.py
    pytest -m "gpu and slow" -q tests/test_backward_sm80_gpu.py
"""

import pytest
import torch

import kernels  # tests/ is on sys.path
from ffpa_cute.problem import AttnProblem
from ffpa_cute.reference import attention_grads, rel_err

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
BR, UL = "bottom_right", "upper_left"

# (D, causal mode or None, Nq, Nkv, Hq / Hkv, dtype)
CASES = [
    (512, None, 1000, 1000, 1, BF16),
    (512, BR, 129, 1000, 4, BF16),      # Nq < Nkv, bottom-right
    (320, BR, 1000, 129, 1, FP16),      # Nq > Nkv: the first rows see no key (dQ = 0)
    (1024, None, 7, 300, 16, BF16),
    (1024, BR, 1000, 1000, 1, FP16),
    (320, None, 1, 129, 4, BF16),
    (512, UL, 129, 1000, 16, FP16),     # upper-left: most keys invisible to every query
    (1024, BR, 129, 7, 4, BF16),        # Nq > Nkv with a single partial KV block
    (320, UL, 1000, 1, 1, BF16),
]
SLOW = [
    (576, BR, 1000, 1000, 4, BF16), (768, None, 129, 1000, 1, FP16),
    (768, UL, 1000, 129, 16, BF16), (576, None, 7, 7, 1, FP16),
    (512, BR, 4097, 4097, 1, BF16), (384, UL, 129, 1000, 4, FP16), (384, None, 1000, 7, 16, BF16),
]


def _inputs(d, mode, nq, nkv, ratio, dt):
    """q, k, v, dO (2 KV heads, `ratio` query heads each), the problem, and our Split-D
    forward's out and lse."""
    hkv = 2
    q, k, v, do = (torch.randn(1, h, n, d, device="cuda", dtype=dt)
                   for h, n in ((hkv * ratio, nq), (hkv, nkv), (hkv, nkv), (hkv * ratio, nq)))
    off = {None: 0, BR: nkv - nq, UL: 0}[mode]
    problem = AttnProblem.from_tensors(q, k, v, causal=mode is not None, causal_offset=off)
    out, lse = kernels.forward(problem, q, k, v, "sm80")
    return q, k, v, do, problem, out, lse


def _check(d, mode, nq, nkv, ratio, dt):
    q, k, v, do, problem, out, lse = _inputs(d, mode, nq, nkv, ratio, dt)
    got = kernels.backward(problem, q, k, v, out, lse, do, "sm80")
    torch.cuda.synchronize()
    off, causal = problem.causal_offset, problem.causal
    ref = attention_grads(q, k, v, do, causal, off, dtype=torch.float64)
    base = attention_grads(q, k, v, do, causal, off, dtype=dt)
    msgs, ok = [], True
    for name, x, r, b in zip(("dq", "dk", "dv"), got, ref, base):
        assert x.dtype == dt and x.shape == r.shape, (name, x.dtype, x.shape)
        err, base_err = rel_err(x, r), rel_err(b, r)
        ok &= err <= 2 * base_err + 1e-3
        msgs.append(f"{name} {err:.3g} (torch {base_err:.3g})")
    assert ok, ", ".join(msgs)


def _id(c):
    d, mode, nq, nkv, ratio, dt = c
    return f"d{d}-{mode or 'full'}-{nq}x{nkv}-g{ratio}-{str(dt)[6:]}"


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_bwd_matches_reference(seed, case):
    _check(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=[_id(c) for c in SLOW])
def test_bwd_matches_reference_slow(seed, case):
    _check(*case)


def test_bwd_is_deterministic(seed):
    """GQA sums run in registers (no atomics): two runs are bitwise equal."""
    q, k, v, do, problem, out, lse = _inputs(512, BR, 129, 1000, 4, BF16)
    a = kernels.backward(problem, q, k, v, out, lse, do, "sm80")
    b = kernels.backward(problem, q, k, v, out, lse, do, "sm80")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_bwd_strided_inputs(seed):
    """[B, N, H, D] storage seen as [B, H, N, D] (unit stride on D, other strides permuted)."""
    d, nq, nkv = 320, 129, 300
    q, do = (torch.randn(1, nq, 4, d, device="cuda", dtype=BF16).transpose(1, 2) for _ in "ab")
    k, v = (torch.randn(1, nkv, 2, d, device="cuda", dtype=BF16).transpose(1, 2) for _ in "ab")
    problem = AttnProblem.from_tensors(q, k, v, causal=True)
    out, lse = kernels.forward(problem, q, k, v, "sm80")
    got = kernels.backward(problem, q, k, v, out, lse, do, "sm80")
    ref = attention_grads(q, k, v, do, True, problem.causal_offset, dtype=torch.float64)
    base = attention_grads(q, k, v, do, True, problem.causal_offset, dtype=BF16)
    for x, r, b in zip(got, ref, base):
        assert rel_err(x, r) <= 2 * rel_err(b, r) + 1e-3
