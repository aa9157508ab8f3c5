"""`attention(..., return_lse=True)` and `merge_attention` on the CPU.

Routes: the real dispatcher (CPU tensors -> the fallback: native SDPA's out plus the torch-math
log-sum-exp) and the fake kernel route of `fake_kernels` (dispatch plans a "kernel", whose
forward is the float64 reference), so both branches of `attention` and its per-signature fast
path are exercised. Truth is `reference.attention_ref` in float64 on fresh random inputs with odd
lengths; float64 inputs are held to 1e-12, float32 ones to 1e-5.
"""

import pytest
import torch
from torch.nn.attention.bias import causal_upper_left

import fake_kernels  # tests/ is on sys.path
from ffpa_cute import attention, interface, merge_attention
from ffpa_cute.blockwise import block_backward, block_forward
from ffpa_cute.reference import attention_grads, attention_ref, rel_err

F64, F32 = torch.float64, torch.float32
MODES = ("none", "bottom_right", "upper_left")


def qkv(b=2, hq=4, hkv=2, nq=7, nkv=29, d=16, dv=None, dtype=F64, grad=False):
    def r(*s):
        return torch.randn(*s, dtype=dtype).requires_grad_(grad)
    return r(b, hq, nq, d), r(b, hkv, nkv, d), r(b, hkv, nkv, dv or d)


def mode_args(q, k, mode):
    """attention() keyword arguments of a causal mode, and its (causal, offset)."""
    nq, nkv = q.shape[-2], k.shape[-2]
    kw = dict(enable_gqa=q.shape[-3] != k.shape[-3])
    if mode == "upper_left":
        return dict(kw, attn_mask=causal_upper_left(nq, nkv)), True, 0
    return dict(kw, is_causal=mode == "bottom_right"), mode == "bottom_right", nkv - nq


def call(q, k, v, mode):
    """attention(..., return_lse=True) in a causal mode; (out, lse, causal, offset)."""
    kw, causal, offset = mode_args(q, k, mode)
    return (*attention(q, k, v, return_lse=True, **kw), causal, offset)


def check_lse(out, lse, q, k, v, causal, offset, tol):
    ref, ref_lse = attention_ref(q, k, v, causal=causal, causal_offset=offset)
    assert lse.shape == ref_lse.shape and lse.dtype == (F64 if q.dtype == F64 else F32)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert rel_err(out, ref) <= tol and rel_err(lse, ref_lse) <= tol
    assert (out[torch.isneginf(ref_lse)] == 0).all()  # rows without keys: 0, lse -inf


# ------------------------------------------------------------------------ return_lse, fallback


@pytest.mark.parametrize("nq,nkv", [(7, 7), (7, 29), (29, 7), (1, 29)])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hkv", [4, 1])
def test_fallback_lse(seed, nq, nkv, mode, hkv):
    q, k, v = qkv(hkv=hkv, nq=nq, nkv=nkv, dv=24)
    out, lse, causal, offset = call(q, k, v, mode)
    check_lse(out, lse, q, k, v, causal, offset, 1e-12)
    assert torch.equal(out, attention(q, k, v, **mode_args(q, k, mode)[0]))  # as without lse


def test_fallback_lse_float32_and_rows_without_keys(seed):
    q, k, v = qkv(nq=29, nkv=7, dtype=F32)
    out, lse, causal, offset = call(q, k, v, "bottom_right")
    check_lse(out, lse, q, k, v, causal, offset, 1e-5)
    assert torch.isneginf(lse[..., :22]).all() and torch.isfinite(lse[..., 22:]).all()
    q, k, v = qkv(nq=5, nkv=0)  # no keys at all
    out, lse = attention(q, k, v, enable_gqa=True, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all() and lse.shape == (2, 4, 5)


def test_fallback_lse_dense_masks(seed):
    q, k, v = qkv(hkv=4, nq=7, nkv=29)
    bool_mask = torch.rand(7, 29) > 0.4
    bool_mask[3] = False  # a row without keys
    float_mask = torch.randn(2, 1, 7, 29, dtype=F64)
    scores = (q @ k.transpose(-1, -2)) * 16 ** -0.5
    for mask, masked in ((bool_mask, scores.masked_fill(~bool_mask, float("-inf"))),
                         (float_mask, scores + float_mask)):
        out, lse = attention(q, k, v, attn_mask=mask, return_lse=True)
        assert rel_err(lse, torch.logsumexp(masked, -1)) <= 1e-12
        assert torch.equal(out, attention(q, k, v, attn_mask=mask))
    assert torch.isneginf(attention(q, k, v, attn_mask=bool_mask, return_lse=True)[1][..., 3]).all()


@pytest.mark.parametrize("shape_q,shape_kv", [((4, 7, 16), (4, 29, 16)),
                                              ((2, 3, 4, 7, 16), (2, 3, 2, 29, 16))])
def test_fallback_lse_other_ranks(seed, shape_q, shape_kv):
    q, k, v = (torch.randn(*s, dtype=F64) for s in (shape_q, shape_kv, shape_kv))
    out, lse = attention(q, k, v, is_causal=True, enable_gqa=shape_q[-3] != shape_kv[-3],
                         return_lse=True)
    assert lse.shape == shape_q[:-1]
    check_lse(out, lse, q, k, v, True, None, 1e-12)


def test_return_lse_errors(seed):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"return_lse=True cannot be combined with dropout_p"):
        attention(q, k, v, dropout_p=0.1, enable_gqa=True, return_lse=True)
    with pytest.raises(TypeError, match=r"^return_lse must be a bool, got int"):
        attention(q, k, v, enable_gqa=True, return_lse=1)
    out = attention(q, k, v, dropout_p=0.1, enable_gqa=True)  # dropout alone is fine
    assert out.shape == (2, 4, 7, 16)


@pytest.mark.parametrize("route", ["fallback", "kernel"])
def test_gradients_flow_through_out(seed, monkeypatch, route):
    if route == "kernel":
        fake_kernels.install(monkeypatch)
    q, k, v = qkv(nq=29, nkv=7, grad=True)
    out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
    assert out.requires_grad and lse.requires_grad
    dout = torch.randn_like(out)
    out.backward(dout)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    attention_ref(*leaves, causal=True)[0].backward(dout)
    for t, r in zip((q, k, v), leaves):
        assert rel_err(t.grad, r.grad) <= 1e-10


# ------------------------------------------------------------------------- the gradient of lse


@pytest.mark.parametrize("route", ["fallback", "kernel"])
@pytest.mark.parametrize("reads", ["out and lse", "lse"])
@pytest.mark.parametrize("nq,nkv", [(13, 29), (29, 13)])
@pytest.mark.parametrize("mode", MODES)
def test_lse_gradient(seed, monkeypatch, route, reads, nq, nkv, mode):
    """A loss through lse (and out) gives the float64 gradients dS = P (dP - Delta + dlse)
    (Note [The gradient of lse]) on both routes; Nq > Nkv bottom-right has rows without keys
    (their lse -inf, read as 0 by the loss). A loss that reads lse alone gives v no gradient."""
    if route == "kernel":
        fake_kernels.install(monkeypatch)
    q, k, v = qkv(hq=6, hkv=2, nq=nq, nkv=nkv, dv=24, grad=True)
    out, lse, causal, offset = call(q, k, v, mode)
    assert lse.requires_grad
    dlse = torch.randn_like(lse)
    loss = (lse.masked_fill(torch.isneginf(lse), 0.0) * dlse).sum()
    dout = torch.randn_like(out) if reads != "lse" else torch.zeros_like(out)
    if reads != "lse":
        loss = loss + (out * dout).sum()
    loss.backward()
    want = attention_grads(q, k, v, dout, causal=causal, causal_offset=offset, dlse=dlse)
    for name, t, w in zip("qk", (q, k), want):
        assert rel_err(t.grad, w) <= 1e-10, name
    if reads == "lse":
        assert v.grad is None or not v.grad.any()
    else:
        assert rel_err(v.grad, want[2]) <= 1e-10


@pytest.mark.parametrize("route", ["fallback", "kernel"])
def test_merged_splits_give_the_full_gradient(seed, monkeypatch, route):
    """Split-KV through `attention(return_lse=True)` and `merge_attention`: the gradients of a
    loss on the merged out equal those of attention over all keys (the lse terms carry each
    part's share of the normaliser)."""
    if route == "kernel":
        fake_kernels.install(monkeypatch)
    q, k, v = qkv(hq=6, hkv=2, nq=13, nkv=29, dv=24, grad=True)
    outs, lses = [], []
    for a, b in splits(29, 3):
        o, s = attention(q, k[..., a:b, :], v[..., a:b, :], enable_gqa=True, return_lse=True)
        outs.append(o)
        lses.append(s)
    out, _ = merge_attention(outs, lses)
    dout = torch.randn_like(out)
    out.backward(dout)
    for name, t, w in zip("qkv", (q, k, v), attention_grads(q, k, v, dout)):
        assert rel_err(t.grad, w) <= 1e-10, name


@pytest.mark.parametrize("route", ["fallback", "kernel"])
def test_lse_gradient_window_sinks(seed, monkeypatch, route):
    """The window and sinks route (math_attention; the fake kernels' FeatureAttention): the
    lse term reaches q, k and the sinks (-sum_i exp(sink - lse_i) (Delta_i - dlse_i))."""
    if route == "kernel":
        fake_kernels.install(monkeypatch)
    q, k, v = qkv(hq=4, hkv=2, nq=13, nkv=29, dv=24, grad=True)
    sinks = torch.randn(4, dtype=F64, requires_grad=True)
    out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, window=(5, None),
                         sinks=sinks, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v, sinks))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    ref, ref_lse = attention_ref(*leaves[:3], causal=True, causal_offset=16, window_lo=11,
                                 sinks=leaves[3])  # every row sees a key: no NaN in autograd
    want = torch.autograd.grad((ref * dout).sum() + (ref_lse * dlse).sum(), leaves)
    for name, g, w in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert rel_err(g, w) <= 1e-10, name


@pytest.mark.parametrize("reads", ["out and lse", "lse"])
def test_lse_gradient_sdpa_recompute(seed, monkeypatch, reads):
    """The kernel forward with no backward kernel for the problem: the SDPA recompute for out,
    the lse term in torch math (`math_lse_grads`)."""
    from ffpa_cute import ops

    fake = fake_kernels.install(monkeypatch)
    monkeypatch.setattr(ops, "bwd_plan", lambda *args, **kwargs: None)
    q, k, v = qkv(hq=6, hkv=2, nq=13, nkv=29, dv=24, grad=True)
    out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
    dlse = torch.randn_like(lse)
    dout = torch.randn_like(out) if reads != "lse" else torch.zeros_like(out)
    loss = (lse * dlse).sum() + ((out * dout).sum() if reads != "lse" else 0)
    loss.backward()
    assert len(fake.fwd_calls) == 1 and not fake.bwd_calls
    want = attention_grads(q, k, v, dout, causal=True, dlse=dlse)
    for name, t, w in zip("qk", (q, k), want):
        assert rel_err(t.grad, w) <= 1e-10, name
    if reads == "lse":
        assert v.grad is None
    else:
        assert rel_err(v.grad, want[2]) <= 1e-10


def test_grad_jobs_subtract_dlse_between_delta_and_the_gradient_kernels(monkeypatch):
    """`launch.run_grad_jobs`: the gradient kernels (and a sink's gradient after them) read
    Delta - dlse; Delta's own job writes Delta."""
    from types import SimpleNamespace

    from ffpa_cute import launch
    from ffpa_cute.common.config import DeltaConfig

    seen = []

    def job(cls, cfg, t, scalars):
        if isinstance(cfg, DeltaConfig):
            t["delta"].fill_(1.0)
        else:
            seen.append(t["delta"].clone())

    monkeypatch.setattr(launch, "run_grad_job", job)
    plan = SimpleNamespace(jobs=[(None, DeltaConfig("sm_90a", "bf16", 64)), (None, "dq"),
                                 (None, "dk")])
    t, dlse = {"delta": torch.empty(1, 2, 3)}, torch.randn(1, 2, 3)
    launch.run_grad_jobs(plan, t, {}, dlse)
    assert len(seen) == 2 and all(torch.equal(s, 1.0 - dlse) for s in seen)
    assert torch.equal(t["delta"], 1.0 - dlse)
    launch.run_grad_jobs(plan, t, {})  # no dlse: Delta as written
    assert torch.equal(seen[-1], torch.ones(1, 2, 3))


def test_lse_gradient_float_mask_refused(seed):
    """A float mask that requires grad cannot take lse's gradient on the fallback: refused by
    name, not dropped."""
    q, k, v = qkv(grad=True)
    mask = torch.randn(7, 29, dtype=F64, requires_grad=True)
    with pytest.raises(NotImplementedError, match="attn_mask.*requires grad.*lse"):
        attention(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True)
    out, lse = attention(q, k, v, attn_mask=mask.detach(), enable_gqa=True, return_lse=True)
    assert lse.requires_grad


# --------------------------------------------------------------------- return_lse, kernel route


@pytest.mark.parametrize("nq,nkv", [(7, 29), (29, 7), (13, 13)])
@pytest.mark.parametrize("mode", MODES)
def test_kernel_route_lse(seed, monkeypatch, nq, nkv, mode):
    fake = fake_kernels.install(monkeypatch)
    q, k, v = qkv(hq=6, hkv=2, nq=nq, nkv=nkv, dv=24)
    out, lse, causal, offset = call(q, k, v, mode)
    assert len(fake.fwd_calls) == 1 and fake.fwd_calls[0].causal_offset == (
        offset if causal else 0)
    check_lse(out, lse, q, k, v, causal, offset, 1e-12)
    q3, k3, v3 = q[0], k[0], v[0]  # 3-D: the op sees [1, H, N, D], lse comes back [H, N]
    out3, lse3 = attention(q3, k3, v3, enable_gqa=True, return_lse=True)
    check_lse(out3, lse3, q3, k3, v3, False, None, 1e-12)


def test_fast_path_keeps_return_lse_calls_apart(seed, monkeypatch):
    """The per-signature memory keys on return_lse: each kind of call keeps its own entry and
    its own return type, however the calls interleave."""
    fake = fake_kernels.install(monkeypatch)
    q, k, v = qkv(nq=13, nkv=29)
    ref, ref_lse = attention_ref(q, k, v, causal=True)
    for _ in range(2):
        out = attention(q, k, v, is_causal=True, enable_gqa=True)
        assert isinstance(out, torch.Tensor) and rel_err(out, ref) <= 1e-12
        out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
        assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12
    assert len(interface._FAST_CALLS) == 2 and len(fake.fwd_calls) == 4
    flags = {key[-2] for key in interface._FAST_CALLS}
    assert flags == {False, True}
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))  # fast path + grad
    out, lse = attention(qg, kg, vg, is_causal=True, enable_gqa=True, return_lse=True)
    assert out.grad_fn is not None and lse.grad_fn is not None
    with pytest.raises(TypeError, match="return_lse"):  # not a bool: never the fast path
        attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=None)


# ---------------------------------------------------------------------------------- merge


def splits(n, parts):
    """Key ranges cutting n into `parts` uneven pieces."""
    cuts = [0, *sorted({max(1, min(n - 1, round(n * (i + 0.37) / parts)))
                        for i in range(parts - 1)}), n]
    return list(zip(cuts[:-1], cuts[1:]))


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nq,nkv,hkv", [(13, 29, 2), (29, 13, 4), (17, 17, 1)])
def test_merge_of_key_splits_is_attention(seed, parts, mode, nq, nkv, hkv):
    """Split the keys, attend to each part (block_forward with the part's causal offset: the
    fallback), merge: equals attention over all keys (out and lse)."""
    q, k, v = qkv(hkv=hkv, nq=nq, nkv=nkv, dv=24)
    causal = mode != "none"
    offset = nkv - nq if mode == "bottom_right" else 0
    outs, lses = [], []
    for a, b in splits(nkv, parts):
        o, s = block_forward(q, k[..., a:b, :], v[..., a:b, :], causal=causal,
                             offset=offset - a, scale=None)
        outs.append(o)
        lses.append(s)
    out, lse = merge_attention(outs, lses)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, causal_offset=offset)
    assert out.dtype == F64 and lse.dtype == F64
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12
    if not causal:  # the public API gives the same parts
        pub = [attention(q, k[..., a:b, :], v[..., a:b, :], enable_gqa=hkv != 4,
                         return_lse=True) for a, b in splits(nkv, parts)]
        out2, lse2 = merge_attention([p[0] for p in pub], [p[1] for p in pub])
        assert rel_err(out2, ref) <= 1e-12 and rel_err(lse2, ref_lse) <= 1e-12


@pytest.mark.parametrize("parts,causal", [(2, False), (3, False), (3, True)])
def test_merge_gradients_match_unsplit(seed, parts, causal):
    """Autograd through merge_attention of differentiable parts (the float64 reference per key
    split, out and lse) equals autograd of the reference over all keys, for a loss on out and
    lse. Causal: bottom-right with Nq < every split, so every part row sees a key (the
    reference's own autograd is NaN on rows without keys)."""
    q, k, v = qkv(hq=4, hkv=2, nq=5, nkv=31, dv=24, grad=True)
    g_out, g_lse = torch.randn(2, 4, 5, 24, dtype=F64), torch.randn(2, 4, 5, dtype=F64)
    offset = 31 - 5
    outs, lses = [], []
    for a, b in splits(31, parts):
        o, s = attention_ref(q, k[..., a:b, :], v[..., a:b, :], causal=causal,
                             causal_offset=offset - a)
        outs.append(o)
        lses.append(s)
    out, lse = merge_attention(outs, lses)
    got = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), (q, k, v))
    ref, ref_lse = attention_ref(q, k, v, causal=causal, causal_offset=offset)
    want = torch.autograd.grad((ref * g_out).sum() + (ref_lse * g_lse).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-12


def test_merge_with_empty_parts(seed):
    """A part whose lse is -inf everywhere contributes nothing (whatever its out holds); rows
    that are -inf in every part give out 0 and lse -inf; no NaN, in values or gradients."""
    q, k, v = qkv(nq=7, nkv=29)
    o1, s1 = block_forward(q, k, v, causal=False, offset=0, scale=None)
    junk = torch.randn_like(o1)
    empty = torch.full_like(s1, float("-inf"))
    out, lse = merge_attention([junk, o1, junk], [empty, s1, empty])
    assert rel_err(out, o1) <= 1e-15 and torch.equal(lse, s1)
    outs = [torch.randn(2, 3, 5, 8, dtype=F64, requires_grad=True) for _ in range(3)]
    lses = [torch.full((2, 3, 5), float("-inf"), dtype=F64).requires_grad_() for _ in range(3)]
    with torch.no_grad():
        lses[1][:, :, 2:] = torch.randn(2, 3, 3, dtype=F64)  # rows 0, 1 empty everywhere
    out, lse = merge_attention(outs, lses)
    assert (out[..., :2, :] == 0).all() and torch.isneginf(lse[..., :2]).all()
    assert rel_err(out[..., 2:, :], outs[1][..., 2:, :]) <= 1e-15
    grads = torch.autograd.grad(out.sum() + lse[..., 2:].sum(), outs + lses)
    assert all(torch.isfinite(g).all() for g in grads)


def test_merge_dtypes(seed):
    q, k, v = qkv(hkv=4, nq=7, nkv=20, dtype=torch.bfloat16)
    parts = [block_forward(q, k[..., a:b, :], v[..., a:b, :], causal=False, offset=0,
                           scale=None) for a, b in splits(20, 2)]
    out, lse = merge_attention([p[0] for p in parts], [p[1] for p in parts])
    assert out.dtype == torch.bfloat16 and lse.dtype == F32
    ref, ref_lse = attention_ref(q, k, v)
    assert rel_err(out, ref) <= 1e-2 and rel_err(lse, ref_lse) <= 1e-5


@pytest.mark.parametrize("outs,lses,exc,pattern", [
    ([], [], ValueError, r"same number \(>= 1\) of parts"),
    ([torch.zeros(2, 3, 4)], [torch.zeros(2, 3), torch.zeros(2, 3)], ValueError, "same number"),
    (torch.zeros(2, 3, 4), [torch.zeros(2, 3)], TypeError, "lists or tuples"),
    ([torch.zeros(2, 3, 4), torch.zeros(2, 3, 5)], [torch.zeros(2, 3)] * 2, ValueError,
     r"outs\[1\] has shape \(2, 3, 5\)"),
    ([torch.zeros(2, 3, 4)], [torch.zeros(2, 4)], ValueError, r"lses\[0\] has shape \(2, 4\)"),
    ([torch.zeros(2, 3, 4)], [torch.zeros(2, 3, dtype=torch.long)], TypeError,
     r"lses\[0\] must be a floating"),
    ([torch.zeros(2, 3, 4), torch.zeros(2, 3, 4, device="meta")], [torch.zeros(2, 3)] * 2,
     ValueError, "one device"),
])
def test_merge_errors_name_the_argument(outs, lses, exc, pattern):
    with pytest.raises(exc, match=pattern):
        merge_attention(outs, lses)


# ------------------------------------------------------------------------------ blockwise


@pytest.mark.parametrize("route", ["fallback", "kernel"])
@pytest.mark.parametrize("offset", [-3, 0, 5, 40])
def test_block_backward_with_global_lse(seed, monkeypatch, route, offset):
    """Gradients of a split attention from per-block gradients given the global out and lse
    (the ring backward's building block) equal the unsplit reference's."""
    fake = fake_kernels.install(monkeypatch) if route == "kernel" else None
    q, k, v = qkv(hq=4, hkv=2, nq=11, nkv=23, dv=24)
    dout = torch.randn(2, 4, 11, 24, dtype=F64)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True, causal_offset=offset)
    want = attention_grads(q, k, v, dout, True, offset)
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for a, b in splits(23, 3):
        g = block_backward(q, k[..., a:b, :], v[..., a:b, :], ref_out, ref_lse, dout,
                           causal=True, offset=offset - a, scale=None)
        dq += g[0]
        dk[..., a:b, :] += g[1]
        dv[..., a:b, :] += g[2]
    for g, w in zip((dq, dk, dv), want):
        assert rel_err(g, w) <= 1e-12
    if fake is not None:
        assert [p.causal_offset for p in fake.bwd_calls] == [offset - a for a, _ in
                                                            splits(23, 3)]


@pytest.mark.parametrize("route", ["fallback", "kernel"])
def test_torch_compile_return_lse(seed, monkeypatch, route):
    """return_lse under torch.compile(fullgraph=True): the same (out, lse) and gradients as
    eager (the kernel route goes through the custom op, the fallback is traced)."""
    if route == "kernel":
        fake_kernels.install(monkeypatch)
    torch._dynamo.reset()

    def fn(q, k, v):
        out, lse = attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
        return out.square().sum() + lse.sum(), lse

    q, k, v = qkv(nq=7, nkv=29, dtype=F32, grad=True)
    loss, lse = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    loss.backward()
    got = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    ref_loss, ref_lse = fn(q, k, v)
    ref_loss.backward()
    assert rel_err(loss, ref_loss) <= 1e-6 and rel_err(lse, ref_lse) <= 1e-6
    for g, t in zip(got, (q, k, v)):
        assert rel_err(g, t.grad) <= 1e-6
