"""The one-line SDPA patch: `patch_sdpa()` routes `torch.nn.functional.scaled_dot_product_attention`
through ffpa_cute with SDPA's exact semantics (upper-left `is_causal`, never strict, fallback
reasons logged at INFO); `unpatch_sdpa()` restores the original."""

import logging

import torch.nn.functional as F

from .fallback import native_sdpa
from .interface import _FAST_CALLS, _attention, _fast_call, _fast_key
from .validate import check_args

__all__ = ["patch_sdpa", "unpatch_sdpa"]

_ORIGINAL_SDPA = None


def _patched_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                  scale=None, enable_gqa=False):
    """`F.scaled_dot_product_attention` with SDPA's exact semantics (upper-left `is_causal`).

    Covered calls run our kernel; everything else, including calls SDPA itself would reject,
    goes to native SDPA with the caller's arguments untouched apart from GQA expansion. Never
    strict: routing uncovered calls is the point of the patch. Fallback reasons log at INFO.
    """
    fast = _fast_key(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, True)
    if fast is not None:
        hit = _FAST_CALLS.get(fast)
        if hit is not None:
            return _fast_call(query, key, value, *hit)[0]
    if check_args(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        return native_sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                           is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, upper_left=True,
                      strict=False, level=logging.INFO, fast_key=fast)


def patch_sdpa() -> None:
    """Route `torch.nn.functional.scaled_dot_product_attention` through ffpa_cute (idempotent).

    Only code that looks the symbol up at call time (`F.scaled_dot_product_attention(...)`) is
    affected; a name imported earlier with `from torch.nn.functional import ...` is not.
    """
    global _ORIGINAL_SDPA
    if F.scaled_dot_product_attention is _patched_sdpa:
        return
    _ORIGINAL_SDPA = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _patched_sdpa


def unpatch_sdpa() -> None:
    """Restore the exact object `patch_sdpa` replaced; a no-op if we are not installed.

    If someone patched over us since, leave their wrapper alone rather than clobber it.
    """
    global _ORIGINAL_SDPA
    if F.scaled_dot_product_attention is _patched_sdpa and _ORIGINAL_SDPA is not None:
        F.scaled_dot_product_attention = _ORIGINAL_SDPA
        _ORIGINAL_SDPA = None
