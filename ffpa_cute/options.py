"""One frozen `Options` value: every choice a caller may switch, passed to the planners and part
of every plan-cache key.

The defaults are the verified configuration (what the GPU tests and sanitizers ran). An
environment variable per field overrides a default for the whole process, read once at first
use; `use(...)` overrides fields for a block of code (per thread / task: a context variable), and
`set_default(...)` for the rest of the process. Planning reads `current()`, and the plan caches
key on the `Options` value itself, so a field changed after a first call gives the new plan on the
next one.

    import ffpa_cute
    with ffpa_cute.options.use(family="sm80"):      # the Split-D kernels on any GPU
        out = ffpa_cute.attention(q, k, v)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from dataclasses import dataclass

FAMILIES = ("sm80", "sm90", "sm100", "sm120")
SELF_CHECK = ("unverified", "always", "off")
JIT = ("allow", "warn", "error")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Options:
    """What a caller may switch (environment variable in brackets).

    family:      force a kernel family ("sm80", "sm90", "sm100", "sm120") instead of the
                 device's own; the compile target stays the device's (FFPA_CUTE_ARCH). E.g.
                 "sm80" runs the mma.sync Split-D kernels on an H200.
    strict:      raise NotImplementedError(reason) where a call would fall back to torch's SDPA
                 (FFPA_CUTE_STRICT).
    pack_gqa:    for GQA / MQA calls with few query rows and no masked row, put the query heads of
                 each KV head into the rows of one tile (fewer, fuller tiles; same bits)
                 (FFPA_CUTE_PACK_GQA).
    kv_pair:     where two CTAs split the output's columns (the forward and the backward
                 above D=576 (16-bit; up to 576 one CTA holds O or the gradient), the FP8
                 forward and varlen above 512): they form
                 a cluster and split the score blocks, exchanging P (dS) over distributed
                 shared memory, instead of both computing every score block; same bits
                 (FFPA_CUTE_KV_PAIR).
    persistent:  16-bit forward with D, Dv in {320, 384, 448, 512} and no right bound or a
                 sliding window: one CTA per SM walks the row tiles, so a tile's prologue and
                 epilogue overlap its neighbours' work; same bits (FFPA_CUTE_PERSISTENT).
    varlen_launch: `varlen_attention` on the sm90 16-bit kernels: one launch over all packed
                 sequences (each CTA finds its sequence's tile from cu_seqlens), forward and
                 backward, instead of one call per sequence (FFPA_CUTE_VARLEN_LAUNCH).
    fast_launch: a repeated no-grad call with the same signature goes straight to a launcher
                 that only writes the data pointers (FFPA_CUTE_FAST_LAUNCH).
    deterministic: the backward: False (default): on sm90 the fused kernel where it builds
                 and measured faster (D 264-576, D % 64 != 0 on operands zero-padded to
                 the next multiple of 64; up to 64 query heads per KV head, more when
                 causal, Dv == D, not varlen, D 520-576 without a window; elsewhere the
                 atomic-free kernels): 5 GEMM units instead of 8, dQ summed by fp32
                 reductions in whatever order they land, so dQ's last bits vary run to run
                 (dK, dV do not, but for causal groups of 16+, walked by row units whose dK /
                 dV are fp32 reductions too; GPU-tested and sanitizer-clean). True, or torch's
                 `use_deterministic_algorithms(True)`: the atomic-free kernels everywhere,
                 the same bits every run (FFPA_CUTE_DETERMINISTIC).
    self_check:  "unverified" (default): the first call of each kernel configuration of a family
                 never run on the device's target (or of a configuration not verified on any
                 GPU, e.g. the fused backward with D over C CTAs, `scatter`) first passes a
                 canary problem against a float32 reference, else it falls back
                 (ffpa_cute/selfcheck.py); "always": every family; "off": no canary
                 (FFPA_CUTE_SELF_CHECK).
    jit:         a kernel compiled at run time, in a call (not by `python -m
                 ffpa_cute.precompile`): "allow" (default; logged at INFO), "warn" (a warning
                 naming the kernel, its config and the precompile command), "error" (raise
                 `cache.JitCompileError` instead: a deployment that precompiled its kernels finds
                 a missing one in its warm-up, not as a multi-second stall in serving)
                 (FFPA_CUTE_JIT).
    """

    family: str | None = None
    strict: bool = False
    pack_gqa: bool = True
    kv_pair: bool = True
    persistent: bool = True
    varlen_launch: bool = True
    fast_launch: bool = True
    deterministic: bool = False
    self_check: str = "unverified"
    jit: str = "allow"

    def __post_init__(self):
        if self.family is not None and self.family not in FAMILIES:
            raise ValueError(f"Options.family={self.family!r}: accepted values are None, "
                             f"{', '.join(FAMILIES)}")
        for name, accepted in _CHOICES.items():
            if getattr(self, name) not in accepted:
                raise ValueError(f"Options.{name}={getattr(self, name)!r}: accepted values are "
                                 f"{', '.join(accepted)}")
        for f in dataclasses.fields(self):
            if f.name not in ("family", *_CHOICES) and not isinstance(getattr(self, f.name),
                                                                      bool):
                raise TypeError(f"Options.{f.name} must be a bool, got "
                                f"{type(getattr(self, f.name)).__name__}")


_CHOICES = {"self_check": SELF_CHECK, "jit": JIT}   # fields taking one of a few strings
ENV = {"family": "FFPA_CUTE_ARCH", "strict": "FFPA_CUTE_STRICT", "pack_gqa": "FFPA_CUTE_PACK_GQA",
       "kv_pair": "FFPA_CUTE_KV_PAIR", "persistent": "FFPA_CUTE_PERSISTENT",
       "deterministic": "FFPA_CUTE_DETERMINISTIC",
       "varlen_launch": "FFPA_CUTE_VARLEN_LAUNCH",
       "fast_launch": "FFPA_CUTE_FAST_LAUNCH",
       "self_check": "FFPA_CUTE_SELF_CHECK", "jit": "FFPA_CUTE_JIT"}


def from_env(environ=None) -> Options:
    """The defaults with the environment's overrides; raises ValueError naming the variable and
    the accepted values for a value it cannot read."""
    environ = os.environ if environ is None else environ
    kw = {}
    for field, var in ENV.items():
        raw = environ.get(var, "").strip().lower()
        if not raw:
            continue
        if field == "family":
            value = raw.replace("_", "")
            if value not in FAMILIES:
                raise ValueError(f"{var}={raw!r}: accepted values are {', '.join(FAMILIES)}")
            kw[field] = value
        elif field in _CHOICES:
            if raw not in _CHOICES[field]:
                raise ValueError(f"{var}={raw!r}: accepted values are "
                                 f"{', '.join(_CHOICES[field])}")
            kw[field] = raw
        elif raw in _TRUE or raw in _FALSE:
            kw[field] = raw in _TRUE
        else:
            raise ValueError(f"{var}={raw!r}: accepted values are {_TRUE + _FALSE}")
    return Options(**kw)


_DEFAULT: Options | None = None
_CURRENT: contextvars.ContextVar[Options | None] = contextvars.ContextVar("ffpa_cute_options",
                                                                          default=None)


def default() -> Options:
    """The process-wide options: `from_env()` at first use, or what `set_default` set."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = from_env()
    return _DEFAULT


def current() -> Options:
    """The options in force here: the innermost `use(...)`, else the process default."""
    return _CURRENT.get() or default()


def for_backward(options: Options) -> Options:
    """`options` as the backward plans with them: `deterministic` also while torch's
    deterministic algorithms are on (`torch.use_deterministic_algorithms(True)`), as torch's
    own nondeterministic kernels then refuse to run."""
    import torch

    if not options.deterministic and torch.are_deterministic_algorithms_enabled():
        return dataclasses.replace(options, deterministic=True)
    return options


def set_default(options: Options | None = None, **changes) -> Options:
    """Replace the process default (`options`, or the current default with `changes`); None and
    no changes re-read the environment. Returns the previous default."""
    global _DEFAULT
    previous = default()
    if options is None and not changes:
        _DEFAULT = from_env()
    else:
        _DEFAULT = dataclasses.replace(options or previous, **changes)
    return previous


@contextlib.contextmanager
def use(options: Options | None = None, **changes):
    """Options for the block: `options`, or the current ones with `changes`."""
    token = _CURRENT.set(dataclasses.replace(options or current(), **changes))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


__all__ = ["ENV", "FAMILIES", "JIT", "Options", "current", "default", "for_backward", "from_env",
           "set_default", "use"]
