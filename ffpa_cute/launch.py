"""Running planned kernels on torch tensors: the forward, the backward's kernel list, and the
per-signature launcher of repeated calls.

Every kernel class names its tensor arguments (`OPERANDS`: "q", "k", "v", "o", "do", "dq", "dk",
"dv", "lse", "delta") and scalars (`SCALARS`), so one `run_job` launches any of them from a dict
of tensors: the host side needs no per-kernel code, and a kernel module never imports this one.
Compiled kernels take torch tensors directly (cutlass-dsl's TVM-FFI convention) and launch on
torch's current stream of the current device, which the caller makes the tensors' device.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import dispatch
from .cache import jit_cache
from .common.config import DeltaConfig
from .dispatch import BwdPlan, Plan


def kernel_ready(t: torch.Tensor) -> torch.Tensor:
    """The kernels need unit stride on D and 16-byte aligned rows: copy only when that fails.

    A clone, not `.contiguous()`: a contiguous view at a misaligned offset would come back as is.
    """
    elems = 16 // t.element_size()
    if (t.stride(-1) != 1 or t.data_ptr() % 16
            or any(s % elems for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)):
        return t.clone(memory_format=torch.contiguous_format)
    return t


# TMA reads each row of a box in 128-byte lines of 32-byte sectors; a row that does not start
# on a line (2 D % 128 != 0 at 16 bits, e.g. D=520: 1040-byte rows) straddles two, and one that
# does not start on a sector (D % 16 == 8) splits every sector it touches. Measured, the same
# kernel on rows padded to 128 bytes (forward, B=1, H=32, N=8K; perf.row_stride, perf.pad_d):
# above 512 (H200) D=520 16.2 -> 13.4 ms, 712 20.0 -> 17.7, 1016 26.0 -> 20.3; below 512
# (H100) 13-30% faster at every D % 16 == 8 (D=504 11.37 -> 8.71 ms, 312 8.14 -> 6.42; the
# backward likewise), but only 1-4% at D % 16 == 0, less than the copy (the H200 read 264
# -10%, 328 -5%, 336 -2%).
ROW_LINE = 128
ROW_SECTOR = 32


def repack_rows(p, cfg, nq: int, nkv: int) -> bool:
    """Whether `run_fwd` / `run_bwd` first copy the inputs they stream into rows padded to 128
    bytes (`row_aligned`; the forward k and v, as it reads each Q tile once: copying q too
    measured 3-4% slower (perf.pad_d `kv`, D % 16 == 8 up to 504, N=8K, H100); the backward
    q, k, v and dout): 16-bit WGMMA kernels at D > 512 whose rows are not whole lines, when the
    attention work outweighs the copy, nq nkv >= 700 (nq + 2 nkv) (about N >= 2K for Nq =
    Nkv: the copy is ~3% of the forward's time at N=8K); and the 16-bit WGMMA kernels at D <=
    512, or with O (the gradient) in one CTA above it (`wide_o`), whose rows do not start on
    32-byte sectors (D % 16 == 8), when nq nkv >= 1000 (nq + 2 nkv) (N >= 3K; the copy is 6-9%
    of the forward's time at N=8K, the gain 13-30%: measured with the copy 8-23% faster
    forward, 21-30% faster backward, H100, perf.pad_d; `wide_o`, perf.one_cta, H100, N=8K:
    the forward at D=520 / 536 / 552 +17-37% with the copy, 528 / 544 +5-8% without it; the
    backward at 520 +18% with it, 544 +4% without it, 576 even). Never for the fused backward
    at a head dim above D (`fused_width`): `run_bwd` copies into zeroed rows of that width
    instead. p: the problem; cfg: the (forward, or a gradient) kernel's config."""
    if not (type(cfg).__name__.endswith("Sm90") and p.dtype in ("bf16", "fp16")):
        return False
    if type(cfg).__name__ == "BwdFusedConfigSm90" and cfg.head_dim != p.head_dim:
        return False
    row = 2 * p.head_dim
    if p.head_dim > 512 and not getattr(cfg, "wide_o", False):
        return row % ROW_LINE != 0 and nq * nkv >= 700 * (nq + 2 * nkv)
    return row % ROW_SECTOR != 0 and nq * nkv >= 1000 * (nq + 2 * nkv)


def fused_width(plan: BwdPlan) -> int:
    """The head dim a backward plan's fused kernel runs at, above D where D % 64 != 0 is
    planned on the next multiple of 64 (`sm90/fused_config.fused_head_dim`: `run_bwd` zero-pads q,
    k, v and dout and drops the extra columns' gradients), else D."""
    cfg = plan.cfgs[-1]
    return (cfg.head_dim if type(cfg).__name__ == "BwdFusedConfigSm90"
            else plan.problem.head_dim)


def row_aligned(t: torch.Tensor) -> torch.Tensor:
    """t's values in rows that start on 128-byte lines: a [..., :D] view of a buffer whose rows
    are padded (the padding is never read: TMA stops at D), or t itself when every row already
    starts on a line (unit last stride, base and outer strides whole lines)."""
    elem = t.element_size()
    if (t.stride(-1) == 1 and t.data_ptr() % ROW_LINE == 0
            and all(s * elem % ROW_LINE == 0 for s in t.stride()[:-1])):
        return t
    return copy_rows(_line_rows(t, t.shape[-1]), t)


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src), as 8-byte words where both tensors' rows allow it (same dtype and
    shape, unit last stride, rows and strides whole words): torch copies strided views element
    by element, and the row copies measured 1.6 TB/s in 2-byte elements against 2.6 as words
    (perf.pad_pair `copies`, H100, [1, 32, 8K, 584] bf16 into rows on lines). Returns dst."""
    if dst.dtype == src.dtype and dst.shape == src.shape and src.element_size() < 8:
        try:
            words = dst.view(torch.int64), src.view(torch.int64)
        except RuntimeError:   # rows or strides not whole words: element by element
            return dst.copy_(src)
        words[0].copy_(words[1])
        return dst
    return dst.copy_(src)


def _line_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """An uninitialised [..., :width] view, t's dtype and leading shape, of a buffer whose rows
    are padded to whole 128-byte lines."""
    elem = t.element_size()
    full = -(-width * elem // ROW_LINE) * ROW_LINE // elem
    return t.new_empty(*t.shape[:-1], full)[..., :width]


# The widened forward (`widened_fwd`) runs at D % 16 == 8 up to WIDENED_MAX_HEAD_DIM, where it
# measured faster than the D kernel with the copies counted (H100, B=1, H=32, N=8K: D=264 +8%,
# 280 +7%, 296 +3%, 312 +2%, 328 +9%, 344 +8%, 360 +4%, 376 +9%, 392 +2%; 408-504 -4% to 0;
# docs/perf-log.md). `candidate=True` plans it up to WIDENED_CANDIDATE_MAX_HEAD_DIM (the
# experiments' and the GPU tests' kernel lists).
WIDENED_MAX_HEAD_DIM = 392
WIDENED_CANDIDATE_MAX_HEAD_DIM = 504


def widened_fwd(plan: Plan, nq: int, nkv: int, candidate: bool = False) -> Plan | None:
    """The plan `run_fwd` runs instead of `plan` on q and k zero-padded to D + 8 columns (V and O
    as they are: Dv = D), or None. A 16-bit WGMMA forward at D = Dv <= 504 with D % 16 == 8,
    no window, sinks or varlen, where the rows are copied anyway (`repack_rows`): the scores
    are the same sums (the 8 columns are zeros; the softmax scale stays 1 / sqrt(D) or the
    caller's), and the kernel reads Q and K as at D + 8 (perf.pad16, H100, B=1, H=32, N=8K,
    operands padded beforehand: D + 8 wide q, k, v ran 7-13% faster than D, a D + 8 wide V
    alone 1-6%), up to D = WIDENED_MAX_HEAD_DIM, where it measured faster with the copies
    counted (`candidate`: up to WIDENED_CANDIDATE_MAX_HEAD_DIM). The D + 8 plan keeps `plan`'s
    lazy rescaling (LAZY_RESCALE_HEAD_DIMS names measured D, and D + 8 may differ: 504 ->
    512), so out and lse are the D kernel's bits."""
    p = plan.problem
    top = WIDENED_CANDIDATE_MAX_HEAD_DIM if candidate else WIDENED_MAX_HEAD_DIM
    if not (_plain_copied_rows(plan, nq, nkv) and p.head_dim % 16 == 8 and p.head_dim <= top):
        return None
    return _widened_plan(plan)


def _plain_copied_rows(plan: Plan, nq: int, nkv: int) -> bool:
    """Whether `plan` is a 16-bit WGMMA forward at D = Dv with no window, sinks or varlen whose
    rows `run_fwd` copies anyway (`repack_rows`): where a wider kernel on zero-padded copies
    (`widened_fwd`, `padded_fwd`) computes the same scores for the copy it costs."""
    p = plan.problem
    return (plan.reason is None and type(plan.cfg).__name__ == "FwdConfigSm90"
            and p.head_dim == p.head_dim_v and p.window_lo is None and not p.has_sinks
            and not p.varlen and repack_rows(p, plan.cfg, nq, nkv))


@functools.lru_cache(maxsize=1024)
def _widened_plan(plan: Plan) -> Plan | None:
    """`widened_fwd`'s D + 8 plan for `plan` (planned once per D plan, not on every call): the
    (D + 8, Dv = D) problem at D's softmax scale, with D's `lazy_rescale`."""
    p = plan.problem
    wide = dataclasses.replace(p, head_dim=p.head_dim + 8, scale=p.softmax_scale)
    wide = dispatch.plan_fwd(wide, target=plan.target)
    if wide.reason is not None or wide.family != plan.family:
        return None
    lazy = plan.cfg.lazy_rescale
    return (wide if wide.cfg.lazy_rescale == lazy else
            dataclasses.replace(wide, cfg=dataclasses.replace(wide.cfg, lazy_rescale=lazy)))


dispatch.PLAN_CACHES.append(_widened_plan)   # dispatch.clear_plans forgets these too


# The padded pair (`padded_fwd`): above 576 the 16-bit forward runs on a CTA pair, whose D % 64
# != 0 sizes read under the next multiple of 64. Not causal, at D % 16 == 8 the pair at D' ran
# faster with the copies counted (perf.pad_pair, H100, B=1, H=32, N=8K, 2-byte copies: 584-632
# +3-4%, 648-696 +3-6%, 712-888 +5-7%, 920-952 +2-3%, 968-1016 +8-10%), not at 904 (-1%), nor
# at D % 16 == 0 (-1-3%: those rows start on 32-byte sectors) or causal (-2-5%: the copies are a
# larger share of the shorter kernel); docs/perf-log.md, 2026-12-07.
PADDED_PAIR_HEAD_DIMS: frozenset = frozenset(
    d for d in range(584, 1024, 16) if d != 904)


def padded_fwd(plan: Plan, nq: int, nkv: int) -> Plan | None:
    """The plan `run_fwd` runs instead of `plan` on q, k and v zero-padded to D' (the next
    multiple of 64; out's first D columns copied back), or None: a 16-bit WGMMA forward on the
    CTA pair at D = Dv in PADDED_PAIR_HEAD_DIMS (D % 16 == 8 above 576), not causal, no window,
    sinks or varlen, where the rows are copied anyway (`repack_rows`). The scores are the same
    sums (the extra columns are zeros; the softmax scale stays D's) and O's extra columns are
    zeros."""
    if not (_plain_copied_rows(plan, nq, nkv) and not plan.problem.causal
            and plan.problem.head_dim in PADDED_PAIR_HEAD_DIMS):
        return None
    return _padded_plan(plan)


@functools.lru_cache(maxsize=1024)
def _padded_plan(plan: Plan) -> Plan | None:
    """`padded_fwd`'s plan for `plan`: the (D', D') problem at D's softmax scale."""
    p = plan.problem
    w = -(-p.head_dim // 64) * 64
    wide = dispatch.plan_fwd(dataclasses.replace(p, head_dim=w, head_dim_v=w,
                                                 scale=p.softmax_scale), target=plan.target)
    return wide if wide.reason is None and wide.family == plan.family else None


dispatch.PLAN_CACHES.append(_padded_plan)


def describe_fwd(plan: Plan) -> str:
    """`plan.describe()`, naming the kernel `run_fwd` runs instead where `widened_fwd` or
    `padded_fwd` applies."""
    p = plan.problem
    wide = widened_fwd(plan, p.seqlen_q, p.seqlen_kv) if plan.reason is None else None
    pad = padded_fwd(plan, p.seqlen_q, p.seqlen_kv) if plan.reason is None else None
    if pad is not None:
        return (f"{pad.describe()} (q, k and v zero-padded from D={p.head_dim} to "
                f"{pad.cfg.head_dim} columns: `launch.padded_fwd`)")
    if wide is None:
        return plan.describe()
    return (f"{wide.describe()} (q and k zero-padded from D={p.head_dim} to {wide.cfg.head_dim}"
            f" columns: `launch.widened_fwd`)")


def zero_padded(t: torch.Tensor, width: int) -> torch.Tensor:
    """t's values followed by zeros up to `width` columns, in rows that start on 128-byte lines
    (a [..., :width] view of a wider buffer, as `row_aligned`)."""
    out = _line_rows(t, width)
    out[..., t.shape[-1]:].zero_()
    copy_rows(out[..., :t.shape[-1]], t)
    return out


def run_job(cls, cfg, tensors: dict, scalars: dict) -> None:
    """Compile (or load) `cfg`'s kernel and launch it on `tensors[name]` for each name in
    `cls.OPERANDS`, then `scalars[name]` for `cls.SCALARS` (torch's current stream)."""
    fn = jit_cache().get(cls, cfg)
    cls.launch(fn, *(tensors.get(n) for n in cls.OPERANDS), *(scalars[n] for n in cls.SCALARS))


def run_grad_job(cls, cfg, tensors: dict, scalars: dict) -> None:
    """`run_job` for a backward kernel: a config with `group_split` (dV, dK, the fused
    kernel) writes S partial sums per KV head of each of its outputs (dk, dv) in fp32 to a
    workspace [B, H * S, N, D] (S from `group_parts` for these tensors), added up here in a
    fixed order (torch's sum over that dimension: the same bits every run) into the output.
    A fused config with `row_units` adds its partial sums into zeroed fp32 workspaces of the
    outputs' shapes (reductions in whatever order they land), cast here into the outputs."""
    if getattr(cfg, "row_units", False):
        ws = {name: torch.zeros(tensors[name].shape, dtype=torch.float32,
                                device=tensors[name].device) for name in ("dk", "dv")}
        run_job(cls, cfg, {**tensors, **ws}, scalars)
        for name, w in ws.items():
            tensors[name].copy_(w)
        return None
    if not getattr(cfg, "group_split", False):
        return run_job(cls, cfg, tensors, scalars)
    from .sm90.config import group_parts

    names = [n for n in cls.OPERANDS if n in ("dk", "dv")]
    b, h, n, _ = tensors[names[0]].shape
    parts = group_parts(b, tensors["q"].shape[1], h, n, cfg.o_split)
    ws = {name: torch.empty(b, h * parts, n, tensors[name].shape[-1], dtype=torch.float32,
                            device=tensors[name].device) for name in names}
    run_job(cls, cfg, {**tensors, **ws}, scalars)
    for name in names:
        tensors[name].copy_(ws[name].view(b, h, parts, n, -1).sum(2))


def run_grad_jobs(plan: BwdPlan, tensors: dict, scalars: dict, dlse=None,
                  padded: dict | None = None, delta_given: bool = False) -> None:
    """A backward plan's kernels in order (`run_grad_job`): Delta first, then the gradient
    kernels; dlse (not None): subtracted from Delta between the two, so that the gradient
    kernels (and a sink's gradient read from tensors["delta"]) take lse's gradient too (Note
    [The gradient of lse] in math_attention.py). padded: tensors the gradient kernels read in
    place of the Delta kernel's (a zero-padded plan's q, k, v and dout: `run_bwd`).
    delta_given: tensors["delta"] already holds Delta - dlse (`run_delta`): the Delta kernel
    is skipped."""
    if delta_given:
        tensors.update(padded or {})
    for cls, cfg in plan.jobs:
        if isinstance(cfg, DeltaConfig):
            if delta_given:
                continue
            run_grad_job(cls, cfg, tensors, scalars)
            if dlse is not None:
                tensors["delta"].sub_(dlse.reshape(tensors["delta"].shape))
            tensors.update(padded or {})
        else:
            run_grad_job(cls, cfg, tensors, scalars)


def _aligned_rows(t: torch.Tensor) -> torch.Tensor:
    """t contiguous at a 16-byte aligned address (lse and Delta, read by the gradient kernels;
    a row slice of a [B, H, N] buffer that starts mid-line is copied)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def reduces_dq(plan: BwdPlan) -> bool:
    """Whether a backward plan's kernel adds dQ into a zeroed fp32 accumulator (the fused
    backward) rather than writing dq itself: `run_bwd`'s `dq_acc` applies to it."""
    return any("dq_acc" in cls.OPERANDS for cls, _ in plan.jobs)


def run_delta(plan: BwdPlan, out, dout, dlse=None) -> torch.Tensor:
    """Delta = rowsum(dout * out) - dlse [B, Hq, Nq] fp32 by the plan's Delta kernel: what
    `run_bwd(..., delta=)` takes, for calls over slices of one problem's keys that share it."""
    delta = torch.empty(out.shape[:-1], dtype=torch.float32, device=out.device)
    if out.numel():
        t = dict(o=kernel_ready(out), do=kernel_ready(dout), delta=delta)
        for cls, cfg in plan.jobs:
            if isinstance(cfg, DeltaConfig):
                run_grad_job(cls, cfg, t, {})
    if dlse is not None:
        delta.sub_(dlse.reshape(delta.shape))
    return delta


def kernel_args(plan: Plan, q, k, v, out, lse):
    """((q, k, v, o, lse) as the kernel sees them, causal offset) for a plan's call. Packed
    plans see [B, Hkv, G * Nq, .]: views of out / lse, and of q where its strides allow (a copy
    otherwise, which `kernel_ready` then keeps), with no causal offset (no row is masked)."""
    if not plan.packed:
        return (q, k, v, out, lse), plan.problem.right_edge
    b, hkv = out.shape[0], k.shape[1]
    return ((q.reshape(b, hkv, -1, q.shape[-1]), k, v, out.view(b, hkv, -1, out.shape[-1]),
             lse.view(b, hkv, -1)), 0)


def run_fwd(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks=None,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None):
    """Run a forward plan: (out [B, Hq, Nq, Dv] in q.dtype, lse [B, Hq, Nq] fp32). sinks: the
    [Hq] logits of a plan with sinks (its lse then includes them). out / lse: where to write
    them (e.g. a run of rows of a larger out, `dense_mask.RowRunAttention`), returned; the
    kernel writes into them where it can take them as they are (`_writable`), else they are
    copied in."""
    o, m = _writable(plan, out, lse)
    o, m = _run_fwd(plan, q, k, v, sinks, o, m)
    if out is not None and o is not out:
        copy_rows(out, o)
    if lse is not None and m is not lse:
        lse.copy_(m)
    return (o if out is None else out), (m if lse is None else lse)


def _writable(plan: Plan, out, lse):
    """(out, lse) as given where the kernel can write them in place, else None each (then
    allocated): D at unit stride and every tensor 16-byte aligned (what the kernels assume:
    `common.tensors.fake_args`), out's outer strides whole 16-byte units, and for a packed
    plan both contiguous (it views them as [B, Hkv, G * Nq])."""
    if plan.packed and any(t is not None and not t.is_contiguous() for t in (out, lse)):
        return None, None
    if out is not None and kernel_ready(out) is not out:
        out = None
    if lse is not None and (lse.stride(-1) != 1 or lse.data_ptr() % 16):
        lse = None
    return out, lse


def _run_fwd(plan: Plan, q, k, v, sinks, out, lse):
    """`run_fwd` writing into out / lse (None: new tensors)."""
    if plan.reason is not None:
        raise NotImplementedError(plan.reason)
    p = plan.problem
    b, hq, nq, _ = q.shape
    if out is None:
        out = torch.empty(b, hq, nq, p.head_dim_v, dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty(b, hq, nq, dtype=torch.float32, device=q.device)
    if out.numel() == 0:
        return out, lse
    if sinks is not None:
        sinks = sinks.to(torch.float32).contiguous()
    if k.shape[2] == 0:  # no keys at all: every row is empty (its lse: the sink, if any)
        return out.zero_(), lse.copy_(sinks[:, None] if sinks is not None else float("-inf"))
    pad = padded_fwd(plan, nq, k.shape[2])
    if pad is not None:   # the pair at D % 64 != 0: the next multiple of 64, zero-padded
        w = pad.problem.head_dim
        o, lse = run_fwd(pad, *(zero_padded(t, w) for t in (q, k, v)), lse=lse)
        return copy_rows(out, o[..., :p.head_dim_v]), lse
    wide = widened_fwd(plan, nq, k.shape[2])
    if wide is not None:   # D % 16 == 8: the scores over D + 8 columns, 8 of them zeros
        plan, p = wide, wide.problem
        q, k, v = zero_padded(q, p.head_dim), zero_padded(k, p.head_dim), row_aligned(v)
    elif repack_rows(p, plan.cfg, nq, k.shape[2]):   # K, V only: Q is read once per row tile
        k, v = row_aligned(k), row_aligned(v)
    (q, k, v, qo, lo), offset = kernel_args(plan, kernel_ready(q), k, v, out, lse)
    tensors = dict(q=kernel_ready(q), k=kernel_ready(k), v=kernel_ready(v), o=qo, lse=lo,
                   sinks=sinks)
    run_job(plan.kernel_cls, plan.cfg, tensors, kernel_scalars(p, offset))
    return out, lse


def kernel_scalars(p, causal_offset: int) -> dict:
    """The kernels' runtime scalars (`SCALARS`) for problem p: the window's left edge is
    read only by configs with a window (0 otherwise); num_ctas, the current device's SM
    count, only by persistent configs (their grid)."""
    return dict(softmax_scale=p.softmax_scale, causal_offset=causal_offset,
                window_lo=p.window_lo if p.window_lo is not None else 0,
                num_ctas=sm_count())


def sm_count(index: int | None = None) -> int:
    """SMs of CUDA device `index` (default: the current one); 1 without CUDA (the CPU tests'
    fake launches)."""
    if not torch.cuda.is_available():
        return 1
    return _sm_count(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def run_bwd(plan: BwdPlan, q, k, v, out, lse, dout, with_delta: bool = False, dlse=None,
            dq_acc=None, delta=None):
    """(dq, dk, dv) from a backward plan's kernels: Delta = rowsum(dout * out) first, then the
    gradient kernels, each writing its own output (atomic-free: the same bits every run), or
    the fused kernel, whose dQ is reduced into a zeroed fp32 `dq_acc` and cast here.
    dlse: the gradient of lse [B, Hq, Nq] too, or None: Delta' = Delta - dlse is what the
    gradient kernels read (Note [The gradient of lse] in math_attention.py). `with_delta`:
    (dq, dk, dv, Delta [B, Hq, Nq] fp32, dlse subtracted), for a sink's gradient.

    Calls over slices of one problem's keys (dense_mask's key runs) share two things: `delta`,
    Delta' of these rows already computed (`run_delta`; dlse is then not read), and, for a plan
    that `reduces_dq`, `dq_acc`: a float32 [B, Hq, Nq, fused_width(plan)] accumulator, zeroed by
    the caller, that this call's dQ is added into (not cast; dq comes back as None)."""
    if plan.reason is not None:
        raise NotImplementedError(plan.reason)
    p = plan.problem
    width = fused_width(plan)   # > D: the fused kernel on zero-padded operands
    reduces = reduces_dq(plan)
    if dq_acc is not None and (not reduces or dq_acc.shape != (*q.shape[:-1], width)
                               or dq_acc.dtype != torch.float32):
        raise ValueError(f"dq_acc: a float32 {(*q.shape[:-1], width)} accumulator for a plan "
                         f"that reduces dQ, got {dq_acc.dtype} {tuple(dq_acc.shape)} "
                         f"(reduces dQ: {reduces})")
    if q.numel() and k.numel() and repack_rows(p, plan.cfgs[-1], q.shape[2], k.shape[2]):
        q, k, v, dout = (row_aligned(t) for t in (q, k, v, dout))
    q, k, v, dout, out = (kernel_ready(t) for t in (q, k, v, dout, out))
    t = dict(q=q, k=k, v=v, do=dout, o=out, lse=_aligned_rows(lse))
    t["delta"] = (_aligned_rows(delta) if delta is not None
                  else torch.empty(lse.shape, dtype=torch.float32, device=q.device))
    t["dq"] = (None if dq_acc is not None
               else torch.empty(q.shape, dtype=q.dtype, device=q.device))
    t["dk"] = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    t["dv"] = torch.empty(*k.shape[:-1], v.shape[-1], dtype=v.dtype, device=v.device)
    if q.numel() == 0 or k.numel() == 0:
        grads = (t["dq"] if t["dq"] is None else t["dq"].zero_()), t["dk"].zero_(), t["dv"].zero_()
        if with_delta and delta is None:
            t["delta"].zero_()
            if dlse is not None:
                t["delta"].sub_(dlse)
        return (*grads, t["delta"]) if with_delta else grads
    # a kernel that reduces dQ into fp32 (the fused backward) reads a zeroed accumulator
    if reduces:
        t["dq_acc"] = (dq_acc if dq_acc is not None else
                       torch.zeros(*q.shape[:-1], width, dtype=torch.float32, device=q.device))
    grads = t["dq"], t["dk"], t["dv"]
    padded = None
    if width != p.head_dim:   # Delta reads dout and out as they are, the fused kernel padded
        padded = {n: zero_padded(t[n], width) for n in ("q", "k", "v", "do")}
        padded.update(dk=t["dk"].new_empty(*k.shape[:-1], width),
                      dv=t["dv"].new_empty(*k.shape[:-1], width))
    scalars = kernel_scalars(p, p.right_edge)
    run_grad_jobs(plan, t, scalars, dlse, padded, delta_given=delta is not None)
    if reduces and dq_acc is None:
        grads[0].copy_(t["dq_acc"][..., :p.head_dim])
    if padded:
        copy_rows(grads[1], padded["dk"][..., :p.head_dim])
        copy_rows(grads[2], padded["dv"][..., :p.head_dim])
    return (*grads, t["delta"]) if with_delta else grads


class FwdCall:
    """`run_fwd` for one call signature (plan, shapes, strides, dtype, device): what does not
    depend on the data is decided once, so a repeated call allocates out / lse and calls the
    compiled kernel (the per-signature fast path of `attention()`).

    `__call__` returns None whenever the general `run_fwd` must take the call: a misaligned
    data pointer, a layout that `kernel_ready` would copy, an empty problem, or another device
    being current.
    """

    def __init__(self, plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        p = plan.problem
        b, hq, nq, _ = q.shape
        self.plan, self.dtype, self.device = plan, q.dtype, q.device
        self.out_shape, self.lse_shape = (b, hq, nq, p.head_dim_v), (b, hq, nq)
        ready = all(kernel_ready(t) is t for t in (q, k, v))
        if plan.packed:
            packed_q = q.reshape(b, k.shape[1], -1, q.shape[-1])
            ready = ready and packed_q.data_ptr() == q.data_ptr() and (
                kernel_ready(packed_q) is packed_q)
        self.usable = (plan.reason is None and ready and b * hq * nq > 0 and k.shape[2] > 0
                       and q.device.type == "cuda"
                       and not (plan.reason is None
                                and repack_rows(p, plan.cfg, nq, k.shape[2])))
        self.scalars = tuple(kernel_scalars(p, 0 if plan.packed else p.right_edge)[n]
                             for n in plan.kernel_cls.SCALARS) if plan.reason is None else ()
        self.fn = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """(out, lse), or None: the general path takes this call."""
        if (not self.usable or (q.data_ptr() | k.data_ptr() | v.data_ptr()) % 16
                or torch.cuda.current_device() != self.device.index):
            return None
        if self.fn is None:
            self.fn = jit_cache().get(self.plan.kernel_cls, self.plan.cfg)
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        self.plan.kernel_cls.launch(self.fn, *self.args(q, k, v, out, lse))
        return out, lse

    def args(self, q, k, v, out, lse) -> tuple:
        """The kernel's arguments for this call: (q, k, v, o, lse) as it sees them, no sinks
        (calls with sinks never take this path), then its `SCALARS` (what `run_fwd` passes for
        the same call)."""
        if self.plan.packed:
            (q, k, v, out, lse), _ = kernel_args(self.plan, q, k, v, out, lse)
        tensors = dict(q=q, k=k, v=v, o=out, lse=lse)
        return (*(tensors.get(n) for n in self.plan.kernel_cls.OPERANDS), *self.scalars)


__all__ = ["FwdCall", "describe_fwd", "kernel_args", "kernel_ready", "kernel_scalars",
           "repack_rows", "row_aligned", "run_bwd", "run_fwd", "run_grad_job", "run_grad_jobs",
           "run_job", "sm_count", "WIDENED_CANDIDATE_MAX_HEAD_DIM", "WIDENED_MAX_HEAD_DIM",
           "widened_fwd", "zero_padded", "padded_fwd", "PADDED_PAIR_HEAD_DIMS", "copy_rows"]
