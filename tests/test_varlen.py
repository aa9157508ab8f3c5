"""`varlen_attention` on the CPU: packed [total, H, D] sequences with cu_seqlens, against the
float64 reference of `masked_ref` applied sequence by sequence (causal bottom-right per
sequence, window, sinks); forward, lse [Hq, total_q] and gradients (sinks included), empty
sequences, odd lengths, GQA; the fake kernel route (one "kernel" call per sequence; a window
never reaches it); the argument errors.
"""

import pytest
import torch

import fake_kernels  # tests/ is on sys.path
from ffpa_cute import varlen_attention
from masked_ref import bound, ref_attention, rel_err

F64 = torch.float64
# (query lengths, key lengths) per sequence: odd, empty on either side or both, Nq > Nkv
LENGTHS = [([5, 0, 13, 1, 0, 9], [7, 4, 13, 17, 0, 3]), ([1, 1, 1], [19, 0, 6]), ([11], [11])]


def cu(lengths, dtype=torch.int32):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def packed(lq, lk, hq=6, hkv=2, d=16, dv=24, dtype=F64, grad=False):
    def r(*s):
        return torch.randn(*s, dtype=dtype).requires_grad_(grad)
    return r(sum(lq), hq, d), r(sum(lk), hkv, d), r(sum(lk), hkv, dv)


def ref_varlen(q, k, v, lq, lk, dtype=F64, **kw):
    """(out [total_q, Hq, Dv], lse [Hq, total_q]): the reference per sequence."""
    outs, lses = [], []
    cq, ck = cu(lq).tolist(), cu(lk).tolist()
    for b in range(len(lq)):
        qs, ks, vs = (t[a:e].transpose(0, 1) for t, a, e in (
            (q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]), (v, ck[b], ck[b + 1])))
        o, s = ref_attention(qs, ks, vs, dtype=dtype, **kw)
        outs.append(o.transpose(0, 1))
        lses.append(s)
    return torch.cat(outs), torch.cat(lses, dim=-1)


def run(q, k, v, lq, lk, cu_dtype=torch.int32, **kw):
    return varlen_attention(q, k, v, cu(lq, cu_dtype), cu(lk, cu_dtype), max(lq), max(lk),
                            enable_gqa=q.shape[1] != k.shape[1], **kw)


@pytest.mark.parametrize("lq,lk", LENGTHS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (3, 0), (2, None), (4, 5)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_matches_reference(seed, lq, lk, causal, window, with_sinks):
    q, k, v = packed(lq, lk)
    sinks = torch.randn(6, dtype=F64) if with_sinks else None
    out, lse = run(q, k, v, lq, lk, is_causal=causal, window=window, sinks=sinks,
                   return_lse=True)
    ref, ref_lse = ref_varlen(q, k, v, lq, lk, causal=causal, window=window, sinks=sinks)
    assert out.shape == (sum(lq), 6, 24) and lse.shape == (6, sum(lq)) and lse.dtype == F64
    assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12
    assert torch.equal(out, run(q, k, v, lq, lk, is_causal=causal, window=window, sinks=sinks))


def test_empty_sequences(seed):
    """Sequences without keys: out rows 0, lse -inf (the sink with sinks); sequences without
    queries contribute no rows; int64 cu_seqlens and a generous max_seqlen work too."""
    lq, lk = [3, 0, 4], [0, 5, 6]
    q, k, v = packed(lq, lk, hq=4, hkv=4)
    out, lse = varlen_attention(q, k, v, cu(lq, torch.int64), cu(lk, torch.int64), 100, 100,
                                return_lse=True)
    assert (out[:3] == 0).all() and torch.isneginf(lse[:, :3]).all()
    assert torch.isfinite(lse[:, 3:]).all()
    sinks = torch.randn(4, dtype=F64)
    out, lse = run(q, k, v, lq, lk, sinks=sinks, return_lse=True)
    assert (out[:3] == 0).all() and torch.equal(lse[:, :3], sinks[:, None].expand(4, 3))
    out, lse = run(q[:0], k, v, [0, 0, 0], lk, return_lse=True)
    assert out.shape == (0, 4, 24) and lse.shape == (4, 0)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 1)])
def test_gradients_float64(seed, hq, hkv):
    """varlen + causal + GQA + window + sinks + return_lse: dq, dk, dv, d sinks of a loss
    through out and lse against float64 autograd of the per-sequence reference."""
    lq, lk = LENGTHS[0]
    q, k, v = packed(lq, lk, hq=hq, hkv=hkv, grad=True)
    sinks = torch.randn(hq, dtype=F64, requires_grad=True)
    dout = torch.randn(sum(lq), hq, 24, dtype=F64)
    dlse = torch.randn(hq, sum(lq), dtype=F64)
    kw = dict(causal=True, window=(4, 1), sinks=sinks)
    out, lse = run(q, k, v, lq, lk, is_causal=True, window=(4, 1), sinks=sinks, return_lse=True)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (q, k, v, sinks))
    ref, ref_lse = ref_varlen(q, k, v, lq, lk, **kw)
    want = torch.autograd.grad((ref * dout).sum() + (ref_lse * dlse).sum(), (q, k, v, sinks))
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-12


@pytest.mark.parametrize("with_window", [False, True])
def test_bf16_within_the_bound(seed, with_window):
    """bf16 out, lse and gradients within 2x torch's same-dtype error + 1e-3 of float64 (the
    plain causal case runs native SDPA per sequence, the window case the torch math)."""
    lq, lk = [17, 0, 29], [31, 5, 23]
    q, k, v = packed(lq, lk, hq=8, hkv=2, d=32, dv=32, dtype=torch.bfloat16, grad=True)
    sinks = torch.randn(8, requires_grad=True) if with_window else None
    window = (9, 0) if with_window else None
    leaves = (q, k, v) + ((sinks,) if with_window else ())
    dout = torch.randn(sum(lq), 8, 32, dtype=torch.bfloat16)
    kw = dict(causal=True, window=window, sinks=sinks)
    out, lse = run(q, k, v, lq, lk, is_causal=True, window=window, sinks=sinks,
                   return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    got = torch.autograd.grad(out, leaves, dout)
    truth, truth_lse = ref_varlen(q, k, v, lq, lk, **kw)
    want = torch.autograd.grad(truth, leaves, dout.double())
    same, same_lse = ref_varlen(q, k, v, lq, lk, dtype=torch.bfloat16, **kw)
    base = torch.autograd.grad(same, leaves, dout)
    assert rel_err(out, truth) <= bound(rel_err(same, truth))
    assert rel_err(lse, truth_lse) <= bound(rel_err(same_lse, truth_lse))
    for g, w, b in zip(got, want, base):
        assert rel_err(g, w) <= bound(rel_err(b, w))


def test_fake_kernel_route(seed, monkeypatch):
    """Each sequence routes like attention(): with a planner that serves everything, one
    kernel call per sequence that has queries and keys (bottom-right offset each, the most work
    first), with a
    window too (the sm90 kernels have it): strict mode runs it."""
    fake = fake_kernels.install(monkeypatch)
    lq, lk = LENGTHS[0]
    q, k, v = packed(lq, lk, grad=True)
    out = run(q, k, v, lq, lk, is_causal=True)
    calls = [(p.seqlen_q, p.seqlen_kv, p.causal_offset) for p in fake.fwd_calls]
    assert sorted(calls) == sorted((a, b, b - a) for a, b in zip(lq, lk) if a and b)
    work = [a * b for a, b, _ in calls]
    assert work == sorted(work, reverse=True)  # issued most work first
    assert rel_err(out, ref_varlen(q, k, v, lq, lk, causal=True)[0]) <= 1e-12
    out.sum().backward()  # through the fake backward kernels
    assert len(fake.bwd_calls) == len(fake.fwd_calls)
    calls = len(fake.fwd_calls)
    out = run(q, k, v, lq, lk, is_causal=True, window=(3, 0), strict=True)
    assert len(fake.fwd_calls) == 2 * calls and fake.fwd_calls[-1].window_lo is not None
    assert rel_err(out, ref_varlen(q, k, v, lq, lk, causal=True, window=(3, 0))[0]) <= 1e-12


Q, K = torch.randn(9, 4, 16), torch.randn(12, 4, 16)
CQ, CK = cu([4, 5]), cu([5, 7])


@pytest.mark.parametrize("args,kw,exc,pattern", [
    ((Q[None], K, K, CQ, CK, 5, 7), {}, ValueError, r"^q must be packed \[total_tokens"),
    ((Q, K, K[:, :2], CQ, CK, 5, 7), {}, ValueError, r"^k and v must agree on total_k"),
    ((Q, K[:, :2], K[:, :2], CQ, CK, 5, 7), {}, ValueError, r"enable_gqa=True"),
    ((Q, K.double(), K, CQ, CK, 5, 7), {}, TypeError, r"share one dtype"),
    ((Q, K, K, CQ.float(), CK, 5, 7), {}, TypeError, r"^cu_seqlens_q must be an int32 or int64"),
    ((Q, K, K, [0, 4, 9], CK, 5, 7), {}, TypeError, r"^cu_seqlens_q must be an int32"),
    ((Q, K, K, CQ[None], CK, 5, 7), {}, ValueError, r"^cu_seqlens_q must be 1-D"),
    ((Q, K, K, CQ + 1, CK, 5, 7), {}, ValueError, r"^cu_seqlens_q\[0\] must be 0"),
    ((Q, K, K, torch.tensor([0, 6, 4, 9], dtype=torch.int32), cu([5, 7, 0]), 6, 7), {},
     ValueError, r"^cu_seqlens_q must be non-decreasing: cu_seqlens_q\[2\] = 4 < "),
    ((Q, K, K, cu([4, 4]), CK, 5, 7), {}, ValueError,
     r"^cu_seqlens_q\[-1\] = 8 must equal the packed length 9"),
    ((Q, K, K, CQ, cu([5]), 5, 7), {}, ValueError, r"^cu_seqlens_k\[-1\] = 5 must equal"),
    ((Q, K, K, CQ, cu([5, 7, 0]), 5, 7), {}, ValueError, r"same number of sequences, got 2 and 3"),
    ((Q, K, K, CQ, CK, 4, 7), {}, ValueError, r"^max_seqlen_q=4 is below the longest"),
    ((Q, K, K, CQ, CK, 5, 6), {}, ValueError, r"^max_seqlen_k=6 is below the longest"),
    ((Q, K, K, CQ, CK, 5.0, 7), {}, TypeError, r"^max_seqlen_q must be a Python int"),
    ((Q, K, K, CQ, CK, True, 7), {}, TypeError, r"^max_seqlen_q must be a Python int"),
    ((Q, K, K, CQ.to("meta"), CK, 5, 7), {}, ValueError, r"^cu_seqlens_q must be on the CPU"),
    ((Q, K, K, CQ, CK, 5, 7), {"is_causal": 1}, TypeError, r"^is_causal must be a bool"),
    ((Q, K, K, CQ, CK, 5, 7), {"window": (1, -2)}, ValueError, r"^window right=-2"),
    ((Q, K, K, CQ, CK, 5, 7), {"sinks": torch.ones(3)}, ValueError, r"^sinks must have shape"),
    ((Q, K, K, CQ, CK, 5, 7), {"return_lse": 1}, TypeError, r"^return_lse must be a bool"),
])
def test_errors_name_the_argument(args, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        varlen_attention(*args, **kw)


# ------------------------------------------------------------- jagged NestedTensor input


def jagged(values, lengths):
    """[B, H, j, D] NestedTensor (SDPA's NJT layout) on packed [total, H, D] values."""
    return torch.nested.nested_tensor_from_jagged(values, cu(lengths, torch.int64)).transpose(1, 2)


@pytest.mark.parametrize("causal,window,with_sinks", [(False, None, False), (True, (3, 1), True)])
def test_nested_tensor_input(seed, causal, window, with_sinks):
    """attention() on jagged NestedTensors equals varlen on the same values (odd and empty
    sequences, GQA): out and lse share q's ragged dim, and gradients reach the values."""
    from ffpa_cute import attention

    lq, lk = [5, 0, 13, 2], [7, 4, 13, 0]
    q, k, v = packed(lq, lk, dv=16, grad=True)
    sinks = torch.randn(6, dtype=F64, requires_grad=True) if with_sinks else None
    qn, kn, vn = jagged(q, lq), jagged(k, lk), jagged(v, lk)
    out, lse = attention(qn, kn, vn, is_causal=causal, enable_gqa=True, window=window,
                         sinks=sinks, return_lse=True)
    assert out.is_nested and out.shape[2] == qn.shape[2] and (out + qn).shape == qn.shape
    assert lse.is_nested and lse.dim() == 3 and lse.shape[1] == 6
    kw = dict(causal=causal, window=window, sinks=sinks)
    ref, ref_lse = ref_varlen(q, k, v, lq, lk, **kw)
    assert rel_err(out.transpose(1, 2).values(), ref) <= 1e-12
    assert rel_err(lse.transpose(1, 2).values().transpose(0, 1), ref_lse) <= 1e-12
    dout = torch.randn(sum(lq), 6, 16, dtype=F64)
    leaves = (q, k, v) + ((sinks,) if with_sinks else ())
    got = torch.autograd.grad(out.transpose(1, 2).values(), leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-12


def test_nested_tensor_routes(seed, monkeypatch):
    """Jagged inputs without dropout are one `varlen_attention` call on their values (its
    one launch where the kernels serve it); values with rows outside the sequences
    (`lengths`) take the per-sequence route, with the same result."""
    from ffpa_cute import attention, nested, varlen_attention

    calls = []
    monkeypatch.setitem(nested.PACKED, "varlen_attention",
                        lambda *a, **kw: calls.append(a[5:7]) or varlen_attention(*a, **kw))
    lq, lk = [5, 0, 13, 2], [7, 4, 13, 0]
    q, k, v = packed(lq, lk, dv=16)
    ref, _ = ref_varlen(q, k, v, lq, lk, causal=True)
    out = attention(jagged(q, lq), jagged(k, lk), jagged(v, lk), is_causal=True, enable_gqa=True)
    assert calls == [(13, 13)] and rel_err(out.transpose(1, 2).values(), ref) <= 1e-12
    # the same sequences inside larger buffers (`lengths`: rows before and after them)
    def inside(t, lengths, before):
        buf = torch.cat([torch.randn(before, *t.shape[1:], dtype=F64), t,
                         torch.randn(4, *t.shape[1:], dtype=F64)])
        return torch.nested.nested_tensor_from_jagged(
            buf, cu(lengths, torch.int64) + before, lengths=torch.tensor(lengths)).transpose(1, 2)

    for args in ((inside(q, lq, 3), jagged(k, lk), jagged(v, lk)),
                 (jagged(q, lq), inside(k, lk, 2), inside(v, lk, 2))):
        calls.clear()
        out = attention(*args, is_causal=True, enable_gqa=True)
        assert calls == []  # the per-sequence route
        assert rel_err(torch.cat([o.transpose(0, 1) for o in out.unbind()]), ref) <= 1e-12
    calls.clear()
    out = attention(jagged(q, lq), jagged(k, lk), jagged(v, lk), dropout_p=0.5, enable_gqa=True)
    assert calls == [] and out.is_nested  # dropout: per sequence (varlen has none)


def test_nested_tensor_under_torch_compile(seed):
    """Jagged inputs under torch.compile: the offsets are read on the host (a graph break),
    then the varlen op; the same result as eager."""
    from ffpa_cute import attention

    lq, lk = [5, 0, 13, 2], [7, 4, 13, 0]
    q, k, v = packed(lq, lk, dv=16)

    def f(a, b, c):
        return attention(a, b, c, is_causal=True, enable_gqa=True)

    want = f(jagged(q, lq), jagged(k, lk), jagged(v, lk))
    got = torch.compile(f, backend="aot_eager")(jagged(q, lq), jagged(k, lk), jagged(v, lk))
    assert torch.equal(got.values(), want.values())


def test_nested_tensor_errors(seed):
    from ffpa_cute import attention

    q, k, v = packed([3, 4], [5, 2], hq=2, hkv=2)
    qn, kn, vn = jagged(q, [3, 4]), jagged(k, [5, 2]), jagged(v, [5, 2])
    with pytest.raises(TypeError, match=r"^q, k, v must all be jagged NestedTensors .* k has"):
        attention(qn, torch.randn(2, 2, 5, 16, dtype=F64), vn)
    with pytest.raises(TypeError, match=r"q has"):
        attention(qn.transpose(1, 2), kn, vn)  # [B, j, H, D]: the ragged dim in the wrong place
    with pytest.raises(ValueError, match=r"^attn_mask is not supported with NestedTensor"):
        attention(qn, kn, vn, attn_mask=torch.ones(3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"same number of sequences, got 2, 1, 2"):
        attention(qn, jagged(k[:5], [5]), vn)


@pytest.mark.parametrize("causal,window,with_sinks", [(True, None, False), (True, (3, 1), True),
                                                      (False, (None, 2), False)])
def test_varlen_under_torch_compile(seed, causal, window, with_sinks):
    """Under torch.compile (fullgraph) varlen_attention is one op with cu_seqlens as tensors:
    out, lse and every gradient (sinks' included, lse's gradient read) as eager, and one
    graph for two packings of the same tokens (no host read of cu_seqlens, no specialising on
    the lengths); bad cu_seqlens still raise, at run time."""
    from ffpa_cute import varlen_attention

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)

    def f(q, k, v, cq, ck, sinks):
        return varlen_attention(q, k, v, cq, ck, 13, 13, is_causal=causal, enable_gqa=True,
                                window=window, sinks=sinks, return_lse=True)

    compiled = torch.compile(f, fullgraph=True, backend=backend)
    torch._dynamo.reset()
    lk = [7, 4, 13, 0, 3]
    q, k, v = packed([5, 0, 13, 2, 9], lk, grad=True)
    sinks = torch.randn(6, dtype=F64, requires_grad=True) if with_sinks else None
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    for lq in ([5, 0, 13, 2, 9], [1, 12, 5, 2, 9]):
        res = []
        for fn in (f, compiled):
            out, lse = fn(q, k, v, cu(lq), cu(lk), sinks)
            w = torch.linspace(-1, 1, out.numel(), dtype=F64).view_as(out)
            loss = (out * w).sum() + 0.3 * lse.masked_fill(torch.isinf(lse), 0).sum()
            res.append((out, lse, *torch.autograd.grad(loss, leaves)))
        for a, b in zip(*res):
            assert torch.equal(torch.isinf(a), torch.isinf(b))
            assert rel_err(a.masked_fill(torch.isinf(a), 0), b.masked_fill(torch.isinf(b), 0)) \
                <= 1e-12
    assert len(graphs) == 1
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[0\] must be 0"):
        compiled(q, k, v, cu([5, 0, 13, 2, 9]).flip(0), cu(lk), sinks)


def test_bounds_are_read_once_per_tensor_and_version(monkeypatch):
    """cu_seqlens are read (a device sync on CUDA) once per tensor: passed again unchanged they
    reuse the bounds; an in-place write (a new version) or another tensor reads again, and a
    bad tensor still raises every time."""
    from ffpa_cute import varlen

    reads = []
    real = varlen._read_bounds
    monkeypatch.setattr(varlen, "_read_bounds", lambda *a: reads.append(a[1]) or real(*a))
    varlen._BOUNDS.clear()
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    dev = torch.device("cpu")
    for _ in range(3):
        assert varlen.sequence_bounds("cu", cu, 7, "m", 4, dev) == ((0, 3), (3, 7))
    assert len(reads) == 1
    cu[1] = 2  # in place: a new version
    assert varlen.sequence_bounds("cu", cu, 7, "m", 5, dev) == ((0, 2), (2, 7))
    assert len(reads) == 2
    other = torch.tensor([0, 3, 7], dtype=torch.int32)
    varlen.sequence_bounds("cu", other, 7, "m", 4, dev)
    assert len(reads) == 3
    bad = torch.tensor([0, 5, 3], dtype=torch.int32)
    for _ in range(2):
        with pytest.raises(ValueError, match="non-decreasing"):
            varlen.sequence_bounds("cu", bad, 3, "m", 5, dev)
    with torch.inference_mode():   # no version counter: read at every call, never cached
        frozen = torch.tensor([0, 3, 7], dtype=torch.int32)
    reads.clear()
    for _ in range(2):
        assert varlen.sequence_bounds("cu", frozen, 7, "m", 4, dev) == ((0, 3), (3, 7))
    hit = varlen._BOUNDS.get(id(frozen))   # (an id freed earlier may be reused)
    assert len(reads) == 2 and (hit is None or hit[0]() is not frozen)


@pytest.mark.parametrize("causal,window,sinks", [(True, False, False), (True, True, True),
                                                 (False, False, True)])
@pytest.mark.parametrize("wrong", [False, True])
def test_one_launch_canary_catches_a_frame_off(monkeypatch, causal, window, sinks, wrong):
    """The self-check canary of a one-launch varlen configuration never run on its target
    (sm100): two packed sequences through the "kernel" at once against float32 per sequence.
    A stand-in kernel honouring the launch contract (each sequence's bottom-right frame added
    to the runtime causal offset and window edge) passes; one that drops the frame fails."""
    import dataclasses

    from ffpa_cute import dispatch, launch, varlen
    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.reference import attention_ref

    p = AttnProblem(dtype="bf16", batch=2, heads_q=4, heads_kv=2, seqlen_q=131, seqlen_kv=200,
                    head_dim=512, head_dim_v=512, causal=causal, varlen=True,
                    window_lo=-40 if window else None, has_sinks=sinks)
    plan = dispatch.plan_fwd(p, target="sm_100a")
    assert plan.reason is None and plan.cfg.varlen

    def kernel(cls, cfg, t, s):   # [1, H, total, D] views; cu_q / cu_k int32
        cq, ck = t["cu_q"].tolist(), t["cu_k"].tolist()
        for b in range(len(cq) - 1):
            frame = 0 if wrong else (ck[b + 1] - ck[b]) - (cq[b + 1] - cq[b])
            qs = t["q"][:, :, cq[b]:cq[b + 1]]
            ks, vs = (t[n][:, :, ck[b]:ck[b + 1]] for n in ("k", "v"))
            out, lse = attention_ref(
                qs, ks, vs, causal=cfg.causal, causal_offset=s["causal_offset"] + frame,
                scale=s["softmax_scale"], upcast=torch.float32, sinks=t["sinks"],
                window_lo=s["window_lo"] + frame if cfg.window else None)
            t["o"][:, :, cq[b]:cq[b + 1]] = out.to(t["o"].dtype)
            t["lse"][:, :, cq[b]:cq[b + 1]] = lse

    monkeypatch.setattr(launch, "run_job", kernel)
    cplan = dispatch.plan_fwd(dataclasses.replace(p, batch=1), target="sm_100a")
    got = varlen.canary(plan, cplan, torch.device("cpu"))
    if wrong and not causal and not window:
        assert got is None   # no frame to drop: the same answer
    else:
        assert (got is None) == (not wrong), got


def grads_from_stats(q, k, v, do, o, lse, causal, offset, scale, lo):
    """(dq, dk, dv) [1, H, n, .] as the gradient kernels form them from the forward's out and
    lse (P = exp(S - lse), Delta = rowsum(dO * O)), in float32, dK / dV summed over each KV
    head's query heads."""
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.float().repeat_interleave(g, 1) for t in (k, v))
    s = q.float() @ kk.transpose(-1, -2) * scale
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(k.shape[2])[None, :]
    seen = (j <= i + offset) if causal else torch.ones_like(j == i)
    if lo is not None:
        seen = seen & (j >= i + lo)
    p = torch.where(seen, torch.exp(s - lse[..., None]), 0.0)
    delta = (do.float() * o.float()).sum(-1, keepdim=True)
    ds = p * (do.float() @ vv.transpose(-1, -2) - delta)
    dq = ds @ kk * scale
    dk = (ds.transpose(-1, -2) @ q.float() * scale).unflatten(1, (-1, g)).sum(2)
    dv = (p.transpose(-1, -2) @ do.float()).unflatten(1, (-1, g)).sum(2)
    return dq, dk, dv


@pytest.mark.parametrize("causal,window", [(True, False), (False, True)])
@pytest.mark.parametrize("wrong", [None, "frame", "stats"])
def test_one_launch_backward_canary(monkeypatch, causal, window, wrong):
    """The backward's canary of a one-launch varlen plan never run on its target (sm100):
    stand-in gradient kernels honouring the launch contract (each sequence's frame added to
    the runtime offsets, its rows' LSE read from the packed [Hq, total_q]) pass; ones that drop
    the frame, or read the statistics from the packed tensor's first rows, fail."""

    from ffpa_cute import dispatch, launch, varlen
    from ffpa_cute.problem import AttnProblem

    p = AttnProblem(dtype="bf16", batch=2, heads_q=4, heads_kv=2, seqlen_q=131, seqlen_kv=200,
                    head_dim=512, head_dim_v=512, causal=causal, varlen=True,
                    window_lo=-40 if window else None, requires_grad=True)
    plan = dispatch.plan_bwd(p, target="sm_100a")
    assert plan.reason is None and all(getattr(c, "varlen", True) for c in plan.cfgs)

    def kernels(plan, t, s, dlse=None):   # [1, H, total, .] views; lse [1, Hq, total_q]
        cq, ck = t["cu_q"].tolist(), t["cu_k"].tolist()
        for b in range(len(cq) - 1):
            frame = 0 if wrong == "frame" else (ck[b + 1] - ck[b]) - (cq[b + 1] - cq[b])
            rows, keys = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            stat_rows = slice(0, cq[b + 1] - cq[b]) if wrong == "stats" else rows
            q, do = t["q"][:, :, rows], t["do"][:, :, rows]
            k, v = t["k"][:, :, keys], t["v"][:, :, keys]
            lo = s["window_lo"] + frame if plan.problem.window_lo is not None else None
            grads = grads_from_stats(q, k, v, do, t["o"][:, :, rows],
                                     t["lse"][:, :, stat_rows], plan.problem.causal,
                                     s["causal_offset"] + frame, s["softmax_scale"], lo)
            for name, g, sl in zip(("dq", "dk", "dv"), grads, (rows, keys, keys)):
                t[name][:, :, sl] = g.to(t[name].dtype)

    monkeypatch.setattr(launch, "run_grad_jobs", kernels)
    plan_bwd = dispatch.plan_bwd   # the canary's plan, for sm_100a (no GPU here)
    monkeypatch.setattr(dispatch, "plan_bwd",
                        lambda p, device=None, opts=None: plan_bwd(p, target="sm_100a"))
    got = varlen.bwd_canary(plan, torch.device("cpu"))
    assert (got is None) == (wrong is None), got
