"""Writers: the markdown header and tables, CSV/JSON of the raw numbers, PNG bar charts.

Everything here works on plain dicts (rows from perf.runner, env from perf.envinfo), so it runs
and is tested without a GPU. A blank cell renders as "—" in markdown and as empty in CSV.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

BLANK = "—"
FALLBACK_MARK = "†"
SUBTRACT_MARK = "‡"


# ----------------------------------------------------------------------------- number formats
def _ok(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fmt_ms(x) -> str:
    if not _ok(x):
        return BLANK
    return f"{x:.3f}" if x < 1 else f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def fmt_tflops(x) -> str:
    if not _ok(x):
        return BLANK
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 100 else f"{x:.0f}"


def fmt_speedup(x) -> str:
    return f"{x:.2f}×" if _ok(x) else BLANK


def fmt_err(x) -> str:
    if isinstance(x, float) and math.isnan(x):
        return "nan"
    return f"{x:.1e}" if _ok(x) else BLANK


def fmt_s(x) -> str:
    return (f"{x:.2f}" if x < 10 else f"{x:.1f}") if _ok(x) else BLANK


def _na(x) -> str:
    return BLANK if x is None or x == "" else str(x)


# ----------------------------------------------------------------------------- row helpers
def speedup(row: dict, baseline: str, ours: str = "ours"):
    """baseline ms / our ms (> 1: ours is faster); None when either is blank."""
    r = row.get("results", {})
    a, b = (r.get(ours) or {}).get("ms"), (r.get(baseline) or {}).get("ms")
    if not (_ok(a) and _ok(b)) or a <= 0:
        return None
    return b / a


def short_path(path: str | None, fallback: bool, n: int = 48) -> str:
    if not path:
        return BLANK
    first = path.strip().splitlines()[0] if path.strip() else ""
    first = first.replace("|", "/")
    if len(first) > n:
        first = first[: n - 1] + "…"
    return f"**FALLBACK** {first}" if fallback else first


def _mark(res: dict | None) -> str:
    if not res:
        return ""
    m = FALLBACK_MARK if res.get("fallback") else ""
    return m + (SUBTRACT_MARK if res.get("method") == "fwd+bwd - fwd" else "")


# ----------------------------------------------------------------------------- markdown
def render_header(env: dict, ceilings: dict | None = None, impls: list[dict] | None = None,
                  command: str | None = None, title: str | None = None) -> str:
    """The environment table that heads every results file. Works with no GPU (fields '—')."""
    ceilings = ceilings or {}
    gpu = env.get("gpu")
    if gpu:
        gpu_s = f"{gpu} (cc {_na(env.get('cc'))}, {_na(env.get('sm_count'))} SMs, " \
                f"{_na(env.get('gpu_mem_gib'))} GiB)"
    else:
        gpu_s = f"none ({_na(env.get('device'))} run)"
    clk = env.get("sm_clock_mhz")
    clk_s = BLANK if clk is None else f"{clk} MHz (max {_na(env.get('sm_clock_max_mhz'))}), " \
        "read after the matmul ceiling"
    mm, cp = ceilings.get("matmul_bf16_8192_tflops"), ceilings.get("copy_gbps")
    f8 = ceilings.get("matmul_fp8_8192_tflops")
    ceil_s = f"bf16 matmul 8192³: {fmt_tflops(mm)} TFLOPS · " \
             + (f"e4m3 matmul 8192³: {fmt_tflops(f8)} TFLOPS · " if _ok(f8) else "") \
             + f"device copy: {BLANK if not _ok(cp) else f'{cp:.0f}'} GB/s (read + write)"
    if not ceilings:
        ceil_s = "not measured"
    lines = [f"# {title or 'ffpa_cute attention sweep'}", "", "| | |", "|---|---|",
             f"| GPU | {gpu_s} |", f"| SM clock | {clk_s} |",
             f"| driver | {_na(env.get('driver'))} |",
             f"| torch / CUDA | {_na(env.get('torch'))} / {_na(env.get('cuda'))} |",
             f"| cutlass-dsl | {_na(env.get('cutlass_dsl'))} |",
             f"| package commit | {_na(env.get('commit'))} |",
             f"| FFPA_CUTE_ARCH | {env.get('ffpa_cute_arch') or 'auto'} |",
             f"| ceilings (this run) | {ceil_s} |"]
    for im in impls or []:
        state = im.get("version") or ""
        if im.get("unavailable"):
            state = f"unavailable: {im['unavailable']}"
        lines.append(f"| {im['title']} | {_na(state).replace('|', '/')} |")
    lines.append(f"| date / host | {_na(env.get('date'))} / {_na(env.get('host'))} |")
    if command:
        lines.append(f"| command | `{command}` |")
    timer = ("timed with CUDA events, each after a 256 MB write that flushes L2" if gpu else
             "timed with perf_counter on the CPU (a pipeline smoke test: numbers meaningless)")
    lines += ["", "TFLOPS = 4·B·Hq·pairs·D / time (backward: ×2.5), pairs counted exactly under "
              f"bottom-right causal masking (perf/flops.py). Time = median of many calls {timer}"
              "; warm-up and the first call are outside it. `1st call s` = wall time of the very first call "
              "(JIT compile included). Speedup ×B = B's time / our time. err = relative "
              "Frobenius error vs a float32 reference (float64 for float32 inputs) on a subset "
              "of heads; backward err = max over dQ, dK, dV. "
              f"{FALLBACK_MARK} = not the implementation's own kernel (fallback); "
              f"{SUBTRACT_MARK} = backward time from median(fwd+bwd) − median(fwd).", ""]
    return "\n".join(lines)


def table_columns(baselines: list[dict]) -> list[str]:
    cols = ["case", "dtype", "B", "Hq/Hkv", "Nq/Nkv", "D", "causal", "ours path", "ours ms",
            "ours TFLOPS", "1st call s"]
    cols += [f"{b['title']} TFLOPS" for b in baselines]
    cols += [f"×{b['title']}" for b in baselines]
    cols += ["err ours"] + [f"err {b['title']}" for b in baselines]
    if any(b["name"] == "sdpa" for b in baselines):
        cols.append("SDPA backend")
    return cols


def table_row(row: dict, baselines: list[dict]) -> list[str]:
    res = row.get("results", {})
    ours = res.get("ours") or {}
    fb = FALLBACK_MARK if ours.get("fallback") else ""
    cells = [row["name"], row["dtype"], str(row["batch"]), f"{row['hq']}/{row['hkv']}",
             f"{row['nq']}/{row['nkv']}", _head_dims(row), "yes" if row["causal"] else "no",
             short_path(ours.get("backend"), ours.get("fallback", False))
             if ours.get("backend") else (BLANK if not ours.get("note") else "n/a"),
             fmt_ms(ours.get("ms")) + (_mark(ours) if _ok(ours.get("ms")) else ""),
             fmt_tflops(ours.get("tflops")) + (fb if _ok(ours.get("tflops")) else ""),
             fmt_s(ours.get("first_s"))]
    for b in baselines:
        r = res.get(b["name"]) or {}
        cells.append(fmt_tflops(r.get("tflops")) + (_mark(r) if _ok(r.get("tflops")) else ""))
    for b in baselines:
        s = speedup(row, b["name"])
        cells.append(fmt_speedup(s) + (fb if s is not None else ""))
    cells.append(fmt_err(ours.get("err")))
    for b in baselines:
        cells.append(fmt_err((res.get(b["name"]) or {}).get("err")))
    if any(b["name"] == "sdpa" for b in baselines):
        cells.append(_na((res.get("sdpa") or {}).get("backend")).replace("|", "/"))
    return cells


def render_table(rows: list[dict], direction: str, baselines: list[dict]) -> str:
    """Markdown table of the rows of one direction ('fwd' / 'bwd')."""
    cols = table_columns(baselines)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in rows:
        if row.get("direction") == direction:
            lines.append("| " + " | ".join(table_row(row, baselines)) + " |")
    return "\n".join(lines)


def render_notes(notes: list[dict]) -> str:
    if not notes:
        return ""
    out = ["", "Notes (each distinct message once):", ""]
    for n in notes:
        where = f" (first at {n['first']}" + (f"; {n['count']} times)" if n.get("count", 1) > 1
                                               else ")") if n.get("first") else ""
        out.append(f"- {n['who']}: {n['msg']}{where}")
    return "\n".join(out)


def render_markdown(payload: dict, direction: str) -> str:
    name = {"fwd": "forward", "bwd": "backward"}.get(direction, direction)
    gpu = payload.get("env", {}).get("gpu") or payload.get("env", {}).get("device", "cpu")
    head = render_header(payload.get("env", {}), payload.get("ceilings"), payload.get("impls"),
                         payload.get("command"), f"ffpa_cute attention, {name}, {gpu}")
    baselines = [im for im in payload.get("impls", []) if im["name"] != "ours"]
    return head + "\n" + render_table(payload.get("rows", []), direction, baselines) + "\n" + \
        render_curve(payload.get("rows", []), direction) + \
        render_notes(payload.get("notes", [])) + "\n"


CURVE_MIN_DIMS = 5      # head dims a shape needs before its curve is checked
CURVE_TOLERANCE = 0.15  # a D this far below its neighbours' mean is a cliff


def curve_cliffs(rows: list[dict], direction: str) -> list[tuple[str, int, float, float]]:
    """The cliffs in D of our TFLOPS: for each shape (family, dtype, B, heads, N, causal, Dv
    equal to D or not) timed at >= CURVE_MIN_DIMS head dims, every interior D whose TFLOPS is
    more than CURVE_TOLERANCE below the mean of its two neighbours in D (the smooth curve through
    them). Returns (shape, D, TFLOPS, neighbours' mean) per cliff, in the rows' order."""
    groups: dict[tuple, dict[int, float]] = {}
    for r in rows:
        t = ((r.get("results") or {}).get("ours") or {}).get("tflops")
        if r.get("direction") != direction or not _ok(t):
            continue
        key = (r["name"], r["dtype"], r["batch"], r["hq"], r["hkv"], r["nq"], r["nkv"],
               r["causal"], r.get("dv") is None)
        groups.setdefault(key, {})[r["d"]] = t
    out = []
    for key, by_d in groups.items():
        ds = sorted(by_d)
        if len(ds) < CURVE_MIN_DIMS:
            continue
        name, dtype, _, hq, hkv, nq, nkv, causal, _ = key
        shape = f"{name} {dtype} {hq}/{hkv}h {nq}/{nkv}{' causal' if causal else ''}"
        for lo, d, hi in zip(ds, ds[1:], ds[2:]):
            mean = (by_d[lo] + by_d[hi]) / 2
            if by_d[d] < (1 - CURVE_TOLERANCE) * mean:
                out.append((shape, d, by_d[d], mean))
    return out


def render_curve(rows: list[dict], direction: str) -> str:
    """The curve check's lines (issue 20's "no cliffs in D"), or "" when no shape spans
    CURVE_MIN_DIMS head dims."""
    dims = {}
    for r in rows:
        if r.get("direction") == direction:
            dims.setdefault((r["name"], r["dtype"], r["nq"], r["causal"]), set()).add(r["d"])
    if not any(len(v) >= CURVE_MIN_DIMS for v in dims.values()):
        return ""
    cliffs = curve_cliffs(rows, direction)
    lines = ["", f"Curve across D: {len(cliffs)} head dims more than "
             f"{CURVE_TOLERANCE:.0%} below the mean of their neighbours in D", ""]
    lines += [f"- {shape}: D={d} {fmt_tflops(t)} TFLOPS against {fmt_tflops(m)}"
              for shape, d, t, m in cliffs]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- CSV / JSON
RESULT_FIELDS = ("ms", "tflops", "first_s", "err", "backend", "fallback", "method", "reps",
                 "p20_ms", "p80_ms", "note")
CASE_FIELDS = ("label", "name", "dtype", "batch", "hq", "hkv", "nq", "nkv", "d", "causal",
               "direction", "flops")


def flatten_row(row: dict, impl_names: list[str]) -> dict:
    flat = {k: row.get(k) for k in CASE_FIELDS}
    res = row.get("results", {})
    for name in impl_names:
        r = res.get(name) or {}
        for f in RESULT_FIELDS:
            flat[f"{name}_{f}"] = r.get(f)
        if name != "ours":
            flat[f"speedup_vs_{name}"] = speedup(row, name)
    return flat


def write_csv(rows: list[dict], path, impl_names: list[str]) -> Path:
    path = Path(path)
    flat = [flatten_row(r, impl_names) for r in rows]
    fields = list(CASE_FIELDS)
    for name in impl_names:
        fields += [f"{name}_{f}" for f in RESULT_FIELDS]
        if name != "ours":
            fields.append(f"speedup_vs_{name}")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in flat:
            w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return path


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def write_json(payload: dict, path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(_jsonable(payload), indent=1, sort_keys=False) + "\n")
    return path


# ----------------------------------------------------------------------------- PNG
def short_label(row: dict) -> str:
    c = " c" if row.get("causal") else ""
    h = f" {row['hq']}/{row['hkv']}h" if row["hq"] != row["hkv"] else ""
    return f"{row['name']} {row['dtype']} D{_head_dims(row)} {row['nq']}/{row['nkv']}{h}{c}"


def plot_bars(payload: dict, direction: str, path) -> str:
    """Grouped TFLOPS bars per case; returns the path written, or a note why not."""
    rows = [r for r in payload.get("rows", []) if r.get("direction") == direction]
    if not rows:
        return f"no {direction} rows: no chart"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"matplotlib not available ({type(e).__name__}): {direction} chart skipped"
    # Only implementations with at least one number get a bar slot and a legend entry.
    # Colours follow the implementation's place in the full list, so they match across charts.
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    color_of = {im["name"]: colors[i % len(colors)]
                for i, im in enumerate(payload.get("impls", []))}
    impls = [im for im in payload.get("impls", [])
             if any(_ok((r.get("results", {}).get(im["name"]) or {}).get("tflops"))
                    for r in rows)]
    if not impls:
        return f"no {direction} timings: no chart"
    n, k = len(rows), len(impls)
    width = 0.8 / k
    fig, ax = plt.subplots(figsize=(min(48, max(8, 0.55 * n * (k + 1) / 2 + 2)), 5.5))
    for j, im in enumerate(impls):
        xs, ys, hatches = [], [], []
        for i, row in enumerate(rows):
            r = row.get("results", {}).get(im["name"]) or {}
            if _ok(r.get("tflops")):
                xs.append(i + (j - (k - 1) / 2) * width)
                ys.append(r["tflops"])
                hatches.append("//" if r.get("fallback") else "")
        bars = ax.bar(xs, ys, width, label=im["title"], color=color_of[im["name"]])
        for b, h in zip(bars, hatches):
            if h:
                b.set_hatch(h)
                b.set_alpha(0.5)
    mm = (payload.get("ceilings") or {}).get("matmul_bf16_8192_tflops")
    if _ok(mm):
        ax.axhline(mm, ls="--", lw=1, color="grey", label=f"bf16 matmul {mm:.0f}")
    ax.set_xticks(range(n))
    ax.set_xticklabels([short_label(r) for r in rows], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("TFLOPS")
    gpu = (payload.get("env") or {}).get("gpu") or "cpu"
    ax.set_title(f"{gpu}: attention {direction} (hatched = fallback, not own kernel)")
    ax.legend(fontsize=8, loc="upper right", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def write_all(payload: dict, out_dir, directions=("fwd", "bwd"), charts: bool = True) -> dict:
    """fwd.md / bwd.md, raw.json, raw.csv and (when asked) fwd.png / bwd.png under out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    names = [im["name"] for im in payload.get("impls", [])]
    for d in directions:
        p = out / f"{d}.md"
        p.write_text(render_markdown(payload, d))
        written[f"{d}.md"] = str(p)
        if charts:
            written[f"{d}.png"] = plot_bars(payload, d, out / f"{d}.png")
    written["raw.json"] = str(write_json(payload, out / "raw.json"))
    written["raw.csv"] = str(write_csv(payload.get("rows", []), out / "raw.csv", names))
    return written


def _head_dims(row: dict) -> str:
    """D, or D/Dv when V's head dim differs (a row's `dv`; rows written before it have none)."""
    return f"{row['d']}/{row['dv']}" if row.get("dv") is not None else str(row["d"])
