"""Dense masks the kernels serve without a mask operand: key-padding masks and masks whose
rows keep a prefix of the keys (causal, block-causal, prefix-LM), each as a few unmasked or
causal kernel calls.

**Key-padding masks** (`KeptKeys`). A dense `attn_mask` that is the same for every query row
and every head ([B or 1, 1, 1, Nkv] after broadcasting, or a wider tensor whose rows repeat)
selects the keys each batch element attends to. Attention over those keys alone is the
masked attention, so `attention` runs the kernels on them instead of sending the call to SDPA
(which at D > 256 has no fast kernel). How (`KeptKeys.route`):
  * keys kept as a prefix (padding at the end, the common case): views of k and v, no copy;
    one call when every batch element keeps as many, else one call per batch element (up to
    PER_ELEMENT_MAX elements);
  * otherwise k and v gathered once: `index_select` when the whole batch keeps the same keys,
    a `gather` when each element keeps as many, `index_select` per element for unequal
    counts (up to PER_ELEMENT_MAX elements);
  * unequal counts of more elements: the packed sequences of `varlen.varlen_attention` (its
    one launch; q copied into the packed layout, the kept keys back to back).

**Row prefixes** (`RowRuns`). A mask that varies over the queries (the same over heads) whose
row i keeps keys [0, L(i)), L(i) >= 1: a causal mask as a tensor (L(i) = i + 1 + offset),
Gemma's bidirectional image blocks inside a causal text mask (the rows of a block all keep
up to the block's end), a prefix-LM mask, any of them with right padding of the keys. The
rows split into runs that one kernel call serves each: "full" (every row keeps the same L:
the run's queries against k[:L], unmasked) and "diagonal" (L(i) - i constant: the run's
queries against k[:L(last row)], causal bottom-right, which gives row i exactly keys < L(i)).
Runs are taken greedily, the longer kind first; a mask of more than MAX_RUNS calls keeps the
SDPA route. out (and lse) are the runs' concatenated along the queries. Where a gradient
will be asked for, `RowRunAttention` runs the backward by runs of keys instead (one gradient
call over every row that keeps a run of keys; its docstring), when the prefix lengths never
shrink down the rows and the kernels serve every call.

**Row intervals** (`RowRuns` with `starts`). Rows that each keep one interval [lo(i), hi(i)),
some lo(i) > 0 (a sliding window passed as a dense tensor, a window on both sides, its
anti-causal mirror): runs of rows whose lo and hi are each constant or rise by one a row,
each one call on the keys [lo(first), hi(last)): unmasked, causal, or with the kernels'
sliding window (`window=(left, right)`, `_window`). Their gradient runs through those calls
(no key runs).

**Rows that keep no key** (left padding under a causal mask: the padded query rows; a causal
mask shifted past the first rows) are runs of kind "empty" in either form: no kernel call,
out 0 and lse -inf, SDPA's answer for such rows of a bool or -inf mask. (Of a mask of finite
lows, finfo.min say, SDPA averages every key in such a row, the scores all rounding to the
same value: that keeps the SDPA route.)

Elsewhere the gradients reach q, k and v through the views, gathers and concatenations; a
dropped key's are 0, as under the mask.

Which masks: bool (True: the key takes part, SDPA's convention), or floating with every value
either 0 (kept) or at most DROPPED (-65504: fp16's lowest, what transformers fills fp16 masks
with; -1e9, finfo.min and -inf are below it). A dropped key's softmax weight under the mask is
exp(mask + s_k - m) with m >= a kept key's score, which is 0 in float32 unless s_k exceeds every
kept score by more than ~65400: then the mask and this route differ, as they would between
two masks of different large values. Not served (the caller routes the masked call as before:
SDPA, logged): masks that vary over heads, rows that keep more than one interval of keys
while the rows differ, float masks with other values (a genuine additive bias), a row of
finite lows that keeps no key, a key-padding mask's batch element that keeps none, a mask that
keeps nothing at all (SDPA's own semantics for such rows), masks that require grad, non-4-D
inputs, dropout, a window or sinks, and calls under torch.compile (reading the mask needs the
host: device syncs once per mask tensor and version, cached like
`varlen.sequence_bounds`; a model's layers sharing one mask read it once a step; an inference
tensor, which has no version counter, is read at every call; a mask not read before a CUDA
graph capture keeps the SDPA route inside it).
"""

from __future__ import annotations

import bisect
import weakref
from dataclasses import dataclass

import torch

from .problem import tensor_version

__all__ = ["DROPPED", "KeptKeys", "MAX_RUNS", "PER_ELEMENT_MAX", "RowRuns", "clear",
           "describe", "kept_keys", "run"]

DROPPED = -65504.0  # a float mask value at or below this drops its key (module docstring)
# Unequal counts over at most this many batch elements run one call per element (views or an
# index_select each: no copy of q, out assembled by one cat); more take varlen's one launch
PER_ELEMENT_MAX = 16
MAX_RUNS = 64   # masks of more calls (runs over the batch elements that keep keys) keep SDPA's
# route
CHUNK = 1 << 26  # mask elements compared at a time (64 Mi: no temporary of a mask's full size)

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
    def most_keys(self) -> int:
        return max(self.counts)

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


@dataclass(frozen=True)
class RowRuns:
    """A row-prefix mask as runs of query rows (module docstring): `runs[b]` for batch element
    b (one entry when every element has the same), each run (start, end, "full", "diagonal"
    or for row intervals "band" / "suffix", or "empty" (no key kept, no call), the keys its
    kernel call takes); `key_runs[b]` the same mask as runs of keys
    for the gradient (`RowRunAttention`), (start, end, "full" or "diagonal", the first row
    that sees the run's first key), or None where the prefix lengths ever shrink down the
    rows (then the rows that see a key are not a suffix)."""
    runs: tuple
    key_runs: tuple | None = None
    starts: tuple | None = None   # row intervals: each run's first key (`_interval_runs`)

    @property
    def route(self) -> str:
        return "row runs"

    def first_key(self, b: int, i: int) -> int:
        """The first key of entry b's run i (0 for row prefixes)."""
        return 0 if self.starts is None else self.starts[b][i]

    @property
    def most_keys(self) -> int:
        return max(r[3] for e in self.runs for r in e)

    @property
    def calls(self) -> int:
        """Kernel calls of the forward (runs of rows that keep no key make none)."""
        return _calls(self.runs)


def _calls(runs: tuple) -> int:
    """The kernel calls of row runs per batch element (an "empty" run makes none)."""
    return sum(r[2] != "empty" for e in runs for r in e)


# run kinds: how each sequence steps from one row (or key) to the next within a run
STEPS_1 = {"full": (0,), "diagonal": (1,)}
STEPS_2 = {"full": (0, 0), "diagonal": (0, 1), "band": (1, 1), "suffix": (1, 0)}


def _runs(lengths: list) -> tuple:
    """Greedy runs of rows with keep-lengths `lengths` (module docstring): (start, end, kind,
    the keys of the run's call)."""
    return tuple(_emptied((a, e, kind, lengths[a] if kind == "full" else lengths[e - 1]))
                 for a, e, kind in _greedy((lengths,), STEPS_1))


def _emptied(run: tuple, first_key: int = 0) -> tuple:
    """`run` (start, end, kind, keys), its kind "empty" when its rows keep no key (a "full"
    run ending at its first key): its rows get out 0 and lse -inf, no kernel call."""
    a, e, kind, n = run
    return (a, e, "empty", n) if kind == "full" and n == first_key else run


def _key_runs(lengths: list) -> tuple | None:
    """Runs of the keys that some row keeps, for non-decreasing keep-lengths (else None):
    key j is kept by the rows from R(j) = #{i : L(i) <= j} on, so a run of keys with R
    constant ("full") is kept whole by rows [R, Nq), and one with R(j) - j constant
    ("diagonal") by rows [R(c), Nq) causally from its first key c: (start, end, kind, R(c))."""
    if any(b < a for a, b in zip(lengths, lengths[1:])):
        return None
    first = [bisect.bisect_right(lengths, j) for j in range(lengths[-1])]   # R(j)
    return tuple((c, d, kind, first[c]) for c, d, kind in _greedy((first,), STEPS_1))


def _greedy(seqs: tuple, steps: dict):
    """Maximal runs [a, e) over the positions of the equal-length sequences `seqs`: a run of
    kind k has each sequence step by steps[k] (0: constant, 1: rising by one) from each
    position to the next; at each start the longest kind, the first named on a tie."""
    a, n = 0, len(seqs[0])
    while a < n:
        best = None
        for kind, step in steps.items():
            e = a + 1
            while e < n and all(x[e] - x[a] == d * (e - a) for x, d in zip(seqs, step)):
                e += 1
            if best is None or e > best[1]:
                best = (kind, e)
        yield a, best[1], best[0]
        a = best[1]


def kept_keys(mask: torch.Tensor, batch: int, heads: int, nq: int,
              nkv: int) -> KeptKeys | RowRuns | None:
    """The keys `mask` keeps for inputs [batch, heads, nq, ...] x [.., nkv, ..] (`KeptKeys`,
    or `RowRuns` for row prefixes), or None where the kernels cannot serve it this way
    (module docstring). Read once per mask tensor and version."""
    version = tensor_version(mask)
    key = (version, mask.data_ptr(), mask.shape, mask.stride(), mask.dtype, batch, heads, nq,
           nkv)
    hit = _CACHE.get(id(mask))
    if version is not None and hit is not None and hit[0]() is mask and hit[1] == key:
        return hit[2]
    if mask.is_cuda and torch.cuda.is_current_stream_capturing():
        return None   # reading it would sync inside a CUDA graph capture: the SDPA route
    if version is None:   # an inference tensor: read every call
        return _read(mask, batch, heads, nq, nkv)
    kept = _read(mask, batch, heads, nq, nkv)
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    _CACHE[id(mask)] = (weakref.ref(mask), key, kept)
    return kept


def _read(mask, batch, heads, nq, nkv) -> KeptKeys | RowRuns | None:
    """`kept_keys` without the cache: the checks and the host reads."""
    if mask.requires_grad or mask.dim() > 4 or mask.numel() == 0:
        return None
    m = mask[(None,) * (4 - mask.dim())]  # [b', h', q', nkv] view
    target = (batch, heads, nq, nkv)
    if any(s not in (1, t) for s, t in zip(m.shape, target)) or m.shape[3] != nkv:
        return None  # not broadcastable to the call: SDPA raises its own error
    if m.shape[1] > 1 and m.stride(1) != 0 and not _all_rows(m, lambda c: c == c[:, :1]):
        return None   # differs over heads (NaN never equal)
    m = m[:, 0]   # [b', q', nkv]
    if m.shape[1] > 1 and m.stride(1) != 0 and not _all_rows(m, lambda c: c == m[:, :1]):
        return _row_runs(m, nkv)
    keep = _kept(m[:, 0])   # [b', nkv]
    if keep is None:
        return None
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


def _kept(values: torch.Tensor) -> torch.Tensor | None:
    """The bool keep pattern of mask values (contiguous), or None for an additive bias."""
    if values.dtype == torch.bool:
        return values.contiguous()
    keep = values == 0
    if not bool((keep | (values <= DROPPED)).all()):  # an additive bias (or NaN)
        return None
    return keep.contiguous()


def _all_rows(m: torch.Tensor, test) -> bool:
    """Whether `test(chunk)` holds everywhere over chunks of m's query rows (dim -2), each
    chunk at most CHUNK elements: a mask can be as large as the memory left, so no
    temporary of its full size is made."""
    step = max(1, CHUNK // max(1, m[..., :1, :].numel()))
    return all(bool(test(m[..., r:r + step, :]).all()) for r in range(0, m.shape[-2], step))


def _row_runs(m: torch.Tensor, nkv: int) -> RowRuns | None:
    """`RowRuns` of mask values [b', Nq, Nkv] whose rows differ, or None unless every row
    keeps one non-empty interval of keys and the runs are few (read in chunks of query
    rows): prefixes by `_runs` / `_key_runs`, other intervals by `_interval_runs`."""
    step = max(1, CHUNK // max(1, m.shape[0] * nkv))
    cols, parts, firsts = torch.arange(nkv, device=m.device), [], []
    for r in range(0, m.shape[1], step):
        chunk = m[:, r:r + step]
        keep = _kept(chunk)
        if keep is None:
            return None
        lengths = keep.sum(-1)   # [b', rows]
        first = keep.to(torch.uint8).argmax(-1)   # the first kept key (0 for an empty row)
        if not bool((keep == ((cols >= first[..., None])
                              & (cols < (first + lengths)[..., None]))).all()):
            return None   # a row's keys are not one interval
        empty = lengths == 0
        if chunk.dtype != torch.bool and bool(empty.any()) and not bool(
                (chunk[empty] == -float("inf")).all()):
            return None   # an empty row of finite lows: SDPA averages every key there
        parts.append(lengths)
        firsts.append(first)
    per = torch.cat(parts, 1).tolist()
    if max(max(r) for r in per) == 0:
        return None   # no row keeps a key
    lows = torch.cat(firsts, 1).tolist()
    if any(any(r) for r in lows):   # intervals, not prefixes
        return _interval_runs(lows, per)
    if all(r == per[0] for r in per):
        per = per[:1]
    runs = tuple(_runs(r) for r in per)
    if _calls(runs) > MAX_RUNS:
        return None
    keys = tuple(_key_runs(r) for r in per)
    ok = all(r is not None for r in keys) and sum(map(len, keys)) <= MAX_RUNS
    return RowRuns(runs, keys if ok else None)


def _interval_runs(lows: list, lengths: list) -> RowRuns | None:
    """`RowRuns` of rows keeping keys [lo(i), hi(i)) (hi = lo + length), lo not all 0, or None
    past MAX_RUNS calls. A run takes the longest of: "full" (lo and hi constant: unmasked),
    "diagonal" (lo constant, hi rising by one a row: causal), "band" (both rising: a sliding
    window of hi - lo keys) and "suffix" (lo rising, hi constant: a window open on the right),
    each on keys [lo(first row), hi(last row)). The gradient runs by these row runs (no key
    runs)."""
    per = [(tuple(lo), tuple(a + n for a, n in zip(lo, ln))) for lo, ln in zip(lows, lengths)]
    if all(x == per[0] for x in per):
        per = per[:1]
    runs, starts = [], []
    for lo, hi in per:
        rows = tuple(_emptied((a, e, kind, hi[e - 1]), lo[a])
                     for a, e, kind in _greedy((lo, hi), STEPS_2))
        runs.append(rows)
        starts.append(tuple(lo[a] for a, _, _, _ in rows))
    if _calls(runs) > MAX_RUNS:
        return None
    return RowRuns(tuple(runs), None, tuple(starts))


def _window(kind: str, rows: int, keys: int):
    """(causal, window) of a row run's call on `rows` queries and its `keys` keys (bottom-right
    frame: query i' sits at key i' + keys - rows)."""
    if kind == "band":   # row i' keeps local keys [i', i' + keys - rows]
        return False, (keys - rows, 0)
    if kind == "suffix":   # row i' keeps local keys [i', keys)
        return False, (keys - rows, None)
    return kind == "diagonal", None


def describe(kept: KeptKeys | RowRuns) -> str:
    """The start of `explain`'s line for a call this module serves."""
    if isinstance(kept, RowRuns):
        kinds = [r[2] for e in kept.runs for r in e]
        diag, full, empty = (kinds.count(k) for k in ("diagonal", "full", "empty"))
        win = len(kinds) - diag - full - empty
        per = ", per batch element" if len(kept.runs) > 1 else ""
        what = "row-prefix" if kept.starts is None else "row-interval"
        return (f"{what} mask: {kept.calls} kernel calls on runs of query rows ({diag} causal, "
                f"{full} unmasked{f', {win} sliding-window' if win else ''}"
                f"{f', {empty} keeping no key (out 0)' if empty else ''}{per}): ")
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
    if route == "row runs":
        return _run_rows(kept, q, k, v, dense, return_lse, scale)
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
        return _cat(res, 0, return_lse)
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


def _run_rows(kept: RowRuns, q, k, v, dense, return_lse, scale=None):
    """`run` for row prefixes: where the kernels serve every run (and, when a gradient will be
    asked for, every key run), `_forward_runs` (no gradient) or `RowRunAttention`; else one
    `dense` call per run (on every batch element at once when they share their runs), out
    (and lse) concatenated along the queries."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    jobs = _jobs(kept, q, k, v, scale, grad)
    if jobs is not None:
        out, lse = (RowRunAttention.apply(q, k, v, jobs) if grad else
                    _forward_runs(q, k, v, jobs[0], jobs[2]))
        return (out, lse) if return_lse else out
    outs = []
    for b, runs in enumerate(kept.runs):
        qb, kb, vb = (q, k, v) if len(kept.runs) == 1 else (q[b:b + 1], k[b:b + 1], v[b:b + 1])
        parts = []
        for i, (a, e, kind, n) in enumerate(runs):
            if kind == "empty":
                parts.append(_empty_rows(qb, vb, e - a, return_lse))
                continue
            c = kept.first_key(b, i)
            causal, window = _window(kind, e - a, n - c)
            parts.append(dense(qb[:, :, a:e], kb[:, :, c:n], vb[:, :, c:n], causal=causal,
                               window=window))
        outs.append(_cat(parts, 2, return_lse))
    return _cat(outs, 0, return_lse)


def _forward_runs(q, k, v, fwd: list, scale: float):
    """(out, lse) of the forward calls `fwd` (`_plan_jobs`), each writing its run's rows of
    out and lse in place (`launch.run_fwd`'s out / lse); rows of "empty" runs (no call) keep
    out 0 and lse -inf. One call for every row (a causal mask as a tensor) returns its own."""
    from . import ops
    from .math_attention import compute_dtype

    rows = sum((e - a) * (q.shape[0] if bs == slice(None) else 1) for bs, a, e, *_ in fwd)
    every = rows == q.shape[0] * q.shape[2]
    if every and len(fwd) == 1:
        _, _, _, n, off, plan = fwd[0]
        return ops.kernel_forward(q, k[:, :, :n], v[:, :, :n], off is not None, off or 0,
                                  scale, plan)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = q.new_empty(q.shape[:-1], dtype=compute_dtype(q.dtype))   # float32 for 16 bits
    if not every:
        out.zero_()
        lse.fill_(-float("inf"))
    for bs, a, e, n, off, plan in fwd:
        ops.kernel_forward(q[bs][:, :, a:e], k[bs][:, :, :n], v[bs][:, :, :n], off is not None,
                           off or 0, scale, plan, out=out[bs][:, :, a:e], lse=lse[bs][:, :, a:e])
    return out, lse


def _cat(parts: list, dim: int, return_lse: bool):
    """The calls' outs (and lses) concatenated along `dim` (queries 2, batch 0); one part is
    returned as it is (a causal mask as a tensor: one call, no copy)."""
    if len(parts) == 1:
        return parts[0]
    if return_lse:
        return torch.cat([p[0] for p in parts], dim), torch.cat([p[1] for p in parts], dim)
    return torch.cat(parts, dim)


def _empty_rows(q, v, rows: int, return_lse: bool):
    """out (and lse) of `rows` query rows that keep no key: 0 (and -inf), SDPA's answer for a
    row whose bool (or -inf) mask keeps nothing."""
    from .math_attention import compute_dtype

    out = q.new_zeros(*q.shape[:2], rows, v.shape[-1])
    if not return_lse:
        return out
    return out, torch.full((*q.shape[:2], rows), -float("inf"), dtype=compute_dtype(q.dtype),
                           device=q.device)


def _elements(kept: RowRuns, b: int, per: int):
    """The batch slice of entry b of a RowRuns tuple with `per` entries (all when one)."""
    return slice(None) if per == 1 else slice(b, b + 1)


_JOBS: dict = {}   # (RowRuns, the inputs' metadata, scale, options) -> `_plan_jobs`'s answer
_JOBS_MAX = 64


def clear() -> None:
    """Forget the masks read and the runs planned (`interface._clear_caches`)."""
    _CACHE.clear()
    _JOBS.clear()


def _jobs(kept: RowRuns, q, k, v, scale, backward: bool = True):
    """`_plan_jobs`, remembered per RowRuns and call signature (the inputs' shapes, strides,
    dtypes and device, the scale, the options in force, `backward`): a model's layers sharing
    one mask plan their runs once, not at every call."""
    from . import options

    key = (id(kept), *(tuple(t.shape) + tuple(t.stride()) for t in (q, k, v)), q.dtype,
           q.device, scale, options.current(), backward)
    hit = _JOBS.get(key)
    if hit is not None and hit[0] is kept:
        return hit[1]
    jobs = _plan_jobs(kept, q, k, v, scale, backward)
    if len(_JOBS) >= _JOBS_MAX:
        _JOBS.clear()
    _JOBS[key] = (kept, jobs)
    return jobs


def _plan_jobs(kept: RowRuns, q, k, v, scale, backward: bool = True):
    """The kernel calls of a row-prefix mask: (forward [(batch slice, rows a:e, keys n, causal
    offset or None, plan)], gradient [(batch slice, keys c:d, rows r:, causal offset or None,
    plan)] (empty unless `backward`: `RowRunAttention`'s key runs), the softmax scale), or None
    unless the kernels serve every one (their first-use self-checks included) and the mask's
    rows keep prefixes (row intervals take `dense` calls; a backward needs key runs)."""
    import math

    from . import dispatch, ops, selfcheck
    from .problem import AttnProblem
    if kept.starts is not None or (backward and kept.key_runs is None):
        return None
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    fwd, bwd = [], []
    for b, runs in enumerate(kept.runs):
        bs = _elements(kept, b, len(kept.runs))
        for a, e, kind, n in runs:
            if kind == "empty":   # out 0, lse -inf: `_forward_runs`' initial values
                continue
            off = n - (e - a) if kind == "diagonal" else None   # bottom-right
            qs, ks, vs = q[bs][:, :, a:e], k[bs][:, :, :n], v[bs][:, :, :n]
            plan = dispatch.plan_fwd(AttnProblem.from_tensors(
                qs, ks, vs, causal=off is not None, causal_offset=off or 0, scale=scale),
                q.device)
            if plan.reason is not None or selfcheck.reason(plan, q.device) is not None:
                return None
            fwd.append((bs, a, e, n, off, plan))
    for b, runs in enumerate(kept.key_runs if backward else ()):
        bs = _elements(kept, b, len(kept.key_runs))
        for c, d, kind, r in runs:
            off = 0 if kind == "diagonal" else None   # upper-left from the run's first key
            plan = ops.bwd_plan(q[bs][:, :, r:], k[bs][:, :, c:d], v[bs][:, :, c:d],
                                off is not None, off or 0, scale)
            if plan is None:
                return None
            bwd.append((bs, c, d, r, plan))
    return fwd, bwd, scale


def _shared_dq_width(plans) -> int | None:
    """The dQ accumulator's width when every gradient call of a key-run backward reduces dQ
    into fp32 at the same width (`launch.reduces_dq`, `launch.fused_width`): they then share
    one accumulator and one Delta. None: each call returns its own dQ."""
    from . import launch

    widths = {launch.fused_width(p) for p in plans}
    if len(widths) == 1 and all(launch.reduces_dq(p) for p in plans):
        return widths.pop()
    return None


class RowRunAttention(torch.autograd.Function):
    """A row-prefix mask with gradients: the forward by runs of rows (each run one forward
    kernel call, out and lse written into the whole), the backward by runs of keys (each one
    gradient call over all the rows that keep its keys, from the forward's out and lse: P =
    exp(S - lse) is the masked softmax of the whole row, so each call's dK / dV are the run's
    keys' whole gradients and its dQ a part, summed in float32). A key tile's walk then
    covers every row that sees it, where the calls of the row runs gave short runs (image
    blocks) a few query blocks each."""

    @staticmethod
    def forward(ctx, q, k, v, jobs):
        fwd, bwd, scale = jobs
        out, lse = _forward_runs(q, k, v, fwd, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.bwd = bwd
        ctx.per_element = any(job[0] != slice(None) for job in bwd)
        if ctx.per_element:   # each element's last key kept by some row
            ends = [0] * q.shape[0]
            for bs, _, d, _, _ in bwd:
                ends[bs.start] = max(ends[bs.start], d)
            ctx.key_ends = ends
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        from . import launch, ops

        q, k, v, out, lse = ctx.saved_tensors
        if dout is None and dlse is None:
            return None, None, None, None
        dout = torch.zeros_like(out) if dout is None else dout
        nkv = k.shape[2]
        if len(ctx.bwd) == 1 and ctx.bwd[0][1:4] == (0, nkv, 0):   # one call for everything
            plan = ctx.bwd[0][4]
            return (*ops._kernel_backward(plan, q, k, v, out, lse, dout, dlse), None)
        wide = torch.float32 if q.dtype != torch.float64 else q.dtype
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        top = 0
        plans = [job[4] for job in ctx.bwd]
        width = _shared_dq_width(plans)
        share = width is not None
        if share:   # every call adds its dQ into one fp32 accumulator (zeroed and cast once)
            # and reads Delta of all rows computed once, where each call would zero, cast
            # and compute its own on its rows (passes over the rows it walks, per key run)
            acc = torch.zeros(*q.shape[:-1], width, dtype=wide, device=q.device)
            delta = launch.run_delta(plans[0], out, dout, dlse)
        else:
            acc = torch.zeros(q.shape, dtype=wide, device=q.device)
        for bs, c, d, r, plan in ctx.bwd:
            rows = (bs, slice(None), slice(r, None))
            gq, gk, gv = ops._kernel_backward(
                plan, q[rows], k[bs][:, :, c:d], v[bs][:, :, c:d], out[rows], lse[rows],
                dout[rows], None if dlse is None else dlse[rows].contiguous(),
                **(dict(dq_acc=acc[rows], delta=delta[rows]) if share else {}))
            if gq is not None:
                acc[rows] += gq
            dk[bs][:, :, c:d] = gk
            dv[bs][:, :, c:d] = gv
            top = max(top, d)
        if ctx.per_element:   # elements whose rows keep fewer keys: the rest of theirs are 0
            for b, end in enumerate(ctx.key_ends):
                dk[b, :, end:].zero_()
                dv[b, :, end:].zero_()
        else:
            dk[:, :, top:].zero_()
            dv[:, :, top:].zero_()
        return acc[..., :q.shape[-1]].to(q.dtype), dk, dv, None
