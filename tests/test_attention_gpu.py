"""Kernel numerics and integration on a CUDA device (every test is @gpu).

The family under test is the device's own (an H100 / H200 runs the sm90 family, as its users
get); `FFPA_CUTE_ARCH=sm80 pytest -m gpu` runs the same tests on the mma.sync Split-D family
(docs/verification.md runs both). Every case asserts the kernel route (plan.reason is None,
strict=True), so a silent fallback to SDPA can never pass.

Accuracy criterion (FlashAttention's ratio test): with `ref` the float64 reference on the same
bf16/fp16 inputs, rel_err(kernel, ref) <= 2 * rel_err(same-dtype torch math, ref) + 1e-3.

Grids. Default tier (~56 cases): D in {320 (M8N1), 512 (M4N2), 1024 (M2N4)}
in bf16 plus 576 in fp16; causal none / bottom-right / upper-left; (Nq, Nkv, Hq/Hkv) from
(1, 129, 1), (7, 7, 4), (129, 1000, 16), (1000, 129, 1), plus one 4097 x 4097 case, plus
D in {264, 328, 712} (not multiples of the 64-wide head-dim chunk: padded last chunk).
Slow tier (`-m slow`): every D in {264, 320, 328, 384, 448, 512, 576, 640, 712, 768, 1024} x
{bf16, fp16} x the three causal modes, with six (Nq, Nkv) mixes from {1, 7, 129, 1000, 4097},
GQA ratios 1/4/16/64 assigned round-robin (not the full product: compiles scale with D x dtype x causal, and the
shape mixes exercise the same residue/masking code for every config).
"""

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_upper_left

import ffpa_cute
import kernels  # tests/ is on sys.path
from ffpa_cute import attention, dispatch, explain, interface, launch, patch_sdpa, unpatch_sdpa
from ffpa_cute.problem import AttnProblem
from ffpa_cute.reference import attention_grads, attention_ref, attention_same_dtype, rel_err

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
MODES = ("none", "bottom_right", "upper_left")


def make_qkv(b, hq, hkv, nq, nkv, d, dtype, grad=False):
    def r(*s):
        return torch.randn(*s, device="cuda", dtype=dtype).requires_grad_(grad)
    return r(b, hq, nq, d), r(b, hkv, nkv, d), r(b, hkv, nkv, d)


def check_grads(q, k, v, dout, causal, off):
    """q.grad, k.grad, v.grad (from a backward with `dout`) against float64: error <= 2x torch's
    same-dtype (bf16) error + 1e-3, per gradient."""
    grads = {}
    for name, fn, cast in (("ref", attention_ref, torch.float64),
                           ("base", attention_same_dtype, BF16)):
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        fn(*leaves, causal=causal, causal_offset=off)[0].backward(dout.to(cast))
        grads[name] = [t.grad for t in leaves]
    for name, g, r, b in zip("qkv", (q.grad, k.grad, v.grad), grads["ref"], grads["base"]):
        err, base_err = rel_err(g, r), rel_err(b, r)
        assert err <= 2 * base_err + 1e-3, f"d{name}: err {err:.3g} vs torch {base_err:.3g}"


def offset_of(mode, nq, nkv):
    return {"none": 0, "bottom_right": nkv - nq, "upper_left": 0}[mode]


def call(q, k, v, mode, **kw):
    """attention() in one of the three causal modes; strict, so a fallback raises."""
    gqa = q.shape[-3] != k.shape[-3]
    if mode == "upper_left":
        mask = causal_upper_left(q.shape[-2], k.shape[-2])
        return attention(q, k, v, attn_mask=mask, enable_gqa=gqa, strict=True, **kw)
    return attention(q, k, v, is_causal=mode == "bottom_right", enable_gqa=gqa, strict=True, **kw)


def kernel_plan(q, k, v, mode):
    causal = mode != "none"
    problem = AttnProblem.from_tensors(q, k, v, causal=causal,
                                       causal_offset=offset_of(mode, q.shape[-2], k.shape[-2]))
    plan = dispatch.plan_fwd(problem)
    assert plan.reason is None, plan.reason
    return plan


def check_forward(d, dtype, mode, nq, nkv, ratio, b=1, dv=None):
    hkv = 2 if ratio < 16 else 1
    q, k, v = make_qkv(b, hkv * ratio, hkv, nq, nkv, d, dtype)
    if dv is not None:  # Dv != D (MLA-absorbed 576 / 512)
        v = torch.randn(b, hkv, nkv, dv, device="cuda", dtype=dtype)
    plan = kernel_plan(q, k, v, mode)
    causal, off = mode != "none", offset_of(mode, nq, nkv)
    out = call(q, k, v, mode)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, causal_offset=off)
    base, _ = attention_same_dtype(q, k, v, causal=causal, causal_offset=off)
    err, base_err = rel_err(out, ref), rel_err(base, ref)
    assert err <= 2 * base_err + 1e-3, f"{plan.describe()}: err {err:.3g} vs torch {base_err:.3g}"
    out2, lse = torch.ops.ffpa_cute.attention_fwd(q, k, v, causal, off, 1.0 / math.sqrt(d))
    assert torch.equal(out, out2)
    assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert (lse[finite].double() - ref_lse[finite]).abs().max().item() <= 2e-3
    assert (out[torch.isneginf(ref_lse)] == 0).all()  # rows without keys are exactly 0


SHAPES = [(1, 129, 1), (7, 7, 4), (129, 1000, 16), (1000, 129, 1)]
FAST = [(d, dt, mode, *s) for d, dt in ((320, BF16), (512, BF16), (1024, BF16), (576, FP16))
        for mode in MODES for s in SHAPES] + [(512, BF16, "bottom_right", 4097, 4097, 4)] + [
    # D not a multiple of the 64-wide chunk: the zero-padded last chunk (column predicates)
    (d, BF16, mode, 129, 1000, 4) for d in (264, 328, 712) for mode in ("none", "bottom_right")
] + [  # MQA 64:1 (DeepSeek-V4-style): prefill, decode (heads packed into rows), both alignments
    (512, BF16, "bottom_right", 129, 1000, 64), (1024, BF16, "none", 1, 4097, 64),
    (320, FP16, "upper_left", 1000, 129, 64)]
SLOW_SHAPES = [(1, 4097), (7, 129), (129, 7), (1000, 1000), (4097, 1000), (129, 4097)]
SLOW = [(d, dt, mode, nq, nkv, (1, 4, 16, 64)[i % 4])
        for d in (264, 320, 328, 384, 448, 512, 576, 640, 712, 768, 1024) for dt in (BF16, FP16)
        for mode in MODES for i, (nq, nkv) in enumerate(SLOW_SHAPES)]


def case_id(c):
    d, dt, mode, nq, nkv, ratio = c
    return f"d{d}-{str(dt)[6:]}-{mode}-{nq}x{nkv}-g{ratio}"


@pytest.mark.parametrize("case", FAST, ids=case_id)
def test_forward_fast(seed, case):
    check_forward(*case)


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=case_id)
def test_forward_full_grid(seed, case):
    check_forward(*case)


@pytest.mark.parametrize("d,dtype,b,hq,hkv,nq,nkv", [
    (512, BF16, 2, 48, 48, 1000, 333),   # 16 row tiles x 96 heads: ~12 tiles per CTA
    (320, FP16, 1, 64, 8, 777, 1000),    # GQA, rows packed: 8 x 98 row tiles
    (384, BF16, 3, 40, 40, 130, 2000),   # 3 row tiles x 120 heads, the last one partial
    (328, FP16, 2, 32, 4, 500, 700),     # D % 64 != 0 (`split_align` 64), GQA rows packed
    (400, BF16, 1, 96, 96, 1000, 1000)])  # shares 256 + 144 computed 256 + 192
def test_persistent_tiles(seed, d, dtype, b, hq, hkv, nq, nkv):
    """The persistent forward (one CTA per SM walking the row tiles; the default without a
    right bound) with several tiles per CTA, so the rings and P hand-overs carry from tile to
    tile: within the float64 bound, and the same bits as one CTA per tile."""
    q, k, v = make_qkv(b, hq, hkv, nq, nkv, d, dtype)
    plan = kernel_plan(q, k, v, "none")
    assert plan.cfg.persistent
    rows = nq * (hq // hkv) if plan.packed else nq
    tiles = b * (hkv if plan.packed else hq) * -(-rows // 64)
    assert tiles > 2 * launch.sm_count(), tiles
    out = call(q, k, v, "none")
    ref, _ = attention_ref(q, k, v)
    base, _ = attention_same_dtype(q, k, v)
    err, base_err = rel_err(out, ref), rel_err(base, ref)
    assert err <= 2 * base_err + 1e-3, f"err {err:.3g} vs torch {base_err:.3g}"
    with ffpa_cute.options.use(persistent=False):
        assert not kernel_plan(q, k, v, "none").cfg.persistent
        assert torch.equal(call(q, k, v, "none"), out)


MLA = [(576, BF16, "none", 1, 4097, 128, 512), (576, BF16, "bottom_right", 129, 1000, 16, 512),
       (576, BF16, "upper_left", 1000, 1000, 1, 512), (576, FP16, "bottom_right", 1000, 129, 4, 512),
       (512, BF16, "bottom_right", 129, 1000, 4, 320), (320, BF16, "none", 7, 129, 1, 256),
       (1024, BF16, "bottom_right", 1000, 1000, 8, 512), (768, FP16, "none", 129, 4097, 16, 128)]


@pytest.mark.parametrize("case", MLA, ids=lambda c: case_id(c[:6]) + f"-dv{c[6]}")
def test_forward_dv_not_d(seed, case):
    """Dv != D (MLA-absorbed 576 / 512, MQA 128:1 decode among them): the WGMMA kernel on sm_90
    (the Split-D family falls back to SDPA, tests/test_dispatch_config.py)."""
    if dispatch.current_arch() != "sm_90a" or ffpa_cute.options.current().family not in (
            None, "sm90"):
        pytest.skip("Dv != D runs on the sm90 family only")
    d, dt, mode, nq, nkv, ratio, dv = case
    check_forward(d, dt, mode, nq, nkv, ratio, dv=dv)


@pytest.mark.parametrize("mode", MODES)
def test_every_element_written(seed, mode):
    """run_fwd on NaN-poisoned memory: the caching allocator hands the poisoned blocks back."""
    q, k, v = make_qkv(2, 8, 2, 1000, 129, 512, BF16)
    plan = kernel_plan(q, k, v, mode)
    launch.run_fwd(plan, q, k, v)  # compile first, so nothing else allocates in between
    torch.cuda.synchronize()
    poison = [torch.full((2, 8, 1000, 512), float("nan"), device="cuda", dtype=BF16),
              torch.full((2, 8, 1000), float("nan"), device="cuda")]
    ptrs = [t.data_ptr() for t in poison]
    del poison
    out, lse = launch.run_fwd(plan, q, k, v)
    assert [out.data_ptr(), lse.data_ptr()] == ptrs, "allocator did not reuse the poisoned blocks"
    assert not out.isnan().any() and not lse.isnan().any()
    if mode == "bottom_right":  # Nq > Nkv: the first 871 rows see no key
        assert (out[:, :, :871] == 0).all() and torch.isneginf(lse[:, :, :871]).all()


@pytest.mark.parametrize("d", [328, 520, 600])
def test_row_repack_is_the_same_kernel(seed, monkeypatch, d):
    """At D > 512 with rows that are not whole 128-byte lines (D=600: the WGMMA CTA pair
    forward and backward), and at D % 16 == 8 (328; 520: forward and backward with O, and
    the gradients, in one CTA) the inputs are copied into
    padded rows first (`launch.repack_rows`): the same kernels on the same values, so out,
    lse and the gradients are the same bits as without the copy. The gradients come from the
    atomic-free kernels (`deterministic=True`): the fused backward, the default at 328 and
    520 (on zero-padded operands, copied either way), reduces dQ in an order that varies
    from run to run."""
    from ffpa_cute import launch

    n = 3100  # past the size rule's thresholds (nq nkv >= 1000 (nq + 2 nkv) at D <= 512)
    q, k, v = (torch.randn(1, 2, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    problem = AttnProblem.from_tensors(q, k, v, causal=True)
    assert launch.repack_rows(problem, dispatch.plan_fwd(problem).cfg, n, n)
    res = []
    for repack in (True, False):
        if not repack:
            monkeypatch.setattr(launch, "repack_rows", lambda *a: False)
        with ffpa_cute.options.use(deterministic=True):
            out, lse = attention(q, k, v, is_causal=True, return_lse=True, strict=True)
            dout = torch.randn_like(out) if repack else res[0][0][1]
            res.append(((out, dout), lse, torch.autograd.grad(out, (q, k, v), dout)))
    (a, _), lse_a, ga = res[0]
    (b, _), lse_b, gb = res[1]
    assert torch.equal(a, b) and torch.equal(lse_a, lse_b)
    for x, y in zip(ga, gb):
        assert torch.equal(x, y)
    ref, _ = attention_ref(q.detach(), k.detach(), v.detach(), causal=True)
    assert rel_err(a, ref) <= 1e-2


# the widened forward (`launch.widened_fwd`): (D, causal mode, Nq, Nkv, GQA ratio, dtype), long
# enough for the row copy; tests/gpu_jobs.py packs their kernels
WIDENED_CASES = [(280, "none", 3100, 3100, 1, BF16),
                 (504, "bottom_right", 3000, 4097, 4, torch.float16),
                 (264, "upper_left", 4097, 3001, 8, BF16), (328, "none", 4096, 4096, 2, BF16)]


@pytest.mark.parametrize("d,mode,nq,nkv,ratio,dt", WIDENED_CASES)
def test_widened_forward_is_exact(seed, monkeypatch, d, mode, nq, nkv, ratio, dt):
    """At D % 16 == 8 with copied rows the forward runs the D + 8 kernel's score side on q and
    k zero-padded to D + 8 (`launch.widened_fwd`, named by explain): the same scores, so out
    and lse are the same bits as the D kernel's; out is D wide and contiguous; within the
    float64 criterion. GQA (packed rows), both causal alignments with Nq != Nkv, fp16; up to
    D=504 (routed up to `launch.WIDENED_MAX_HEAD_DIM`; the test widens the range to check the
    mechanism at the largest D)."""
    monkeypatch.setattr(launch, "WIDENED_MAX_HEAD_DIM", launch.WIDENED_CANDIDATE_MAX_HEAD_DIM)
    q, k, v = make_qkv(1, 2 * ratio, 2, nq, nkv, d, dt)
    plan = kernel_plan(q, k, v, mode)
    assert launch.widened_fwd(plan, nq, nkv) is not None
    gqa = ratio > 1
    assert f"zero-padded from D={d}" in explain(q, k, v, is_causal=mode != "none",
                                                  enable_gqa=gqa)
    out, lse = call(q, k, v, mode, return_lse=True)
    monkeypatch.setattr(launch, "widened_fwd", lambda *a: None)
    out_d, lse_d = call(q, k, v, mode, return_lse=True)
    assert out.shape == out_d.shape and out.is_contiguous()
    assert torch.equal(out, out_d) and torch.equal(lse, lse_d)
    causal, off = mode != "none", offset_of(mode, nq, nkv)
    ref, _ = attention_ref(q, k, v, causal=causal, causal_offset=off)
    base, _ = attention_same_dtype(q, k, v, causal=causal, causal_offset=off)
    assert rel_err(out, ref) <= 2 * rel_err(base, ref) + 1e-3


# the pair at the next multiple of 64 (`launch.padded_fwd`): (D, causal mode, Nq, Nkv, GQA
# ratio, dtype), long enough for the row copy; tests/gpu_jobs.py packs their kernels
PADDED_PAIR_CASES = [(584, "none", 3100, 3100, 1, BF16),
                     (600, "none", 3000, 4097, 4, torch.float16),
                     (1000, "none", 4097, 3001, 2, BF16)]


@pytest.mark.parametrize("d,mode,nq,nkv,ratio,dt", PADDED_PAIR_CASES)
def test_padded_pair_forward(seed, monkeypatch, d, mode, nq, nkv, ratio, dt):
    """Above 576 at D % 64 != 0 the forward may run the pair at the next multiple of 64 on
    zero-padded q, k and v (`launch.padded_fwd`, named by explain; routed at
    PADDED_PAIR_HEAD_DIMS, patched here): out is D wide and contiguous, lse and out within the
    float64 criterion and close to the D kernel's. GQA, Nq != Nkv both ways, fp16 (not causal:
    the padded pair is not taken under a causal mask)."""
    monkeypatch.setattr(launch, "PADDED_PAIR_HEAD_DIMS", frozenset({d}))
    q, k, v = make_qkv(1, 2 * ratio, 2, nq, nkv, d, dt)
    plan = kernel_plan(q, k, v, mode)
    assert launch.padded_fwd(plan, nq, nkv) is not None
    assert f"zero-padded from D={d}" in explain(q, k, v, is_causal=mode != "none",
                                                  enable_gqa=ratio > 1)
    out, lse = call(q, k, v, mode, return_lse=True)
    monkeypatch.setattr(launch, "PADDED_PAIR_HEAD_DIMS", frozenset())
    out_d, lse_d = call(q, k, v, mode, return_lse=True)
    assert out.shape == out_d.shape and out.is_contiguous()
    assert (lse - lse_d).abs().max().item() < 1e-3
    causal, off = mode != "none", offset_of(mode, nq, nkv)
    ref, _ = attention_ref(q, k, v, causal=causal, causal_offset=off)
    base, _ = attention_same_dtype(q, k, v, causal=causal, causal_offset=off)
    assert rel_err(out, ref) <= 2 * rel_err(base, ref) + 1e-3


def test_deterministic(seed):
    q, k, v = make_qkv(2, 8, 2, 1000, 1000, 640, BF16)
    a = call(q, k, v, "bottom_right")
    b = call(q, k, v, "bottom_right")
    assert torch.equal(a, b)


def test_strided_inputs(seed):
    """[B, N, H, D] storage seen through transposes; K/V sliced from one packed tensor."""
    b, n, hq, hkv, d = 2, 129, 8, 2, 512
    q = torch.randn(b, n, hq, d, device="cuda", dtype=BF16).transpose(1, 2)
    kv = torch.randn(b, 1000, 2, hkv, d, device="cuda", dtype=BF16)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous()
    kernel_plan(q, k, v, "bottom_right")
    out = call(q, k, v, "bottom_right")
    ref, _ = attention_ref(q, k, v, causal=True)
    base, _ = attention_same_dtype(q, k, v, causal=True)
    assert rel_err(out, ref) <= 2 * rel_err(base, ref) + 1e-3
    assert torch.equal(out, call(q.contiguous(), k.contiguous(), v.contiguous(), "bottom_right"))


def test_explain_and_patch(seed):
    q, k, v = make_qkv(1, 4, 4, 129, 1000, 512, BF16)
    text = explain(q, k, v, is_causal=True)
    assert text.startswith("ffpa_cute kernel"), text
    assert any(f"backward: {fam} backward kernels" in text for fam in ("sm90", "sm80")), text
    assert "head_dim=128" in explain(*make_qkv(1, 4, 4, 7, 7, 128, BF16))
    patch_sdpa()
    try:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # upper-left, as SDPA
    finally:
        unpatch_sdpa()
    ref, _ = attention_ref(q, k, v, causal=True, causal_offset=0)
    base, _ = attention_same_dtype(q, k, v, causal=True, causal_offset=0)
    assert rel_err(out, ref) <= 2 * rel_err(base, ref) + 1e-3


def test_fallback_on_cuda(seed):
    """Small D goes to native SDPA; GQA stays native only where flash can take it."""
    q, k, v = make_qkv(1, 8, 2, 129, 1000, 128, BF16)
    text = explain(q, k, v, is_causal=True, enable_gqa=True)
    assert "head_dim=128" in text and "expanding K/V heads 4x" in text, text
    assert "GQA natively" in explain(q, k, v, enable_gqa=True)
    for causal in (False, True):
        out = attention(q, k, v, is_causal=causal, enable_gqa=True)
        ref, _ = attention_ref(q, k, v, causal=causal)
        base, _ = attention_same_dtype(q, k, v, causal=causal)
        assert rel_err(out, ref) <= 2 * rel_err(base, ref) + 1e-3
    with pytest.raises(NotImplementedError, match="head_dim=128"):
        attention(q, k, v, enable_gqa=True, strict=True)


def test_torch_compile_fullgraph(seed):
    torch._dynamo.reset()

    def fn(q, k, v):
        return attention(q, k, v, is_causal=True, enable_gqa=True, strict=True) * 2 + 1

    q, k, v = make_qkv(2, 8, 2, 129, 1000, 512, BF16)
    compiled = torch.compile(fn, fullgraph=True)
    assert torch.equal(compiled(q, k, v), fn(q, k, v))


def test_torch_compile_backward(seed):
    """torch.compile graphs reach the backward kernels through ffpa_cute::attention_bwd: the
    same bits as the eager backward (both atomic-free: `deterministic`, set as the process
    default: a compiled graph's backward plans with the options in force on autograd's own
    thread, where a `use(...)` block does not reach)."""
    torch._dynamo.reset()

    def fn(q, k, v):
        return attention(q, k, v, is_causal=True, enable_gqa=True, strict=True)

    q, k, v = make_qkv(1, 8, 2, 129, 1000, 512, BF16, grad=True)
    dout = torch.randn(1, 8, 129, 512, device="cuda", dtype=BF16)
    grads = []
    previous = ffpa_cute.options.set_default(deterministic=True)
    try:
        for f in (fn, torch.compile(fn, fullgraph=True)):
            f(q, k, v).backward(dout)
            grads.append([t.grad.clone() for t in (q, k, v)])
            for t in (q, k, v):
                t.grad = None
    finally:
        ffpa_cute.options.set_default(previous)
    for a, b in zip(*grads):
        assert torch.equal(a, b)


@pytest.mark.parametrize("hq,hkv,nq,nkv,mode,d", [(128, 1, 1, 4097, "bottom_right", 512),
                                                 (32, 8, 7, 129, "none", 320),
                                                 (16, 2, 1, 1000, "none", 1024)])
def test_gqa_row_packing_is_exact(seed, hq, hkv, nq, nkv, mode, d):
    """Query heads packed into a KV head's rows (`Options.pack_gqa`, the default) give the same
    bits as one head per tile (each row's arithmetic is the same), and pass the reference
    check."""
    q, k, v = make_qkv(2, hq, hkv, nq, nkv, d, BF16)
    off, scale = offset_of(mode, nq, nkv), d ** -0.5
    assert kernel_plan(q, k, v, mode).packed
    packed = torch.ops.ffpa_cute.attention_fwd(q, k, v, mode != "none", off, scale)
    with ffpa_cute.options.use(pack_gqa=False):
        assert not kernel_plan(q, k, v, mode).packed
        plain = torch.ops.ffpa_cute.attention_fwd(q, k, v, mode != "none", off, scale)
    assert torch.equal(packed[0], plain[0]) and torch.equal(packed[1], plain[1])
    check_forward(d, BF16, mode, nq, nkv, hq // hkv)  # (2 KV heads below ratio 16)


def test_cuda_graph_capture(seed):
    q, k, v = make_qkv(2, 8, 2, 129, 1000, 512, BF16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(q, k, v, "bottom_right")  # warm: compile, plan cache, allocator
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call(q, k, v, "bottom_right")
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, call(q, k, v, "bottom_right"))


@pytest.mark.parametrize("mode,nq,nkv,ratio", [("bottom_right", 129, 1000, 4),
                                               ("bottom_right", 1000, 129, 1),
                                               ("upper_left", 129, 129, 16), ("none", 7, 129, 1)])
def test_backward(seed, mode, nq, nkv, ratio):
    _check_backward(mode, nq, nkv, ratio)


@pytest.mark.parametrize("family,d,mode,nq,nkv,ratio", [
    ("sm90", 512, "bottom_right", 129, 1000, 4), ("sm90", 512, "bottom_right", 1000, 129, 1),
    ("sm90", 512, "upper_left", 129, 129, 16), ("sm90", 512, "none", 7, 129, 1),
    ("sm90", 512, "none", 1000, 1000, 1), ("sm80", 512, "bottom_right", 129, 1000, 4),
    ("sm80", 1024, "upper_left", 129, 129, 16), ("sm80", 320, "none", 1000, 1000, 1)])
def test_backward_kernels(seed, family, d, mode, nq, nkv, ratio):
    """Autograd through one family's backward kernels (`Options.family`): the route is the
    kernels', and the gradients pass the same criterion."""
    if family == "sm90" and dispatch.current_arch() != "sm_90a":
        pytest.skip("WGMMA kernels: sm_90 only")
    with ffpa_cute.options.use(family=family):
        _check_backward(mode, nq, nkv, ratio, expect_kernels=True, d=d, family=family)


@pytest.mark.parametrize("mode,nq,nkv,ratio", [("bottom_right", 129, 1000, 4),
                                               ("none", 1000, 1000, 1)])
@pytest.mark.parametrize("d,fwd,bwd", [(1024, "FFPAFwdSm90", "FFPABwdDQSm90"),
                                       (1016, "FFPAFwdSm90", "FFPABwdDQSm90")])
def test_backward_above_512(seed, mode, nq, nkv, ratio, d, fwd, bwd):
    """sm90 family above 512: at D = 1024 the WGMMA forward (O split over a CTA pair) feeds
    the WGMMA backward (gradient split over two CTAs); at D = 1016 (not a multiple of 16) both
    are the WGMMA kernels too, the second CTA of each pair owning 8 columns past D (55f5935:
    the Split-D backward no longer serves the sm90 family)."""
    with sm90_only():
        p = AttnProblem(dtype="bf16", batch=1, heads_q=2 * ratio, heads_kv=2, seqlen_q=nq,
                        seqlen_kv=nkv, head_dim=d, head_dim_v=d, causal=mode != "none",
                        causal_offset=offset_of(mode, nq, nkv))
        assert dispatch.plan_fwd(p).kernel_cls.__name__ == fwd
        assert [c.__name__ for c, _ in dispatch.plan_bwd(p).jobs][1] == bwd
        _check_backward(mode, nq, nkv, ratio, expect_kernels=True, d=d, family="sm90")


def _check_backward(mode, nq, nkv, ratio, expect_kernels=False, d=512, dv=None, family=None):
    hkv = 2 if ratio < 16 else 1
    q, k, v = make_qkv(1, hkv * ratio, hkv, nq, nkv, d, BF16, grad=True)
    if dv is not None:  # Dv != D (MLA-absorbed 576 / 512)
        v = torch.randn(1, hkv, nkv, dv, device="cuda", dtype=BF16, requires_grad=True)
    kernel_plan(q, k, v, mode)
    causal, off = mode != "none", offset_of(mode, nq, nkv)
    if expect_kernels:
        problem = AttnProblem.from_tensors(q, k, v, causal=causal, causal_offset=off)
        plan = dispatch.plan_bwd(problem)
        assert plan.reason is None and family in (None, plan.family), plan
    dout = torch.randn(1, hkv * ratio, nq, dv or d, device="cuda", dtype=BF16)
    call(q, k, v, mode).backward(dout)
    check_grads(q, k, v, dout, causal, off)


SPLIT_O_CASES = [(592, "none", 129, 1000, 1), (640, "bottom_right", 1000, 129, 4),
                 (768, "upper_left", 7, 7, 16), (1024, "none", 1000, 1000, 1),
                 (1024, "bottom_right", 1, 129, 4), (1024, "none", 4097, 4097, 1)]


@pytest.mark.parametrize("d,mode,nq,nkv,ratio", SPLIT_O_CASES)
def test_forward_sm90_split_o(seed, d, mode, nq, nkv, ratio):
    """The WGMMA kernel with O split over two CTAs that both score every block
    (`Options.kv_pair` off): numerics, and the plan really is FFPAFwdSm90."""
    with sm90_only(kv_pair=False):
        q, k, v = make_qkv(1, 2 * ratio, 2, nq, nkv, d, BF16)
        plan = kernel_plan(q, k, v, mode)
        assert plan.kernel_cls.__name__ == "FFPAFwdSm90" and plan.cfg.o_split == 2
        assert not plan.cfg.kv_pair
        check_forward(d, BF16, mode, nq, nkv, ratio)


KV_PAIR_CASES = [(1024, "none", 1000, 1000, 1), (1024, "bottom_right", 129, 1000, 4),
                 (1024, "upper_left", 1000, 1000, 16), (768, "bottom_right", 1000, 129, 1),
                 (592, "none", 7, 4097, 4), (1024, "none", 1, 1, 1), (640, "upper_left", 129, 7, 1),
                 (1024, "bottom_right", 4097, 4097, 2),
                 # D % 128 == 8: the second CTA on a 64-byte half line (`cta_align` 32)
                 (776, "bottom_right", 1000, 129, 4), (648, "upper_left", 129, 1000, 1),
                 (776, "none", 7, 4097, 16), (904, "bottom_right", 1000, 1000, 2)]


@pytest.mark.parametrize("d,mode,nq,nkv,ratio", KV_PAIR_CASES)
def test_kv_pair_forward(seed, d, mode, nq, nkv, ratio):
    """D > 512 with `kv_pair` (the CTA pair splits the KV blocks and exchanges row maxima, P
    and row sums through distributed shared memory): numerics and LSE as every forward, odd and
    even block counts (a last block both CTAs score), both causal alignments, GQA; at D %
    128 == 8 the second CTA's columns from a half line (`cta_align` 32)."""
    with sm90_only():
        q, k, v = make_qkv(1, 2 * ratio, 2, nq, nkv, d, BF16)
        plan = kernel_plan(q, k, v, mode)
        assert plan.cfg.kv_pair and plan.cfg.o_split == 2
        assert plan.cfg.cta_align == 32 or d % 128 != 8
        check_forward(d, BF16, mode, nq, nkv, ratio)


WIDE_O_CASES = [(520, BF16, "none", 129, 1000, 4), (520, BF16, "bottom_right", 1000, 1000, 1),
                (528, FP16, "upper_left", 1000, 129, 16), (536, BF16, "bottom_right", 7, 4097, 2),
                (544, BF16, "none", 1, 4097, 64), (552, FP16, "none", 4097, 4097, 1),
                (560, BF16, "upper_left", 129, 7, 4), (568, BF16, "bottom_right", 129, 1000, 64),
                (576, BF16, "none", 1000, 129, 16), (576, FP16, "bottom_right", 4097, 1000, 4)]


@pytest.mark.parametrize("d,dtype,mode,nq,nkv,ratio", WIDE_O_CASES)
def test_forward_wide_o(seed, d, dtype, mode, nq, nkv, ratio):
    """D in (512, 576] with O in one CTA (`wide_o`: O shares of up to 288 columns as m64n96
    WGMMAs, `setmaxnreg` S 152 / O 176): numerics and LSE as every forward, both causal
    alignments, GQA and MQA (rows packed), odd lengths, fp16, both share splits (the hi share
    from column 256 up to D=544, from 288 above)."""
    with sm90_only():
        q, k, v = make_qkv(1, 2 * ratio, 2, nq, nkv, d, dtype)
        plan = kernel_plan(q, k, v, mode)
        assert plan.cfg.wide_o and plan.cfg.o_split == 1 and not plan.cfg.kv_pair
        check_forward(d, dtype, mode, nq, nkv, ratio)


@contextlib.contextmanager
def sm90_only(**changes):
    """The sm90 family (sm_90 only) with these `Options` changes for the block."""
    if dispatch.current_arch() != "sm_90a":
        pytest.skip("WGMMA kernels: sm_90 only")
    with ffpa_cute.options.use(family="sm90", **changes):
        yield


@pytest.mark.parametrize("hq,hkv,nq,nkv,mode", [(32, 8, 1, 4097, "none"),
                                                (8, 8, 129, 1000, "bottom_right"),
                                                (128, 1, 1, 300, "bottom_right")])
def test_repeated_calls_take_the_fast_path(seed, hq, hkv, nq, nkv, mode):
    """Same-signature calls without grad, fresh data each time: from the second on the
    per-signature launcher (`launch.FwdCall`: outputs allocated, the compiled kernel called)
    launches; every result passes the reference check, and a misaligned view of the same
    signature falls back to the general path and is still right."""
    interface._clear_caches()
    causal, off = mode != "none", offset_of(mode, nq, nkv)

    def check(q, k, v):
        with torch.no_grad():
            out = call(q, k, v, mode)
        ref, _ = attention_ref(q, k, v, causal=causal, causal_offset=off)
        base, _ = attention_same_dtype(q, k, v, causal=causal, causal_offset=off)
        assert rel_err(out, ref) <= 2 * rel_err(base, ref) + 1e-3

    for _ in range(4):
        check(*make_qkv(1, hq, hkv, nq, nkv, 512, BF16))
    entries = list(interface._FAST_CALLS.values())
    assert len(entries) == 1 and entries[0][-1] is not None
    assert entries[0][-1].fn is not None  # the launcher ran
    q, k, v = make_qkv(1, hq, hkv, nq, nkv, 512, BF16)
    buf = torch.randn(q.numel() + 1, device="cuda", dtype=BF16)
    check(buf[1:].view(q.shape), k, v)  # 2-byte offset: same signature, general path
    # with gradients: the autograd Function around the same launcher, same bits forward
    with torch.no_grad():
        want = call(q, k, v, mode)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    for _ in range(3):
        out = call(qg, kg, vg, mode)
        assert out.grad_fn is not None and torch.equal(out, want)
    out.float().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (qg, kg, vg))


@pytest.mark.parametrize("d,n,dt", [(512, 1000, BF16), (264, 7, FP16), (1024, 1, BF16),
                                    (576, 4097, BF16)])
def test_fused_delta(seed, d, n, dt):
    """The Delta kernel (`common/delta.py`: Delta = rowsum(dO * O), one warp per row) against
    float64, contiguous and with a strided head layout."""
    run_delta = kernels.delta

    base = torch.randn(2, n, 3, d, device="cuda", dtype=dt)  # [B, N, H, D] storage
    for dout, out in ((torch.randn(2, 3, n, d, device="cuda", dtype=dt),
                       torch.randn(2, 3, n, d, device="cuda", dtype=dt)),
                      (base.transpose(1, 2), torch.randn_like(base).transpose(1, 2))):
        got = run_delta(dout, out)
        ref = (dout.double() * out.double()).sum(-1)
        assert got.dtype == torch.float32 and got.shape == ref.shape
        assert rel_err(got, ref) <= 1e-5, rel_err(got, ref)


@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_backward_with_fused_delta(seed, family):
    if family == "sm90" and dispatch.current_arch() != "sm_90a":
        pytest.skip("WGMMA kernels: sm_90 only")
    with ffpa_cute.options.use(family=family):
        _check_backward("bottom_right", 129, 1000, 4, expect_kernels=True, family=family)


@pytest.mark.parametrize("mode,nq,nkv,ratio", [("bottom_right", 129, 1000, 16),
                                               ("none", 1000, 1000, 1)])
def test_backward_dv_not_d(seed, mode, nq, nkv, ratio):
    """MLA 576 / 512 through autograd: the WGMMA forward and backward kernels (no SDPA
    recompute)."""
    with sm90_only():
        _check_backward(mode, nq, nkv, ratio, expect_kernels=True, d=576, dv=512)


@pytest.mark.parametrize("d,mode,nq,nkv,ratio", [(512, "bottom_right", 1000, 1000, 4),
                                                 (512, "upper_left", 129, 1000, 8),
                                                 (1024, "none", 129, 1000, 1),
                                                 (1024, "bottom_right", 1000, 129, 1)])
def test_return_lse(seed, d, mode, nq, nkv, ratio):
    """attention(return_lse=True) on the kernel path: out as without it, lse (float32, -inf
    exactly on rows without keys) against float64, the fast path keeps both kinds of call apart,
    and gradients flow through out and lse (the backward kernels read Delta - dlse)."""
    interface._clear_caches()
    q, k, v = make_qkv(1, 2 * ratio, 2, nq, nkv, d, BF16, grad=True)
    kernel_plan(q, k, v, mode)
    causal, off = mode != "none", offset_of(mode, nq, nkv)
    ref, ref_lse = attention_ref(q, k, v, causal=causal, causal_offset=off)
    base, _ = attention_same_dtype(q, k, v, causal=causal, causal_offset=off)
    for _ in range(2):  # the second round takes the per-signature fast path
        out, lse = call(q, k, v, mode, return_lse=True)
        assert torch.equal(out, call(q, k, v, mode))
        assert rel_err(out, ref) <= 2 * rel_err(base, ref) + 1e-3
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
        assert lse.requires_grad and out.requires_grad
        assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
        finite = torch.isfinite(ref_lse)
        assert (lse[finite].double() - ref_lse[finite]).abs().max().item() <= 2e-3
    dout = torch.randn_like(out)
    out.backward(dout, retain_graph=True)
    check_grads(q, k, v, dout, causal, off)
    # a loss through out and lse: dS = P (dP - Delta + dlse)
    for t in (q, k, v):
        t.grad = None
    dlse = torch.randn_like(lse)
    ((out * dout).sum() + (lse.masked_fill(torch.isneginf(lse), 0.0) * dlse).sum()).backward()
    ref_g = attention_grads(q, k, v, dout, causal=causal, causal_offset=off, dlse=dlse)
    base_g = attention_grads(q, k, v, dout, causal=causal, causal_offset=off, dtype=BF16,
                             dlse=dlse)
    for name, t, r, b in zip("qkv", (q, k, v), ref_g, base_g):
        err, base_err = rel_err(t.grad, r), rel_err(b, r)
        assert err <= 2 * base_err + 1e-3, f"d{name} with dlse: {err:.3g} vs {base_err:.3g}"


def test_merge_of_kernel_blocks(seed):
    """Key splits through the kernels with explicit causal offsets (`blockwise.block_forward`,
    the ring's unit), merged: attention over all keys within the bf16 criterion."""
    from ffpa_cute.blockwise import block_forward

    q, k, v = make_qkv(1, 8, 2, 1000, 1000, 512, BF16)
    outs, lses = [], []
    for a, b in ((0, 384), (384, 640), (640, 1000)):
        o, s = block_forward(q, k[:, :, a:b], v[:, :, a:b], causal=True, offset=-a, scale=None,
                             strict=True)
        outs.append(o)
        lses.append(s)
    out, lse = ffpa_cute.merge_attention(outs, lses)
    ref, ref_lse = attention_ref(q, k, v, causal=True, causal_offset=0)
    base, _ = attention_same_dtype(q, k, v, causal=True, causal_offset=0)
    assert rel_err(out, ref) <= 2 * rel_err(base, ref) + 1e-3
    assert (lse.double() - ref_lse).abs().max().item() <= 2e-3
