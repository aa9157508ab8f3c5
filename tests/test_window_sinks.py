"""`attention(..., window=, sinks=)` on the CPU: the torch-math fallback against the float64
reference of `masked_ref` (visibility written out entry by entry, the sink in the softmax
denominator), forward, lse and gradients (sinks included); the routing (no kernel plan ever
gets a window or sinks, strict mode raises with the reason); the argument errors.

Fresh random inputs, odd lengths, GQA; float64 inputs are held to 1e-12, float32 / bf16 to the
issue's bound (2x torch's same-dtype error + 1e-3).
"""

import logging

import pytest
import torch
from torch.nn.attention.bias import causal_upper_left

import fake_kernels  # tests/ is on sys.path
from ffpa_cute import attention, dispatch, explain, math_attention, quantize_fp8
from ffpa_cute.options import Options
from ffpa_cute.problem import AttnProblem
from masked_ref import bound, ref_attention, rel_err

F64 = torch.float64
WINDOWS = [(3, 0), (0, 2), (5, None), (None, 4), (2, 3), (0, 0), (None, None)]


def qkv(b=2, hq=6, hkv=2, nq=7, nkv=29, d=16, dv=None, dtype=F64, grad=False):
    def r(*s):
        return torch.randn(*s, dtype=dtype).requires_grad_(grad)
    return r(b, hq, nq, d), r(b, hkv, nkv, d), r(b, hkv, nkv, dv or d)


def sink_logits(h, dtype=F64, grad=False):
    return (torch.randn(h, dtype=dtype) + 1.0).requires_grad_(grad)


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("nq,nkv", [(7, 29), (29, 7), (13, 13)])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_forward_and_lse_match_reference(seed, nq, nkv, window, causal, with_sinks):
    q, k, v = qkv(nq=nq, nkv=nkv, dv=24)
    sinks = sink_logits(6) if with_sinks else None
    out, lse = attention(q, k, v, is_causal=causal, enable_gqa=True, window=window, sinks=sinks,
                         return_lse=True)
    ref, ref_lse = ref_attention(q, k, v, causal=causal, window=window, sinks=sinks)
    assert out.shape == (2, 6, nq, 24) and lse.shape == (2, 6, nq) and lse.dtype == F64
    assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert torch.equal(out, attention(q, k, v, is_causal=causal, enable_gqa=True, window=window,
                                      sinks=sinks))


def test_rows_without_keys(seed):
    """Rows the window and causal leave empty: out 0 and lse -inf, or lse = sink with sinks."""
    q, k, v = qkv(nq=29, nkv=7)
    out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, window=(1, 0),
                         return_lse=True)
    assert (out[..., :22, :] == 0).all() and torch.isneginf(lse[..., :22]).all()
    assert torch.isfinite(lse[..., 22:]).all()
    sinks = sink_logits(6)
    out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks, return_lse=True)
    assert (out[..., :22, :] == 0).all()
    assert torch.equal(lse[..., :22], sinks[:, None].expand(2, 6, 22))
    q, k, v = qkv(nq=5, nkv=0)  # no keys at all
    out, lse = attention(q, k, v, enable_gqa=True, window=(2, 2), sinks=sinks, return_lse=True)
    assert (out == 0).all() and torch.equal(lse, sinks[:, None].expand(2, 6, 5))
    q, k, v = qkv(nq=0, nkv=9)
    assert attention(q, k, v, enable_gqa=True, window=(2, 2), sinks=sinks).shape == (2, 6, 0, 16)


@pytest.mark.parametrize("nq,nkv", [(7, 29), (29, 7)])
def test_upper_left_bias_sets_the_frame(seed, nq, nkv):
    """With a causal_upper_left mask, query i sits at key i (frame 0) for the window too."""
    q, k, v = qkv(nq=nq, nkv=nkv)
    sinks = sink_logits(6)
    out, lse = attention(q, k, v, attn_mask=causal_upper_left(nq, nkv), enable_gqa=True,
                         window=(3, None), sinks=sinks, return_lse=True)
    ref, ref_lse = ref_attention(q, k, v, causal=True, frame=0, window=(3, None), sinks=sinks)
    assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12


def test_dense_masks_with_window_and_sinks(seed):
    q, k, v = qkv(hq=4, hkv=4, nq=9, nkv=23)
    sinks = sink_logits(4)
    bool_mask = torch.rand(9, 23) > 0.3
    bool_mask[4] = False  # a row hidden entirely: out 0, lse = sink
    float_mask = torch.randn(2, 1, 9, 23, dtype=F64)
    for mask in (bool_mask, float_mask):
        out, lse = attention(q, k, v, attn_mask=mask, window=(4, 6), sinks=sinks,
                             return_lse=True)
        ref, ref_lse = ref_attention(q, k, v, window=(4, 6), sinks=sinks, mask=mask)
        assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12
    float_mask.requires_grad_()
    with pytest.raises(NotImplementedError, match="attn_mask"):
        attention(q, k, v, attn_mask=float_mask, window=(4, 6))


@pytest.mark.parametrize("shape_q,shape_kv", [((6, 7, 16), (2, 29, 16)),
                                              ((2, 3, 6, 7, 16), (2, 3, 3, 29, 16))])
def test_other_ranks(seed, shape_q, shape_kv):
    q, k, v = (torch.randn(*s, dtype=F64) for s in (shape_q, shape_kv, shape_kv))
    sinks = sink_logits(6)
    out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, window=(4, 0), sinks=sinks,
                         return_lse=True)
    ref, ref_lse = ref_attention(q, k, v, causal=True, window=(4, 0), sinks=sinks)
    assert out.shape == shape_q and lse.shape == shape_q[:-1]
    assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("nq,nkv,window,causal", [
    (7, 29, (5, 2), False), (29, 7, (3, None), True), (13, 13, (None, 0), False),
    (13, 13, (2, 2), True)])
def test_gradients_float64(seed, nq, nkv, window, causal):
    """dq, dk, dv and d sinks against float64 autograd of the reference (rows without keys
    included: 29 queries on 7 causal keys)."""
    q, k, v = qkv(hq=8, hkv=2, nq=nq, nkv=nkv, dv=24, grad=True)
    sinks = sink_logits(8, grad=True)
    dout = torch.randn(2, 8, nq, 24, dtype=F64)
    out = attention(q, k, v, is_causal=causal, enable_gqa=True, window=window, sinks=sinks)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    ref, _ = ref_attention(q, k, v, causal=causal, window=window, sinks=sinks)
    want = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    for g, w in zip(got, want):
        assert g.dtype == F64 and rel_err(g, w) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_within_the_bound(seed, dtype):
    """out, lse and every gradient of a 16-bit / float32 call within 2x torch's same-dtype
    error + 1e-3 of the float64 truth."""
    q, k, v = qkv(hq=8, hkv=2, nq=37, nkv=53, d=32, dtype=dtype, grad=True)
    sinks = sink_logits(8, dtype=torch.float32, grad=True)
    dout = torch.randn(2, 8, 37, 32, dtype=dtype)
    kw = dict(causal=True, window=(11, 3), sinks=sinks)
    out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, window=(11, 3), sinks=sinks,
                         return_lse=True)
    assert out.dtype == dtype and lse.dtype == torch.float32
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    truth, truth_lse = ref_attention(q, k, v, **kw)
    want = torch.autograd.grad(truth, (q, k, v, sinks), dout.double())
    same, same_lse = ref_attention(q, k, v, **kw, dtype=dtype)
    base = torch.autograd.grad(same, (q, k, v, sinks), dout)
    assert rel_err(out, truth) <= bound(rel_err(same, truth))
    assert rel_err(lse, truth_lse) <= bound(rel_err(same_lse, truth_lse))
    for g, w, b in zip(got, want, base):
        assert rel_err(g, w) <= bound(rel_err(b, w))


def test_chunks_skip_keys_outside_the_window(seed, monkeypatch):
    """With a small score budget the math runs in many row chunks, each scoring only the keys
    its rows can see (skipped, not masked), with the same results and gradients."""
    q, k, v = qkv(hq=2, hkv=1, nq=64, nkv=64, grad=True)
    sinks = sink_logits(2, grad=True)
    dout = torch.randn(2, 2, 64, 16, dtype=F64)

    def run():
        out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, window=(5, 0),
                             sinks=sinks, return_lse=True)
        return out, lse, torch.autograd.grad(out, (q, k, v, sinks), dout)

    whole = run()
    monkeypatch.setattr(math_attention, "CHUNK_ELEMS", 4 * 8 * 16)  # 8 rows x 16 keys per chunk
    seen = []
    real = math_attention._chunks
    monkeypatch.setattr(math_attention, "_chunks", lambda *a: seen.append(real(*a)) or seen[-1])
    chunked = run()
    assert len(seen[0]) > 1
    assert all(4 * (j - i) * (ke - ks) <= 4 * 8 * 16 for i, j, ks, ke in seen[0])
    assert sum((j - i) * (ke - ks) for i, j, ks, ke in seen[0]) < 64 * 64 / 4
    for a, b in zip((*whole[:2], *whole[2]), (*chunked[:2], *chunked[2])):
        assert rel_err(a, b) <= 1e-12


# ------------------------------------------------------------------------------- routing


def prob(**kw):
    base = dict(dtype="bf16", batch=1, heads_q=4, heads_kv=4, seqlen_q=7, seqlen_kv=7,
                head_dim=512, head_dim_v=512)
    return AttnProblem(**{**base, **kw})


@pytest.mark.parametrize("fields,cfg", [
    (dict(window_lo=-3), dict(window=True, causal=False, sinks=False)),
    (dict(window_hi=0), dict(window=False, causal=True, sinks=False)),
    (dict(window_lo=-3, window_hi=2, causal=True, causal_offset=0),
     dict(window=True, causal=True, sinks=False)),
    (dict(has_sinks=True), dict(window=False, causal=False, sinks=True))])
def test_sm90_plans_window_and_sinks(fields, cfg):
    """The sm90 16-bit forward takes a window (left edge: `window`; right edge: the causal
    rule) and sinks; its backward (atomic-free, and the fused kernel) the window (sinks reach
    it through the lse); the problem's
    right edge is min(causal offset, window_hi); GQA rows are never packed with them."""
    p = prob(**fields)
    plan = dispatch.plan_fwd(p, target="sm_90a")
    assert plan.reason is None and not plan.packed
    assert {f: getattr(plan.cfg, f) for f in cfg} == cfg
    bwd = dispatch.plan_bwd(p, target="sm_90a", opts=Options(deterministic=True))
    assert bwd.reason is None
    assert all(c.window == cfg["window"] and not c.sinks for c in bwd.cfgs[1:])
    fused = dispatch.plan_bwd(p, target="sm_90a").cfgs[1]   # the default: the fused kernel
    assert type(fused).__name__ == "BwdFusedConfigSm90" and fused.window == cfg["window"]
    assert prob(window_hi=5, causal=True, causal_offset=2).right_edge == 2
    assert prob(window_hi=1, causal=True, causal_offset=2).right_edge == 1
    assert dispatch.plan_fwd(prob(heads_kv=1, seqlen_q=1, **fields), target="sm_90a").packed \
        is False


@pytest.mark.parametrize("fields", [dict(window_lo=-3), dict(window_hi=0), dict(has_sinks=True)])
def test_splitd_and_fp8_plan_them(fields):
    """The Split-D kernels (sm80 family, forced or on sm_120a) take the window and sinks as the
    sm90 ones do; so do the FP8 kernels (sm90 WGMMA, Split-D)."""
    import dataclasses

    from ffpa_cute.options import Options
    p = prob(**fields)
    for plan in (dispatch.plan_fwd(p, target="sm_90a", opts=Options(family="sm80")),
                 dispatch.plan_fwd(p, target="sm_120a"),
                 dispatch.plan_fwd(dataclasses.replace(p, head_dim=520, head_dim_v=520),
                                   target="sm_90a", opts=Options(family="sm80"))):
        assert plan.reason is None and plan.kernel_cls.__name__ == "FFPAFwdSm80"
        assert plan.cfg.window == ("window_lo" in fields) and plan.cfg.sinks == p.has_sinks
        assert plan.cfg.causal == ("window_hi" in fields)
    bwd = dispatch.plan_bwd(p, target="sm_90a", opts=Options(family="sm80"))
    assert bwd.reason is None and all(not c.sinks for c in bwd.cfgs[1:])
    for opts in (Options(), Options(family="sm80")):
        fp8 = dispatch.plan_fwd(dataclasses.replace(p, dtype="e4m3"), target="sm_90a",
                                opts=opts)
        assert fp8.reason is None and "FP8" in fp8.kernel_cls.__name__
        assert fp8.cfg.window == ("window_lo" in fields) and fp8.cfg.sinks == p.has_sinks


@pytest.mark.parametrize("kw", [dict(window=(4, 0)), dict(window=(3, 5)),
                                dict(sinks=True), dict(window=(6, 1), sinks=True)])
def test_kernel_route_with_fake_kernels(seed, monkeypatch, kw):
    """Where a planner serves the problem (fake kernels standing in), a window / sinks call
    runs the kernel route (`ops.FeatureAttention`): its forward gets the sinks, its backward
    the window, and the sinks' gradient comes from lse and Delta; all against float64."""
    fake = fake_kernels.install(monkeypatch)
    q, k, v = qkv(nq=7, nkv=29, grad=True)
    sinks = sink_logits(6, grad=True) if kw.pop("sinks", False) else None
    out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks,
                         return_lse=True, **kw)
    assert len(fake.fwd_calls) == 1
    ref, ref_lse = ref_attention(q, k, v, causal=True, sinks=sinks, **kw)
    assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12
    dout = torch.randn_like(out)
    ins = [t for t in (q, k, v, sinks) if t is not None]
    got = torch.autograd.grad(out, ins, dout)
    want = torch.autograd.grad(ref, ins, dout)
    assert len(fake.bwd_calls) == 1
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-10
    assert explain(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks, **kw).startswith(
        "ffpa_cute kernel: fake kernel")


@pytest.mark.parametrize("kw", [dict(window=(4, 0)), dict(window=(6, 1), sinks=True),
                                dict(sinks=True)])
def test_torch_compile_kernel_route(seed, monkeypatch, kw):
    """Under torch.compile(fullgraph=True) a window / sinks call the kernels serve is one
    opaque op, `ffpa_cute::feature_attention_fwd` (its backward `..._bwd`): the fake kernels
    run once each way, and out, lse and the gradients (sinks included) match float64."""
    fake = fake_kernels.install(monkeypatch)
    torch._dynamo.reset()
    with_sinks = kw.pop("sinks", False)

    def fn(q, k, v, sinks):
        out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, sinks=sinks,
                             return_lse=True, **kw)
        return out, lse

    q, k, v = qkv(nq=7, nkv=29, dtype=torch.float32, grad=True)
    sinks = sink_logits(6, dtype=torch.float32, grad=True) if with_sinks else None
    out, lse = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
    assert len(fake.fwd_calls) == 1 and fake.fwd_calls[0].has_sinks == with_sinks
    ref, ref_lse = ref_attention(q, k, v, causal=True, sinks=sinks, **kw)
    assert rel_err(out, ref) <= 1e-5 and rel_err(lse, ref_lse) <= 1e-5
    ins = [t for t in (q, k, v, sinks) if t is not None]
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, ins, dout)
    want = torch.autograd.grad(ref, ins, dout)
    assert len(fake.bwd_calls) == 1
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-4


def test_feature_ops_opcheck(seed, monkeypatch):
    """The window / sinks custom ops' schemas, fake implementations and autograd
    registration (torch.library.opcheck), with and without sinks."""
    from ffpa_cute import ops

    fake_kernels.install(monkeypatch)
    q, k, v = qkv(nq=7, nkv=9, dtype=torch.float32, grad=True)
    sinks = sink_logits(6, dtype=torch.float32, grad=True)
    for s in (sinks, None):
        args = (q, k, v, s, True, 2, -3, None, 0.25)
        torch.library.opcheck(torch.ops.ffpa_cute.feature_attention_fwd.default, args,
                              test_utils=("test_schema", "test_faketensor",
                                          "test_autograd_registration"))
        out, lse = ops.feature_attention_fwd(*args)
        dlse = torch.randn_like(lse) if s is not None else None  # lse's gradient, or none
        torch.library.opcheck(torch.ops.ffpa_cute.feature_attention_bwd.default,
                              (q, k, v, s, out, lse, torch.randn_like(out), dlse, True, 2, -3,
                               None, 0.25), test_utils=("test_schema", "test_faketensor"))


def test_strict_and_logging_on_cpu(seed, caplog):
    q, k, v = qkv()
    with pytest.raises(NotImplementedError, match="cpu"):
        attention(q, k, v, enable_gqa=True, window=(2, 2), strict=True)
    caplog.set_level(logging.DEBUG, logger="ffpa_cute")
    for _ in range(3):
        attention(q, k, v, enable_gqa=True, window=(2, 2), sinks=sink_logits(6))
    recs = [r for r in caplog.records if r.name == "ffpa_cute"]
    assert len(recs) == 1 and "cpu" in recs[0].getMessage()
    assert explain(q, k, v, enable_gqa=True, window=(2, 2)).startswith("torch-math fallback")


# -------------------------------------------------------------------------------- errors

Q, K = torch.randn(1, 4, 7, 16), torch.randn(1, 4, 9, 16)


@pytest.mark.parametrize("kw,exc,pattern", [
    (dict(window=3), TypeError, r"^window must be None or a pair \(left, right\)"),
    (dict(window=(1, 2, 3)), TypeError, r"^window must be None or a pair"),
    (dict(window=(1.5, 2)), TypeError, r"^window left must be an int >= 0 or None"),
    (dict(window=(1, True)), TypeError, r"^window right must be an int >= 0 or None"),
    (dict(window=(-1, 2)), ValueError, r"^window left=-1: must be an int >= 0, or None"),
    (dict(sinks=[1.0] * 4), TypeError, r"^sinks must be None or a float tensor \[Hq\]"),
    (dict(sinks=torch.ones(4, dtype=torch.int32)), TypeError, r"^sinks must be"),
    (dict(sinks=torch.ones(2)), ValueError, r"^sinks must have shape \[Hq\] = \[4\]"),
    (dict(sinks=torch.ones(1, 4)), ValueError, r"^sinks must have shape \[Hq\]"),
    (dict(sinks=torch.ones(4, device="meta")), ValueError, r"^sinks must be on q's device"),
    (dict(window=(1, 1), dropout_p=0.1), ValueError,
     r"^dropout_p=0.1 cannot be combined with window or sinks"),
])
def test_errors_name_the_argument(kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        attention(Q, K, K, **kw)
    with pytest.raises(exc, match=pattern):
        explain(Q, K, K, **kw)


def test_fp8_with_window_or_sinks_is_the_dequantised_call(seed):
    """FP8 inputs with a window or sinks: the attention of the dequantised inputs with them
    (on the CPU through the bf16 route); sinks that require grad are refused (FP8 is
    forward-only)."""
    (q8, qd), (k8, kd) = quantize_fp8(Q), quantize_fp8(K)
    qb, kb = ((t.float() * d).to(torch.bfloat16) for t, d in ((q8, qd), (k8, kd)))
    for kw in (dict(window=(2, 0)), dict(sinks=torch.randn(4)),
               dict(window=(3, None), sinks=torch.randn(4), is_causal=True)):
        got = attention(q8, k8, k8, q_descale=qd, k_descale=kd, v_descale=kd, **kw)
        want = attention(qb, kb, kb, **kw)
        assert torch.equal(got, want)
    with pytest.raises(NotImplementedError, match="forward-only"):
        attention(q8, k8, k8, q_descale=qd, k_descale=kd, v_descale=kd,
                  sinks=torch.zeros(4, requires_grad=True))


def test_torch_compile_fullgraph(seed):
    """window and sinks under torch.compile(fullgraph=True): the same out, lse and gradients
    (sinks included) as eager."""
    torch._dynamo.reset()

    def fn(q, k, v, sinks):
        out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, window=(3, 1),
                             sinks=sinks, return_lse=True)
        return out.square().sum() + lse.sum()

    q, k, v = qkv(nq=7, nkv=11, dtype=torch.float32, grad=True)
    sinks = sink_logits(6, dtype=torch.float32, grad=True)
    loss = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, sinks)
    got = torch.autograd.grad(loss, (q, k, v, sinks))
    ref = fn(q, k, v, sinks)
    want = torch.autograd.grad(ref, (q, k, v, sinks))
    assert rel_err(loss, ref) <= 1e-6
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-6
