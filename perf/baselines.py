"""The implementations a sweep compares: ours (`ffpa_cute.attention`) and the baselines.

Each `Impl` is loaded lazily (a missing package is a blank column, not an error) and, per case,
`prepare()` returns a `Prepared`: a callable over inputs in the implementation's own layout, plus
what actually ran (the SDPA backend, our path as `ffpa_cute.explain` reports it, FFPA's backend)
and whether it was a fallback. `Unsupported` means "no kernel here": the cell is blank and the
reason is noted once.

Causal everywhere means bottom-right alignment (query i sees key j iff j <= i + Nkv - Nq), as
`ffpa_cute.attention(is_causal=True)`, FlashAttention and FFPA define it; SDPA gets
`causal_lower_right` when Nq != Nkv (its own `is_causal` is upper-left).
"""

from __future__ import annotations

import importlib
import inspect
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .cases import attn_mask


class Unsupported(Exception):
    """This implementation has no kernel for the case; the cell stays blank."""


@dataclass
class Prepared:
    call: Callable  # (q, k, v) in `layout` -> out in `layout`
    layout: str = "bhnd"  # "bhnd" ([B, H, N, D], SDPA) or "bnhd" ([B, N, H, D], FA)
    backend: str | None = None  # what ran: SDPA backend, our path, FFPA backend
    fallback: bool = False  # True: not this implementation's own kernel
    note: str | None = None
    first_s: float | None = None  # set when prepare() already made the first call


def to_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.transpose(1, 2).contiguous() if layout == "bnhd" else x


def from_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x.transpose(1, 2) if layout == "bnhd" else x


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


def _short(e: BaseException, n: int = 200) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:n]


def dist_version(*names: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    for n in names:
        try:
            return version(n)
        except PackageNotFoundError:
            continue
    return None


class Impl:
    name = "?"  # key in raw results and column prefix
    title = "?"  # column title

    def __init__(self):
        self._loaded = False
        self._reason: str | None = None

    def load(self) -> str | None:
        """None when usable, else why not (import failure); cached."""
        if not self._loaded:
            self._loaded = True
            try:
                self._reason = self._load()
            except Exception as e:  # an import that fails is a blank column
                self._reason = f"not importable ({_short(e)})"
        return self._reason

    def _load(self) -> str | None:
        return None

    def version(self) -> str | None:
        return None

    def prepare(self, case, q, k, v, direction: str, ctx) -> Prepared:
        raise NotImplementedError


# --------------------------------------------------------------------------------------- ours
class Ours(Impl):
    name, title = "ours", "ours"

    def _load(self):
        self.mod = importlib.import_module("ffpa_cute")
        if not callable(getattr(self.mod, "attention", None)):
            return "ffpa_cute has no attention()"
        return None

    def version(self):
        return getattr(getattr(self, "mod", None), "__version__", None) or dist_version(
            "ffpa-cute", "ffpa_cute")

    def explain(self, q, k, v, causal: bool, gqa: bool, direction: str = "fwd",
                mask=None) -> str:
        """ffpa_cute.explain(...) for this call; passes `direction`/`backward` if it takes them,
        and `mask` as attn_mask."""
        fn = getattr(self.mod, "explain", None)
        if fn is None:
            return "? (no ffpa_cute.explain)"
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        kw = {"is_causal": causal}
        if gqa:
            kw["enable_gqa"] = True
        if mask is not None:
            kw["attn_mask"] = mask
        if "direction" in params:
            kw["direction"] = direction
        if "backward" in params:
            kw["backward"] = direction == "bwd"
        if direction == "bwd":  # explain() may route on requires_grad; it runs nothing
            q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
        try:
            try:
                return str(fn(q, k, v, **kw))
            except TypeError:
                return str(fn(q, k, v, is_causal=causal))
        except Exception as e:
            return f"? (explain failed: {_short(e)})"

    def prepare(self, case, q, k, v, direction, ctx):
        if case.dtype == "fp8":
            if case.mask:
                raise Unsupported("no FP8 rows with a dense mask")
            return self._prepare_fp8(case, q, k, v, direction)
        gqa = case.hq != case.hkv
        mask = attn_mask(case, q.device) if case.mask else None
        path = self.explain(q, k, v, case.causal, gqa, direction, mask)
        fallback = "fallback" in path.lower()
        note = None
        if direction == "bwd" and "sdpa recompute" in path.lower():
            fallback = True  # a kernel forward whose backward is torch's SDPA recompute
            note = "backward: SDPA recompute (explain() gives the reason)"
        elif direction == "bwd" and not any(t in path.lower() for t in ("backward", "bwd")):
            # explain() named only the forward path: do not credit the backward to a kernel.
            path = "fwd path: " + path
            note = "explain() names no backward path: backward kernel not verified as ours"
        elif direction == "bwd" and bwd_kernels(path):
            path = f"bwd {bwd_kernels(path)}; {path}"   # the table shows the row's start
        attention = self.mod.attention
        kw = {} if mask is None else {"attn_mask": mask}

        def call(q, k, v):
            return attention(q, k, v, is_causal=case.causal, enable_gqa=gqa, **kw)

        return Prepared(call, "bhnd", backend=path, fallback=fallback, note=note)

    def _prepare_fp8(self, case, q, k, v, direction):
        """FP8 rows: q, k, v quantised per (batch, head) to e4m3 here (not timed), q's descale
        taken per KV head; the timed call is `attention()` on them (its V transpose included),
        bf16 out. The error column compares with the bf16 inputs' reference, so it includes the
        inputs' quantisation."""
        if direction != "fwd":
            raise Unsupported("FP8 is forward-only")
        quantize = getattr(self.mod, "quantize_fp8", None)
        if quantize is None:
            raise Unsupported("no ffpa_cute.quantize_fp8")
        g = case.hq // case.hkv
        qd = q.abs().amax((-2, -1)).float().reshape(q.shape[0], case.hkv, g).amax(-1) / 448.0
        q8 = (q.float() / qd.repeat_interleave(g, 1)[..., None, None]).to(torch.float8_e4m3fn)
        (k8, kd), (v8, vd) = quantize(k, "head"), quantize(v, "head")
        kw = dict(is_causal=case.causal, enable_gqa=g > 1, q_descale=qd, k_descale=kd,
                  v_descale=vd)
        path = str(self.mod.explain(q8, k8, v8, is_causal=case.causal, enable_gqa=g > 1))
        attention = self.mod.attention

        def call(q_, k_, v_):  # the pre-quantised inputs: the same data every call
            return attention(q8, k8, v8, **kw)

        return Prepared(call, "bhnd", backend=path, fallback="fallback" in path.lower(),
                        note="fp8: e4m3 inputs quantised per head; err includes quantisation")


# --------------------------------------------------------------------------------------- SDPA
SDPA_ORDER = ("cudnn", "flash", "efficient", "math")
_SDPA_ENUM = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION",
              "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


def bwd_kernels(path: str) -> str | None:
    """The backward kernels an `explain()` text names, short ("Fused", "DQ, DK, DV"), or None:
    a backward row's path starts with them (which ran: the fused kernel or the atomic-free
    ones)."""
    import re

    m = re.search(r"backward kernels \(dQ, dK, dV\) \[([^:\]]+)", path)
    if m is None:
        return None
    return ", ".join(re.sub(r"^FFPABwd|Sm\d+$", "", n.strip()) for n in m.group(1).split(","))


def math_bytes(case, direction: str) -> int:
    """Rough peak of SDPA's MATH backend: fp32 score-sized buffers (3 forward: scores, probs,
    a cast; 6 backward). N = 64K with H = 1 needs ~52 GB forward: skipped at the default limit."""
    per = case.batch * case.hq * case.nq * case.nkv * 4
    return per * (3 if direction == "fwd" else 6)


class Sdpa(Impl):
    """torch SDPA; the backend is the first of `order` that runs this case (fwd, or fwd+bwd)."""

    name, title = "sdpa", "SDPA"

    def __init__(self, order=SDPA_ORDER):
        super().__init__()
        self.order = tuple(order)

    def _load(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401
        return None

    def version(self):
        return torch.__version__

    def candidates(self, case):
        """(backend name, GQA mode) in preference order; mode: None | 'native' | 'expand'."""
        fast = [b for b in self.order if b != "math"]
        if case.hq == case.hkv:
            out = [(b, None) for b in fast]
        else:
            out = [(b, "native") for b in fast] + [(b, "expand") for b in fast]
        if "math" in self.order:
            out.append(("math", "native" if case.hq != case.hkv else None))
        return out

    def make_call(self, case, backend: str, gqa_mode, device=None):
        """The timed SDPA call; a mask case's attn_mask is made once, on `device`."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        be = getattr(SDPBackend, _SDPA_ENUM[backend])
        mask, is_causal = None, case.causal
        if case.causal and case.nq != case.nkv:
            from torch.nn.attention.bias import causal_lower_right
            mask, is_causal = causal_lower_right(case.nq, case.nkv), False
        if case.mask:
            mask = attn_mask(case, device)
        rep = case.hq // case.hkv

        def call(q, k, v):
            with sdpa_kernel([be]):
                if gqa_mode == "expand":
                    k = k.repeat_interleave(rep, dim=1)
                    v = v.repeat_interleave(rep, dim=1)
                return F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, is_causal=is_causal,
                    enable_gqa=gqa_mode == "native")

        return call

    @staticmethod
    def label(backend: str, gqa_mode) -> str:
        name = "MATH" if backend == "math" else backend
        return f"{name} (K/V expanded)" if gqa_mode == "expand" else name

    def prepare(self, case, q, k, v, direction, ctx):
        if case.dtype == "fp8":
            raise Unsupported("torch SDPA has no FP8 attention")
        tried = []
        for backend, mode in self.candidates(case):
            if backend == "math" and math_bytes(case, direction) > ctx.mem_limit_bytes:
                gb = math_bytes(case, direction) / 1e9
                tried.append(f"MATH skipped (would need ~{gb:.0f} GB)")
                continue
            call = self.make_call(case, backend, mode, q.device)
            try:
                t0 = time.perf_counter()
                self._trial(call, q, k, v, direction)
                first_s = time.perf_counter() - t0
            except Exception as e:
                tried.append(f"{self.label(backend, mode)}: {_short(e, 80)}")
                if q.is_cuda:
                    torch.cuda.empty_cache()
                continue
            note = None
            if mode == "expand":
                note = "SDPA has no GQA kernel here: K/V expanded inside the timed call"
            return Prepared(call, "bhnd", backend=self.label(backend, mode), note=note,
                            first_s=first_s)
        raise Unsupported("no SDPA backend runs this case: " + "; ".join(tried))

    @staticmethod
    def _trial(call, q, k, v, direction):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if direction == "fwd":
                with torch.no_grad():
                    call(q, k, v)
            else:
                qs = [x.detach().requires_grad_(True) for x in (q, k, v)]
                out = call(*qs)
                torch.autograd.grad(out, qs, torch.ones_like(out))
            if q.is_cuda:
                torch.cuda.synchronize(q.device)


# --------------------------------------------------------------------------------------- FFPA
FFPA_API_NAMES = ("ffpa_attn_func", "ffpa_attn", "ffpa_func", "ffpa", "attention",
                  "flash_attn_func")


def introspect_api(fn) -> dict:
    """How to call an attention function found at run time: layout and keyword names.

    SDPA-style (`is_causal` / `enable_gqa` parameters) -> [B, H, N, D]; FA-style (`causal`)
    -> [B, N, H, D]. `backend_kw` is the keyword that picks a kernel family, when there is one
    (an explicit `forward_backend` / `backend` parameter, or `forward_backend` through **kwargs).
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        params = {}
    names = set(params)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if "is_causal" in names or "enable_gqa" in names:
        layout, causal_kw = "bhnd", "is_causal"
    elif "causal" in names:
        layout, causal_kw = "bnhd", "causal"
    else:
        layout, causal_kw = "bhnd", "is_causal"
    backend_kw = next((n for n in ("forward_backend", "backend") if n in names),
                      "forward_backend" if var_kw else None)
    return {"layout": layout, "causal_kw": causal_kw, "backend_kw": backend_kw,
            "gqa_kw": "enable_gqa" if "enable_gqa" in names else None}


class Ffpa(Impl):
    """The FFPA package (`ffpa_attn`), CuTeDSL backend by default ('triton' for the other)."""

    def __init__(self, backend: str = "cutedsl"):
        super().__init__()
        self.backend = backend
        self.name = "ffpa" if backend == "cutedsl" else f"ffpa-{backend}"
        self.title = "FFPA" if backend == "cutedsl" else f"FFPA-{backend}"

    def _load(self):
        self.mod = importlib.import_module("ffpa_attn")
        fn = next((getattr(self.mod, n) for n in FFPA_API_NAMES
                   if callable(getattr(self.mod, n, None))), None)
        if fn is None:
            return "ffpa_attn has no known entry point (" + ", ".join(FFPA_API_NAMES) + ")"
        self.fn, self.api = fn, introspect_api(fn)
        return None

    def version(self):
        return getattr(getattr(self, "mod", None), "__version__", None) or dist_version(
            "ffpa-attn", "ffpa_attn")

    def _kwargs(self, case, with_backend: bool) -> dict:
        kw = {self.api["causal_kw"]: case.causal}
        if self.api["gqa_kw"] and case.hq != case.hkv:
            kw[self.api["gqa_kw"]] = True
        if with_backend and self.api["backend_kw"]:
            kw[self.api["backend_kw"]] = self.backend
        return kw

    def _routes_to_sdpa(self, q, k, mask=None) -> bool:
        try:
            iface = importlib.import_module(self.mod.__name__ + ".ffpa_attn_interface")
            return bool(iface._should_fallback_to_sdpa(q, k, mask, 0.0, self.backend))
        except Exception:
            return False

    def prepare(self, case, q, k, v, direction, ctx):
        if case.dtype == "fp8":
            raise Unsupported("no FP8 path compared here (FP8 rows time ffpa_cute alone)")
        if case.dv is not None:
            raise Unsupported("no Dv != D path compared here (MLA rows: ffpa_cute and SDPA)")
        layout, fn, bkw = self.api["layout"], self.fn, self.api["backend_kw"]
        kw = self._kwargs(case, with_backend=True)
        mask = None
        if case.mask:
            if layout != "bhnd":
                raise Unsupported("this ffpa_attn entry point takes no SDPA-style attn_mask")
            kw["attn_mask"] = mask = attn_mask(case, q.device)
        fallback = self._routes_to_sdpa(q, k, mask) if layout == "bhnd" else False
        label = self.backend + (" -> SDPA fallback" if fallback else "")
        prep = Prepared(None, layout, backend=label, fallback=fallback)
        if bkw is None:
            prep.note = f"ffpa_attn takes no backend keyword: ran its default, not {self.backend}"

        def call(q, k, v):
            try:
                return _first(fn(q, k, v, **kw))
            except TypeError as e:
                if bkw is None or bkw not in kw or bkw not in str(e):
                    raise
                # The keyword is not accepted by this version: run its default backend.
                kw.pop(bkw)
                prep.backend = "default"
                prep.note = f"{bkw}= refused ({_short(e, 80)}): ran the default backend"
                return _first(fn(q, k, v, **kw))

        prep.call = call
        return prep


# --------------------------------------------------------------------------------------- FA
FA_MODULES = (("flash_attn.cute", "FA4 (cute)"), ("flash_attn_interface", "FA3"),
              ("flash_attn", "FA2"))


class FlashAttn(Impl):
    """FlashAttention: flash_attn.cute (FA4) if importable, else FA3, else FA2 ([B, N, H, D])."""

    name, title = "fa", "FA"

    def _load(self):
        errors = []
        for mod_name, flavor in FA_MODULES:
            try:
                mod = importlib.import_module(mod_name)
            except Exception as e:
                errors.append(f"{mod_name}: {_short(e, 60)}")
                continue
            fn = getattr(mod, "flash_attn_func", None)
            if callable(fn):
                self.fn, self.flavor, self.mod = fn, flavor, mod
                return None
            errors.append(f"{mod_name}: no flash_attn_func")
        return "not importable (" + "; ".join(errors) + ")"

    def version(self):
        v = dist_version("flash-attn-4", "fa4", "flash-attn-3", "flash_attn_3", "flash-attn")
        return f"{getattr(self, 'flavor', '?')} {v}" if v else getattr(self, "flavor", None)

    def prepare(self, case, q, k, v, direction, ctx):
        if case.dtype == "fp8":
            raise Unsupported("no FP8 path compared here (FP8 rows time ffpa_cute alone)")
        if case.dv is not None:
            raise Unsupported("no Dv != D path compared here (MLA rows: ffpa_cute and SDPA)")
        if case.mask:
            raise Unsupported("FlashAttention takes no dense attn_mask")
        fn = self.fn

        def call(q, k, v):
            return _first(fn(q, k, v, causal=case.causal))

        return Prepared(call, "bnhd", backend=self.flavor)


BASELINES = {"sdpa": Sdpa, "ffpa": Ffpa, "ffpa-triton": lambda: Ffpa("triton"), "fa": FlashAttn}
DEFAULT_BASELINES = ("sdpa", "ffpa", "fa")


def parse_baselines(spec: str | None) -> tuple[str, ...]:
    if spec is None:
        return DEFAULT_BASELINES
    out = []
    for tok in (t.strip().lower() for t in spec.split(",")):
        if not tok or tok == "none":
            continue
        if tok not in BASELINES:
            raise ValueError(f"unknown baseline {tok!r}; choose from {', '.join(BASELINES)}")
        if tok not in out:
            out.append(tok)
    return tuple(out)


def make_impls(baselines, sdpa_order=SDPA_ORDER, with_ours: bool = True) -> list[Impl]:
    impls: list[Impl] = [Ours()] if with_ours else []
    for b in baselines:
        impls.append(Sdpa(sdpa_order) if b == "sdpa" else BASELINES[b]())
    return impls
