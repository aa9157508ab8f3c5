"""The serving and training-stack rows of `python -m perf.sweep`: `--cases window,varlen,kvdecode`
(alias `serving`). Each family has its own yardstick, so they get their own table (serving.md)
beside the attention tables:

* `window`: sliding-window causal attention (D=512) timed against the plain causal kernel at
  the same N and heads: window 1024 to the left with H=32 (Gemma-style; the issue's case), and
  window 128 with Hq 64 / Hkv 1 (DeepSeek-V4's MQA layers); TFLOPS counted on the visible
  (query, key) pairs of each. The issue's bar: within 10% of the causal kernel's TFLOPS. SDPA
  beside it with the window as a boolean mask (its kernels have no window).
* `varlen`: `varlen_attention` on 8 packed causal sequences of 1K-8K (D=512, Hq 32 / Hkv 4),
  forward and backward, against `attention()` on the padded equal-length batch of the same total
  tokens (B=8, N = total / 8); TFLOPS on valid pairs. The bar: within 5%. Also the per-sequence
  route (`Options(varlen_launch=False)`) in the same run.
* `varlen-short`: the same on 32 short sequences (64-1006 tokens, 17K in all), where the
  per-sequence route pays 32 launches a kernel and partial waves: the regime the one launch
  is for. Under FFPA_CUTE_ARCH=sm80 both rows time the Split-D kernels.
* `kvdecode`: one decode step (Nq = 1, bf16) of `attention_with_kvcache` on a paged cache
  (page 64, every row at length N, D=512, Hq 32 / Hkv 4 and Hq 64 / Hkv 1, B 1 / 8 / 64); GB/s of
  K/V bytes read, and that as a share of the measured copy bandwidth (the bar: 85%). SDPA beside
  it on a contiguous cache of the same length (GQA natively).
* `kvdecode-fp8`: the same steps on an FP8 (e4m3) cache under bf16 queries, GB/s counting the
  cache's 8-bit bytes (the FP8 issue's bar: 85% of copy at B=8, Hq 32 / Hkv 4, N=32K).
* `kvprefill`: one chunked-prefill step (chunks of 16, 64, 256 queries, causal bottom-right over each
  row's N keys, B=4, Hq 32 / Hkv 4, D=512, page 64): the default route (the decode kernel's one
  launch while the chunk's row tiles do not fill the SMs, else the host loop) against the host
  loop the same call takes with a window that hides nothing (`window=(N, 0)`: per row, the
  pages gathered, then `attention()`); TFLOPS on the visible pairs.

Times are CUDA-event medians with L2 flushed before each call (timing.bench). Error columns:
relative Frobenius error against a float32 explicit-matmul reference on one head (window,
kvdecode) or one sequence (varlen).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from .cases import SERVING_FAMILIES
from .flops import tflops
from .timing import bench

WINDOW_SEQLENS = (8192, 16384)
WINDOW_SHAPES = ((1024, 32, 32), (128, 64, 1))  # (left, Hq, Hkv)
VARLEN_LENS = (1024, 8192, 2048, 4096, 3072, 6144, 5120, 7168)
VARLEN_SHORT_LENS = tuple(64 + (i * 397) % 961 for i in range(32))  # 64-1006, 17K tokens
KVDECODE_SEQLENS = (4096, 32768, 131072)
KVDECODE_SHAPES = ((32, 4), (64, 1))
KVDECODE_BATCHES = (1, 8, 64)
KVPREFILL_SEQLENS = (8192, 32768)
KVPREFILL_CHUNKS = (16, 64, 256)
PAGE = 64
D = 512


@dataclass(frozen=True)
class ServingCase:
    family: str
    n: int
    batch: int = 1
    hq: int = 32
    hkv: int = 32
    d: int = D
    lens: tuple = ()
    kv: str = "bf16"  # the cache's dtype (kvdecode)
    nq: int = 1       # queries per row (kvprefill's chunk)
    left: int = 0     # the window's left reach (window)

    @property
    def label(self) -> str:
        w = f"-w{self.left}" if self.left else ""
        return f"{self.family}-b{self.batch}-h{self.hq}x{self.hkv}-n{self.n}-d{self.d}{w}"


def serving_cases(families, seqlens=None) -> list[ServingCase]:
    """The selected serving families' cases (`seqlens` replaces the window / kvdecode N list)."""
    out = []
    for fam in families:
        if fam == "window":
            out += [ServingCase("window", n, hq=hq, hkv=hkv, left=left)
                    for left, hq, hkv in WINDOW_SHAPES for n in seqlens or WINDOW_SEQLENS]
        elif fam in ("varlen", "varlen-short"):
            lens = VARLEN_LENS if fam == "varlen" else VARLEN_SHORT_LENS
            out.append(ServingCase(fam, sum(lens), len(lens), 32, 4, lens=lens))
        elif fam == "kvprefill":
            out += [ServingCase("kvprefill", n, 4, 32, 4, nq=c) for c in KVPREFILL_CHUNKS
                    for n in seqlens or KVPREFILL_SEQLENS]
        elif fam in ("kvdecode", "kvdecode-fp8"):
            kv = "e4m3" if fam == "kvdecode-fp8" else "bf16"
            out += [ServingCase(fam, n, b, hq, hkv, kv=kv) for hq, hkv in KVDECODE_SHAPES
                    for b in KVDECODE_BATCHES for n in seqlens or KVDECODE_SEQLENS]
    return out


@dataclass
class Row:
    case: dict
    cells: dict = field(default_factory=dict)  # name -> value (ms, tflops, gbps, ratio, err)
    notes: list = field(default_factory=list)


def _pairs_window(n: int, left: int) -> int:
    """Visible pairs of causal self-attention where row i sees keys i - left .. i: rows below
    `left` see i + 1, the others left + 1."""
    w = min(n, left)
    return w * (w + 1) // 2 + (n - w) * (left + 1)


def _ref_err(out_head, q, k, v, vis=None) -> float:
    """||out - ref|| / ||ref|| for one head ([N, D] each) against float32 explicit matmuls."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        s = (q.float() @ k.float().T) / math.sqrt(q.shape[-1])
        if vis is not None:
            s = s.masked_fill(~vis, float("-inf"))
        ref = torch.softmax(s, -1).nan_to_num(0.0) @ v.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return ((out_head.float() - ref).norm() / ref.norm()).item()


def _time(fn, dev, ctx) -> float:
    fn()
    return bench(fn, dev, **ctx).median_ms


def run_window(case: ServingCase, dev, ctx, ffpa) -> Row:
    n, h, left = case.n, case.hq, case.left
    gqa = dict(enable_gqa=case.hkv != h)
    q = torch.randn(1, h, n, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(1, case.hkv, n, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    row = Row(asdict(case) | {"window": left})
    pw, pc = _pairs_window(n, left), n * (n + 1) // 2
    with torch.no_grad():
        ms_w = _time(lambda: ffpa.attention(q, k, v, is_causal=True, window=(left, 0), **gqa),
                     dev, ctx)
        ms_c = _time(lambda: ffpa.attention(q, k, v, is_causal=True, **gqa), dev, ctx)
        out = ffpa.attention(q, k, v, is_causal=True, window=(left, 0), **gqa)
    i = torch.arange(n, device=dev)
    vis = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - left)
    row.cells.update(
        path=ffpa.explain(q, k, v, is_causal=True, window=(left, 0), **gqa)[:48],
        window_ms=ms_w, window_tflops=tflops(4 * h * pw * D, ms_w),
        causal_ms=ms_c, causal_tflops=tflops(4 * h * pc * D, ms_c),
        err=_ref_err(out[0, 0], q[0, 0], k[0, 0], v[0, 0], vis))
    row.cells["ratio"] = row.cells["window_tflops"] / row.cells["causal_tflops"]
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    for name, kw in (("window", dict(window=(left, 0))), ("causal", {})):
        out = ffpa.attention(qg, kg, vg, is_causal=True, **kw, **gqa)
        dout = torch.randn_like(out)
        ms = _time(lambda: torch.autograd.grad(out, (qg, kg, vg), dout, retain_graph=True), dev,
                   ctx)
        pairs = pw if name == "window" else pc
        row.cells[f"{name}_bwd_ms"] = ms
        row.cells[f"{name}_bwd_tflops"] = tflops(2.5 * 4 * h * pairs * D, ms)
    row.cells["bwd_ratio"] = row.cells["window_bwd_tflops"] / row.cells["causal_bwd_tflops"]
    try:  # SDPA with the window as a boolean mask (no kernel of its own has a window)
        with torch.no_grad():
            ms = _time(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=vis, **gqa), dev, ctx)
        row.cells["sdpa_tflops"] = tflops(4 * h * pw * D, ms)
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is a note
        row.notes.append(f"sdpa: {type(e).__name__}: {str(e)[:80]}")
    return row


def run_varlen(case: ServingCase, dev, ctx, ffpa) -> Row:
    lens, hq, hkv = case.lens, case.hq, case.hkv
    total = sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    q = torch.randn(total, hq, D, device=dev, dtype=torch.bfloat16)
    k, v = (torch.randn(total, hkv, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
    pairs = sum(n * (n + 1) // 2 for n in lens)
    npad = total // len(lens)
    qp = torch.randn(len(lens), hq, npad, D, device=dev, dtype=torch.bfloat16)
    kp, vp = (torch.randn(len(lens), hkv, npad, D, device=dev, dtype=torch.bfloat16)
              for _ in range(2))
    ppad = len(lens) * npad * (npad + 1) // 2
    row = Row(asdict(case) | {"padded_n": npad})

    def var(a, b, c):
        return ffpa.varlen_attention(a, b, c, cu, cu, max(lens), max(lens), is_causal=True,
                                     enable_gqa=True)

    def pad(a, b, c):
        return ffpa.attention(a, b, c, is_causal=True, enable_gqa=True)

    with torch.no_grad():
        ms_v, ms_p = _time(lambda: var(q, k, v), dev, ctx), _time(lambda: pad(qp, kp, vp), dev, ctx)
        out = var(q, k, v)
    s0 = slice(0, lens[0])
    g = hq // hkv
    row.cells.update(varlen_ms=ms_v, varlen_tflops=tflops(4 * hq * pairs * D, ms_v),
                     padded_ms=ms_p, padded_tflops=tflops(4 * hq * ppad * D, ms_p))
    i = torch.arange(lens[0], device=dev)
    row.cells["err"] = _ref_err(out[s0, 0], q[s0, 0], k[s0, 0 // g], v[s0, 0 // g],
                                i[None, :] <= i[:, None])
    for name, fn, ins, p in (("varlen", var, (q, k, v), pairs), ("padded", pad, (qp, kp, vp), ppad)):
        ins = tuple(x.detach().requires_grad_() for x in ins)
        out = fn(*ins)
        dout = torch.randn_like(out)
        ms = _time(lambda: torch.autograd.grad(out, ins, dout, retain_graph=True), dev, ctx)
        row.cells[f"{name}_bwd_ms"] = ms
        row.cells[f"{name}_bwd_tflops"] = tflops(2.5 * 4 * hq * p * D, ms)
    with ffpa.options.use(varlen_launch=False):  # the per-sequence route, same run
        ms = _time(lambda: var(q, k, v), dev, ctx)
        row.cells["loop_tflops"] = tflops(4 * hq * pairs * D, ms)
        ins = tuple(x.detach().requires_grad_() for x in (q, k, v))
        out = var(*ins)
        dout = torch.randn_like(out)
        ms = _time(lambda: torch.autograd.grad(out, ins, dout, retain_graph=True), dev, ctx)
        row.cells["loop_bwd_tflops"] = tflops(2.5 * 4 * hq * pairs * D, ms)
    row.cells["ratio"] = row.cells["varlen_tflops"] / row.cells["padded_tflops"]
    row.cells["bwd_ratio"] = row.cells["varlen_bwd_tflops"] / row.cells["padded_bwd_tflops"]
    return row


def run_kvdecode(case: ServingCase, dev, ctx, ffpa, mem_limit: float) -> Row:
    b, n, hq, hkv = case.batch, case.n, case.hq, case.hkv
    fp8 = case.kv == "e4m3"
    kv_bytes = b * n * hkv * 2 * D * (1 if fp8 else 2)
    row = Row(asdict(case) | {"page": PAGE, "kv_bytes": kv_bytes})
    if 2.2 * kv_bytes > mem_limit:
        row.notes.append(f"skipped: the cache needs {kv_bytes / 1e9:.0f} GB")
        return row
    pages = b * -(-n // PAGE)
    kc, vc = (torch.randn(pages, PAGE, hkv, D, device=dev, dtype=torch.bfloat16)
              for _ in range(2))
    scales = {}
    if fp8:  # N(0, 1) quantised per tensor (|x| <= 6 here: descale 6 / 448)
        kc, vc = ((x.clamp(-6, 6) * (448 / 6)).to(torch.float8_e4m3fn) for x in (kc, vc))
        scales = dict(k_descale=6 / 448, v_descale=6 / 448)
    table = torch.randperm(pages, device=dev, dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), n, dtype=torch.int32, device=dev)
    q = torch.randn(b, 1, hq, D, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        ms = _time(lambda: ffpa.attention_with_kvcache(q, kc, vc, lens, table, **scales), dev,
                   ctx)
        ms_fast = _time(lambda: ffpa.attention_with_kvcache(q, kc, vc, lens, table,
                                                            validate=False, **scales), dev, ctx)
        graph = torch.cuda.CUDAGraph()  # what a serving loop replays: no host work at all
        with torch.cuda.graph(graph):
            ffpa.attention_with_kvcache(q, kc, vc, lens, table, validate=False, **scales)
        ms_graph = _time(graph.replay, dev, ctx)
        out = ffpa.attention_with_kvcache(q, kc, vc, lens, table, **scales)
        ks = kc[table[0].long()].flatten(0, 1)[:n, 0].float() * scales.get("k_descale", 1.0)
        vs = vc[table[0].long()].flatten(0, 1)[:n, 0].float() * scales.get("v_descale", 1.0)
        row.cells.update(ms=ms, gbps=kv_bytes / (ms * 1e-3) / 1e9, fast_ms=ms_fast,
                         fast_gbps=kv_bytes / (ms_fast * 1e-3) / 1e9, graph_ms=ms_graph,
                         graph_gbps=kv_bytes / (ms_graph * 1e-3) / 1e9,
                         err=_ref_err(out[0, 0, :1], q[0, 0, :1], ks, vs))
        kc = vc = None  # free the paged cache before SDPA's contiguous one
        torch.cuda.empty_cache()
        if fp8:
            row.notes.append("e4m3 cache")
            return row
        try:  # SDPA on a contiguous cache of the same keys (natively GQA)
            kd, vd = (torch.randn(b, hkv, n, D, device=dev, dtype=torch.bfloat16)
                      for _ in range(2))
            qd = q.transpose(1, 2)
            ms = _time(lambda: torch.nn.functional.scaled_dot_product_attention(
                qd, kd, vd, enable_gqa=True), dev, ctx)
            row.cells["sdpa_gbps"] = kv_bytes / (ms * 1e-3) / 1e9
        except Exception as e:  # noqa: BLE001
            row.notes.append(f"sdpa: {type(e).__name__}: {str(e)[:80]}")
    return row


def run_kvprefill(case: ServingCase, dev, ctx, ffpa) -> Row:
    b, n, hq, hkv, nq = case.batch, case.n, case.hq, case.hkv, case.nq
    row = Row(asdict(case) | {"page": PAGE})
    pages = b * -(-n // PAGE)
    kc, vc = (torch.randn(pages, PAGE, hkv, D, device=dev, dtype=torch.bfloat16)
              for _ in range(2))
    table = torch.randperm(pages, device=dev, dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), n, dtype=torch.int32, device=dev)  # the chunk's keys are cached
    q = torch.randn(b, nq, hq, D, device=dev, dtype=torch.bfloat16)
    flops = 4 * b * hq * (nq * (n - nq) + nq * (nq + 1) // 2) * D
    with torch.no_grad():
        ms = _time(lambda: ffpa.attention_with_kvcache(q, kc, vc, lens, table), dev, ctx)
        ms_loop = _time(lambda: ffpa.attention_with_kvcache(q, kc, vc, lens, table,
                                                            window=(n, 0)), dev, ctx)
        out = ffpa.attention_with_kvcache(q, kc, vc, lens, table)
        ks = kc[table[0].long()].flatten(0, 1)[:n, 0].float()
        vs = vc[table[0].long()].flatten(0, 1)[:n, 0].float()
        i = torch.arange(nq, device=dev)[:, None] + n - nq
        vis = torch.arange(n, device=dev)[None, :] <= i
    row.cells.update(ms=ms, tflops=tflops(flops, ms), loop_ms=ms_loop,
                     loop_tflops=tflops(flops, ms_loop),
                     err=_ref_err(out[0, :, 0], q[0, :, 0], ks, vs, vis))
    return row


def run_serving(cases, device, bench_kw: dict, mem_limit: float, log=print) -> list[dict]:
    import ffpa_cute as ffpa

    rows = []
    for case in cases:
        try:
            if case.family == "window":
                row = run_window(case, device, bench_kw, ffpa)
            elif case.family in ("varlen", "varlen-short"):
                row = run_varlen(case, device, bench_kw, ffpa)
            elif case.family == "kvprefill":
                row = run_kvprefill(case, device, bench_kw, ffpa)
            else:  # kvdecode, kvdecode-fp8
                row = run_kvdecode(case, device, bench_kw, ffpa, mem_limit)
        except Exception as e:  # noqa: BLE001 - one failing case is a note, not the run
            row = Row(asdict(case), notes=[f"failed: {type(e).__name__}: {str(e)[:160]}"])
        torch.cuda.empty_cache()
        log(f"{case.label}: " + ", ".join(
            f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.cells.items())
            + (f" [{'; '.join(row.notes)}]" if row.notes else ""))
        rows.append(asdict(row))
    return rows


def _f(x, fmt="{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def render(rows: list[dict], copy_gbps: float | None) -> str:
    """serving.md: one table per family present."""
    out = ["# Serving and training-stack rows (perf.serving)", ""]
    if copy_gbps:
        out.append(f"Copy ceiling (read + write): {copy_gbps:.0f} GB/s.\n")
    win = [r for r in rows if r["case"]["family"] == "window"]
    if win:
        out += ["## Sliding window (causal, D=512; TFLOPS on visible pairs)", "",
                "| left | Hq / Hkv | N | window fwd | causal fwd | ratio | window bwd | "
                "causal bwd | ratio | SDPA (mask) fwd | err |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in win:
            c, k = r["cells"], r["case"]
            out.append(f"| {k.get('window')} | {k['hq']} / {k['hkv']} | {k['n']} | "
                       f"{_f(c.get('window_tflops'))} | "
                       f"{_f(c.get('causal_tflops'))} | {_f(c.get('ratio'), '{:.2f}')} | "
                       f"{_f(c.get('window_bwd_tflops'))} | {_f(c.get('causal_bwd_tflops'))} | "
                       f"{_f(c.get('bwd_ratio'), '{:.2f}')} | {_f(c.get('sdpa_tflops'))} | "
                       f"{_f(c.get('err'), '{:.1e}')} |")
        out.append("")
    var = [r for r in rows if r["case"]["family"] in ("varlen", "varlen-short")]
    if var:
        out += ["## Varlen (causal sequences, D=512, Hq 32 / Hkv 4; TFLOPS on valid "
                "pairs) vs the padded equal-length batch", "",
                "| sequences | total | varlen fwd | padded fwd | ratio | varlen bwd | padded bwd | ratio | "
                "per-sequence fwd / bwd | err |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in var:
            c = r["cells"]
            lens = r["case"]["lens"]
            out.append(f"| {len(lens)} of {min(lens)}-{max(lens)} | {r['case']['n']} | "
                       f"{_f(c.get('varlen_tflops'))} | "
                       f"{_f(c.get('padded_tflops'))} | {_f(c.get('ratio'), '{:.2f}')} | "
                       f"{_f(c.get('varlen_bwd_tflops'))} | {_f(c.get('padded_bwd_tflops'))} | "
                       f"{_f(c.get('bwd_ratio'), '{:.2f}')} | {_f(c.get('loop_tflops'))} / "
                       f"{_f(c.get('loop_bwd_tflops'))} | {_f(c.get('err'), '{:.1e}')} |")
        out.append("")
    pre = [r for r in rows if r["case"]["family"] == "kvprefill"]
    if pre:
        out += ["## Chunked prefill (causal, B=4, Hq 32 / Hkv 4, D=512, page 64; TFLOPS on "
                "visible pairs)", "",
                "| chunk | N | default µs | TFLOPS | host loop µs | TFLOPS | speed-up | err |",
                "|---|---|---|---|---|---|---|---|"]
        for r in pre:
            c = r["cells"]
            up = c["loop_ms"] / c["ms"] if c.get("ms") and c.get("loop_ms") else None
            out.append(f"| {r['case']['nq']} | {r['case']['n']} | "
                       f"{_f(c.get('ms') and c['ms'] * 1e3)} | "
                       f"{_f(c.get('tflops'))} | {_f(c.get('loop_ms') and c['loop_ms'] * 1e3)} | "
                       f"{_f(c.get('loop_tflops'))} | {_f(up, '{:.1f}')} | "
                       f"{_f(c.get('err'), '{:.1e}')} |")
        out.append("")
    for fam, what in (("kvdecode", "bf16 cache; GB/s of K/V read"),
                      ("kvdecode-fp8", "e4m3 cache under bf16 q; GB/s of the 8-bit K/V read")):
        out += _decode_table([r for r in rows if r["case"]["family"] == fam], what, copy_gbps)
    return "\n".join(out)


def _decode_table(dec: list[dict], what: str, copy_gbps: float | None) -> list[str]:
    """One decode family's table (none without rows)."""
    out = []
    if dec:
        out += [f"## Paged-KV decode (Nq 1, page 64, D=512, {what})", "",
                "validated: the default call (cache_seqlens / block_table checked on the host: "
                "device syncs); unvalidated: `validate=False` (no host read); graph: that call "
                "captured in a CUDA graph and replayed (what a serving loop runs).", "",
                "| B | Hq/Hkv | N | validated µs | GB/s | % | unvalidated µs | GB/s | % | "
                "graph µs | GB/s | % of copy | SDPA (contiguous) GB/s | err | note |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in dec:
            c, k = r["cells"], r["case"]
            cols = []  # (µs, GB/s, % of copy) of the validated, unvalidated and graph calls
            for ms, gbps in (("ms", "gbps"), ("fast_ms", "fast_gbps"), ("graph_ms", "graph_gbps")):
                pct = 100 * c[gbps] / copy_gbps if c.get(gbps) and copy_gbps else None
                cols += [_f(c.get(ms) and c[ms] * 1e3), _f(c.get(gbps)), _f(pct)]
            out.append(f"| {k['batch']} | {k['hq']}/{k['hkv']} | {k['n']} | "
                       + " | ".join(cols) + f" | {_f(c.get('sdpa_gbps'))} | "
                       f"{_f(c.get('err'), '{:.1e}')} | {'; '.join(r['notes'])} |")
        out.append("")
    return out


__all__ = ["SERVING_FAMILIES", "ServingCase", "render", "run_serving", "serving_cases"]
