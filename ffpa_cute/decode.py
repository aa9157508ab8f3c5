"""The host side of the split-KV decode kernel (sm90/decode_sm90.py): `attention_with_kvcache`'s
route for decode (Nq = 1) and chunked prefill (Nq > 1, causal bottom-right over the row's keys,
or not causal) without a window, on a cache contiguous or paged in pages of a multiple of 64
rows.

One launch reads the cache in place: the G = Hq / Hkv query heads of each KV head are packed into
rows (K / V read once for all of them), and each batch row's keys are split over S CTAs (the
head axis of the replicated queries: head h = kv_head * S + split), each writing an fp32 partial
O and its LSE; one combine kernel (common/combine.py) merges them exactly. S is chosen from the batch, the KV heads and
the longest row so that about one wave of CTAs covers the SMs, with at least two KV blocks per
split.
"""

from __future__ import annotations

import torch

from . import dispatch, launch
from .common.config import CombineConfig
from .problem import AttnProblem, dtype_name

MIN_BLOCKS_PER_SPLIT = 2  # KV blocks (of tile_n rows) a split reads at least


def decode_plan(q, k_cache, v_cache, causal: bool, window, page_size, scale):
    """The decode kernel's plan for this call (q [B, Nq, Hq, D], caches in the kvcache layout,
    16-bit like q or float8_e4m3fn; causal with Nq > 1: the chunked-prefill mask), or None when
    the call is not its shape (a window, pages not a multiple of 64 rows), no kernel serves it,
    or a chunk (Nq > 1) whose row tiles alone already fill the SMs: there the host loop's
    gather and the forward kernel (128-key blocks) are faster (H200, chunks of 256 queries at
    B=4, GQA 32/4: 0.7x; of 16-64: 1.8-4.9x the host loop; design section 11)."""
    b, nq, hq, d = q.shape
    hkv = k_cache.shape[2]
    if window is not None or q.device.type != "cuda":
        return None
    if page_size is not None and page_size % 64:
        return None
    # causal with one query per row sees every key: the mask-free kernel
    problem = AttnProblem(dtype=dtype_name(q.dtype), batch=b, heads_q=hkv, heads_kv=hkv,
                          seqlen_q=(hq // hkv) * nq, seqlen_kv=k_cache.shape[1], head_dim=d,
                          head_dim_v=v_cache.shape[3], scale=scale, causal=causal and nq > 1)
    views = [t.permute(0, 2, 1, 3) for t in (k_cache, v_cache)]
    if dispatch.problem_reason(problem) is not None or any(
            launch.kernel_ready(t) is not t for t in views):  # read in place, never copied
        return None
    kv_dtype = dtype_name(k_cache.dtype) if k_cache.dtype != q.dtype else None
    plan = dispatch.plan_decode(problem, page_size, q.device, kv_dtype=kv_dtype)
    if plan.reason is not None:
        return None
    ctas = b * hkv * -(-problem.seqlen_q // plan.cfg.tile_m) * plan.cfg.o_split  # unsplit
    if nq > 1 and ctas > launch.sm_count(q.device.index or 0):
        return None
    return plan


MAX_SPLITS = 256  # B=1 MQA: one CTA per split, 132 of them fill the H200
WAVE_FILL = 0.95  # the fewest splits whose grid keeps this share of the SM-waves busy


def num_splits(plan, b: int, hkv: int, max_len: int, device) -> int:
    """S: the fewest splits whose grid keeps WAVE_FILL of the SM-waves busy (one CTA per SM: a
    partial last wave idles the rest; fewer splits, fewer partials to merge), else the best
    fill; each split at least MIN_BLOCKS_PER_SPLIT blocks. E.g. 132 SMs, B=8, Hkv=4: S=4 (128
    CTAs; S=5 would be 160 CTAs, 1.2 waves)."""
    cfg = plan.cfg
    ctas = b * hkv * -(-plan.problem.seqlen_q // cfg.tile_m) * cfg.o_split
    blocks = -(-max_len // cfg.tile_n)
    sms = launch.sm_count(device.index or 0)
    top = max(1, min(MAX_SPLITS, blocks // MIN_BLOCKS_PER_SPLIT))

    def fill(s):  # share of the SM-waves the grid keeps busy
        n = ctas * s
        return n / (-(-n // sms) * sms)

    good = [s for s in range(1, top + 1) if fill(s) >= WAVE_FILL]
    return good[0] if good else max(range(1, top + 1), key=lambda s: (fill(s), -s))


def kernel_operands(q, k_cache, v_cache, seqlens, block_table, splits: int, descales=None
                    ) -> dict:
    """The decode kernels' tensors by operand name (`launch.run_job`) for q [B, Nq, Hq, D]
    over the caches in the kvcache layout split S = `splits` ways: the rows (g, i) of each KV
    head replicated for the splits ([B, Hkv * S, G * Nq, D]), the caches seen as (pages, Hkv,
    rows, D), fp32 partials o [B, Hkv * S, G * Nq, Dv] and lse [B, Hkv * S, G * Nq] to fill,
    seqlens_k, the int32 block table (None: contiguous) and an FP8 cache's (k, v) descales."""
    b, nq, hq, d = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    m = hq // hkv * nq
    rows = q.permute(0, 2, 1, 3).reshape(b, hkv, 1, m, d).expand(b, hkv, splits, m, d)
    return dict(
        q=rows.reshape(b, hkv * splits, m, d),
        k=k_cache.permute(0, 2, 1, 3), v=v_cache.permute(0, 2, 1, 3),
        o=torch.empty(b, hkv * splits, m, dv, dtype=torch.float32, device=q.device),
        lse=torch.empty(b, hkv * splits, m, dtype=torch.float32, device=q.device),
        seqlens_k=seqlens,
        block_table=(None if block_table is None else
                     block_table.to(device=q.device, dtype=torch.int32).contiguous()),
        k_descale=None if descales is None else descales[0],
        v_descale=None if descales is None else descales[1])


def combine_config(target: str, dtype: str, dv: int) -> CombineConfig:
    """The split combine's compile key after a decode kernel of `target` with `dtype` queries
    and Dv = dv (what `split_kv_decode` launches and `precompile --decode` compiles)."""
    return CombineConfig(target, dtype, dv)


def split_kv_decode(plan, q, k_cache, v_cache, seqlens, max_len: int, block_table,
                    splits: int | None, descales=None):
    """(out [B, Hq, Nq, Dv] in q's dtype, lse [B, Hq, Nq] fp32) of q [B, Nq, Hq, D] over each
    row's first seqlens[b] cached keys (int32 [B] on q's device; max_len bounds them), by one
    launch of the decode kernel and one of the combine kernel that merges its splits
    (common/combine.py; `merge_splits` is the same in torch). `splits`: S, or None to pick it
    (`num_splits`). descales: an FP8 cache's (k, v) [B, Hkv] fp32 (None: a 16-bit cache)."""
    b, nq, hq, _ = q.shape
    hkv, dv = k_cache.shape[2], v_cache.shape[3]
    m = hq // hkv * nq
    s = splits or num_splits(plan, b, hkv, max_len, q.device)
    tensors = kernel_operands(q, k_cache, v_cache, seqlens, block_table, s, descales)
    out = torch.empty(b, hkv, m, dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(b, hkv, m, dtype=torch.float32, device=q.device)
    combine = combine_config(plan.target, dtype_name(q.dtype), dv)
    with torch.cuda.device(q.device):
        launch.run_job(plan.kernel_cls, plan.cfg, tensors,
                       dict(softmax_scale=plan.problem.softmax_scale, num_splits=s, nq=nq))
        launch.run_job(dispatch.kernel_class(combine), combine,
                       dict(o_part=tensors["o"].view(b, hkv, s, m, dv),
                            lse_part=tensors["lse"].view(b, hkv, s, m), out=out, lse=lse), {})
    return out.view(b, hq, nq, dv), lse.view(b, hq, nq)


def merge_splits(out, lse):
    """(out [..., M, Dv], lse [..., M]) from S split partials out [..., S, M, Dv] (each
    normalised over its split's keys) and lse [..., S, M] (-inf: an empty split), merged over
    dim -3 / -2 by their LSE weights; rows empty in every split give out 0, lse -inf."""
    top = lse.amax(-2, keepdim=True)
    top = top.masked_fill(torch.isneginf(top), 0.0)
    w = torch.exp(lse - top)                      # [..., S, M], 0 for empty splits
    total = w.sum(-2)                             # [..., M]
    merged = (w.unsqueeze(-1) * out).sum(-3) / total.clamp_min(1e-30).unsqueeze(-1)
    return merged, torch.where(total > 0, top.squeeze(-2) + torch.log(total), float("-inf"))


__all__ = ["combine_config", "decode_plan", "kernel_operands", "merge_splits", "num_splits",
           "split_kv_decode"]
