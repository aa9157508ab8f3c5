"""The sm90 backward kernels on a GPU (every test is @gpu; sm_90 only).

dV, dQ and dK (`ffpa_cute/sm90/bwd_sm90.py`) against float64 with the forward's criterion:
rel_err(kernel) <= 2 * rel_err(same-dtype torch) + 1e-3. The LSE (and O for Delta) they consume
come from our own forward, as in training. The dQ / dK reference is written out
(`reference.attention_grads`, not autograd): rows that see no key make autograd's softmax
gradient NaN.
"""

import pytest
import torch

from ffpa_cute import dispatch
from ffpa_cute.problem import AttnProblem
from ffpa_cute.reference import attention_grads, attention_ref, attention_same_dtype, rel_err

pytestmark = pytest.mark.gpu

CASES = [(512, False, 1000, 1000, 1), (512, True, 129, 1000, 4), (320, True, 1000, 129, 1),
         (384, False, 7, 300, 16), (448, True, 4097, 4097, 1), (264, False, 1, 129, 4),
         (512, True, 1000, 1000, 8)]


def _inputs(d, causal, nq, nkv, ratio, dt=torch.bfloat16, dv=None):
    """q, k, v, dO (2 KV heads, `ratio` query heads each; v and dO `dv` wide when given), the
    problem, and our forward's out and lse (bottom-right causal offset)."""
    if dispatch.current_arch() != "sm_90a":
        pytest.skip("WGMMA kernels: sm_90 only")
    from ffpa_cute import sm90

    hkv, dv = 2, dv or d
    q, k, v, do = (torch.randn(1, h, n, w, device="cuda", dtype=dt)
                   for h, n, w in ((hkv * ratio, nq, d), (hkv, nkv, d), (hkv, nkv, dv),
                                   (hkv * ratio, nq, dv)))
    problem = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=nkv - nq)
    plan = dispatch.Plan(problem, "sm_90a", "sm90", cfg=sm90.plan_fwd(problem, "sm_90a"))
    out, lse = dispatch.run_fwd(plan, q, k, v)
    return q, k, v, do, problem, out, lse


@pytest.mark.parametrize("d,causal,nq,nkv,ratio", CASES)
def test_dv_matches_reference(seed, d, causal, nq, nkv, ratio):
    """dV summed over each KV head's query heads (GQA ratio `ratio`) inside the kernel."""
    _check_dv(d, causal, nq, nkv, ratio)


def _check_dv(d, causal, nq, nkv, ratio, dt=torch.bfloat16, dv=None):
    from ffpa_cute.sm90.bwd_sm90 import run_dv

    q, k, v, do, problem, _, lse = _inputs(d, causal, nq, nkv, ratio, dt, dv)
    dt, off = q.dtype, problem.causal_offset
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


@pytest.mark.parametrize("want", ["dq", "dk"])
@pytest.mark.parametrize("d,causal,nq,nkv,ratio", CASES)
def test_dq_dk_match_reference(seed, d, causal, nq, nkv, ratio, want):
    _check_dq_dk(d, causal, nq, nkv, ratio, want)


def _check_dq_dk(d, causal, nq, nkv, ratio, want, dt=torch.bfloat16, dv=None):
    from ffpa_cute.sm90.bwd_sm90 import run_dk, run_dq

    q, k, v, do, problem, out, lse = _inputs(d, causal, nq, nkv, ratio, dt, dv)
    dt, off = q.dtype, problem.causal_offset
    delta = (do.float() * out.float()).sum(-1)
    run = run_dq if want == "dq" else run_dk
    grad = run(q, k, v, do, lse, delta, problem.softmax_scale, causal, off)
    torch.cuda.synchronize()
    pick = 0 if want == "dq" else 1
    ref = attention_grads(q, k, v, do, causal, off, dtype=torch.float64)[pick]
    base = attention_grads(q, k, v, do, causal, off, dtype=dt)[pick]
    err, base_err = rel_err(grad, ref), rel_err(base, ref)
    assert err <= 2 * base_err + 1e-3, f"{want} err {err:.3g} vs torch {base_err:.3g}"


@pytest.mark.parametrize("want", ["dv", "dq", "dk"])
@pytest.mark.parametrize("d,causal,nq,nkv,ratio", [CASES[1], CASES[4], CASES[5]])
def test_without_prefetch(seed, monkeypatch, d, causal, nq, nkv, ratio, want):
    """The configs without `prefetch_stats` (statistics loaded after the block's WGMMAs; the
    default is with), same checks."""
    from ffpa_cute.sm90 import bwd_sm90

    monkeypatch.setattr(bwd_sm90, "PREFETCH_STATS", False)
    if want == "dv":
        _check_dv(d, causal, nq, nkv, ratio)
    else:
        _check_dq_dk(d, causal, nq, nkv, ratio, want)


@pytest.mark.parametrize("d,causal,nq,nkv,ratio", [CASES[1], CASES[2], CASES[4], CASES[5]])
def test_dk_without_seq_scores(seed, monkeypatch, d, causal, nq, nkv, ratio):
    """dK without `seq_scores` (64-query blocks, S^T and dP^T in two accumulators; the default
    is with, which the reference tests above run)."""
    from ffpa_cute.sm90 import bwd_sm90

    monkeypatch.setattr(bwd_sm90, "SEQ_SCORES", False)
    assert bwd_sm90.plan_dk(_inputs(d, causal, nq, nkv, ratio)[4]).tile_n == 64
    _check_dq_dk(d, causal, nq, nkv, ratio, "dk")


@pytest.mark.parametrize("want", ["dv", "dq", "dk"])
@pytest.mark.parametrize("d,causal,nq,nkv,ratio", [(512, True, 129, 1000, 4),
                                                   (320, False, 1000, 1000, 16),
                                                   (384, True, 1000, 129, 1)])
def test_fp16(seed, d, causal, nq, nkv, ratio, want):
    """fp16 inputs (dS goes to fp16 before the gradient GEMM): same criterion."""
    if want == "dv":
        _check_dv(d, causal, nq, nkv, ratio, torch.float16)
    else:
        _check_dq_dk(d, causal, nq, nkv, ratio, want, torch.float16)


@pytest.mark.parametrize("want", ["dv", "dq", "dk"])
@pytest.mark.parametrize("d,causal,nq,nkv,ratio", [(1024, True, 129, 1000, 4),
                                                   (768, False, 1000, 1000, 1),
                                                   (576, True, 1000, 129, 16)])
def test_above_512(seed, monkeypatch, d, causal, nq, nkv, ratio, want):
    """D > 512: the gradient split over two CTAs (each recomputing the scores), as the forward
    splits O (`bwd_sm90.MAX_HEAD_DIM` = 1024, the default)."""
    from ffpa_cute.sm90 import bwd_sm90

    monkeypatch.setattr(bwd_sm90, "MAX_HEAD_DIM", 1024)
    if want == "dv":
        _check_dv(d, causal, nq, nkv, ratio)
    else:
        _check_dq_dk(d, causal, nq, nkv, ratio, want)


@pytest.mark.parametrize("want", ["dv", "dq", "dk"])
@pytest.mark.parametrize("d,dv,causal,nq,nkv,ratio", [(576, 512, True, 129, 1000, 16),
                                                      (576, 512, False, 1000, 1000, 1),
                                                      (512, 320, True, 1000, 129, 4)])
def test_dv_not_d(seed, d, dv, causal, nq, nkv, ratio, want):
    """Dv != D (MLA-absorbed 576 / 512): dQ / dK with the second score product over Dv, dV
    accumulating Dv columns (`dispatch.DV_NOT_D_BWD` routes autograd here)."""
    if want == "dv":
        _check_dv(d, causal, nq, nkv, ratio, dv=dv)
    else:
        _check_dq_dk(d, causal, nq, nkv, ratio, want, dv=dv)


@pytest.mark.parametrize("d,causal,nq,nkv,ratio,dt", [c + (torch.bfloat16,) for c in CASES] + [
    (512, True, 129, 1000, 4, torch.float16), (320, False, 1000, 1000, 16, torch.float16)])
def test_dkdv_pair(seed, d, causal, nq, nkv, ratio, dt):
    """dK and dV from the 2-CTA pair (bwd_pair_sm90.py: rank 0 forms P^T for dV and sends it,
    rank 1 forms dS^T from it for dK) against float64, the dK / dV kernels' criterion, and the
    same bits on a second run."""
    from ffpa_cute.sm90.bwd_pair_sm90 import run_dkdv

    q, k, v, do, problem, out, lse = _inputs(d, causal, nq, nkv, ratio, dt)
    off = problem.causal_offset
    delta = (do.float() * out.float()).sum(-1)
    dk, dv = run_dkdv(q, k, v, do, lse, delta, problem.softmax_scale, causal, off)
    torch.cuda.synchronize()
    ref = attention_grads(q, k, v, do, causal, off, dtype=torch.float64)
    base = attention_grads(q, k, v, do, causal, off, dtype=dt)
    for name, got, i in (("dK", dk, 1), ("dV", dv, 2)):
        err, base_err = rel_err(got, ref[i]), rel_err(base[i], ref[i])
        assert err <= 2 * base_err + 1e-3, f"{name} err {err:.3g} vs torch {base_err:.3g}"
    # the same bits on a second run (no atomics, fixed order)
    dk2, dv2 = run_dkdv(q, k, v, do, lse, delta, problem.softmax_scale, causal, off)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)


@pytest.mark.parametrize("causal", [False, True])
def test_autograd_through_the_pair(seed, monkeypatch, causal):
    """`ffpa_cute.attention`'s backward with `dispatch.DKDV_PAIR` on: dQ from the dQ kernel,
    dK / dV from the pair, GQA 4, against float64."""
    import ffpa_cute

    monkeypatch.setattr(dispatch, "DKDV_PAIR", True)
    q, k, v, do, problem, _, _ = _inputs(512, causal, 1000, 1000, 4)
    off = problem.causal_offset
    assert dispatch._dkdv_pair(problem)
    qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ffpa_cute.attention(qq, kk, vv, is_causal=causal, enable_gqa=True).backward(do)
    ref = attention_grads(q, k, v, do, causal, off, dtype=torch.float64)
    base = attention_grads(q, k, v, do, causal, off, dtype=q.dtype)
    for name, got, i in (("dQ", qq.grad, 0), ("dK", kk.grad, 1), ("dV", vv.grad, 2)):
        err, base_err = rel_err(got, ref[i]), rel_err(base[i], ref[i])
        assert err <= 2 * base_err + 1e-3, f"{name} err {err:.3g} vs torch {base_err:.3g}"
