"""Dense masks that only drop keys (key-padding masks), served by the kernels on the kept keys.

A dense `attn_mask` that is the same for every query row and every head ([B or 1, 1, 1, Nkv]
after broadcasting, or a wider tensor whose rows repeat: what a key-padding mask is) selects
the keys each batch element attends to. Attention over those keys alone is the masked
attention, so `attention` runs the kernels on them instead of sending the call to SDPA (which
at D > 256 has no fast kernel). How (`run`):
  * keys kept as a prefix (padding at the end, the common case): views of k and v, no copy;
    one call when every batch element keeps as many, else one call per batch element (up to
    PER_ELEMENT_MAX elements);
  * otherwise k and v gathered once: `index_select` when the whole batch keeps the same keys,
    a `gather` when each element keeps as many, `index_select` per element for unequal
    counts (up to PER_ELEMENT_MAX elements);
  * unequal counts of more elements: the packed sequences of `varlen.varlen_attention` (its
    one launch; q copied into the packed layout, the kept keys back to back).
The gradients reach k and v through the views and gathers; a dropped key's are 0, as under
the mask.

Which masks: bool (True: the key takes part, SDPA's convention), or floating with every value
either 0 (kept) or at most DROPPED (-65504: fp16's lowest, what transformers fills fp16 masks
with; -1e9, finfo.min and -inf are below it). A dropped key's softmax weight under the mask is
exp(mask + s_k - m) with m >= a kept key's score, which is 0 in float32 unless s_k exceeds every
kept score by more than ~65400: then the mask and this route differ, as they would between
two masks of different large values. Not served (the caller routes the masked call as before:
SDPA, logged): masks that vary over queries or heads, float masks with other values (a
genuine additive bias), a batch element that keeps no key (SDPA's own semantics for such
rows), masks that require grad, non-4-D inputs, dropout, a window or sinks, and calls under
torch.compile (reading the mask needs the host: one device sync per mask tensor and version,
cached like `varlen.sequence_bounds`; a model's layers sharing one mask read it once a step).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

__all__ = ["DROPPED", "KeptKeys", "PER_ELEMENT_MAX", "describe", "kept_keys", "run"]

DROPPED = -65504.0  # a float mask value at or below this drops its key (module docstring)
# Unequal counts over at most this many batch elements run one call per element (views or an
# index_select each: no copy of q, out assembled by one cat); more take varlen's one launch
PER_ELEMENT_MAX = 16

# `varlen.varlen_attention`, set by varlen.py when it loads (`import ffpa_cute` loads it):
# varlen routes each sequence through the interface, which calls this module, so neither this
# module nor the interface may import varlen
PACKED: dict = {}
_CACHE: dict = {}  # id(mask) -> (weakref to mask, key, KeptKeys or None)
_CACHE_MAX = 64


@dataclass(frozen=True)
class KeptKeys:
    """The keys a mask keeps: `keep` bool [B', Nkv] on the mask's device (B' = 1 when every
    batch element keeps the same keys), `counts` its row sums (host ints), `prefix` whether
    each row keeps its first `count` keys, and what the routes use: `index` ([c] for B' = 1,
    [B, c] when every count is c; not for prefixes), `rows` (unequal counts of at most
    PER_ELEMENT_MAX elements that are not all prefixes: each element's [count] index), and
    for varlen int32 `cu_q` / `cu_k`, the cumulative query and key counts (kept here so that
    `varlen.sequence_bounds` reads them once)."""
    keep: torch.Tensor
    counts: tuple
    prefix: bool
    index: torch.Tensor | None = None
    rows: tuple | None = None
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None

    @property
    def all_kept(self) -> bool:
        return all(c == self.keep.shape[-1] for c in self.counts)

    @property
    def route(self) -> str:
        """"all", "prefix" (one call on views), "prefix rows" (a call per element on views),
        "gather" (one call on gathered keys), "rows" (a call per element on gathered keys) or
        "varlen"."""
        if self.all_kept:
            return "all"
        equal = len(set(self.counts)) == 1
        if self.prefix:
            return "prefix" if equal else "prefix rows" if self.cu_k is None else "varlen"
        return "gather" if equal else "rows" if self.rows is not None else "varlen"


def kept_keys(mask: torch.Tensor, batch: int, heads: int, nq: int, nkv: int) -> KeptKeys | None:
    """The keys `mask` keeps for inputs [batch, heads, nq, ...] x [.., nkv, ..], or None where
    the mask does more than drop keys or drops all of a batch element's (module docstring).
    Read once per mask tensor and version."""
    key = (mask._version, mask.data_ptr(), mask.shape, mask.stride(), mask.dtype, batch, heads,
           nq, nkv)
    hit = _CACHE.get(id(mask))
    if hit is not None and hit[0]() is mask and hit[1] == key:
        return hit[2]
    kept = _read(mask, batch, heads, nq, nkv)
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[id(mask)] = (weakref.ref(mask), key, kept)
    return kept


def _read(mask, batch, heads, nq, nkv) -> KeptKeys | None:
    """`kept_keys` without the cache: the checks and the host reads."""
    if mask.requires_grad or mask.dim() > 4 or mask.numel() == 0:
        return None
    m = mask[(None,) * (4 - mask.dim())]  # [b', h', q', nkv] view
    target = (batch, heads, nq, nkv)
    if any(s not in (1, t) for s, t in zip(m.shape, target)) or m.shape[3] != nkv:
        return None  # not broadcastable to the call: SDPA raises its own error
    first = m[:, :1, :1, :]
    if (m.shape[1] > 1 and m.stride(1) != 0) or (m.shape[2] > 1 and m.stride(2) != 0):
        if not bool((m == first).all()):  # differs over heads or queries (NaN never equal)
            return None
    rows = first[:, 0, 0, :]   # [b', nkv]
    if rows.dtype == torch.bool:
        keep = rows
    else:
        keep = rows == 0
        if not bool((keep | (rows <= DROPPED)).all()):  # an additive bias (or NaN)
            return None
    keep = keep.contiguous()
    sums = keep.sum(-1)
    counts = tuple(sums.tolist())
    if min(counts) == 0:
        return None
    prefix = bool((keep == (torch.arange(nkv, device=keep.device) < sums[:, None])).all())
    if len(counts) > 1 and len(set(counts)) == 1 and bool((keep == keep[:1]).all()):
        keep, counts = keep[:1], counts[:1]   # the same keys for every element
    if len(set(counts)) == 1:
        if prefix:
            return KeptKeys(keep, counts, True)
        index = keep.nonzero()[:, 1].view(len(counts), counts[0])
        return KeptKeys(keep, counts, False, index=index[0] if len(counts) == 1 else index)
    if len(counts) <= PER_ELEMENT_MAX:
        return KeptKeys(keep, counts, prefix, rows=None if prefix else tuple(
            r.nonzero().squeeze(1) for r in keep))
    ends = [0]
    for c in counts:
        ends.append(ends[-1] + c)
    return KeptKeys(keep, counts, prefix,
                    cu_q=torch.arange(0, (batch + 1) * nq, nq, dtype=torch.int32,
                                      device=mask.device),
                    cu_k=torch.tensor(ends, dtype=torch.int32, device=mask.device))


def describe(kept: KeptKeys) -> str:
    """The start of `explain`'s line for a call this module serves."""
    counts, nkv = kept.counts, kept.keep.shape[-1]
    n = counts[0] if len(set(counts)) == 1 else f"{min(counts)}-{max(counts)}"
    how = {"all": "the unmasked call", "prefix": "the unmasked call on views of k and v",
           "prefix rows": "one unmasked call per batch element on views of k and v",
           "gather": "k and v gathered, then the unmasked call",
           "rows": "k and v gathered per batch element, then one unmasked call each",
           "varlen": "the kept keys packed, then varlen_attention"}[kept.route]
    return f"key-padding mask ({n} of {nkv} keys kept): {how}: "


def run(kept: KeptKeys, q, k, v, dense, *, scale, strict, return_lse):
    """The masked attention of q, k, v [B, H, N, D] over the kept keys (module docstring):
    `dense(q, k, v)` is the caller's unmasked route (returning out, or (out, lse) with
    `return_lse`). varlen's out and lse come back as [B, Hq, Nq, Dv] / [B, Hq, Nq] views."""
    route = kept.route
    if route == "all":
        return dense(q, k, v)
    if route == "prefix":
        c = kept.counts[0]
        return dense(q, k[:, :, :c], v[:, :, :c])
    if route == "gather":
        if kept.index.dim() == 1:
            return dense(q, k.index_select(2, kept.index), v.index_select(2, kept.index))
        b, c = kept.index.shape
        idx = kept.index[:, None, :, None]
        return dense(q, torch.gather(k, 2, idx.expand(b, k.shape[1], c, k.shape[3])),
                     torch.gather(v, 2, idx.expand(b, v.shape[1], c, v.shape[3])))
    if route in ("prefix rows", "rows"):
        res = []
        for i, c in enumerate(kept.counts):
            ki, vi = k[i:i + 1], v[i:i + 1]
            if route == "prefix rows":
                ki, vi = ki[:, :, :c], vi[:, :, :c]
            else:
                ki, vi = ki.index_select(2, kept.rows[i]), vi.index_select(2, kept.rows[i])
            res.append(dense(q[i:i + 1], ki, vi))
        if not return_lse:
            return torch.cat(res)
        return torch.cat([r[0] for r in res]), torch.cat([r[1] for r in res])
    b, hq, nq, d = q.shape
    res = PACKED["varlen_attention"](
        q.transpose(1, 2).reshape(b * nq, hq, d), k.transpose(1, 2)[kept.keep],
        v.transpose(1, 2)[kept.keep], kept.cu_q, kept.cu_k, nq, max(kept.counts), scale=scale,
        enable_gqa=hq != k.shape[1], return_lse=return_lse, strict=strict)
    out, lse = res if return_lse else (res, None)
    out = out.view(b, nq, *out.shape[1:]).transpose(1, 2)
    if not return_lse:
        return out
    return out, lse.view(hq, b, nq).transpose(0, 1)
