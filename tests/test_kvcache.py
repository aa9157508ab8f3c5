"""`attention_with_kvcache` on the CPU: decode and chunked prefill against a contiguous or paged
cache. Each row's keys are gathered for the reference position by position (page
block_table[b, t // page_size], slot t % page_size) from a copy of the cache taken before the
call, plus the new keys; the float64 reference of `masked_ref` then applies causal
(bottom-right over the row's keys), window and sinks. Shuffled page tables with junk in the
unused entries, stale data past every valid length, page sizes that do not divide the lengths,
GQA / MQA up to 128:1, split-KV (num_splits) combined exactly, the in-place append, the fake
kernel route, the argument errors.
"""

import math

import pytest
import torch

import fake_kernels  # tests/ is on sys.path
from ffpa_cute import attention_with_kvcache
from ffpa_cute.common import convert
from masked_ref import bound, ref_attention, rel_err

F64 = torch.float64


class Cache:
    """A random cache (contiguous, or paged with a shuffled block table) and what it holds."""

    def __init__(self, lens, nnew, hkv=2, d=16, dv=24, page_size=None, dtype=F64):
        b = len(lens)
        need = [n + nnew for n in lens]
        self.lens, self.page_size = lens, page_size
        if page_size is None:
            cap = max(need) + 5
            self.k = torch.randn(b, cap, hkv, d, dtype=dtype)
            self.v = torch.randn(b, cap, hkv, dv, dtype=dtype)
            self.table = None
        else:
            counts = [math.ceil(n / page_size) for n in need]
            num_pages = sum(counts) + 3  # spare pages hold junk too
            perm = torch.randperm(num_pages).tolist()
            width = max(counts, default=0) + 2
            self.table = torch.full((b, width), -1, dtype=torch.int32)  # junk past the used
            for row, c in enumerate(counts):
                self.table[row, :c] = torch.tensor(perm[:c], dtype=torch.int32)
                perm = perm[c:]
            self.k = torch.randn(num_pages, page_size, hkv, d, dtype=dtype)
            self.v = torch.randn(num_pages, page_size, hkv, dv, dtype=dtype)
        self.k0, self.v0 = self.k.clone(), self.v.clone()  # before the call

    def slot(self, row, t):
        """Index of key t of `row` in the cache tensors."""
        if self.table is None:
            return row, t
        return int(self.table[row, t // self.page_size]), t % self.page_size

    def keys(self, row, n, cache):
        """[n, Hkv, D] gathered position by position."""
        return torch.stack([cache[self.slot(row, t)] for t in range(n)]) if n else cache[0, :0]


def reference(q, cache, new_k, new_v, dtype=F64, **kw):
    """(out [B, Nq, Hq, Dv], lse [B, Hq, Nq]) from the cache's contents before the call."""
    outs, lses = [], []
    for row, n in enumerate(cache.lens):
        k, v = cache.keys(row, n, cache.k0), cache.keys(row, n, cache.v0)
        if new_k is not None:
            k, v = torch.cat([k, new_k[row]]), torch.cat([v, new_v[row]])
        o, s = ref_attention(q[row].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                             dtype=dtype, **kw)
        outs.append(o.transpose(0, 1))
        lses.append(s)
    return torch.stack(outs), torch.stack(lses)


def inputs(cache, nq, nnew, hq, dtype=F64):
    b, hkv, d = len(cache.lens), cache.k.shape[2], cache.k.shape[3]
    q = torch.randn(b, nq, hq, d, dtype=dtype)
    if not nnew:
        return q, None, None
    return (q, torch.randn(b, nnew, hkv, d, dtype=dtype),
            torch.randn(b, nnew, hkv, cache.v.shape[3], dtype=dtype))


def seqlens(cache):
    return torch.tensor(cache.lens, dtype=torch.int32)


def check_append(cache, new_k, new_v):
    """The new keys sit at positions lens[b] .. + Nnew - 1 of each row; nothing else moved."""
    k_want, v_want = cache.k0.clone(), cache.v0.clone()
    if new_k is not None:
        for row, n in enumerate(cache.lens):
            for i in range(new_k.shape[1]):
                k_want[cache.slot(row, n + i)] = new_k[row, i]
                v_want[cache.slot(row, n + i)] = new_v[row, i]
    assert torch.equal(cache.k, k_want) and torch.equal(cache.v, v_want)


# (cache lengths per row, Nq, Nnew): decode, chunked prefill, more queries than keys
CASES = [([37, 0, 100, 5], 1, 1), ([37, 1, 100, 5], 1, 0), ([29, 0, 63], 3, 3),
         ([2, 9], 5, 0)]


@pytest.mark.parametrize("page_size", [None, 16, 24, 256])
@pytest.mark.parametrize("lens,nq,nnew", CASES)
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("features", ["none", "window+sinks"])
def test_matches_reference(seed, page_size, lens, nq, nnew, num_splits, features):
    cache = Cache(lens, nnew, page_size=page_size)
    q, k, v = inputs(cache, nq, nnew, hq=6)
    kw = dict(window=(7, 0), sinks=torch.randn(6, dtype=F64)) if features != "none" else {}
    out, lse = attention_with_kvcache(q, cache.k, cache.v, seqlens(cache), cache.table, k=k,
                                      v=v, num_splits=num_splits, return_lse=True, **kw)
    ref, ref_lse = reference(q, cache, k, v, causal=True, **kw)
    assert out.shape == (len(lens), nq, 6, 24) and lse.shape == (len(lens), 6, nq)
    assert lse.dtype == F64
    assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12
    check_append(cache, k, v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (4, 2), (None, 0)])
def test_causal_and_window_frames(seed, causal, window):
    """Non-causal, causal and windowed prefill chunks sit at the end of each row's keys."""
    cache = Cache([21, 3, 40], 4, page_size=16)
    q, k, v = inputs(cache, 7, 4, hq=4)
    out = attention_with_kvcache(q, cache.k, cache.v, seqlens(cache), cache.table, k=k, v=v,
                                 is_causal=causal, window=window)
    assert rel_err(out, reference(q, cache, k, v, causal=causal, window=window)[0]) <= 1e-12


@pytest.mark.parametrize("num_splits", [1, 2, 5, 7, 200])
def test_split_kv_is_exact(seed, num_splits):
    """Any number of parts (more than there are keys too) merges to the same attention."""
    cache = Cache([37, 1, 100], 0, page_size=16)
    q, _, _ = inputs(cache, 2, 0, hq=4)
    sinks = torch.randn(4, dtype=F64)
    out, lse = attention_with_kvcache(q, cache.k, cache.v, seqlens(cache), cache.table,
                                      window=(50, None), sinks=sinks, num_splits=num_splits,
                                      return_lse=True)
    ref, ref_lse = reference(q, cache, None, None, causal=True, window=(50, None), sinks=sinks)
    assert rel_err(out, ref) <= 1e-12 and rel_err(lse, ref_lse) <= 1e-12


@pytest.mark.parametrize("hq,hkv", [(128, 1), (64, 2), (32, 8)])
@pytest.mark.parametrize("dtype", [F64, torch.bfloat16])
def test_decode_gqa_mqa(seed, hq, hkv, dtype):
    """Decode (one new token per row) with up to 128 query heads per KV head, page 16 against
    lengths it does not divide, a window, sinks, two splits; bf16 within 2x torch's same-dtype
    error + 1e-3."""
    cache = Cache([33, 0, 70], 1, hkv=hkv, d=32, dv=32, page_size=16, dtype=dtype)
    q, k, v = inputs(cache, 1, 1, hq=hq, dtype=dtype)
    sinks = torch.randn(hq)
    out, lse = attention_with_kvcache(q, cache.k, cache.v, seqlens(cache), cache.table, k=k,
                                      v=v, window=(40, 0), sinks=sinks, num_splits=2,
                                      return_lse=True)
    kw = dict(causal=True, window=(40, 0), sinks=sinks)
    truth, truth_lse = reference(q, cache, k, v, **kw)
    if dtype == F64:
        assert rel_err(out, truth) <= 1e-12 and rel_err(lse, truth_lse) <= 1e-12
        return
    same, same_lse = reference(q, cache, k, v, dtype=dtype, **kw)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel_err(out, truth) <= bound(rel_err(same, truth))
    assert rel_err(lse, truth_lse) <= bound(rel_err(same_lse, truth_lse))


def test_empty_rows_and_int_seqlens(seed):
    """A row with no keys gives out 0 and lse -inf (the sink with sinks); cache_seqlens may be
    one int for every row."""
    cache = Cache([0, 0], 0, hkv=2, page_size=16)
    q, _, _ = inputs(cache, 3, 0, hq=2)
    out, lse = attention_with_kvcache(q, cache.k, cache.v, 0, cache.table, return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
    sinks = torch.randn(2, dtype=F64)
    out, lse = attention_with_kvcache(q, cache.k, cache.v, seqlens(cache), cache.table,
                                      sinks=sinks, return_lse=True)
    assert (out == 0).all() and torch.equal(lse, sinks[None, :, None].expand(2, 2, 3))
    cache = Cache([12, 12, 12], 0)
    q, _, _ = inputs(cache, 2, 0, hq=4)
    out = attention_with_kvcache(q, cache.k, cache.v, 12)
    assert rel_err(out, reference(q, cache, None, None, causal=True)[0]) <= 1e-12


def test_forward_only(seed):
    cache = Cache([5, 9], 0, page_size=16)
    q, _, _ = inputs(cache, 1, 0, hq=4)
    sinks = torch.nn.Parameter(torch.randn(4, dtype=F64))  # a model's parameter
    with pytest.raises(NotImplementedError, match=r"forward-only \(serving\); sinks require"):
        attention_with_kvcache(q, cache.k, cache.v, seqlens(cache), cache.table, sinks=sinks)
    with torch.no_grad():
        out = attention_with_kvcache(q, cache.k, cache.v, seqlens(cache), cache.table,
                                     sinks=sinks)
    with torch.inference_mode():
        out2 = attention_with_kvcache(q, cache.k, cache.v, seqlens(cache), cache.table,
                                      sinks=sinks)
    want = reference(q, cache, None, None, causal=True, sinks=sinks.detach())[0]
    assert rel_err(out, want) <= 1e-12 and torch.equal(out, out2)


def test_fake_kernel_route(seed, monkeypatch):
    """Every part of every row routes like attention(): with a planner that serves everything,
    B x num_splits "kernel" calls (sinks applied after the merge); with a window too (the sm90
    kernels have it): strict mode runs it."""
    fake = fake_kernels.install(monkeypatch)
    cache = Cache([37, 10, 100], 1, page_size=16)
    q, k, v = inputs(cache, 1, 1, hq=4)
    sinks = torch.randn(4, dtype=F64)
    out = attention_with_kvcache(q, cache.k, cache.v, seqlens(cache), cache.table, k=k, v=v,
                                 sinks=sinks, num_splits=3)
    assert len(fake.fwd_calls) == 9 and sum(p.seqlen_kv for p in fake.fwd_calls) == 150
    assert rel_err(out, reference(q, cache, k, v, causal=True, sinks=sinks)[0]) <= 1e-12
    out = attention_with_kvcache(q, cache.k, cache.v, seqlens(cache), cache.table,
                                 window=(3, 0), strict=True)
    assert len(fake.fwd_calls) > 9 and fake.fwd_calls[-1].window_lo is not None
    assert rel_err(out, reference(q, cache, None, None, causal=True, window=(3, 0))[0]) <= 1e-12


# -------------------------------------------------------------------------------- errors

E4M3 = torch.float8_e4m3fn
KC = torch.randn(6, 16, 2, 8)  # 6 pages of 16
QD = torch.randn(2, 1, 4, 8)  # B=2, Nq=1, Hq=4
BT = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
SL = torch.tensor([20, 5], dtype=torch.int32)


@pytest.mark.parametrize("args,kw,exc,pattern", [
    ((QD, KC, KC, SL, BT), {"k": torch.randn(2, 1, 2, 8)}, ValueError,
     r"^k and v \(the new keys and values\) must be given together"),
    ((QD[0], KC, KC, SL, BT), {}, ValueError, r"^q must be 4-D"),
    ((QD, KC.double(), KC, SL, BT), {}, TypeError,
     r"^k_cache and v_cache must both be in q's dtype .* got torch.float64 and torch.float32"),
    ((QD.long(), KC, KC, SL, BT), {}, TypeError, r"^q must be bfloat16, .* got torch.int64"),
    ((QD, KC.to(E4M3), KC, SL, BT), {}, TypeError, r"^k_cache and v_cache must both be"),
    ((QD, KC.to(E4M3), KC.to(E4M3), SL, BT), {"k": torch.randn(2, 1, 2, 8).double(),
     "v": torch.randn(2, 1, 2, 8)}, TypeError,
     r"^k \(new keys / values\) must be in the cache's dtype .* or q's"),
    ((QD, KC, KC, SL, BT), {"k_descale": 0.5}, ValueError,
     r"^k_descale / v_descale scale an FP8 cache"),
    ((QD, KC.to(E4M3), KC.to(E4M3), SL, BT), {"v_descale": torch.ones(3)}, ValueError,
     r"^v_descale must be a number, a 1-element tensor or \[B, Hkv\] = \[2, 2\]"),
    ((QD, KC[..., :4], KC[..., :4], SL, BT), {}, ValueError, r"^k_cache / v_cache must be .*D = 8"),
    ((QD, KC, KC[:, :, :1], SL, BT), {}, ValueError, r"^k_cache / v_cache must be"),
    ((QD, KC[:, :, :1].expand(6, 16, 3, 8), KC[:, :, :1].expand(6, 16, 3, 8), SL, BT), {},
     ValueError, r"q's heads \(4\) must be a multiple of the cache's heads \(3\)"),
    ((QD, KC[:3], KC[:3], SL), {}, ValueError, r"\[B, Ncache, Hkv, D\] \(contiguous"),
    ((QD, KC, KC, SL.float(), BT), {}, TypeError, r"^cache_seqlens must be an int32"),
    ((QD, KC, KC, SL[:1], BT), {}, ValueError, r"^cache_seqlens must have shape \[B\] = \[2\]"),
    ((QD, KC, KC, -SL, BT), {}, ValueError, r"^cache_seqlens must be >= 0"),
    ((QD, KC, KC, SL, BT.float()), {}, TypeError, r"^block_table must be an int32"),
    ((QD, KC, KC, SL, BT[:1]), {}, ValueError, r"^block_table must be \[B, max_pages\]"),
    ((QD, KC, KC, SL + 20, BT), {}, ValueError, r"^row 0 needs 40 keys .* 2 pages of 16 = 32"),
    ((QD, KC, KC, SL, BT + 5), {}, ValueError, r"^block_table\[0\] refers to pages \[5, 6\]; "
     r"k_cache has 6"),
    ((QD, KC[:2], KC[:2], SL), {}, ValueError,
     r"^a row needs 20 keys .* Ncache = 16"),
    ((QD, KC, KC, SL, BT), {"k": torch.randn(2, 1, 2, 4), "v": torch.randn(2, 1, 2, 8)},
     ValueError, r"^k / v must be \[B, Nnew, Hkv, D\]"),
    ((QD, KC, KC, SL, BT), {"num_splits": 0}, ValueError, r"^num_splits must be None"),
    ((QD, KC, KC, SL, BT), {"num_splits": 2.0}, TypeError, r"^num_splits must be None"),
    ((QD, KC, KC, SL, BT), {"is_causal": None}, TypeError, r"^is_causal must be a bool"),
    ((QD, KC, KC, SL, BT), {"scale": "x"}, TypeError, r"^scale must be None or a float"),
    ((QD, KC, KC, SL, BT), {"window": (2,)}, TypeError, r"^window must be None or a pair"),
    ((QD, KC, KC, SL, BT), {"sinks": torch.ones(2)}, ValueError, r"sinks must have shape"),
    ((QD, KC, KC, SL, BT), {"return_lse": "yes"}, TypeError, r"^return_lse must be a bool"),
])
def test_errors_name_the_argument(args, kw, exc, pattern):
    with pytest.raises(exc, match=pattern):
        attention_with_kvcache(*args, **kw)


@pytest.mark.parametrize("page_size", [None, 16])
@pytest.mark.parametrize("granularity", ["tensor", "head"])
def test_fp8_cache(seed, page_size, granularity):
    """An FP8 cache (e4m3 with descales) under bf16 queries, through the host loop: the
    attention of the dequantised cache (cache * descale), the new bf16 keys quantised into it
    with the descales; GQA 4:2, odd lengths, one empty row."""
    from ffpa_cute import quantize_fp8

    cache = Cache([37, 0, 100], 1, d=16, dv=16, page_size=page_size, dtype=torch.float32)
    b, hkv = 3, cache.k.shape[2]

    def fp8(x):  # the cache's [rows, page, Hkv, D] quantised per tensor or per (., head)
        x8, d = quantize_fp8(x.transpose(1, 2), granularity=granularity)
        return x8.transpose(1, 2).contiguous(), d

    (k8, kd), (v8, vd) = fp8(cache.k), fp8(cache.v)
    if granularity == "head":  # the kernel's descales are per (batch row, KV head), near the
        # quantiser's amax / 448 (codes of N(0, 1) data span +-448): descales near 1 made K
        # ~100x N(0, 1), scores of hundreds and one-hot rows whose winning key flips with bf16
        # rounding (torch 2.11's CPU SDPA and 2.13's picked different keys)
        kd, vd = (torch.rand(b, hkv) + 0.5) / 64, (torch.rand(b, hkv) + 0.5) / 64
    q, k, v = inputs(cache, 1, 1, hq=4, dtype=torch.bfloat16)
    want_k, want_v = k8.clone(), v8.clone()
    out, lse = attention_with_kvcache(q, k8, v8, seqlens(cache), cache.table, k=k, v=v,
                                      k_descale=kd, v_descale=vd, return_lse=True)
    kd, vd = (torch.as_tensor(d).float().reshape(-1, 1).expand(b, hkv) if d.numel() == 1
              else d for d in (kd, vd))
    # the reference reads the dequantised cache: each slot times its batch row's descales
    for row, n in enumerate(cache.lens):
        for t in range(n + 1):
            slot = cache.slot(row, t)
            if t == n:  # the new key: quantised with the descales on the way in
                want_k[slot] = (k[row, 0].float() / kd[row, :, None]).clamp(-448, 448).to(E4M3)
                want_v[slot] = (v[row, 0].float() / vd[row, :, None]).clamp(-448, 448).to(E4M3)
            cache.k0[slot] = want_k[slot].double() * kd[row, :, None]
            cache.v0[slot] = want_v[slot].double() * vd[row, :, None]
    assert torch.equal(k8.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), want_v.view(torch.uint8))
    cache.lens = [n + 1 for n in cache.lens]
    ref, ref_lse = reference(q.double(), cache, None, None, causal=True)
    assert rel_err(out, ref) <= 2e-2 and rel_err(lse, ref_lse) <= 1e-2
    assert out.dtype == torch.bfloat16


def test_e4m3_bit_conversion_is_exact():
    """common/convert.py's bit recipe (mirrored here on every e4m3 byte but the NaN codes):
    bytes -> [b1, 0, b0, 0] words, magnitudes shifted into a bf16 / fp16's fields, signs put
    back, times 2^120 / 2^8, equals torch's conversion exactly (subnormals and zero included)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.int64)
    exact = codes.to(torch.uint8).view(E4M3).double()
    for kind, shift, bias, dtype in (("bf16", 4, 2.0 ** 120, torch.bfloat16),
                                     ("fp16", 1, 2.0 ** 8, torch.float16)):
        t = codes << 8                               # the byte in bits 8-15 (prmt 0x1404)
        m = (codes & 0x7F) << 8
        half = ((m >> shift) | (t & 0x8000)).to(torch.int16)  # lop3 a | (b & 0x8000)
        got = half.view(dtype).double() * bias       # mul.rn by the packed power of two
        assert torch.equal(got, exact), kind
        assert f"shr.b32 t0, t0, {shift};" in convert.PTX[kind]


def test_validate_must_be_a_bool():
    with pytest.raises(TypeError, match="^validate must be a bool"):
        attention_with_kvcache(QD, KC, KC, SL, BT, validate=1)


def test_decode_split_count_fills_the_waves(monkeypatch):
    """decode.num_splits: the fewest splits keeping >= 95% of the SM waves busy (132 SMs), at
    least two KV blocks each, at most 256."""
    from types import SimpleNamespace

    from ffpa_cute import decode

    monkeypatch.setattr(decode.launch, "sm_count", lambda index=None: 132)

    def splits(b, hkv, g, n, tile_n=64):
        plan = SimpleNamespace(cfg=SimpleNamespace(tile_m=64, tile_n=tile_n, o_split=1),
                               problem=SimpleNamespace(seqlen_q=g))
        return decode.num_splits(plan, b, hkv, n, torch.device("cpu"))

    assert splits(8, 4, 8, 32768) == 4      # 128 CTAs (5 would be 160: 1.2 waves)
    assert splits(64, 4, 8, 32768) == 1     # 256 CTAs: 1.94 waves already
    assert splits(1, 4, 8, 4096) == 32      # 128 CTAs
    assert splits(1, 1, 64, 131072) == 126  # one row tile: 126 of 132 SMs
    assert splits(1, 4, 8, 256) == 2        # two blocks per split at least
    assert splits(1, 4, 8, 0) == 1


def test_decode_merge_of_splits_is_exact():
    """decode.merge_splits equals merge_attention over the same parts, empty splits (lse -inf)
    and rows empty everywhere (out 0, lse -inf) included."""
    from ffpa_cute import decode, merge_attention

    out = torch.randn(2, 3, 5, 7, 16, dtype=F64)  # [B, Hkv, S, M, Dv]
    lse = torch.randn(2, 3, 5, 7, dtype=F64)
    lse[0, 1, 2] = -math.inf       # an empty split
    lse[1, 2, :, 3] = -math.inf    # a row empty in every split
    got, got_lse = decode.merge_splits(out, lse)
    want, want_lse = merge_attention(list(out.unbind(2)), list(lse.unbind(2)))
    assert rel_err(got, want) <= 1e-12 and rel_err(got_lse, want_lse) <= 1e-12
    assert (got[1, 2, 3] == 0).all() and torch.isneginf(got_lse[1, 2, 3])
