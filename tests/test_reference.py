"""The reference itself (CPU): `attention_grads` equals autograd through `attention_ref` where
autograd is defined, and gives P = 0 (finite gradients) on rows that see no key."""

import pytest
import torch

from ffpa_cute.reference import attention_grads, attention_ref, rel_err


@pytest.mark.parametrize("nq,nkv,hq,hkv,causal,offset", [
    (7, 129, 4, 2, True, None), (129, 7, 4, 1, True, 200), (33, 33, 2, 2, False, None),
    (9, 20, 4, 4, True, 0)])
def test_grads_match_autograd(nq, nkv, hq, hkv, causal, offset):
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, h, n, 40, dtype=torch.float64)
                   for h, n in ((hq, nq), (hkv, nkv), (hkv, nkv), (hq, nq)))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention_ref(*leaves, causal=causal, causal_offset=offset, scale=0.3)[0].backward(do)
    got = attention_grads(q, k, v, do, causal, offset, scale=0.3)
    for g, t in zip(got, leaves):
        assert rel_err(g, t.grad) < 1e-12


def test_rows_without_keys_give_zero():
    q, k, v, do = (torch.randn(1, 2, 5, 16, dtype=torch.float64) for _ in range(4))
    dq, dk, dv = attention_grads(q, k, v, do, causal=True, causal_offset=-2)  # rows 0, 1 see none
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert dq[..., :2, :].abs().max() == 0


def test_same_dtype_baseline_is_close():
    q, k, v, do = (torch.randn(1, 4, 64, 32, dtype=torch.float64) for _ in range(4))
    ref = attention_grads(q, k, v, do, causal=True)
    low = attention_grads(*(t.bfloat16() for t in (q, k, v, do)), causal=True,
                          dtype=torch.bfloat16)
    for a, r in zip(low, ref):
        assert a.dtype == torch.bfloat16 and 1e-4 < rel_err(a, r) < 5e-2
