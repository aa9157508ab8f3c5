"""Dense masks on the kernel route (ffpa_cute/dense_mask.py), on the CPU with the fake
kernels: out, lse and gradients against the float64 reference with the mask, for bool and
float masks of every served form (key padding: one row of keys for all, per batch element
with equal and unequal counts, prefixes, repeated rows, expanded views; row prefixes: causal
as a tensor, Gemma's image blocks, prefix-LM, with padding, per batch element), the kernel
calls they make, the masks that keep the SDPA route, `explain`, strict mode and the per-mask
cache.
"""

import pytest
import torch

import fake_kernels  # tests/ is on sys.path
from ffpa_cute import attention, explain, dense_mask, patch_sdpa, unpatch_sdpa
from masked_ref import ref_attention, rel_err

F64 = torch.float64
B, HQ, HKV, NQ, NKV, D, DV = 3, 4, 2, 7, 13, 16, 24


def inputs(grad=True, b=B):
    def r(*s):
        return torch.randn(*s, dtype=F64).requires_grad_(grad)
    return r(b, HQ, NQ, D), r(b, HKV, NKV, D), r(b, HKV, NKV, DV)


def keep_rows(b, counts=None, seed=0):
    """A bool [b, NKV] keep pattern, scattered (not a prefix), with the given counts."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.zeros(b, NKV, dtype=torch.bool)
    for i in range(b):
        c = counts[i] if counts else 9
        rows[i, torch.randperm(NKV, generator=g)[:c]] = True
    return rows


def as_float(keep, low=-float("inf")):
    return torch.zeros(keep.shape, dtype=F64).masked_fill(~keep, low)


def prefix_rows(counts):
    return torch.arange(NKV)[None, :] < torch.tensor(counts)[:, None]


def served_masks():
    """(label, mask, its keep pattern broadcast to [B, NKV], the route)."""
    one = keep_rows(1, [8])[0]
    equal = keep_rows(B, [9, 9, 9])
    unequal = keep_rows(B, [5, 13, 1])
    hf = as_float(unequal, torch.finfo(torch.float32).min)[:, None, None, :].repeat(1, 1, NQ, 1)
    pre, pre_equal = prefix_rows([4, 13, 9]), prefix_rows([6, 6, 6])
    hf_pre = as_float(pre, torch.finfo(torch.float32).min)[:, None, None, :].repeat(1, 1, NQ, 1)
    return [
        ("[Nkv] bool", one, one.expand(B, NKV), "gather"),
        ("[1,1,1,Nkv] float -inf", as_float(one)[None, None, None], one.expand(B, NKV),
         "gather"),
        ("[B,1,1,Nkv] bool, equal counts", equal[:, None, None], equal, "gather"),
        ("[B,1,1,Nkv] bool, unequal counts", unequal[:, None, None], unequal, "rows"),
        ("[B,1,Nq,Nkv] float finfo.min, rows repeated (transformers)", hf, unequal, "rows"),
        ("[B,Hq,Nq,Nkv] expanded view, fp16 lowest", as_float(equal, -65504.0)[:, None, None]
         .expand(B, HQ, NQ, NKV), equal, "gather"),
        ("all kept", torch.ones(NKV, dtype=torch.bool), torch.ones(B, NKV, dtype=torch.bool),
         "all"),
        ("[B,1,1,Nkv] prefixes, unequal", pre[:, None, None], pre, "prefix rows"),
        ("[B,1,Nq,Nkv] prefixes, transformers", hf_pre, pre, "prefix rows"),
        ("[B,1,1,Nkv] prefixes, equal", pre_equal[:, None, None], pre_equal, "prefix"),
        ("[B,1,1,Nkv] the same keys in every row", equal[:1].expand(B, NKV)[:, None, None]
         .clone(), equal[:1].expand(B, NKV), "gather"),
    ]


@pytest.mark.parametrize("label,mask,keep,route", served_masks(),
                         ids=[m[0] for m in served_masks()])
def test_served_on_the_kept_keys(seed, monkeypatch, label, mask, keep, route):
    fake = fake_kernels.install(monkeypatch)
    q, k, v = inputs()
    assert dense_mask.kept_keys(mask, B, HQ, NQ, NKV).route == route
    out, lse = attention(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True,
                         strict=True)
    ref, ref_lse = ref_attention(q, k, v, mask=keep[:, None, None, :])
    assert out.shape == (B, HQ, NQ, DV) and lse.shape == (B, HQ, NQ)
    assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-12
    assert fake.fwd_calls and len(fake.bwd_calls) == len(fake.fwd_calls)
    counts = keep.sum(-1).tolist()
    if len(set(counts)) == 1:  # one call on the kept keys
        assert [p.seqlen_kv for p in fake.fwd_calls] == [counts[0]]
    else:  # per batch element (varlen): each on its own kept keys
        assert sorted(p.seqlen_kv for p in fake.fwd_calls) == sorted(counts)
    assert "key-padding mask" in explain(q, k, v, attn_mask=mask, enable_gqa=True)


def matches_reference(q, k, v, mask, keep):
    """attention with `mask` against the float64 reference with the kept pairs `keep`: out,
    lse and the gradients of both (fake kernels: to 1e-12); returns (out, lse)."""
    out, lse = attention(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True,
                         strict=True)
    ref, ref_lse = ref_attention(q, k, v, mask=keep)
    assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    got = torch.autograd.grad((out, lse), (q, k, v), (dout, dlse))
    for g, w in zip(got, torch.autograd.grad((ref, ref_lse), (q, k, v), (dout, dlse))):
        assert rel_err(g, w) <= 1e-12
    return out, lse


def row_lengths(nq, nkv, kind, shift=0):
    """Keep-lengths L(i) of a row-prefix mask (row i keeps keys [0, L(i)))."""
    i = torch.arange(nq)
    if kind == "causal":   # bottom-right
        return (i + 1 + nkv - nq).clamp(max=nkv)
    if kind == "upper-left":
        return (i + 1).clamp(max=nkv)
    if kind == "image blocks":   # causal text, two bidirectional blocks
        lengths = i + 1
        for a, e in ((1 + shift, 4 + shift), (6, 9)):
            lengths[a:e] = e
        return lengths.clamp(max=nkv)
    if kind == "prefix-LM":
        return torch.maximum(i + 1, torch.tensor(4 + shift)).clamp(max=nkv)
    if kind == "causal, padded":
        return (i + 1).clamp(max=nkv - 3 - shift)
    raise ValueError(kind)


def as_keep(lengths, nkv):
    return torch.arange(nkv)[None, :] < lengths[..., None]


ROW_CASES = [  # (kind, Nq = Nkv, calls, per batch element)
    ("causal", True, 1, False), ("upper-left", False, 1, False), ("causal", False, 1, False),
    ("image blocks", True, 5, False), ("prefix-LM", True, 2, False),
    ("causal, padded", True, 2, False), ("image blocks", True, 14, True),
    ("prefix-LM", True, 6, True)]


@pytest.mark.parametrize("kind,square,calls,per_element", ROW_CASES,
                         ids=[f"{c[0]}-{'square' if c[1] else 'Nq<Nkv'}"
                              f"{'-per-element' if c[3] else ''}" for c in ROW_CASES])
@pytest.mark.parametrize("as_float_mask", [False, True])
@pytest.mark.parametrize("shared_dq", [True, False], ids=["dq_acc shared", "dq per call"])
def test_row_prefixes_run_as_causal_and_full_calls(seed, monkeypatch, kind, square, calls,
                                                   per_element, as_float_mask, shared_dq):
    """shared_dq: the gradient calls add dQ into one accumulator and read one Delta (a fused
    backward plan), or each returns its own dQ (the atomic-free kernels)."""
    fake = fake_kernels.install(monkeypatch)
    fake.reduces_dq = shared_dq
    nq, nkv = (NKV, NKV) if square else (NQ, NKV)
    q, k, v = inputs()
    q = torch.randn(B, HQ, nq, D, dtype=F64, requires_grad=True)
    if per_element:
        keep = torch.stack([as_keep(row_lengths(nq, nkv, kind, b), nkv) for b in range(B)])
    else:
        keep = as_keep(row_lengths(nq, nkv, kind), nkv).expand(B, nq, nkv)
    mask = keep[:, None] if per_element else keep[0]
    if as_float_mask:
        mask = as_float(mask, torch.finfo(torch.float64).min)
    kept = dense_mask.kept_keys(mask, B, HQ, nq, nkv)
    assert kept.route == "row runs" and kept.calls == calls
    out, _ = matches_reference(q, k, v, mask, keep[:, None])
    assert len(fake.fwd_calls) == calls
    # the gradient by runs of keys (RowRunAttention): one call per key run
    assert len(fake.bwd_calls) == sum(map(len, kept.key_runs))
    with torch.no_grad():   # the forward alone: the same calls, each writing its rows
        assert torch.equal(attention(q, k, v, attn_mask=mask, enable_gqa=True, strict=True),
                           out)
    assert len(fake.fwd_calls) == 2 * calls
    assert explain(q, k, v, attn_mask=mask, enable_gqa=True).startswith(
        f"row-prefix mask: {calls} kernel calls")


def test_key_runs_of_growing_prefixes():
    """Rows keeping [0, L(i)): key j is kept from row R(j) on; runs of R constant or rising by
    one; lengths that shrink down the rows have none (the gradient then runs by row runs)."""
    runs = dense_mask._key_runs([1, 2, 3, 8, 8, 8, 8, 8, 9, 10])   # an image block at rows 3-7
    assert runs == ((0, 4, "diagonal", 0), (4, 8, "full", 3), (8, 10, "diagonal", 8))
    assert dense_mask._key_runs([4, 4, 4, 5, 6]) == ((0, 4, "full", 0), (4, 6, "diagonal", 3))
    assert dense_mask._key_runs([3, 2, 5]) is None


def test_shrinking_prefixes_take_the_row_runs_gradient(seed, monkeypatch):
    fake = fake_kernels.install(monkeypatch)
    q, k, v = inputs()
    lengths = torch.tensor([5, 3, 7, 7, 2, 13, 9])
    keep = as_keep(lengths, NKV)
    kept = dense_mask.kept_keys(keep, B, HQ, NQ, NKV)
    assert kept.route == "row runs" and kept.key_runs is None
    out = attention(q, k, v, attn_mask=keep, enable_gqa=True, strict=True)
    ref = ref_attention(q, k, v, mask=keep)[0]
    assert rel_err(out, ref) <= 1e-12
    got = torch.autograd.grad(out.sum(), (q, k, v))
    for g, w in zip(got, torch.autograd.grad(ref.sum(), (q, k, v))):
        assert rel_err(g, w) <= 1e-12
    assert len(fake.bwd_calls) == kept.calls
    with torch.no_grad():   # no gradient: the row runs' calls write their rows in place
        assert torch.equal(attention(q, k, v, attn_mask=keep, enable_gqa=True, strict=True),
                           out)
    assert len(fake.fwd_calls) == 2 * kept.calls


def empty_row_masks():
    """(label, bool keep [B or 1, NQ, NKV], the runs' kinds) of masks whose first rows keep no
    key: SDPA gives those rows 0 (bool or -inf masks), and so does the route, with no call."""
    i = torch.arange(NQ)[:, None]
    cols = torch.arange(NKV)[None, :]
    pads = torch.tensor([2, 4, 3])[:, None, None]
    return [
        ("causal, upper-left shifted", cols < i - 1, ["empty", "diagonal"]),
        ("left padding + causal (interval rows)", (cols <= i + NKV - NQ) & (cols >= 9),
         ["empty", "diagonal"]),
        ("left padding + causal per element", ((cols <= i + NKV - NQ) & (cols >= pads + 5)),
         None),
    ]


@pytest.mark.parametrize("label,keep,kinds", empty_row_masks(),
                         ids=[m[0] for m in empty_row_masks()])
@pytest.mark.parametrize("form", ["bool", "-inf"])
def test_rows_keeping_no_key_give_zero(seed, monkeypatch, label, keep, kinds, form):
    """Rows whose bool or -inf mask keeps no key come out 0 (lse -inf, gradients 0), as from
    SDPA, with no kernel call; the other rows as any row run."""
    fake = fake_kernels.install(monkeypatch)
    q, k, v = inputs()
    keep = keep[:, None] if keep.dim() == 3 else keep   # per element: [B, 1, NQ, NKV]
    mask = keep if form == "bool" else as_float(keep)
    kept = dense_mask.kept_keys(mask, B, HQ, NQ, NKV)
    assert kept is not None and kept.route == "row runs"
    if kinds is not None:
        assert [r[2] for r in kept.runs[0]] == kinds
    out, lse = matches_reference(q, k, v, mask, keep)   # out, lse, gradients to 1e-12
    empty = ~keep.expand(B, 1, NQ, NKV)[:, 0].any(-1)
    assert bool((out[empty.nonzero(as_tuple=True)[0], :, empty.nonzero(as_tuple=True)[1]]
                 == 0).all())
    assert bool(torch.isneginf(lse.transpose(1, 2)[empty]).all())
    assert len(fake.fwd_calls) == kept.calls
    assert "keeping no key" in explain(q, k, v, attn_mask=mask, enable_gqa=True)


def test_runs_keeping_no_key_make_no_call_toward_max_runs(monkeypatch):
    """MAX_RUNS bounds the kernel calls: left padding per element is two runs an element, one
    of them a call."""
    keep = empty_row_masks()[2][1][:, None]   # [B, 1, NQ, NKV], a pad per element
    monkeypatch.setattr(dense_mask, "MAX_RUNS", B)
    kept = dense_mask.kept_keys(keep, B, HQ, NQ, NKV)
    assert kept is not None and kept.calls == B and sum(map(len, kept.runs)) == 2 * B
    monkeypatch.setattr(dense_mask, "MAX_RUNS", B - 1)
    dense_mask.clear()
    assert dense_mask.kept_keys(keep.clone(), B, HQ, NQ, NKV) is None


def sdpa_masks():
    """Masks that do more than drop keys, or drop all of a row's: the SDPA route."""
    keep = keep_rows(B)
    per_query = torch.rand(B, 1, NQ, NKV) > 0.3
    per_query[..., 0] = True
    per_head = keep[:, None, None].repeat(1, HQ, 1, 1)
    per_head[:, 1, :, :] = True
    none_kept = keep.clone()
    none_kept[1] = False
    two = as_keep(torch.arange(NQ) + 3, NKV)
    two[3:, 1] = False   # rows differ, and some keep two intervals of keys
    no_key = as_keep(torch.arange(NQ) - 2, NKV)   # the first two rows keep nothing
    return [
        ("varies over queries", per_query),
        ("rows keeping two intervals", two),
        ("a row that keeps no key, finite lows (SDPA averages every key there)",
         as_float(no_key, torch.finfo(torch.float64).min)),
        ("varies over queries and heads", per_head & per_query[:1]),
        ("varies over heads", per_head),
        ("additive bias", torch.randn(NKV, dtype=F64)),
        ("bias of zeros and -100", as_float(keep, -100.0)),
        ("a batch element keeps no key", none_kept[:, None, None]),
        ("requires grad", as_float(keep, -1e9).requires_grad_()),
    ]


@pytest.mark.parametrize("label,mask", sdpa_masks(), ids=[m[0] for m in sdpa_masks()])
def test_other_masks_keep_the_sdpa_route(seed, monkeypatch, label, mask):
    fake = fake_kernels.install(monkeypatch)
    q, k, v = inputs(grad=False)
    with pytest.raises(NotImplementedError, match="mask"):
        attention(q, k, v, attn_mask=mask, enable_gqa=True, strict=True)
    assert not fake.fwd_calls
    assert "key-padding" not in explain(q, k, v, attn_mask=mask, enable_gqa=True)


def test_too_many_row_runs_keep_the_sdpa_route(seed, monkeypatch):
    fake = fake_kernels.install(monkeypatch)
    monkeypatch.setattr(dense_mask, "MAX_RUNS", NQ - 1)
    q, k, v = inputs(grad=False)
    alternating = as_keep(torch.tensor([1 + (i % 2) * 5 for i in range(NQ)]), NKV)  # NQ runs
    with pytest.raises(NotImplementedError, match="mask"):
        attention(q, k, v, attn_mask=alternating, enable_gqa=True, strict=True)
    monkeypatch.setattr(dense_mask, "MAX_RUNS", NQ)
    dense_mask._CACHE.clear()
    out = attention(q, k, v, attn_mask=alternating, enable_gqa=True, strict=True)
    assert rel_err(out, ref_attention(q, k, v, mask=alternating)[0]) <= 1e-12
    assert len(fake.fwd_calls) == NQ


def test_not_with_dropout_or_on_three_dims(seed, monkeypatch):
    fake = fake_kernels.install(monkeypatch)
    q, k, v = inputs(grad=False)
    mask = keep_rows(1)[0]
    with pytest.raises(NotImplementedError):
        attention(q, k, v, attn_mask=mask, dropout_p=0.1, enable_gqa=True, strict=True)
    with pytest.raises(NotImplementedError):
        attention(q[0], k[0], v[0], attn_mask=mask, enable_gqa=True, strict=True)
    assert not fake.fwd_calls


@pytest.mark.parametrize("prefix", [False, True])
def test_unequal_counts_of_many_elements_take_varlen(seed, monkeypatch, prefix):
    fake = fake_kernels.install(monkeypatch)
    b = dense_mask.PER_ELEMENT_MAX + 1
    q, k, v = inputs(b=b)
    counts = [1 + i % NKV for i in range(b)]
    keep = prefix_rows(counts) if prefix else keep_rows(b, counts)
    mask = keep[:, None, None]
    assert dense_mask.kept_keys(mask, b, HQ, NQ, NKV).route == "varlen"
    out, lse = attention(q, k, v, attn_mask=mask, enable_gqa=True, return_lse=True, strict=True)
    ref, ref_lse = ref_attention(q, k, v, mask=keep[:, None, None, :])
    assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12
    got = torch.autograd.grad(out.sum(), (q, k, v))
    for g, w in zip(got, torch.autograd.grad(ref.sum(), (q, k, v))):
        assert rel_err(g, w) <= 1e-12
    assert sorted(p.seqlen_kv for p in fake.fwd_calls) == sorted(counts)
    assert "varlen_attention" in explain(q, k, v, attn_mask=mask, enable_gqa=True)


def test_the_sdpa_patch_serves_them_too(seed, monkeypatch):
    fake = fake_kernels.install(monkeypatch)
    q, k, v = inputs(grad=False)
    keep = keep_rows(B, [4, 9, 12])
    patch_sdpa()
    try:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=keep[:, None, None], enable_gqa=True)
    finally:
        unpatch_sdpa()
    assert rel_err(out, ref_attention(q, k, v, mask=keep[:, None, None, :])[0]) <= 1e-12
    assert sorted(p.seqlen_kv for p in fake.fwd_calls) == [4, 9, 12]
    # transformers' causal mask with right padding, through the patch: row runs, each causal
    # run bottom-right in its own frame whatever the patch's upper-left is_causal means
    rows = as_keep(row_lengths(NKV, NKV, "causal, padded"), NKV)
    qs = torch.randn(B, HQ, NKV, D, dtype=F64)
    patch_sdpa()
    try:
        out = torch.nn.functional.scaled_dot_product_attention(
            qs, k, v, attn_mask=as_float(rows, torch.finfo(F64).min)[None, None],
            enable_gqa=True)
    finally:
        unpatch_sdpa()
    assert rel_err(out, ref_attention(qs, k, v, mask=rows)[0]) <= 1e-12
    assert [p.causal for p in fake.fwd_calls[3:]] == [True, False]


def test_read_once_per_mask_and_version():
    mask = keep_rows(B)[:, None, None]
    first = dense_mask.kept_keys(mask, B, HQ, NQ, NKV)
    assert first is not None and dense_mask.kept_keys(mask, B, HQ, NQ, NKV) is first
    mask[0, 0, 0, :] = True   # an in-place write: read again
    again = dense_mask.kept_keys(mask, B, HQ, NQ, NKV)
    assert again is not first and again.counts[0] == NKV
    assert dense_mask.kept_keys(mask, B, HQ, NQ + 1, NKV) is not again  # another call shape


@pytest.mark.gpu
@pytest.mark.parametrize("d,dtype,hq,hkv", [(512, torch.bfloat16, 8, 2),
                                            (320, torch.float16, 4, 4)])
@pytest.mark.parametrize("form", ["gather", "equal", "rows", "prefix", "prefix rows",
                                  "varlen", "causal rows", "image blocks", "sliding window",
                                  "left padding"])
def test_kernels_on_the_kept_keys_gpu(seed, d, dtype, hq, hkv, form):
    """The kernels on the kept keys against float64 with the mask, every route: within twice
    torch's own same-dtype error (SDPA given the mask) plus a floor, out and gradients; strict
    (no fallback anywhere)."""

    b, nq, nkv = (dense_mask.PER_ELEMENT_MAX + 2 if form == "varlen" else 3), 129, 1000
    dev = torch.device("cuda")
    keep = torch.rand(b, nkv, device=dev) > 0.3
    lengths = torch.tensor([1000, 517, 3] * b, device=dev)[:b, None]
    if form == "gather":
        keep[:] = keep[0]
    elif form == "equal":
        keep = torch.zeros(b, nkv, dtype=torch.bool, device=dev)
        for i in range(b):
            keep[i, torch.randperm(nkv, device=dev)[:611]] = True
    elif form in ("rows", "varlen"):
        keep[2, 3:] = False   # 3 keys or fewer
        keep[2, 0] = True
    elif form == "prefix":
        keep = (torch.arange(nkv, device=dev) < 611).expand(b, nkv)
    else:
        keep = torch.arange(nkv, device=dev) < lengths
    mask = keep[:, None, None, :]
    if form == "left padding":   # causal, element b's first pads[b] keys padding: its rows
        nq = nkv = 700           # before them keep no key (out 0, as from SDPA)
        i = torch.arange(nq, device=dev)[:, None]
        pads = torch.tensor([0, 37, 301], device=dev)[:b, None, None]
        mask = ((torch.arange(nkv, device=dev) <= i) & (torch.arange(nkv, device=dev) >= pads))
        mask = keep = mask[:, None]
    if form in ("causal rows", "image blocks", "sliding window"):   # Nq = Nkv = 700
        nq = nkv = 700
        i = torch.arange(nq, device=dev)
        lengths = i + 1
        if form == "image blocks":   # Gemma's bidirectional image blocks in causal text
            for a, e in ((101, 357), (603, 700)):   # key runs from odd rows
                lengths[a:e] = e
        cols = torch.arange(nkv, device=dev)
        mask = cols < lengths[:, None]
        if form == "sliding window":   # a window of 128 keys, as a dense tensor
            mask &= cols > (i - 128)[:, None]
        keep = mask.expand(b, nq, nkv)[:, None]
    route = dense_mask.kept_keys(mask, b, hq, nq, nkv).route
    assert route == {"equal": "gather", "causal rows": "row runs", "image blocks": "row runs",
                     "sliding window": "row runs", "left padding": "row runs"}.get(form, form)

    def r(*s):
        return torch.randn(*s, device=dev, dtype=dtype).requires_grad_()
    q, k, v = r(b, hq, nq, d), r(b, hkv, nkv, d), r(b, hkv, nkv, d)
    within_sdpa_bound(q, k, v, mask, keep if keep.dim() == 4 else mask)


def within_sdpa_bound(q, k, v, mask, keep):
    """attention with `mask` (strict) against float64 with the kept pairs `keep`: out and the
    gradients within twice the error of SDPA given the mask in the inputs' dtype (where its
    answer is not finite, rows keeping no key: masked_ref in that dtype), plus a floor
    (masked_ref.bound); out without gradients the same bits."""
    from masked_ref import bound

    group = q.shape[1] // k.shape[1]
    out = attention(q, k, v, attn_mask=mask, enable_gqa=group > 1, strict=True)
    ref = ref_attention(q, k, v, mask=keep)[0]
    same = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask)
    dout = torch.randn_like(out)
    base = torch.autograd.grad(same, (q, k, v), dout)
    if not all(bool(t.isfinite().all()) for t in (same, *base)):
        # SDPA's backward on rows that keep no key: the reference in the inputs' dtype
        same = ref_attention(q, k, v, mask=keep, dtype=q.dtype)[0]
        base = torch.autograd.grad(same, (q, k, v), dout)
    assert rel_err(out, ref) <= bound(rel_err(same, ref))
    with torch.no_grad():   # the forward alone: the same kernel calls, the same bits
        assert torch.equal(attention(q, k, v, attn_mask=mask, enable_gqa=group > 1,
                                     strict=True), out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    for g, w, s in zip(got, want, base):
        assert rel_err(g, w) <= bound(rel_err(s, w))


@pytest.mark.gpu
def test_key_runs_from_odd_rows_one_head_gpu(seed):
    """Image blocks starting at odd rows with B = Hq = 1: the key runs' lse and Delta row slices
    start mid-line (copied to aligned buffers), their dQ added into row slices of the shared
    fp32 accumulator; out and gradients against float64 within twice SDPA's error."""
    dev, n = torch.device("cuda"), 517
    i = torch.arange(n, device=dev)
    lengths = i + 1
    for a, e in ((37, 101), (259, 388)):
        lengths[a:e] = e
    mask = i[None] < lengths[:, None]
    q, k, v = (torch.randn(1, 1, n, 512, device=dev, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    within_sdpa_bound(q, k, v, mask, mask)


def test_inference_mode_masks(seed, monkeypatch):
    """A mask made under torch.inference_mode has no version counter: read at every call
    (not cached), and served as any other."""
    fake = fake_kernels.install(monkeypatch)
    q, k, v = inputs(grad=False)
    with torch.inference_mode():
        keep = keep_rows(B, [4, 9, 12])
        mask = keep[:, None, None]
        out = attention(q, k, v, attn_mask=mask, enable_gqa=True, strict=True)
        again = attention(q, k, v, attn_mask=mask, enable_gqa=True, strict=True)
    ref = ref_attention(q, k, v, mask=keep[:, None, None, :])[0]
    assert rel_err(out, ref) <= 1e-12 and torch.equal(out, again)
    assert sorted(p.seqlen_kv for p in fake.fwd_calls) == [4, 4, 9, 9, 12, 12]
    hit = dense_mask._CACHE.get(id(mask))   # (an id freed by an earlier test may be reused)
    assert hit is None or hit[0]() is not mask


@pytest.mark.gpu
def test_cuda_graph_capture_gpu(seed):
    """A mask read before the capture (its keys cached) replays as the same kernel calls; a
    mask first seen inside the capture is not read there (a sync would break the capture):
    that call keeps the SDPA route, which captures too."""
    b, h, n, d = 2, 4, 256, 512
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = (torch.arange(n, device="cuda") < torch.tensor([n, 100], device="cuda")[:, None])
    mask = mask[:, None, None]
    fresh = mask.clone()
    want = attention(q, k, v, attn_mask=mask)   # reads the mask, compiles
    torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=fresh)  # SDPA warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = attention(q, k, v, attn_mask=mask)
        other = attention(q, k, v, attn_mask=fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)
    hit = dense_mask._CACHE.get(id(fresh))
    assert hit is None or hit[0]() is not fresh
    ref = ref_attention(q, k, v, mask=mask)[0]
    assert rel_err(other, ref) <= 2e-2


def test_row_prefixes_tall_and_strided(seed, monkeypatch):
    """Upper-left causal as a tensor with Nq > Nkv (rows past Nkv keep every key: a causal run
    then an unmasked one; one key run, upper-left, for the gradient), on q, k, v in the
    [B, N, H, D] memory layout (transposed views)."""
    fake = fake_kernels.install(monkeypatch)
    nq, nkv = 20, NKV

    def r(h, n, d):
        return torch.randn(B, n, h, d, dtype=F64).transpose(1, 2).requires_grad_()
    q, k, v = r(HQ, nq, D), r(HKV, nkv, D), r(HKV, nkv, DV)
    keep = torch.ones(nq, nkv, dtype=torch.bool).tril()
    kept = dense_mask.kept_keys(keep, B, HQ, nq, nkv)
    assert [r[2] for r in kept.runs[0]] == ["diagonal", "full"]
    assert kept.key_runs == (((0, nkv, "diagonal", 0),),)
    out, lse = attention(q, k, v, attn_mask=keep, enable_gqa=True, return_lse=True, strict=True)
    ref, ref_lse = ref_attention(q, k, v, mask=keep)
    assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12
    got = torch.autograd.grad(out.sum(), (q, k, v))
    for g, w in zip(got, torch.autograd.grad(ref.sum(), (q, k, v))):
        assert rel_err(g, w) <= 1e-12
    assert len(fake.fwd_calls) == 2 and len(fake.bwd_calls) == 1
    assert fake.bwd_calls[0].causal and fake.bwd_calls[0].causal_offset == 0


def test_masks_read_in_chunks_of_rows(monkeypatch):
    """The checks over queries and heads and the row-prefix read go by chunks of query rows
    (`CHUNK` elements): the same verdicts and runs with chunks of a row or two."""
    keep = as_keep(row_lengths(NKV, NKV, "image blocks"), NKV)
    masks = [keep, as_float(keep, -1e9), keep[None, None].expand(B, HQ, NKV, NKV),
             as_keep(row_lengths(NKV, NKV, "causal"), NKV) & (torch.rand(NKV, NKV) > 0.1),
             keep_rows(B)[:, None, None].expand(B, HQ, NKV, NKV),
             keep[None, None].repeat(1, HQ, 1, 1)]   # heads materialised: compared by chunks
    want = [dense_mask._read(m, B, HQ, NKV, NKV) for m in masks]
    monkeypatch.setattr(dense_mask, "CHUNK", NKV + 3)   # one row a chunk (two with heads)
    got = [dense_mask._read(m, B, HQ, NKV, NKV) for m in masks]
    assert [type(w) for w in want] == [dense_mask.RowRuns, dense_mask.RowRuns,
                                       dense_mask.RowRuns, type(None), dense_mask.KeptKeys,
                                       dense_mask.RowRuns]
    for g, w in zip(got, want):
        assert type(g) is type(w)
        if isinstance(w, dense_mask.RowRuns):
            assert g == w
        elif w is not None:
            assert g.counts == w.counts and torch.equal(g.keep, w.keep)


def intervals(nq, nkv, kind, shift=0):
    """(lo, hi) per row of a row-interval mask: row i keeps keys [lo(i), hi(i))."""
    i = torch.arange(nq)
    if kind == "sliding window":   # causal, the last 4 keys (bottom-right)
        hi = (i + 1 + nkv - nq).clamp(max=nkv)
        return (hi - 4 - shift).clamp(min=0), hi
    if kind == "anti-causal":   # row i keeps keys [i, Nkv)
        return i.clamp(max=nkv - 1), torch.full((nq,), nkv)
    if kind == "window both sides":   # [i - 2, i + 3) clipped
        return (i - 2).clamp(min=0), (i + 3 + shift).clamp(max=nkv)
    raise ValueError(kind)


INTERVAL_CASES = [  # (kind, Nq, kinds of the runs, per batch element)
    ("sliding window", NKV, ["diagonal", "band"], False),
    ("sliding window", NQ, ["band"], False),
    ("anti-causal", NKV, ["suffix"], False),
    ("window both sides", NKV, ["diagonal", "band", "suffix"], False),
    ("sliding window", NKV, None, True),
]


@pytest.mark.parametrize("kind,nq,kinds,per_element", INTERVAL_CASES,
                         ids=[f"{c[0]}-nq{c[1]}{'-per-element' if c[3] else ''}"
                              for c in INTERVAL_CASES])
def test_row_intervals_run_as_window_calls(seed, monkeypatch, kind, nq, kinds, per_element):
    """Rows keeping one interval of keys each (a sliding window as a dense tensor, its
    anti-causal mirror, a window on both sides): runs of unmasked, causal and sliding-window
    kernel calls on key slices; out, lse and gradients (by those calls) against float64."""
    fake = fake_kernels.install(monkeypatch)
    q = torch.randn(B, HQ, nq, D, dtype=F64, requires_grad=True)
    _, k, v = inputs()
    cols = torch.arange(NKV)
    bounds = [intervals(nq, NKV, kind, b if per_element else 0) for b in range(B)]
    keep = torch.stack([(cols >= lo[:, None]) & (cols < hi[:, None]) for lo, hi in bounds])
    mask = keep[:, None] if per_element else keep[0]
    kept = dense_mask.kept_keys(mask, B, HQ, nq, NKV)
    assert kept.route == "row runs" and kept.key_runs is None and kept.starts is not None
    if kinds is not None:
        assert [r[2] for r in kept.runs[0]] == kinds
    matches_reference(q, k, v, mask, keep[:, None])
    assert len(fake.fwd_calls) == kept.calls
    assert any(p.window_lo is not None for p in fake.fwd_calls) == (
        any(r[2] in ("band", "suffix") for e in kept.runs for r in e))
    assert explain(q, k, v, attn_mask=mask, enable_gqa=True).startswith(
        f"row-interval mask: {kept.calls} kernel calls")
