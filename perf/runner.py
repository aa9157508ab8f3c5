"""Run one case through every implementation: first call, error, steady-state timing.

A row is a plain dict (JSON-ready): the case's fields, `direction`, `flops`, and `results`,
one entry per implementation with `ms`, `tflops`, `first_s`, `err`, `backend`, `fallback`,
`note`, `method` and the spread of the timing. A blank cell is `ms = None` with a `note`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import accuracy
from .baselines import Impl, Unsupported, _short, from_layout, to_layout
from .cases import Case, keep
from .flops import tflops
from .timing import L2Flusher, bench, first_call

# fp8 cases draw bf16 inputs; each implementation quantises them (outside the timing)
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                "fp8": torch.bfloat16}


class FatalCudaError(RuntimeError):
    """The CUDA context is unusable (illegal access, launch failure): stop the sweep."""


def is_fatal(e: BaseException) -> bool:
    s = str(e).lower()
    return any(t in s for t in ("illegal memory access", "illegal instruction",
                                "unspecified launch failure", "misaligned address",
                                "device-side assert", "an illegal"))


class Notes:
    """Distinct problems, each recorded once with the first case it appeared in and a count."""

    def __init__(self):
        self.items: dict[tuple[str, str], dict] = {}

    def add(self, who: str, msg: str, where: str = "") -> None:
        key = (who, msg)
        if key in self.items:
            self.items[key]["count"] += 1
        else:
            self.items[key] = {"who": who, "msg": msg, "first": where, "count": 1}

    def to_list(self) -> list[dict]:
        return list(self.items.values())


@dataclass
class Ctx:
    device: torch.device
    flush: L2Flusher | None = None
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    min_reps: int = 3
    max_reps: int = 100
    mem_limit_bytes: int = 40 * 10**9
    err_heads: int = 4  # 0: no error column
    seed: int = 0
    notes: Notes = field(default_factory=Notes)
    log: object = print


def make_inputs(case: Case, device: torch.device, seed: int = 0):
    """Random normal q, k, v, dout in [B, H, N, D] (never zeros); with `case.dv`, v is
    k[..., :dv] (a view: MLA's absorbed layout) and dout is dv wide."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    dt = TORCH_DTYPES[case.dtype]

    def rnd(h, n, d=case.d):
        return torch.randn(case.batch, h, n, d, generator=g, device=device, dtype=dt)

    if case.dv is not None:
        q, k = rnd(case.hq, case.nq), rnd(case.hkv, case.nkv)
        return q, k, k[..., :case.dv], rnd(case.hq, case.nq, case.dv)
    return rnd(case.hq, case.nq), rnd(case.hkv, case.nkv), rnd(case.hkv, case.nkv), \
        rnd(case.hq, case.nq)


def base_row(case: Case, direction: str) -> dict:
    row = case.to_dict()
    row.update(label=case.label, direction=direction, flops=case.flops(direction), results={})
    return row


def blank(note: str | None = None) -> dict:
    return {"ms": None, "tflops": None, "first_s": None, "err": None, "backend": None,
            "fallback": False, "note": note, "method": None}


def _reference(case, q, k, v, dout, direction, ctx):
    if ctx.err_heads <= 0:
        return None
    mask = keep(case).to(q.device) if case.mask else None
    try:
        if direction == "fwd":
            heads = accuracy.fwd_heads(case.hq, ctx.err_heads)
            return heads, accuracy.ref_forward(q, k, v, causal=case.causal, heads=heads,
                                               mask=mask)
        qh, kvh = accuracy.bwd_heads(case.hq, case.hkv, ctx.err_heads)
        return (qh, kvh), accuracy.ref_backward(q, k, v, dout, causal=case.causal, kv_heads=kvh,
                                                mask=mask)
    except Exception as e:
        if is_fatal(e):
            raise FatalCudaError(_short(e)) from e
        ctx.notes.add("reference", f"no error column: {_short(e)}", case.label)
        return None


def _run_fwd(prep, q, k, v, ref, ctx) -> dict:
    qi, ki, vi = (to_layout(x, prep.layout) for x in (q, k, v))
    res = {}
    with torch.no_grad():
        def fn():
            return prep.call(qi, ki, vi)
        res["first_s"], out = first_call(fn, ctx.device)
        if ref is not None:
            res["err"] = accuracy.fwd_error(from_layout(out, prep.layout), ref[1], ref[0])
        del out
        t = bench(fn, ctx.device, flush=ctx.flush, warmup_ms=ctx.warmup_ms, rep_ms=ctx.rep_ms,
                  min_reps=ctx.min_reps, max_reps=ctx.max_reps)
    res.update(ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, reps=t.reps, method="events")
    return res


def _run_bwd(prep, q, k, v, dout, ref, ctx) -> dict:
    ins = tuple(to_layout(x, prep.layout).detach().requires_grad_(True) for x in (q, k, v))
    doi = to_layout(dout, prep.layout)
    kw = dict(flush=ctx.flush, warmup_ms=ctx.warmup_ms, rep_ms=ctx.rep_ms,
              min_reps=ctx.min_reps, max_reps=ctx.max_reps)
    res = {}
    out = prep.call(*ins)  # forward outside the backward's first-call time

    def bwd_only():
        return torch.autograd.grad(out, ins, doi, retain_graph=True)

    res["first_s"], grads = first_call(bwd_only, ctx.device)
    if ref is not None:
        (qh, kvh), rg = ref
        res["err"] = accuracy.bwd_error([from_layout(g, prep.layout) for g in grads], rg, qh, kvh)
    del grads
    try:
        bwd_only()  # can the graph be replayed?
        t = bench(bwd_only, ctx.device, **kw)
        res.update(ms=t.median_ms, p20_ms=t.p20_ms, p80_ms=t.p80_ms, reps=t.reps,
                   method="bwd alone")
    except Exception as e:
        if is_fatal(e):
            raise

        def fwd_bwd():
            return torch.autograd.grad(prep.call(*ins), ins, doi)

        def fwd():
            with torch.no_grad():
                return prep.call(*ins)

        fwd_bwd()
        t_fb = bench(fwd_bwd, ctx.device, **kw)
        t_f = bench(fwd, ctx.device, **kw)
        res.update(ms=t_fb.median_ms - t_f.median_ms, reps=min(t_fb.reps, t_f.reps),
                   method="fwd+bwd - fwd", p20_ms=None, p80_ms=None)
    return res


def run_impl(impl: Impl, case: Case, q, k, v, dout, direction: str, ref, ctx: Ctx) -> dict:
    res = blank()
    reason = impl.load()
    if reason:
        ctx.notes.add(impl.name, reason)
        return blank(reason)
    try:
        prep = impl.prepare(case, q, k, v, direction, ctx)
    except Unsupported as e:
        ctx.notes.add(impl.name, str(e), case.label)
        return blank(str(e))
    except Exception as e:
        if is_fatal(e):
            raise FatalCudaError(_short(e)) from e
        msg = f"prepare failed: {_short(e)}"
        ctx.notes.add(impl.name, msg, case.label)
        return blank(msg)
    res.update(backend=prep.backend, fallback=prep.fallback)
    try:
        if direction == "fwd":
            res.update(_run_fwd(prep, q, k, v, ref, ctx))
        else:
            res.update(_run_bwd(prep, q, k, v, dout, ref, ctx))
    except Exception as e:
        if is_fatal(e):
            raise FatalCudaError(f"{impl.name} at {case.label}: {_short(e)}") from e
        msg = f"call failed: {_short(e)}"
        ctx.notes.add(impl.name, msg, case.label)
        res.update(ms=None, note=msg)
    finally:
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    if prep.first_s is not None and res.get("first_s") is not None:
        res["first_s"] = prep.first_s  # the real first call happened in prepare()
    if prep.note:
        res["note"] = prep.note if not res.get("note") else f"{prep.note}; {res['note']}"
        ctx.notes.add(impl.name, prep.note, case.label)
    if prep.fallback:
        ctx.notes.add(impl.name, f"fallback, not its own kernel: {prep.backend}", case.label)
    res["tflops"] = tflops(case.flops(direction), res.get("ms"))
    return res


def run_case(case: Case, impls: list[Impl], directions, ctx: Ctx) -> list[dict]:
    """One row per direction; inputs are shared by every implementation."""
    q, k, v, dout = make_inputs(case, ctx.device, ctx.seed)
    rows = []
    try:
        for direction in directions:
            row = base_row(case, direction)
            ref = _reference(case, q, k, v, dout, direction, ctx)
            for impl in impls:
                row["results"][impl.name] = run_impl(impl, case, q, k, v, dout, direction,
                                                     ref, ctx)
            del ref
            rows.append(row)
    finally:
        del q, k, v, dout
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
