"""The public API's contract, checked on CPU (no GPU, fast).

Two routes are exercised:
  * the real dispatcher, which sends CPU tensors to native SDPA (fallback semantics, logging,
    strict mode, explain, the SDPA patch);
  * a fake dispatcher (`fake_kernel`) whose "kernel" is the fp32 reference, so the custom op,
    its fake impl, autograd formula and torch.compile integration are tested without CUDA.
Inputs are random (never zeros) with odd lengths so masking and residues show up.
"""

import logging
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

import ffpa_cute
from ffpa_cute import attention, dispatch, explain, interface, launch, ops, patch_sdpa, unpatch_sdpa
from ffpa_cute.reference import attention_grads, attention_ref, rel_err
from fake_kernels import FakeKernels, FakePlan  # tests/ is on sys.path

NATIVE = torch._C._nn.scaled_dot_product_attention


def rand(*shape, dtype=torch.float32, grad=False):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


def qkv(b=2, hq=4, hkv=4, nq=7, nkv=7, d=32, dv=None, dtype=torch.float32, grad=False):
    return (rand(b, hq, nq, d, dtype=dtype, grad=grad),
            rand(b, hkv, nkv, d, dtype=dtype, grad=grad),
            rand(b, hkv, nkv, dv or d, dtype=dtype, grad=grad))


def bottom_right_mask(nq, nkv):
    return torch.ones(nq, nkv, dtype=torch.bool).tril(diagonal=nkv - nq)


def close(a, b, tol=1e-5):
    err = rel_err(a, b)
    assert err <= tol, f"relative error {err:.3g} > {tol}"


# ----------------------------------------------------------------------- fallback semantics


@pytest.mark.parametrize("nq,nkv", [(1, 1), (7, 7), (7, 129), (129, 7), (1, 129)])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (6, 2)])
def test_fallback_matches_native_sdpa(seed, nq, nkv, hq, hkv):
    q, k, v = qkv(hq=hq, hkv=hkv, nq=nq, nkv=nkv, dv=48)
    gqa = hq != hkv
    close(attention(q, k, v, enable_gqa=gqa), NATIVE(q, k, v, enable_gqa=gqa))
    close(attention(q, k, v, scale=0.3, enable_gqa=gqa), NATIVE(q, k, v, scale=0.3, enable_gqa=gqa))


@pytest.mark.parametrize("nq,nkv", [(1, 1), (7, 7), (7, 129), (129, 7), (1, 129), (129, 129)])
@pytest.mark.parametrize("hkv", [4, 2])
def test_causal_is_bottom_right(seed, nq, nkv, hkv):
    q, k, v = qkv(hkv=hkv, nq=nq, nkv=nkv)
    out = attention(q, k, v, is_causal=True, enable_gqa=hkv != 4)
    ref, _ = attention_ref(q, k, v, causal=True)  # default offset: Nkv - Nq
    close(out, ref)
    if nq <= nkv:  # every row sees a key: equals SDPA with the explicit mask
        kx, vx = k.repeat_interleave(4 // hkv, 1), v.repeat_interleave(4 // hkv, 1)
        close(out, NATIVE(q, kx, vx, attn_mask=bottom_right_mask(nq, nkv)))
    if nq == nkv:  # identical to SDPA's own is_causal
        close(out, NATIVE(q, k, v, is_causal=True, enable_gqa=hkv != 4))


def test_rows_without_keys_are_zero(seed):
    q, k, v = qkv(nq=129, nkv=7)
    out = attention(q, k, v, is_causal=True)
    assert torch.isfinite(out).all()
    assert (out[..., : 129 - 7, :] == 0).all()
    assert (out[..., 129 - 7:, :].abs().sum(-1) > 0).all()
    out = attention(q, k, v, attn_mask=causal_lower_right(129, 7))
    assert (out[..., : 129 - 7, :] == 0).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("nq,nkv", [(7, 7), (7, 129), (129, 7)])
def test_causal_bias_objects(seed, nq, nkv):
    q, k, v = qkv(nq=nq, nkv=nkv)
    close(attention(q, k, v, attn_mask=causal_lower_right(nq, nkv)),
          attention_ref(q, k, v, causal=True, causal_offset=nkv - nq)[0])
    close(attention(q, k, v, attn_mask=causal_upper_left(nq, nkv)),
          attention_ref(q, k, v, causal=True, causal_offset=0)[0])
    close(attention(q, k, v, attn_mask=causal_upper_left(nq, nkv)),
          NATIVE(q, k, v, attn_mask=torch.ones(nq, nkv, dtype=torch.bool).tril()))


def test_dense_masks_fall_back_to_native(seed):
    q, k, v = qkv(nq=7, nkv=129)
    bool_mask = torch.rand(7, 129) > 0.3
    float_mask = torch.randn(2, 1, 7, 129)
    close(attention(q, k, v, attn_mask=bool_mask), NATIVE(q, k, v, attn_mask=bool_mask))
    close(attention(q, k, v, attn_mask=float_mask), NATIVE(q, k, v, attn_mask=float_mask))
    assert "attn_mask" in explain(q, k, v, attn_mask=bool_mask) or "cpu" in explain(
        q, k, v, attn_mask=bool_mask)


@pytest.mark.parametrize("shape_q,shape_kv", [((4, 7, 32), (4, 129, 32)),
                                              ((2, 3, 4, 7, 32), (2, 3, 2, 129, 32))])
def test_other_ranks(seed, shape_q, shape_kv):
    q, k, v = rand(*shape_q), rand(*shape_kv), rand(*shape_kv)
    gqa = shape_q[-3] != shape_kv[-3]
    close(attention(q, k, v, enable_gqa=gqa), NATIVE(q, k, v, enable_gqa=gqa))
    out = attention(q, k, v, is_causal=True, enable_gqa=gqa)
    assert out.shape == shape_q
    close(out, attention_ref(q, k, v, causal=True)[0])


def test_gradients_through_fallback(seed):
    q, k, v = qkv(hkv=2, nq=129, nkv=7, grad=True)
    attention(q, k, v, is_causal=True, enable_gqa=True).square().sum().backward()
    got = [t.grad for t in (q, k, v)]
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    attention_ref(qr, kr, vr, causal=True)[0].square().sum().backward()
    for g, r in zip(got, (qr.grad, kr.grad, vr.grad)):
        close(g, r)


def test_empty_shapes(seed):
    q, k, v = qkv(nq=0, nkv=7)
    assert attention(q, k, v).shape == (2, 4, 0, 32)
    q, k, v = qkv(nq=7, nkv=0)
    out = attention(q, k, v, is_causal=True, strict=True)  # nothing to compute: never strict
    assert out.shape == (2, 4, 7, 32) and (out == 0).all()
    q, k = rand(4, 0, 32), rand(4, 9, 32)  # 3-D with no queries
    assert attention(q, k, k).shape == (4, 0, 32)


# -------------------------------------------------------------------------------- validation

Q, K = rand(1, 4, 7, 32), rand(1, 4, 9, 32)


@pytest.mark.parametrize("args,kwargs,exc,pattern", [
    ((Q.numpy(), K, K), {}, TypeError, r"^q must be a torch.Tensor"),
    ((Q, K, "v"), {}, TypeError, r"^v must be a torch.Tensor"),
    ((Q.long(), K.long(), K.long()), {}, TypeError, r"^q must have a floating dtype"),
    ((Q, K.double(), K), {}, TypeError, r"share one dtype"),
    ((Q, K, K.to("meta")), {}, ValueError, r"one device"),
    ((Q[0, 0], K[0, 0], K[0, 0]), {}, ValueError, r"rank >= 3"),
    ((Q, K[0], K[0]), {}, ValueError, r"same rank"),
    ((Q, rand(2, 4, 9, 32), rand(2, 4, 9, 32)), {}, ValueError, r"batch dims"),
    ((Q, rand(1, 4, 9, 16), K), {}, ValueError, r"head dims"),
    ((Q, K, rand(1, 4, 8, 32)), {}, ValueError, r"k and v must agree"),
    ((Q, rand(1, 2, 9, 32), rand(1, 2, 9, 32)), {}, ValueError, r"enable_gqa=True"),
    ((Q, rand(1, 3, 9, 32), rand(1, 3, 9, 32)), {"enable_gqa": True}, ValueError, r"divisible"),
    ((Q, K, K), {"dropout_p": 1.0}, ValueError, r"dropout_p must be in \[0, 1\)"),
    ((Q, K, K), {"dropout_p": -0.1}, ValueError, r"dropout_p"),
    ((Q, K, K), {"dropout_p": "0"}, TypeError, r"dropout_p"),
    ((Q, K, K), {"is_causal": 1}, TypeError, r"is_causal must be a bool"),
    ((Q, K, K), {"scale": "1"}, TypeError, r"scale must be"),
    ((Q, K, K), {"enable_gqa": 1}, TypeError, r"enable_gqa must be a bool"),
    ((Q, K, K), {"attn_mask": [1]}, TypeError, r"attn_mask must be"),
    ((Q, K, K), {"attn_mask": torch.ones(7, 9, dtype=torch.int32)}, TypeError, r"attn_mask"),
    ((Q, K, K), {"attn_mask": torch.ones(7, 9, dtype=torch.bool), "is_causal": True},
     ValueError, r"is_causal=True cannot be combined with attn_mask"),
    ((Q, K, K), {"attn_mask": causal_lower_right(7, 8)}, ValueError, r"attn_mask CausalBias"),
])
def test_errors_name_the_argument(args, kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        attention(*args, **kwargs)
    with pytest.raises(exc, match=pattern):
        explain(*args, **kwargs)


# ------------------------------------------------------------- strict mode, explain, logging


def test_strict_mode(seed, monkeypatch):
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="cpu"):
        attention(q, k, v, strict=True)
    with ffpa_cute.options.use(strict=True):
        with pytest.raises(NotImplementedError, match="cpu"):
            attention(q, k, v)
        close(attention(q, k, v, strict=False), NATIVE(q, k, v))  # explicit argument wins


def test_explain_names_fallback_reason(seed):
    q, k, v = qkv(hkv=2, nq=7, nkv=129)
    text = explain(q, k, v, is_causal=True, enable_gqa=True)
    assert text.startswith("native SDPA fallback") and "cpu" in text
    assert "expanding K/V heads 2x" in text and "bool mask" in text


def test_logs_once_per_reason(seed, caplog, monkeypatch):
    real_plan = dispatch.plan_fwd

    def plan(problem, *a, **kw):  # make the reason depend on the head dim
        p = real_plan(problem, *a, **kw)
        return FakePlan(problem, reason=f"fake reason D={problem.head_dim}") if p.reason else p

    monkeypatch.setattr(dispatch, "plan_fwd", plan)
    caplog.set_level(logging.DEBUG, logger="ffpa_cute")
    for d in (32, 32, 48, 32, 48):
        attention(*qkv(d=d))
    recs = [r for r in caplog.records if r.name == "ffpa_cute"]
    assert [r.levelno for r in recs] == [logging.WARNING] * 2
    assert "fake reason D=32" in recs[0].getMessage() and "D=48" in recs[1].getMessage()
    explain(*qkv(d=64))  # explain never logs
    assert len([r for r in caplog.records if r.name == "ffpa_cute"]) == 2


# --------------------------------------------------------------------------------- SDPA patch


def test_patch_roundtrip(seed):
    original = F.scaled_dot_product_attention
    patch_sdpa()
    patch_sdpa()  # idempotent
    assert F.scaled_dot_product_attention is not original
    assert torch.nn.functional.scaled_dot_product_attention is F.scaled_dot_product_attention
    unpatch_sdpa()
    assert F.scaled_dot_product_attention is original
    unpatch_sdpa()  # no-op
    assert F.scaled_dot_product_attention is original


def test_patch_keeps_sdpa_semantics(seed, caplog):
    q, k, v = qkv(hkv=2, nq=7, nkv=129)
    expected = NATIVE(q, k, v, is_causal=True, enable_gqa=True)  # upper-left
    bias_mask = torch.rand(7, 129) > 0.5
    patch_sdpa()
    caplog.set_level(logging.DEBUG, logger="ffpa_cute")
    close(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), expected)
    close(F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(7, 129),
                                         enable_gqa=True),
          attention_ref(q, k, v, causal=True, causal_offset=129 - 7)[0])
    close(F.scaled_dot_product_attention(q, k, v, bias_mask, enable_gqa=True),
          NATIVE(q, k, v, bias_mask, enable_gqa=True))
    q3, k3, v3 = rand(4, 7, 32), rand(4, 129, 32), rand(4, 129, 32)
    close(F.scaled_dot_product_attention(q3, k3, v3, scale=0.2), NATIVE(q3, k3, v3, scale=0.2))
    # calls our validation rejects go to native SDPA untouched: SDPA decides what they mean
    # (a mask with is_causal=True: torch <= 2.13 computes something, 2.14 raises)
    same_as_native(lambda f: f(q, k, v, bias_mask, is_causal=True, enable_gqa=True))
    # SDPA accepts broadcastable batch dims; we hand those to it untouched
    kb, vb = rand(1, 4, 129, 32), rand(1, 4, 129, 32)
    close(F.scaled_dot_product_attention(q.repeat(1, 1, 1, 1), kb, vb), NATIVE(q, kb, vb))
    with ffpa_cute.options.use(strict=True):  # the patch is never strict
        F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    unpatch_sdpa()
    recs = [r for r in caplog.records if r.name == "ffpa_cute"]
    assert len(recs) == 1 and recs[0].levelno == logging.INFO


def same_as_native(call):
    """`call(F.scaled_dot_product_attention)` (patched) does what `call(NATIVE)` does: the same
    result, or the same exception, whichever this torch version gives."""
    try:
        expected = call(NATIVE)
    except Exception as e:  # noqa: BLE001  (whatever native SDPA raises, we must raise too)
        with pytest.raises(type(e), match=None):
            call(F.scaled_dot_product_attention)
        return
    close(call(F.scaled_dot_product_attention), expected)


# ------------------------------------------------------- kernel op path with a fake dispatcher


@pytest.fixture
def fake_kernel(monkeypatch):
    """Forward "kernels" for every problem (masks / dropout too, to prove interface never sends
    those) on CPU, and no backward kernels (the SDPA recompute)."""
    fake = FakeKernels()
    monkeypatch.setattr(dispatch, "plan_fwd", fake.plan_fwd)
    monkeypatch.setattr(launch, "run_fwd", fake.run_fwd)
    monkeypatch.setattr(dispatch, "plan_bwd", no_bwd_kernels)
    interface._clear_caches()
    return fake


def no_bwd_kernels(problem, device=None, target=None, opts=None):
    return dispatch.BwdPlan(problem, family="fake", reason="no backward kernels (fake)")


def fake_bwd_plan(problem, device=None, target=None, opts=None):
    return dispatch.BwdPlan(problem, family="fake")


@pytest.mark.parametrize("nq,nkv", [(1, 129), (7, 7), (129, 7)])
@pytest.mark.parametrize("causal", [False, True])
def test_op_path_forward_and_lse(seed, fake_kernel, nq, nkv, causal):
    q, k, v = qkv(hkv=2, nq=nq, nkv=nkv, dv=48)
    out = attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert len(fake_kernel.fwd_calls) == 1 and fake_kernel.fwd_calls[0].causal == causal
    assert "fake kernel" in explain(q, k, v, is_causal=causal, enable_gqa=True)
    ref, ref_lse = attention_ref(q, k, v, causal=causal)
    close(out, ref)
    out2, lse = torch.ops.ffpa_cute.attention_fwd(q, k, v, causal, nkv - nq, 32 ** -0.5)
    close(out2, ref)
    assert lse.dtype == torch.float32 and lse.shape == (2, 4, nq)
    close(lse, ref_lse)


def test_op_path_never_gets_masks_or_dropout(seed, fake_kernel):
    q, k, v = qkv()
    attention(q, k, v, attn_mask=torch.rand(7, 7) > 0.5)
    attention(q, k, v, dropout_p=0.5)
    assert fake_kernel.fwd_calls == []
    attention(q, k, v, attn_mask=causal_upper_left(7, 7))
    assert fake_kernel.fwd_calls[-1].causal and fake_kernel.fwd_calls[-1].causal_offset == 0


def test_op_path_strides_and_ranks(seed, fake_kernel):
    base = rand(2, 129, 4, 40)  # [B, N, H, D] storage, seen as [B, H, N, D]
    q = base[..., :32].transpose(1, 2)
    kv = rand(2, 7, 4, 2, 32)
    k, v = kv[..., 0, :].transpose(1, 2), kv[..., 1, :].transpose(1, 2)
    col = rand(2, 4, 32, 7).transpose(-1, -2)  # stride(-1) != 1: must be copied for the op
    for kk in (k, col):
        close(attention(q, kk, v, is_causal=True), attention_ref(q, kk, v, causal=True)[0])
    q3, k3, v3 = rand(4, 7, 32), rand(4, 129, 32), rand(4, 129, 32)
    close(attention(q3, k3, v3), attention_ref(q3, k3, v3)[0])
    patch_sdpa()  # the patch routes covered calls to the op with upper-left causal
    close(F.scaled_dot_product_attention(q3, k3, v3, is_causal=True),
          attention_ref(q3, k3, v3, causal=True, causal_offset=0)[0])
    assert fake_kernel.fwd_calls[-1].causal_offset == 0


@pytest.mark.parametrize("nq,nkv,hkv", [(7, 129, 4), (129, 7, 2), (7, 7, 1)])
def test_op_path_backward(seed, fake_kernel, nq, nkv, hkv):
    q, k, v = qkv(hkv=hkv, nq=nq, nkv=nkv, dv=48, grad=True)
    dout = rand(2, 4, nq, 48)
    attention(q, k, v, is_causal=True, enable_gqa=hkv != 4).backward(dout)
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    attention_ref(qr, kr, vr, causal=True)[0].backward(dout.double())
    for g, r in zip((q.grad, k.grad, v.grad), (qr.grad, kr.grad, vr.grad)):
        close(g, r)
    assert len(fake_kernel.fwd_calls) == 1


@pytest.fixture
def fake_bwd_kernels(monkeypatch, fake_kernel):
    """Backward "kernels" on CPU: autograd through the float64 reference, calls recorded."""
    calls = []

    def run_bwd(plan, q, k, v, out, lse, dout, dlse=None):  # written out: no autograd inside
        problem = plan.problem
        calls.append(problem)
        grads = attention_grads(q, k, v, dout, problem.causal, problem.causal_offset,
                                problem.softmax_scale, dlse=dlse)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))

    monkeypatch.setattr(dispatch, "plan_bwd", fake_bwd_plan)
    monkeypatch.setattr(launch, "run_bwd", run_bwd)
    return calls


@pytest.mark.parametrize("compiled", [False, True])
def test_backward_kernels_eager_and_compiled(seed, fake_bwd_kernels, compiled):
    """The backward kernels serve eager calls directly and torch.compile graphs through the
    `ffpa_cute::attention_bwd` op (never traced into)."""
    torch._dynamo.reset()

    def fn(q, k, v):
        return attention(q, k, v, is_causal=True, enable_gqa=True).float().square().sum()

    q, k, v = qkv(hkv=2, nq=7, nkv=129, grad=True)
    (torch.compile(fn, fullgraph=True, backend="aot_eager") if compiled else fn)(q, k, v).backward()
    assert len(fake_bwd_kernels) == 1 and fake_bwd_kernels[0].causal_offset == 122
    qr, kr, vr = (t.detach().double().requires_grad_() for t in (q, k, v))
    attention_ref(qr, kr, vr, causal=True)[0].square().sum().backward()
    for g, r in zip((q.grad, k.grad, v.grad), (qr.grad, kr.grad, vr.grad)):
        close(g, r)


def test_backward_opcheck(seed, fake_bwd_kernels):
    q, k, v = qkv(hkv=2, nq=7, nkv=9)
    out, lse = ops.attention_fwd(q, k, v, True, 2, 0.25)
    for dlse in (None, torch.randn_like(lse)):  # lse's gradient, or none
        torch.library.opcheck(torch.ops.ffpa_cute.attention_bwd.default,
                              (q, k, v, out, lse, torch.randn_like(out), dlse, True, 2, 0.25),
                              test_utils=("test_schema", "test_faketensor"))


def test_op_path_partial_grads(seed, fake_kernel):
    q, k, v = qkv()
    v.requires_grad_()
    attention(q, k, v).sum().backward()
    assert q.grad is None and v.grad is not None


def test_opcheck(seed, fake_kernel):
    q, k, v = qkv(hkv=2, nq=7, nkv=9, grad=True)
    torch.library.opcheck(torch.ops.ffpa_cute.attention_fwd.default,
                          (q, k, v, True, 2, 0.25))


@pytest.mark.parametrize("route", ["kernel", "fallback"])
def test_torch_compile_fullgraph(seed, request, route):
    if route == "kernel":
        request.getfixturevalue("fake_kernel")
    torch._dynamo.reset()

    def fn(q, k, v):
        return attention(q, k, v, is_causal=True, enable_gqa=True).float().square().sum()

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    for nq in (7, 129):  # the second shape recompiles (routing depends on shapes)
        q, k, v = qkv(hkv=2, nq=nq, nkv=129, grad=True)
        loss = compiled(q, k, v)
        loss.backward()
        got = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        ref = fn(q, k, v)
        ref.backward()
        close(loss, ref)
        for g, t in zip(got, (q, k, v)):
            close(g, t.grad)


# ----------------------------------------------------------------------------------- packaging


def test_constant_result_flag_matches_torch():
    """interface marks `_decide` by hand to avoid importing torch._dynamo at import time."""
    marked = torch._dynamo.assume_constant_result(lambda: 0)
    assert getattr(marked, "_dynamo_marked_constant", False)
    assert interface._decide._dynamo_marked_constant


def test_import_is_light():
    code = ("import sys, ffpa_cute; print(ffpa_cute.__version__); "
            "print(any(m.split('.')[0] == 'cutlass' for m in sys.modules)); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0.1.0", "False", "False"], out.stdout
    assert ffpa_cute.__all__ == ["NVFP4Tensor", "Options", "attention", "attention_with_kvcache",
                                 "dequantize_nvfp4", "explain", "merge_attention", "options",
                                 "patch_sdpa", "quantize_fp8", "quantize_nvfp4", "unpatch_sdpa",
                                 "varlen_attention", "__version__"]


def test_eager_calls_skip_the_custom_op_dispatcher(seed, fake_kernel, monkeypatch):
    """Eager: autograd.Function around the same forward (no ~35 us op dispatch per call)."""
    calls = []
    real = ops.attention_fwd
    monkeypatch.setattr(ops, "attention_fwd", lambda *a: calls.append(a) or real(*a))
    q, k, v = qkv(grad=True)
    out = attention(q, k, v)
    out.sum().backward()
    assert calls == [] and len(fake_kernel.fwd_calls) == 1 and q.grad is not None


def test_same_signature_calls_skip_checks_and_routing(seed, fake_kernel, monkeypatch):
    """A repeated eager call (same shapes, strides, dtypes, devices, flags) goes straight to
    the kernel: no argument checks, no routing; results, gradients and errors are unchanged."""
    routed = []
    real_route = interface._route
    monkeypatch.setattr(interface, "_route", lambda *a: routed.append(a) or real_route(*a))
    q, k, v = qkv(hkv=2, nq=7, nkv=129)
    for _ in range(3):
        close(attention(q, k, v, is_causal=True, enable_gqa=True),
              attention_ref(q, k, v, causal=True)[0])
    assert len(routed) == 1 and len(fake_kernel.fwd_calls) == 3
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attention(q2, k2, v2, is_causal=True, enable_gqa=True)  # same signature, with grad
    assert len(routed) == 1 and out.grad_fn is not None
    out.sum().backward()
    assert q2.grad is not None and k2.grad is not None and v2.grad is not None
    with pytest.raises(TypeError, match="dropout_p"):  # not a float: checked, as before
        attention(q, k, v, dropout_p=False, is_causal=True, enable_gqa=True)
    attention(q, k, v, enable_gqa=True)  # another flag, another signature: routed
    attention(q.transpose(-1, -2).contiguous().transpose(-1, -2), k, v, is_causal=True,
              enable_gqa=True)  # other strides: routed
    assert len(routed) == 3
    interface._clear_caches()
    attention(q, k, v, is_causal=True, enable_gqa=True)
    assert len(routed) == 4
    patch_sdpa()
    try:  # the patch keeps its own entries (upper-left causal)
        for _ in range(2):
            close(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                  attention_ref(q, k, v, causal=True, causal_offset=0)[0])
        assert len(routed) == 5
    finally:
        unpatch_sdpa()


def test_explain_names_the_backward(seed, fake_kernel, monkeypatch):
    """On the kernel path explain() also says what the backward runs: kernels, or the SDPA
    recompute with the reason."""
    q, k, v = qkv(hkv=2, nq=7, nkv=129)
    text = explain(q, k, v, is_causal=True, enable_gqa=True)
    assert "backward: SDPA recompute (no backward kernels (fake))" in text
    monkeypatch.setattr(dispatch, "plan_bwd", fake_bwd_plan)
    assert "backward: fake backward kernels (dQ, dK, dV)" in explain(q, k, v, is_causal=True,
                                                                    enable_gqa=True)


def test_call_memory_is_bounded(seed, fake_kernel):
    """Call signatures are remembered up to a bound (decode grows Nkv every step): past it the
    memory starts over, and calls still run."""
    for i in range(interface._FAST_CALLS_MAX + 5):
        interface._remember(("signature", i), None)
        assert len(interface._FAST_CALLS) <= interface._FAST_CALLS_MAX
    for nkv in range(1, 6):
        q, k, v = qkv(nq=1, nkv=nkv)
        close(attention(q, k, v), attention_ref(q, k, v)[0])
