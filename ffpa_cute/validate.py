"""Argument checks and mask resolution of the public API (SDPA's signature).

`check_args` returns the first argument error instead of raising, so the SDPA patch can hand
invalid calls to native SDPA unchanged while `attention` raises our clearer message.
`resolve_mask` maps (attn_mask, is_causal) to the causal alignment the kernels take;
`check_window_sinks` and `window_bounds` serve `attention`, `varlen_attention` and
`attention_with_kvcache` alike.
"""

import numbers

import torch

SINK_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def causal_bias(mask):
    """The mask if it is a torch CausalBias, else None.

    Imported only when a mask is given: torch.nn.attention.bias pulls in torch._dynamo (~1 s),
    which `import ffpa_cute` must not pay.
    """
    if mask is None:
        return None
    from torch.nn.attention.bias import CausalBias

    return mask if isinstance(mask, CausalBias) else None


def check_args(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """Return the first argument error (TypeError/ValueError) or None; never raises.

    Returning instead of raising lets the SDPA patch hand invalid calls to native SDPA unchanged,
    so users see torch's own behaviour there, while `attention` raises our clearer message.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            return TypeError(f"{name} must have a floating dtype (bf16/fp16/fp32/fp64), "
                             f"got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        return TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        return ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.dim() < 3 or not (q.dim() == k.dim() == v.dim()):
        return ValueError("q, k, v must have the same rank >= 3 ([..., H, N, D]), got shapes "
                          f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:-3] != k.shape[:-3] or q.shape[:-3] != v.shape[:-3]:
        return ValueError(f"batch dims (all but the last 3) must match: q {tuple(q.shape[:-3])}, "
                          f"k {tuple(k.shape[:-3])}, v {tuple(v.shape[:-3])}")
    if q.shape[-1] != k.shape[-1]:
        return ValueError(f"q and k head dims (last dim) must match, got {q.shape[-1]} and "
                          f"{k.shape[-1]}")
    if k.shape[-2] != v.shape[-2] or k.shape[-3] != v.shape[-3]:
        return ValueError(f"k and v must agree on heads and length (dims -3, -2), got "
                          f"{tuple(k.shape)} and {tuple(v.shape)}")
    hq, hkv = q.shape[-3], k.shape[-3]
    if not isinstance(enable_gqa, bool):
        return TypeError(f"enable_gqa must be a bool, got {type(enable_gqa).__name__}")
    if hq != hkv:
        if not enable_gqa:
            return ValueError(f"q has {hq} heads but k/v have {hkv}: pass enable_gqa=True for "
                              "grouped-query attention (as SDPA requires)")
        if hkv == 0 or hq % hkv:
            return ValueError(f"enable_gqa=True needs q heads ({hq}) divisible by k/v heads "
                              f"({hkv})")
    if not isinstance(is_causal, bool):
        return TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        return TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p < 1.0:
        return ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        return TypeError(f"scale must be None or a float, got {type(scale).__name__}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            return TypeError("attn_mask must be None, a bool/float tensor, or a CausalBias "
                             f"(torch.nn.attention.bias), got {type(attn_mask).__name__}")
        if is_causal:
            return ValueError("is_causal=True cannot be combined with attn_mask (as in SDPA); "
                              "pass causal_lower_right/causal_upper_left as attn_mask instead")
        if causal_bias(attn_mask) is not None:
            if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (q.shape[-2], k.shape[-2]):
                return ValueError(f"attn_mask CausalBias is for (Nq, Nkv) = "
                                  f"({attn_mask.seq_len_q}, {attn_mask.seq_len_kv}) but the inputs "
                                  f"have ({q.shape[-2]}, {k.shape[-2]})")
        elif attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            return TypeError(f"attn_mask must be a bool or floating tensor, got {attn_mask.dtype}")
    return None


def check_return_lse(return_lse, dropout_p):
    """The error of a `return_lse` argument (or None): a bool, and not with dropout, whose
    dropped-out softmax has no log-sum-exp that `merge_attention` could combine exactly."""
    if not isinstance(return_lse, bool):
        return TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    if return_lse and dropout_p != 0:
        return ValueError(f"return_lse=True cannot be combined with dropout_p={dropout_p}: "
                          "the log-sum-exp of a dropped-out softmax is not defined; pass "
                          "dropout_p=0.0 (or return_lse=False)")
    return None


def check_window_sinks(window, sinks, q, dropout_p=0.0):
    """The error of the `window` / `sinks` arguments (or None).

    window: None, or (left, right) with each side an int >= 0 or None (unbounded on that
    side). sinks: None, or a floating tensor [Hq] on q's device (one logit per query head).
    Neither combines with dropout (their math path has none)."""
    if window is not None:
        if not isinstance(window, (tuple, list)) or len(window) != 2:
            return TypeError("window must be None or a pair (left, right), each an int >= 0 "
                             f"or None (unbounded), got {window!r}")
        for side, w in zip(("left", "right"), window):
            if w is not None and (isinstance(w, bool) or not isinstance(w, numbers.Integral)):
                return TypeError(f"window {side} must be an int >= 0 or None (unbounded), got "
                                 f"{type(w).__name__}")
            if w is not None and w < 0:
                return ValueError(f"window {side}={w}: must be an int >= 0, or None for an "
                                  "unbounded side (not -1)")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or sinks.dtype not in SINK_DTYPES:
            return TypeError("sinks must be None or a float tensor [Hq] (float32, float64, "
                             f"bfloat16 or float16), got {getattr(sinks, 'dtype', type(sinks))}")
        if tuple(sinks.shape) != (q.shape[-3],):
            return ValueError(f"sinks must have shape [Hq] = [{q.shape[-3]}] (one logit per "
                              f"query head), got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            return ValueError(f"sinks must be on q's device ({q.device}), got {sinks.device}")
    if dropout_p != 0 and (window is not None or sinks is not None):
        return ValueError(f"dropout_p={dropout_p} cannot be combined with window or sinks (their "
                          "exact math path has no dropout); pass dropout_p=0.0")
    return None


def window_bounds(window, frame):
    """(lo, hi) of a checked (left, right) window whose query row i sits at key i + frame:
    row i may see key j iff i + lo <= j <= i + hi (None: unbounded). None when there is no
    window or both sides are unbounded."""
    if window is None or (window[0] is None and window[1] is None):
        return None
    left, right = window
    return (None if left is None else frame - int(left),
            None if right is None else frame + int(right))


def resolve_mask(attn_mask, is_causal, nq, nkv, upper_left):
    """Map (attn_mask, is_causal) to (causal, causal_offset, tensor_mask).

    Only a CausalBias becomes kernel-servable causal masking; any other tensor stays a mask.
    `upper_left` selects SDPA's meaning of `is_causal` (the patch) over ours (bottom-right).
    """
    if causal_bias(attn_mask) is not None:
        from torch.nn.attention.bias import CausalVariant

        right = attn_mask.variant == CausalVariant.LOWER_RIGHT
        return True, (nkv - nq if right else 0), None
    if is_causal:
        return True, (0 if upper_left else nkv - nq), None
    return False, 0, attn_mask


__all__ = ["causal_bias", "check_args", "check_return_lse", "check_window_sinks", "resolve_mask",
           "window_bounds"]
