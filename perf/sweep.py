"""`python -m perf.sweep`: the table users pick a kernel by, and we steer kernel changes by.

For every selected case and direction (forward, backward) it times `ffpa_cute.attention` and the
baselines (torch SDPA with the backend it used, the FFPA package's CuTeDSL backend,
FlashAttention), checks each against a float32 reference, and writes under
perf/results/<date>-<gpu>/ (or --out): fwd.md, bwd.md, fwd.png, bwd.png, raw.json, raw.csv.
Each markdown file opens with the run's environment and measured ceilings.

Examples:
  python -m perf.sweep --quick
  python -m perf.sweep --cases self,causal --head-dims 512,1024 --seqlens 8k --fwd
  python -m perf.sweep --cases users --bwd --baselines sdpa
  python -m perf.sweep --backend sm80 --quick         # force our sm80 kernel family
  python -m perf.sweep --cases window,varlen,kvdecode # serving rows -> serving.md
  python -m perf.sweep --list                         # print the selected cases, run nothing
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile

from .baselines import BASELINES, DEFAULT_BASELINES, SDPA_ORDER, parse_baselines
from .cases import (ALL_FAMILIES, FAMILY_ALIASES, FFPA_HEAD_DIMS, FFPA_SEQLENS, SERVING_FAMILIES,
                    parse_families, parse_ints, select_cases)
from .serving import render as render_serving
from .serving import run_serving, serving_cases


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m perf.sweep", description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Case families: " + ", ".join(ALL_FAMILIES + SERVING_FAMILIES) + "; aliases: "
        + ", ".join(f"{k}={'+'.join(v)}" for k, v in FAMILY_ALIASES.items() if k != "all")
        + ". Causal is bottom-right aligned (as ffpa_cute.attention).")
    sel = p.add_argument_group("case selection")
    sel.add_argument("--quick", action="store_true",
                     help="a handful of cases (D=512 self/causal/GQA, D=320, D=1024 at N=8K; "
                          "backward at D=512 only, since the peers' own backward JIT at other D "
                          "alone takes ~1 min), under two minutes; the flags below filter it")
    sel.add_argument("--cases", metavar="LIST",
                     help="comma list of case families or aliases (default: all)")
    sel.add_argument("--head-dims", metavar="LIST",
                     help=f"head dims of the FFPA grid (default {','.join(map(str, FFPA_HEAD_DIMS))})"
                          "; filters the user shapes (their D is the model's); 'all': every "
                          "multiple of 8 in [264, 1024], and the tables then flag the head dims "
                          "more than 15%% below their neighbours (the curve across D)")
    sel.add_argument("--seqlens", metavar="LIST",
                     help=f"N values, 8k style allowed (default {','.join(map(str, FFPA_SEQLENS))} "
                          "for the FFPA grid; each user shape has its own list)")
    sel.add_argument("--dtypes", metavar="LIST",
                     help="bf16,fp16,fp32 (default bf16, plus fp32 for the VAE)")
    sel.add_argument("--fwd", action="store_true", help="forward only (default: both)")
    sel.add_argument("--bwd", action="store_true", help="backward only (default: both)")
    sel.add_argument("--list", action="store_true", help="print the selected cases and exit")
    imp = p.add_argument_group("implementations")
    imp.add_argument("--backend", metavar="ARCH",
                     help="force our kernel family: Options.family (e.g. sm80, sm90) "
                          "before the first call")
    imp.add_argument("--baselines", metavar="LIST",
                     help=f"from {','.join(BASELINES)}, or none "
                          f"(default {','.join(DEFAULT_BASELINES)}); a missing one is blank")
    imp.add_argument("--sdpa-backends", metavar="LIST", default=",".join(SDPA_ORDER),
                     help="SDPA backends in preference order; the first that runs a case is "
                          "timed (default %(default)s)")
    imp.add_argument("--cold-cache", action="store_true",
                     help="point FFPA_CUTE_CACHE_DIR at a fresh temp dir, so `1st call s` "
                          "is a cold JIT compile")
    tm = p.add_argument_group("timing and checks")
    tm.add_argument("--rep-ms", type=float, default=100.0,
                    help="timed calls per measurement ~ this many ms (default %(default)s)")
    tm.add_argument("--warmup-ms", type=float, default=25.0, help="default %(default)s")
    tm.add_argument("--min-reps", type=int, default=3, help="default %(default)s")
    tm.add_argument("--max-reps", type=int, default=100, help="default %(default)s")
    tm.add_argument("--flush-mb", type=int, default=256,
                    help="MB written before every timed call to flush L2; 0 = off "
                         "(default %(default)s)")
    tm.add_argument("--err-heads", type=int, default=4,
                    help="query heads checked against the fp32 reference; 0 = no error column "
                         "(default %(default)s)")
    tm.add_argument("--mem-limit-gb", type=float, default=40.0,
                    help="skip a baseline (SDPA MATH) that would need more (default %(default)s)")
    tm.add_argument("--no-ceilings", action="store_true",
                    help="skip the matmul / copy ceiling measurements")
    tm.add_argument("--seed", type=int, default=0)
    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="DIR",
                     help="results folder (default perf/results/<date>-<gpu>/)")
    out.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    out.add_argument("--no-progress", action="store_true", help="plain prints, no rich bar")
    out.add_argument("--commit", help="package commit for the header (default: git, or "
                                      "$PERF_COMMIT)")
    out.add_argument("--device", default=None,
                     help="torch device (default cuda; 'cpu' runs a smoke test of the "
                          "pipeline, numbers meaningless)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.directions = directions(args)
    args.baseline_names = parse_baselines(args.baselines)
    args.sdpa_order = tuple(t.strip().lower() for t in args.sdpa_backends.split(",") if t.strip())
    bad = [b for b in args.sdpa_order if b not in SDPA_ORDER]
    if bad:
        raise SystemExit(f"unknown SDPA backend(s) {bad}; choose from {', '.join(SDPA_ORDER)}")
    return args


QUICK_BWD_HEAD_DIM = 512


def directions(args) -> tuple[str, ...]:
    if args.fwd and not args.bwd:
        return ("fwd",)
    if args.bwd and not args.fwd:
        return ("bwd",)
    return ("fwd", "bwd")


def cases_from_args(args):
    return select_cases(quick=args.quick, cases=args.cases, head_dims=args.head_dims,
                        seqlens=args.seqlens, dtypes=args.dtypes)


class Reporter:
    """rich progress bar with a log above it; plain prints when rich is missing or unwanted."""

    def __init__(self, total: int, plain: bool = False):
        self.total, self.done, self.bar = total, 0, None
        if not plain:
            try:
                from rich.progress import (BarColumn, MofNCompleteColumn, Progress,
                                           SpinnerColumn, TextColumn, TimeElapsedColumn,
                                           TimeRemainingColumn)
                self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                    BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                    TimeRemainingColumn())
            except ImportError:
                self.bar = None

    def __enter__(self):
        if self.bar is not None:
            self.bar.start()
            self.task = self.bar.add_task("starting", total=self.total)
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.stop()

    def log(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.console.print(msg, markup=False, highlight=False, soft_wrap=True)
        else:
            print(msg, flush=True)

    def start(self, desc: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=desc)
        else:
            print(f"[{self.done + 1}/{self.total}] {desc}", flush=True)

    def advance(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.advance(self.task)


def summary_line(row: dict, impls) -> str:
    from .report import fmt_err, fmt_tflops, short_label
    parts = []
    for im in impls:
        r = row["results"].get(im.name) or {}
        if r.get("ms") is None:
            parts.append(f"{im.title} —")
            continue
        s = f"{im.title} {fmt_tflops(r.get('tflops'))}"
        if im.name in ("ours", "sdpa") and r.get("backend"):
            s += f" [{str(r['backend']).splitlines()[0][:40]}]"
        if r.get("fallback"):
            s += " (FALLBACK)"
        parts.append(s + f" err {fmt_err(r.get('err'))}")
    return f"{short_label(row)} {row['direction']}: TFLOPS " + " | ".join(parts)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.backend:
        import ffpa_cute

        ffpa_cute.options.set_default(family=args.backend)
    if args.cold_cache:
        os.environ["FFPA_CUTE_CACHE_DIR"] = tempfile.mkdtemp(prefix="ffpa_cute_cold_")
    cases = cases_from_args(args)
    served = serving_cases([f for f in parse_families(args.cases) if f in SERVING_FAMILIES],
                           parse_ints(args.seqlens)) if args.cases else []
    if args.list or not (cases or served):
        for c in (*cases, *served):
            print(c.label)
        print(f"{len(cases)} cases x {len(args.directions)} directions, {len(served)} serving "
              "cases", file=sys.stderr)
        return 0 if cases or served or args.list else 1

    import torch

    from . import report
    from .baselines import make_impls
    from .envinfo import collect_env, default_out_dir
    from .runner import Ctx, FatalCudaError, run_case
    from .timing import L2Flusher, measure_ceilings

    dev_name = args.device or "cuda"
    if dev_name.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: run on a GPU machine, or `--device cpu` for a smoke test "
              "of the pipeline (numbers meaningless), or `--list`.", file=sys.stderr)
        return 2
    device = torch.device(dev_name)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    impls = make_impls(args.baseline_names, args.sdpa_order)
    impl_meta = []
    for im in impls:
        reason = im.load()
        impl_meta.append({"name": im.name, "title": im.title, "version": im.version(),
                          "unavailable": reason})
    ceilings = {}
    if not args.no_ceilings and device.type == "cuda":
        ceilings = measure_ceilings(device)
    env = collect_env(device, {m["name"]: m["version"] for m in impl_meta}, args.commit)
    out_dir = args.out or str(default_out_dir(env))
    flush = L2Flusher(device, args.flush_mb) if args.flush_mb > 0 else None
    ctx = Ctx(device=device, flush=flush, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
              min_reps=args.min_reps, max_reps=args.max_reps,
              mem_limit_bytes=int(args.mem_limit_gb * 1e9), err_heads=args.err_heads,
              seed=args.seed)
    payload = {"command": "python -m perf.sweep " + " ".join(shlex.quote(a) for a in argv),
               "env": env, "ceilings": ceilings, "impls": impl_meta, "rows": [], "notes": [],
               "args": {k: v for k, v in vars(args).items() if k != "directions"}
               | {"directions": list(args.directions)}}
    status = 0
    with Reporter(len(cases), plain=args.no_progress) as rep:
        ctx.log = rep.log
        rep.log(f"{env.get('gpu') or dev_name}: {len(cases)} cases x "
                f"{'+'.join(args.directions)}; ceilings {ceilings or 'not measured'}; "
                f"results -> {out_dir}")
        for m in impl_meta:
            if m["unavailable"]:
                rep.log(f"{m['title']}: blank column ({m['unavailable']})")
        try:
            for case in cases:
                rep.start(case.label)
                dirs = args.directions
                if args.quick and case.d != QUICK_BWD_HEAD_DIM:
                    dirs = tuple(d for d in dirs if d == "fwd") or dirs
                rows = run_case(case, impls, dirs, ctx)
                payload["rows"].extend(rows)
                payload["notes"] = ctx.notes.to_list()
                for row in rows:
                    rep.log(summary_line(row, impls))
                report.write_all(payload, out_dir, args.directions, charts=False)
                rep.advance()
        except FatalCudaError as e:
            ctx.notes.add("sweep", f"stopped: CUDA context lost ({e}); rerun without this case")
            status = 3
        except KeyboardInterrupt:
            ctx.notes.add("sweep", "interrupted: partial results")
            status = 130
        if served and status == 0:
            bench_kw = dict(flush=flush, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                            min_reps=args.min_reps, max_reps=args.max_reps)
            payload["serving"] = run_serving(served, device, bench_kw, ctx.mem_limit_bytes,
                                             log=rep.log)
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "serving.md"), "w") as f:
                f.write(render_serving(payload["serving"], ceilings.get("copy_gbps")) + "\n")
    payload["notes"] = ctx.notes.to_list()
    written = report.write_all(payload, out_dir, args.directions, charts=not args.no_charts)
    for d in args.directions:
        print()
        print(report.render_markdown(payload, d))
    for k, v in written.items():
        print(f"{k}: {v}")
    return status


if __name__ == "__main__":
    sys.exit(main())
