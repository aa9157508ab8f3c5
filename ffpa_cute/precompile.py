"""Fill a kernel cache directory ahead of time, on any machine (no GPU needed).

    python -m ffpa_cute.precompile --arch sm_90 --head-dims 320,512,1024 --dtypes bf16,fp16 \
        --cache-dir /opt/ffpa-cache

A head dim is D, or D/Dv where V's head dim differs (DeepSeek's absorbed MLA: 576/512). Each
(head dim, dtype, causal) is planned exactly as `dispatch.plan_fwd` plans it for that arch
under the options in force (`ffpa_cute.options`; e.g. FFPA_CUTE_ARCH=sm80 for the Split-D family)
(with --backward also the kernels of `dispatch.plan_bwd`: Delta, then the fused kernel where
it is the default (sm90, D 264-576, at the next multiple of 64) or dQ, dK and dV, for one
query head per KV head and for GQA / MQA groups that the dV / dK kernels split;
FFPA_CUTE_DETERMINISTIC=1 plans the atomic-free kernels everywhere, as `deterministic=True`
runs them; with --decode the split-KV decode kernels of `attention_with_kvcache` for those
page sizes: 16-bit caches, and e4m3 caches under the 16-bit dtypes when --dtypes has fp8; with
--varlen the one-launch kernels of `varlen_attention` for the same problems, forward and with
--backward its gradient kernels, where the target's family has them), compiled
from fake tensors (cutlass-dsl's `--gpu-arch`, so no device is queried) and exported as
an object file into `<cache-dir>/<fingerprint>/`. A process on the GPU machine that sets
`FFPA_CUTE_CACHE_DIR` to the same directory (same package sources and cutlass-dsl version) loads
those files and compiles nothing.
"""

from __future__ import annotations

import argparse
import sys
import time

from . import dispatch
from .cache import JitCache
from .problem import AttnProblem

ARCH_ALIASES = {"sm_80": "sm_80", "sm80": "sm_80", "sm_86": "sm_86", "sm_89": "sm_89",
                "sm_90": "sm_90a", "sm_90a": "sm_90a", "sm90": "sm_90a",
                "sm_100": "sm_100a", "sm_100a": "sm_100a", "sm_120": "sm_120a",
                "sm_120a": "sm_120a", "sm120": "sm_120a", "sm_121a": "sm_121a"}
ALL_HEAD_DIMS = tuple(range(dispatch.MIN_HEAD_DIM, dispatch.MAX_HEAD_DIM + 1, 8))
DTYPE_ALIASES = {"fp8": "e4m3", "fp4": "nvfp4"}


def normalize_arch(arch: str) -> str:
    a = arch.strip().lower()
    if a not in ARCH_ALIASES:
        raise ValueError(f"--arch {arch!r}: accepted values are {sorted(set(ARCH_ALIASES))}")
    return ARCH_ALIASES[a]


def head_dim_pair(x) -> tuple[int, int]:
    """(D, Dv) of a head-dims entry: an int D (Dv = D), a (D, Dv) pair, or the CLI's "D" /
    "D/Dv" text."""
    if isinstance(x, str):
        d, _, dv = x.strip().partition("/")
        try:
            return int(d), int(dv or d)
        except ValueError:
            raise ValueError(f"--head-dims entry {x!r}: a head dim D, or D/Dv (e.g. 576/512)") \
                from None
    if isinstance(x, tuple):
        return int(x[0]), int(x[1])
    return int(x), int(x)


def plans_for(target: str, head_dims, dtypes, causals) -> list:
    """The kernel plans dispatch would make on `target` (uncovered combinations skipped), and
    where long sequences widen the scores (`launch.widened_fwd`, D % 16 == 8) or pad D to the
    next multiple of 64 (`launch.padded_fwd`) that plan too; `head_dims` entries as
    `head_dim_pair` reads them."""
    from . import launch

    plans, seen, long = [], set(), 1 << 16   # long: rows the widening rule copies
    for d, dv in map(head_dim_pair, head_dims):
        for dt in dtypes:
            for causal in causals:
                p = AttnProblem(dtype=dt, batch=1, heads_q=1, heads_kv=1, seqlen_q=1,
                                seqlen_kv=1, head_dim=d, head_dim_v=dv, causal=causal)
                plan = dispatch.plan_fwd(p, target=target)
                wide = launch.widened_fwd(plan, long, long) if plan.reason is None else None
                pad = launch.padded_fwd(plan, long, long) if plan.reason is None else None
                for x in (plan, wide, pad):
                    if x is not None and x.reason is None and (x.kernel_cls, x.cfg) not in seen:
                        seen.add((x.kernel_cls, x.cfg))
                        plans.append(x)
    return plans


KEYS_ROWS = (8, 16, 24, 32, 64)  # query rows per KV head an e4m3 cache is compiled for


def decode_jobs(target: str, head_dims, dtypes, pages) -> list:
    """(kernel class, config) of the split-KV decode kernels per head dim, 16-bit query dtype,
    cache dtype (the query's; e4m3 too when `dtypes` has it) and page size (None: a
    contiguous cache); combinations no decode kernel serves are skipped. An e4m3 cache is
    compiled for each row count the keys-as-rows kernel keys on (8, 16, 24, 32 query rows per
    KV head) and for the row-tiled kernel (more rows: MQA); each with the split combine that
    follows it (`decode.combine_config`), so a precompiled decode step compiles nothing."""
    from .decode import combine_config

    q_dtypes = [dt for dt in dtypes if dt != "e4m3"] or ["bf16"]
    kv_dtypes = [None] + (["e4m3"] if "e4m3" in dtypes else [])
    jobs = []
    for d, dv in map(head_dim_pair, head_dims):
        for dt in q_dtypes:
            for kv in kv_dtypes:
                if kv is None and dt not in dtypes:
                    continue  # only an FP8 cache was asked for under these queries
                for rows in ((1,) if kv is None else KEYS_ROWS):
                    p = AttnProblem(dtype=dt, batch=1, heads_q=1, heads_kv=1, seqlen_q=rows,
                                    seqlen_kv=1, head_dim=d, head_dim_v=dv)
                    for page in pages:
                        plan = dispatch.plan_decode(p, page, target=target, kv_dtype=kv)
                        if plan.reason is None:
                            combine = combine_config(target, dt, dv)
                            for job in ((plan.kernel_cls, plan.cfg),
                                        (dispatch.kernel_class(combine), combine)):
                                if job not in jobs:
                                    jobs.append(job)
    return jobs


def jobs_for(target: str, head_dims, dtypes, causals, backward: bool = False,
             decode_pages=(), varlen: bool = False) -> list:
    """(kernel class, config) pairs to compile: the forward plans (FP8 ones with the transpose
    kernel that gives them Vt), with `backward` the backward kernels of the same problems, the
    decode kernels for `decode_pages` (`decode_jobs`), and with `varlen` the one-launch varlen
    kernels (`varlen_jobs`) (deduplicated, uncovered combinations skipped)."""
    from .fp8 import vt_config

    jobs = []
    for plan in plans_for(target, head_dims, dtypes, causals):
        jobs.append((plan.kernel_cls, plan.cfg))
        if "vt" in plan.kernel_cls.OPERANDS:  # sm90's FP8 kernel reads V transposed
            t = vt_config(plan.kernel_cls, target, plan.problem.head_dim_v)
            if (dispatch.kernel_class(t), t) not in jobs:
                jobs.append((dispatch.kernel_class(t), t))
    if backward:
        for p in _problems(head_dims, dtypes, causals, GRAD_GROUPS):
            jobs += [j for j in dispatch.plan_bwd(p, target=target).jobs if j not in jobs]
    jobs += [j for j in decode_jobs(target, head_dims, dtypes, decode_pages) if j not in jobs]
    if varlen:
        jobs += [j for j in varlen_jobs(target, head_dims, dtypes, causals, backward)
                 if j not in jobs]
    return jobs


def varlen_jobs(target: str, head_dims, dtypes, causals, backward: bool = False) -> list:
    """(kernel class, config) of the one-launch varlen kernels (`varlen=True` configs:
    `varlen_attention` over packed sequences) per head dim, dtype and causal mode, forward
    and with `backward` the gradient kernels (one query head per KV head and GQA / MQA
    groups, as `jobs_for`), where the target's family has them."""
    jobs = []
    for p in _problems(head_dims, dtypes, causals, GRAD_GROUPS if backward else (1,), batch=2,
                       varlen=True):
        plan = dispatch.plan_fwd(p, target=target)
        if plan.reason is not None or not getattr(plan.cfg, "varlen", False):
            continue
        todo = [(plan.kernel_cls, plan.cfg)]
        if backward:
            bwd = dispatch.plan_bwd(p, target=target)
            todo += bwd.jobs if bwd.reason is None else []
        jobs += [j for j in todo if j not in jobs]
    return jobs


# the query heads per KV head whose gradient kernels are precompiled: one, a group over few KV
# tiles (GQA / MQA: the dV / dK kernels split it over CTAs, `group_split`), and a large causal
# group (the fused kernel by row units, `row_units`)
GRAD_GROUPS = (1, 2, 32)


def _problems(head_dims, dtypes, causals, groups, batch=1, **fields):
    """A one-row problem per head dim (pair), dtype, causal mode and query heads per KV head
    in `groups` (fields: more AttnProblem fields, e.g. varlen)."""
    for d, dv in map(head_dim_pair, head_dims):
        for dt in dtypes:
            for causal in causals:
                for hq in groups:
                    yield AttnProblem(dtype=dt, batch=batch, heads_q=hq, heads_kv=1,
                                      seqlen_q=1, seqlen_kv=1, head_dim=d, head_dim_v=dv,
                                      causal=causal, **fields)


def job_label(cls, cfg) -> str:
    """A job's line on the progress bar: the kernel, its head dim (Dv for the kernels that
    have only that, the split combine), dtype, causal mode and cache dtype where it has them."""
    d = getattr(cfg, "head_dim", None) or getattr(cfg, "head_dim_v", "?")
    causal = f" causal={cfg.causal}" if hasattr(cfg, "causal") else ""
    if getattr(cfg, "kv_dtype", None):
        causal += f" cache={cfg.kv_dtype}"
    return f"{cls.__name__} D={d} {getattr(cfg, 'dtype', '')}{causal}"


def precompile(target: str, head_dims, dtypes, causals, cache_dir, progress: bool = True,
               backward: bool = False, decode_pages=(), varlen: bool = False):
    """Compile every job into cache_dir; returns (the cache, its .stats count the work; the
    (kernel class, config) jobs)."""
    cache = JitCache(cache_dir, disk=True, jit="allow")
    plans = jobs_for(target, head_dims, dtypes, causals, backward, decode_pages, varlen)
    try:
        from rich.progress import Progress
    except ImportError:  # rich is a dependency, but keep precompile usable without it
        Progress = None
    if progress and Progress is not None:
        with Progress() as bar:
            task = bar.add_task(f"precompiling for {target}", total=len(plans))
            for cls, cfg in plans:
                bar.update(task, description=f"{target} {job_label(cls, cfg)}")
                cache.get(cls, cfg)
                bar.advance(task)
    else:
        for cls, cfg in plans:
            cache.get(cls, cfg)
    return cache, plans


def _csv(s: str, conv=str):
    return [conv(x) for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ffpa_cute.precompile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", required=True, help="sm_80, sm_86, sm_89, sm_90, sm_120 ...")
    ap.add_argument("--head-dims", default="320,384,448,512,576,640,768,1024",
                    help="comma list of D, or D/Dv where V's head dim differs (e.g. 576/512), "
                         "or 'all' for every multiple of 8 in [264, 1024]")
    ap.add_argument("--dtypes", default="bf16,fp16",
                    help="bf16, fp16, fp8 (e4m3 in, bf16 out: the FP8 forwards), fp4 (nvfp4 in, "
                         "bf16 out: sm_120's NVFP4 forward)")
    ap.add_argument("--causal", default="both", choices=("both", "yes", "no"))
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--backward", action="store_true",
                    help="also the backward kernels (training) as the options in force plan "
                         "them: Delta, then the fused kernel or dQ, dK, dV per config")
    ap.add_argument("--decode", default="", metavar="PAGES",
                    help="also the split-KV decode kernels (serving, sm_90) for these page sizes, "
                    "e.g. 'none,64' (none: a contiguous cache); e4m3 caches when --dtypes has "
                    "fp8")
    ap.add_argument("--varlen", action="store_true",
                    help="also the one-launch kernels of varlen_attention (packed sequences) "
                         "for the same problems; with --backward their gradient kernels too")
    args = ap.parse_args(argv)
    target = normalize_arch(args.arch)
    dims = ALL_HEAD_DIMS if args.head_dims == "all" else _csv(args.head_dims, head_dim_pair)
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    t0 = time.time()
    dtypes = [DTYPE_ALIASES.get(d, d) for d in _csv(args.dtypes)]
    pages = [None if x.lower() == "none" else int(x) for x in _csv(args.decode)]
    cache, plans = precompile(target, dims, dtypes, causals, args.cache_dir,
                              backward=args.backward, decode_pages=pages, varlen=args.varlen)
    st = cache.stats
    print(f"{len(plans)} kernels for {target} in {cache.entry_dir(target)}: {st.compiles} "
          f"compiled, {st.disk_loads} already there ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
