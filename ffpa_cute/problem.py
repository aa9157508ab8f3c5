"""The attention problem as the dispatcher sees it: dtypes, head dims, sizes, causal alignment.

`AttnProblem` is built once per call from the (already validated) tensors and describes *what* is
asked, not how it will be computed. Kernel planners (`smXX/config.py:plan_fwd`) turn it into a
frozen per-kernel config, which is the compile key; sizes (B, H, N) never enter that key.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
               torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def concrete(x):
    """A Python constant for a problem field; under torch.compile this specializes the guard.

    `operator.index` / `__float__` make Dynamo burn the symbolic size or float into the graph
    (with a guard), which is what lets the interface's routing run as a plain Python call at
    trace time.
    """
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, (float, torch.SymFloat)):
        return x.__float__()
    return operator.index(x)


def tensor_version(t) -> int | None:
    """t's version counter (it counts in-place writes), or None where there is none to read:
    not a tensor, or an inference tensor (made under `torch.inference_mode`, whose
    `_version` raises). Caches of values read from a tensor key on it, and keep nothing for
    None."""
    if not isinstance(t, torch.Tensor) or t.is_inference():
        return None
    return t._version


def kv_shared(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether v is k's first Dv columns: `v is k`, or a view of k's storage at k's first
    element with k's strides (`k[..., :Dv]`: DeepSeek's absorbed MLA). Read from metadata
    only; tensors without storage answer False (`from_tensors` does not ask under
    torch.compile, whose traced tensors have no data pointers)."""
    if v is k:
        return True
    try:
        if v.data_ptr() != k.data_ptr():  # the usual answer, found first (every call asks)
            return False
    except (RuntimeError, NotImplementedError):
        return False
    return (v.device == k.device and v.dtype == k.dtype and v.shape[:-1] == k.shape[:-1]
            and v.shape[-1] <= k.shape[-1] and v.stride() == k.stride())


@dataclass(frozen=True)
class AttnProblem:
    """One attention call in kernel terms ([B, H, N, D] inputs).

    causal_offset: query row i may see key j iff j <= i + causal_offset (only when `causal`).
    Bottom-right alignment (FlashAttention / our `attention(is_causal=True)`) is
    offset = seqlen_kv - seqlen_q; upper-left (SDPA's `is_causal`) is offset = 0.
    window_lo / window_hi: a sliding window, query row i may see key j iff
    i + window_lo <= j <= i + window_hi (None: that side unbounded), intersected with causal;
    the public (left, right) window becomes lo = frame - left, hi = frame + right.
    has_sinks: a per-head sink logit joins every row's softmax denominator.
    varlen: packed variable-length sequences in one launch (`varlen_attention`): batch counts
    the sequences, seqlen_q / seqlen_kv are the longest ones', and causal_offset, window_lo and
    window_hi are relative to each sequence's frame (its Nkv - Nq, added by the kernel).
    shared_kv: v holds k's first Dv columns (`kv_shared`), so a kernel may read them once.
    """

    dtype: str  # "bf16" | "fp16" | "fp32" | ...
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_kv: int
    head_dim: int
    head_dim_v: int
    causal: bool = False
    causal_offset: int = 0
    scale: float | None = None  # None: 1/sqrt(head_dim), as SDPA
    device_type: str = "cuda"
    has_mask: bool = False
    dropout_p: float = 0.0
    requires_grad: bool = False
    out_dtype: str | None = None  # the output's dtype when it differs from the inputs' (FP8)
    window_lo: int | None = None
    window_hi: int | None = None
    has_sinks: bool = False
    varlen: bool = False
    shared_kv: bool = False

    @property
    def qhead_per_kvhead(self) -> int:
        return self.heads_q // self.heads_kv

    @property
    def has_window(self) -> bool:
        return self.window_lo is not None or self.window_hi is not None

    @property
    def right_bounded(self) -> bool:
        """Whether keys right of some bound are hidden (causal, or a window's right side): the
        kernels' `causal` rule, j <= i + `right_edge`."""
        return self.causal or self.window_hi is not None

    @property
    def right_edge(self) -> int:
        """The kernels' causal offset: min(causal offset, window_hi) over the bounds present
        (0 when `right_bounded` is False)."""
        edges = [e for e, on in ((self.causal_offset, self.causal),
                                 (self.window_hi, self.window_hi is not None)) if on]
        return min(edges) if edges else 0

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)

    @staticmethod
    def from_tensors(q, k, v, *, causal: bool = False, causal_offset: int | None = None,
                     scale: float | None = None, has_mask: bool = False,
                     dropout_p: float = 0.0, bounds: tuple | None = None,
                     has_sinks: bool = False) -> "AttnProblem":
        """Describe q [B, Hq, Nq, D], k [B, Hkv, Nkv, D], v [B, Hkv, Nkv, Dv].

        causal_offset defaults to bottom-right alignment (Nkv - Nq); bounds is the window's
        (window_lo, window_hi), None for no window.
        """
        lo, hi = bounds if bounds is not None else (None, None)
        b, hq, nq, d = q.shape
        _, hkv, nkv, _ = k.shape
        if causal_offset is None:
            causal_offset = nkv - nq
        return AttnProblem(
            dtype=dtype_name(q.dtype), batch=b, heads_q=hq, heads_kv=hkv, seqlen_q=nq,
            seqlen_kv=nkv, head_dim=d, head_dim_v=v.shape[-1], causal=bool(causal),
            causal_offset=int(causal_offset) if causal else 0,
            scale=float(scale) if scale is not None else None, device_type=q.device.type,
            has_mask=has_mask, dropout_p=float(dropout_p),
            requires_grad=bool(q.requires_grad or k.requires_grad or v.requires_grad),
            window_lo=None if lo is None else int(lo), window_hi=None if hi is None else int(hi),
            has_sinks=bool(has_sinks),
            shared_kv=not torch.compiler.is_compiling() and kv_shared(k, v),
        )
