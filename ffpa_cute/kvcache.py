"""Attention against a key/value cache, contiguous or paged, for decode and chunked prefill:
`attention_with_kvcache`, FlashAttention's `flash_attn_with_kvcache` convention. Forward only.

Layouts (FlashAttention's kvcache layout: batch, sequence, heads, head dim):
  q [B, Nq, Hq, D] -> out [B, Nq, Hq, Dv], lse [B, Hq, Nq].
  contiguous cache: k_cache [B, Ncache, Hkv, D], v_cache [B, Ncache, Hkv, Dv]; row b's key t is
    k_cache[b, t].
  paged cache (block_table [B, max_pages] given): k_cache [num_pages, page_size, Hkv, D],
    v_cache [num_pages, page_size, Hkv, Dv]; row b's key t is
    k_cache[block_table[b, t // page_size], t % page_size]. Any page size (the issue asks for
    16-256); it need not divide the lengths.
  cache_seqlens [B] (or one int): keys already valid in row b. New keys k / v
    [B, Nnew, Hkv, D(v)] are written into the cache in place at positions cache_seqlens[b] ..
    cache_seqlens[b] + Nnew - 1 (as FlashAttention does; cache_seqlens itself is not changed),
    and row b attends over its first n_b = cache_seqlens[b] + Nnew keys.
Causal is bottom-right over those n_b keys: the Nq queries are the last Nq positions (decode
with Nq = 1 sees every key; chunked prefill: query i sees keys j <= i + n_b - Nq); a window
is in the same frame. GQA / MQA: Hq any multiple of Hkv (128:1 included).

FP8 cache: k_cache / v_cache in float8_e4m3fn under bf16 / fp16 q hold K / V = cache * descale
(k_descale / v_descale: a number or [B, Hkv] fp32); the decode kernel converts its 8-bit stages
in shared memory (`FFPADecodeSm90`, config `kv_dtype`), the host loop dequantises the row's keys.

cache_seqlens and block_table are checked on the host (device syncs on CUDA; `validate=False`
skips that on the decode kernel's route). Decode and chunked prefill
(causal or not) without a window, with a contiguous cache or pages of a multiple of 64 rows,
on the sm90 family: one launch of the split-KV decode kernel reads the cache in place
(`decode.split_kv_decode`: query heads packed into rows, each row's keys split over several
CTAs, the fp32 partials merged exactly; a causal chunk masks per packed row). Anything else is
a loop on the host: row b's n_b keys gathered from its pages into a contiguous tensor (a
copy), cut into `num_splits` parts, each part routed like `attention()`
(`blockwise.block_forward`: a kernel where one serves it, else the native fallback; a window
takes the kernels or torch math as attention() does), the parts combined exactly with
`merge_attention`. Either way the sinks are added once to the merged result
(`math_attention.apply_sinks`).
"""

from __future__ import annotations

import numbers

import torch

from .blockwise import block_forward
from .decode import decode_plan, split_kv_decode
from .fp8 import descale_bh
from .math_attention import compute_dtype
from .merge import merge_attention
from .math_attention import apply_sinks
from .validate import check_return_lse, check_window_sinks, window_bounds

__all__ = ["attention_with_kvcache"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
FP8_CACHE = torch.float8_e4m3fn  # an FP8 cache: K / V = cache * descale
INDEX_DTYPES = (torch.int32, torch.int64)


def _check_tensors(q, k_cache, v_cache, k, v, paged):
    """Shape / dtype / device errors of the tensor arguments (raises)."""
    if (k is None) != (v is None):
        raise ValueError("k and v (the new keys and values) must be given together")
    named = [("q", q), ("k_cache", k_cache), ("v_cache", v_cache)]
    named += [("k", k), ("v", v)] if k is not None else []
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q must be bfloat16, float16, float32 or float64, got {q.dtype}")
    cache = k_cache.dtype
    fp8 = cache == FP8_CACHE
    if v_cache.dtype != cache or cache not in (q.dtype, FP8_CACHE):
        raise TypeError(f"k_cache and v_cache must both be in q's dtype ({q.dtype}) or both "
                        f"float8_e4m3fn (an FP8 cache, with k_descale / v_descale), got {cache} "
                        f"and {v_cache.dtype}")
    for name, t in named[3:]:  # new keys / values: quantised into an FP8 cache if 16-bit
        if t.dtype not in ((cache, q.dtype) if fp8 else (cache,)):
            raise TypeError(f"{name} (new keys / values) must be in the cache's dtype {cache}"
                            + (f" or q's ({q.dtype})" if fp8 else "") + f", got {t.dtype}")
    for name, t in named:
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}: one device")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D, got shape {tuple(t.shape)}")
    b, _, hq, d = q.shape
    layout = ("[num_pages, page_size, Hkv, D] (paged: block_table given)" if paged
              else "[B, Ncache, Hkv, D] (contiguous: no block_table)")
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != d or (
            not paged and k_cache.shape[0] != b):
        raise ValueError(f"k_cache / v_cache must be {layout} with q's B = {b} and D = {d}, got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    hkv = k_cache.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q's heads ({hq}) must be a multiple of the cache's heads ({hkv}) "
                         "(GQA / MQA)")
    if k is not None and (k.shape[0] != b or k.shape[2:] != k_cache.shape[2:]
                          or v.shape[:3] != k.shape[:3] or v.shape[3] != v_cache.shape[3]):
        raise ValueError(f"k / v must be [B, Nnew, Hkv, D] / [B, Nnew, Hkv, Dv] = [{b}, Nnew, "
                         f"{hkv}, {d} / {v_cache.shape[3]}], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")


def _lengths(cache_seqlens, b, device):
    """cache_seqlens as a host list of B ints >= 0 (raises naming it)."""
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        lens = [int(cache_seqlens)] * b
    elif isinstance(cache_seqlens, torch.Tensor) and cache_seqlens.dtype in INDEX_DTYPES:
        if tuple(cache_seqlens.shape) != (b,):
            raise ValueError(f"cache_seqlens must have shape [B] = [{b}], got "
                             f"{tuple(cache_seqlens.shape)}")
        if cache_seqlens.device.type != "cpu" and cache_seqlens.device != device:
            raise ValueError(f"cache_seqlens must be on the CPU or q's device ({device})")
        lens = cache_seqlens.tolist()
    else:
        raise TypeError(f"cache_seqlens must be an int32 / int64 tensor [B] or an int, got "
                        f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)}")
    if any(n < 0 for n in lens):
        raise ValueError(f"cache_seqlens must be >= 0, got {min(lens)}")
    return lens


def _pages(block_table, lens, page_size, num_pages, b, device):
    """block_table, checked: every page a row's n_b keys use is in [0, num_pages) (one
    vectorised check, one device sync), or raise naming the first bad row."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype not in INDEX_DTYPES:
        raise TypeError(f"block_table must be an int32 / int64 tensor [B, max_pages], got "
                        f"{getattr(block_table, 'dtype', type(block_table).__name__)}")
    if block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be [B, max_pages] with B = {b}, got "
                         f"{tuple(block_table.shape)}")
    if block_table.device.type != "cpu" and block_table.device != device:
        raise ValueError(f"block_table must be on the CPU or q's device ({device})")
    capacity = block_table.shape[1] * page_size
    for row, n in enumerate(lens):
        if n > capacity:
            raise ValueError(f"row {row} needs {n} keys (cache_seqlens + new) but block_table "
                             f"holds {block_table.shape[1]} pages of {page_size} = {capacity}")
    used = torch.tensor([-(-n // page_size) for n in lens], device=block_table.device)
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    bad = ((block_table < 0) | (block_table >= num_pages)) & (cols < used[:, None])
    rows = bad.any(1).nonzero().flatten().tolist()
    if rows:
        row = rows[0]
        pages = block_table[row, :used[row]].tolist()
        raise ValueError(f"block_table[{row}] refers to pages {pages}; k_cache has "
                         f"{num_pages} (0 .. {num_pages - 1})")
    return block_table


def _quantized(x, cache_dtype, descale):
    """New keys / values [B, Nnew, Hkv, D] as the cache stores them: as they are, or for an
    FP8 cache from a 16-bit x, x / descale ([B, Hkv]) rounded to e4m3 (saturated at +-448)."""
    if x.dtype == cache_dtype:
        return x
    top = torch.finfo(cache_dtype).max
    return (x.float() / descale[:, None, :, None]).clamp(-top, top).to(cache_dtype)


def _append(k_cache, v_cache, k, v, lens_before, table, page_size, descales=None):
    """Write the new keys / values into the cache in place at each row's positions
    cache_seqlens[b] .. + Nnew - 1 (table: the checked block_table, or None; descales: an FP8
    cache's (k, v) [B, Hkv], with which 16-bit new keys are quantised)."""
    b, nnew = k.shape[:2]
    dev = k_cache.device
    if descales is not None:
        k, v = (_quantized(x, k_cache.dtype, d) for x, d in zip((k, v), descales))
    before = (lens_before.to(dev, torch.long) if isinstance(lens_before, torch.Tensor)
              else torch.tensor(lens_before, device=dev))
    pos = before.unsqueeze(1) + torch.arange(nnew, device=dev)  # [B, Nnew]
    if table is None:
        rows = torch.arange(b, device=dev).unsqueeze(1).expand(b, nnew)
        k_cache[rows, pos], v_cache[rows, pos] = k, v
        return
    page = table.to(dev, torch.long).gather(1, torch.div(pos, page_size, rounding_mode="floor"))
    k_cache[page, pos % page_size], v_cache[page, pos % page_size] = k, v


def _parts(n, num_splits):
    """Key ranges cutting [0, n) into at most `num_splits` equal parts (one empty part if n
    is 0)."""
    size = max(1, -(-n // num_splits))
    return [(a, min(n, a + size)) for a in range(0, n, size)] or [(0, 0)]


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table=None, *, k=None,
                           v=None, is_causal=True, scale=None, window=None, sinks=None,
                           return_lse=False, num_splits=None, strict=None, validate=True,
                           k_descale=None, v_descale=None):
    """Attention of q [B, Nq, Hq, D] against each row's cached keys (plus new ones appended in
    place); returns out [B, Nq, Hq, Dv] in q's dtype, or with `return_lse=True` (out, lse
    [B, Hq, Nq] float32, float64 for float64 inputs). Layouts and the in-place append: the
    module docstring.

    is_causal (default True): bottom-right over each row's keys. window=(left, right), sinks
    [Hq] (scaled-score units, in every row's denominator and in lse): as in `attention()`.
    num_splits: cut each row's keys into that many parts and combine them exactly through
    their lse (split-KV); None picks automatically (the decode kernel: about one wave of CTAs;
    the host loop: 1). Forward only (serving): inputs
    that require grad are refused while grad mode is on; run it under torch.no_grad() or
    torch.inference_mode(). Routing, logging and `strict` as in `attention()`, per part.

    validate (default True): check cache_seqlens and block_table on the host (lengths >= 0 and
    within the cache, every used page in range; named errors), which reads them: one or two
    device syncs. False skips that on the decode kernel's route (no sync: CUDA-graph capture,
    the lowest latency): the caller guarantees them, and an out-of-range page or length gives
    wrong results, not an error. The host loop always validates (it reads the lengths anyway).

    FP8 cache (k_cache, v_cache float8_e4m3fn under bfloat16 / float16 q, as vLLM and SGLang
    store it): the keys and values are cache * descale, k_descale / v_descale a number, a
    1-element tensor or [B, Hkv] fp32 (None: 1); new k / v in q's dtype are quantised into
    the cache with them (x / descale, saturated at +-448), or given already in e4m3. The decode
    kernel converts the 8-bit tiles to q's dtype in shared memory and runs its 16-bit path:
    half the bytes of a 16-bit cache, the numerics of attention on the dequantised cache; the
    host loop dequantises the row's keys to q's dtype. (`ffpa_cute.quantize_fp8` makes such a
    cache and its descales.)
    """
    paged = block_table is not None
    _check_tensors(q, k_cache, v_cache, k, v, paged)
    descales = _kv_descales(k_cache, k_descale, v_descale, q)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"scale must be None or a float, got {type(scale).__name__}")
    if num_splits is not None and (isinstance(num_splits, bool)
                                   or not isinstance(num_splits, numbers.Integral)):
        raise TypeError(f"num_splits must be None (automatic) or an int >= 1, got "
                        f"{type(num_splits).__name__}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be None (automatic) or an int >= 1, got {num_splits}")
    err = check_return_lse(return_lse, 0.0) or check_window_sinks(window, sinks,
                                                                  q.transpose(1, 2))
    if err is not None:
        raise err
    grads = [n for n, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k),
                            ("v", v), ("sinks", sinks)) if t is not None and t.requires_grad]
    if grads and torch.is_grad_enabled():
        raise NotImplementedError(f"attention_with_kvcache is forward-only (serving); "
                                  f"{', '.join(grads)} require grad: call it under "
                                  "torch.no_grad() or torch.inference_mode(), or detach them")
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
    b, nq = q.shape[:2]
    strict = None if strict is None else bool(strict)
    nnew = 0 if k is None else k.shape[1]
    if not validate and b:
        res = _unchecked(q, k_cache, v_cache, cache_seqlens, block_table, k, v, nnew, is_causal,
                         scale, window, sinks, num_splits, descales)
        if res is not None:
            return res if return_lse else res[0]
    before = _lengths(cache_seqlens, b, q.device)
    lens = [n + nnew for n in before]
    if paged:
        page_size = k_cache.shape[1]
        table = _pages(block_table, lens, page_size, k_cache.shape[0], b, q.device)
    else:
        table, page_size = None, None
        if max(lens, default=0) > k_cache.shape[1]:
            raise ValueError(f"a row needs {max(lens)} keys (cache_seqlens + new) but the cache "
                             f"holds Ncache = {k_cache.shape[1]}")
    with torch.no_grad():
        if nnew:
            _append(k_cache, v_cache, k, v, before, table, page_size, descales)
        plan = decode_plan(q, k_cache, v_cache, is_causal, window, page_size, scale) if b else None
        if plan is not None:
            seqlens = torch.tensor(lens, dtype=torch.int32).to(q.device, non_blocking=True)
            out, lse = _decode(plan, q, k_cache, v_cache, seqlens, max(lens), block_table, sinks,
                               num_splits, descales)
            return (out, lse) if return_lse else out
        rows = [_row(q[r], k_cache, v_cache, lens[r],
                     None if table is None else table[r, :-(-lens[r] // page_size)], r,
                     is_causal, scale, window, sinks, num_splits or 1, strict,
                     None if descales is None else [d[r] for d in descales])
                for r in range(b)]
    if b == 0:
        out = q.new_zeros(0, nq, q.shape[2], v_cache.shape[3])
        lse = torch.zeros(0, q.shape[2], nq, dtype=compute_dtype(q.dtype), device=q.device)
    else:
        out, lse = torch.stack([o for o, _ in rows]), torch.stack([s for _, s in rows])
    return (out, lse) if return_lse else out


def _kv_descales(k_cache, k_descale, v_descale, q):
    """An FP8 cache's descales as [B, Hkv] fp32 on q's device (None for a 16-bit cache, which
    takes none: raises if given)."""
    if k_cache.dtype != FP8_CACHE:
        if k_descale is not None or v_descale is not None:
            raise ValueError(f"k_descale / v_descale scale an FP8 cache (float8_e4m3fn); this "
                             f"cache is {k_cache.dtype}: leave them None")
        return None
    b, hkv = q.shape[0], k_cache.shape[2]
    return [descale_bh(d, name, b, hkv, q.device)
            for name, d in (("k_descale", k_descale), ("v_descale", v_descale))]


def _decode(plan, q, k_cache, v_cache, seqlens, max_len, block_table, sinks, num_splits,
            descales=None):
    """(out [B, Nq, Hq, Dv] in q's dtype, lse [B, Hq, Nq]) by the decode kernel."""
    out, lse = split_kv_decode(plan, q, k_cache, v_cache, seqlens, max_len, block_table,
                               num_splits, descales)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return out.to(q.dtype).permute(0, 2, 1, 3), lse


@torch.no_grad()
def _unchecked(q, k_cache, v_cache, cache_seqlens, block_table, k, v, nnew, causal, scale,
               window, sinks, num_splits, descales):
    """`validate=False`: the decode kernel's route with no host read of cache_seqlens or
    block_table (their lengths on the device; the splits sized for the cache's capacity), or
    None when the call is not the kernel's shape (the caller then validates and loops)."""
    page_size = k_cache.shape[1] if block_table is not None else None
    plan = decode_plan(q, k_cache, v_cache, causal, window, page_size, scale)
    if plan is None:
        return None
    b = q.shape[0]
    if isinstance(cache_seqlens, torch.Tensor):
        before = cache_seqlens.to(q.device, torch.int32)
    else:
        before = torch.full((b,), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if nnew:
        _append(k_cache, v_cache, k, v, before, block_table, page_size, descales)
    capacity = (block_table.shape[1] * page_size if block_table is not None
                else k_cache.shape[1])
    return _decode(plan, q, k_cache, v_cache, before + nnew if nnew else before, capacity,
                   block_table, sinks, num_splits, descales)


def _row(q, k_cache, v_cache, n, pages, row, causal, scale, window, sinks, num_splits, strict,
         descales=None):
    """(out [Nq, Hq, Dv], lse [Hq, Nq]) of batch row `row` over its first n keys (an FP8
    cache's dequantised to q's dtype with the row's descales [Hkv])."""
    if pages is None:
        k, v = k_cache[row, :n], v_cache[row, :n]
    else:
        idx = pages.to(k_cache.device, torch.long)
        k, v = k_cache[idx].flatten(0, 1)[:n], v_cache[idx].flatten(0, 1)[:n]
    if descales is not None:  # [n, Hkv, D] * [Hkv, 1]
        k, v = ((x.float() * d[:, None]).to(q.dtype) for x, d in zip((k, v), descales))
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, N, D]
    offset = n - q.shape[2]
    bounds = window_bounds(window, offset)
    outs, lses = [], []
    for a, e in _parts(n, num_splits):
        part = None if bounds is None else tuple(None if x is None else x - a for x in bounds)
        o, s = block_forward(q, k[..., a:e, :], v[..., a:e, :], causal=causal, offset=offset - a,
                             scale=scale, strict=strict, bounds=part)
        outs.append(o)
        lses.append(s)
    out, lse = merge_attention(outs, lses) if len(outs) > 1 else (outs[0], lses[0])
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks)
    return out[0].transpose(0, 1), lse[0]
