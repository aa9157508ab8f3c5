"""What bounds the FP8 forward (e4m3 WGMMA, `FFPAFwdSm90FP8`): the kernel timed beside variants
of itself that drop one piece of a block's work or change its schedule, and beside the whole
call (`attention`, V's transpose included) and the transpose alone.

    python -m perf.fp8_limits --precompile DIR     # CPU: compile the variants into a cache
    python -m perf.fp8_limits                      # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

Variants (each the planned config with the fields shown changed):
  full      the planned kernel: mask, row max, exp2 in the block's frame, row sums, P -> e4m3
  serial    the planned config without `overlap` (the score step between QK[i] and QK[i+1]),
            its rings as the planner picks them for that schedule
  no-exp    `serial` with P = S rounded to e4m3 (no max / exp2 / sums): the tensor-core work,
            the loads, the P hand-over and stores stay, the softmax arithmetic goes
  ov<h>-k<k>-v<v>  the `overlap` schedule (QK[i+1]'s first h chunks before the score step of
            block i, the rest after it; config.FwdConfigSm90), K ring k, V rings v deep. Its
            output must equal `full`'s bit for bit (same products, same order): checked.
  pub<p>    `serial` with P[i-1] published after p of QK[i]'s chunks (the plan: after all of
            them), so that PV[i-1] runs beside QK[i] rather than beside the score step of
            block i (D=512 unmasked; the same bits: checked)
  lazy      the planned config with `lazy_rescale` (the frame kept while a block's max lies
            in [frame - 4, frame + 2], so most rows skip O's rescale; Note [Lazy rescaling]).
            Not the same bits: the largest difference from `full`'s output is reported
            relative to its largest value ("lazy diff")
  call      `ffpa_cute.attention` on the same e4m3 q, k, v (the default route, V's transpose
            inside); transpose: the byte-transpose kernel alone.
The matmul ceiling (torch._scaled_mm, e4m3, 8192^3) is measured in the same run.

The kernels and the call are timed in rounds, in an order rotated each round
(`experiment.interleaved_ms`: timed one after the other, the first variant read up to 11%
high). TFLOPS on the 16-bit FLOP count of the attention (4 B Hq N^2 D; causal: the visible
pairs). The kernel rows: V arrives pre-transposed (Vt). Experiments only: `no-exp` computes
wrong attention and is never routed.
"""

from __future__ import annotations

import dataclasses
import sys

import cutlass.cute as cute

from ffpa_cute.sm90.fwd_sm90 import FFPAFwdSm90FP8
from perf import experiment

SHAPES = [  # (D, N, causal)
    (512, 8192, False), (512, 16384, False), (512, 8192, True), (320, 8192, False)]
HEADS = 32


class FP8NoExp(FFPAFwdSm90FP8):
    """The FP8 forward with P = S (rounded to e4m3): no softmax arithmetic."""

    @cute.jit
    def _softmax_block(self, tile, frags, n_block):
        self._p_to_regs(frags)


def _variants(d: int, causal: bool) -> dict:
    """name -> (kernel class, config fields changed) at head dim d (None: the serial
    schedule, `_config`); causal D=512 times the `overlap` schedule beside the planned serial
    one, unmasked D=512 the other h beside the planned one."""
    out = {"full": (FFPAFwdSm90FP8, {}), "serial": (FFPAFwdSm90FP8, None),
           "no-exp": (FP8NoExp, None)}
    sched = ([(2, 7, 2)] if causal else [(3, 7, 2)]) if d == 512 else [(1, 5, 3)]
    for h, k, v in sched:
        out[f"ov{h}-k{k}-v{v}"] = (FFPAFwdSm90FP8, dict(overlap=h, k_stages=k, v_stages=v))
    if d == 512 and not causal:
        for p in (0, 2):
            out[f"pub{p}"] = (FFPAFwdSm90FP8, dict(publish_after=p))
    out["lazy"] = (FFPAFwdSm90FP8, dict(lazy_rescale=True))
    return out


def _config(cfg, fields):
    """The planned cfg with `fields` changed; None: without `overlap`, the rings the planner
    picks for the serial schedule."""
    if fields is None:
        from ffpa_cute.common.config import deepest_rings
        from ffpa_cute.sm90.config import can_implement

        return deepest_rings(lambda k, v: dataclasses.replace(cfg, overlap=0, k_stages=k,
                                                              v_stages=v), can_implement)
    return dataclasses.replace(cfg, **fields)


def _plan(d: int, causal: bool, n: int = 8192):
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    p = AttnProblem(dtype="e4m3", batch=1, heads_q=HEADS, heads_kv=HEADS, seqlen_q=n,
                    seqlen_kv=n, head_dim=d, head_dim_v=d, causal=causal, out_dtype="bf16")
    plan = dispatch.plan_fwd(p, target="sm_90a", opts=Options())
    assert plan.reason is None, plan.reason
    return plan.cfg


def jobs() -> list:
    """Every variant kernel at every shape's config, and the transpose kernels."""
    from ffpa_cute import dispatch
    from ffpa_cute.fp8 import vt_config

    out = []
    for d, _, causal in SHAPES:
        cfg = _plan(d, causal)
        out += [(cls, _config(cfg, kw)) for cls, kw in _variants(d, causal).values()]
    for d in sorted({d for d, _, _ in SHAPES}):
        tcfg = vt_config(FFPAFwdSm90FP8, "sm_90a", d)
        out.append((dispatch.kernel_class(tcfg), tcfg))
    return out


def run(dev, flush) -> dict:
    import torch

    import ffpa_cute
    from ffpa_cute.cache import jit_cache
    from ffpa_cute.fp8 import _transposed_v
    from perf.timing import bench

    out = {}
    a = torch.randn(8192, 8192, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)

    def mm():
        return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)

    mm()
    out["matmul_tflops"] = 2 * 8192 ** 3 / (bench(mm, dev, flush=flush).median_ms * 1e9)
    print(f"e4m3 matmul 8192^3: {out['matmul_tflops']:.0f} TFLOPS", flush=True)
    for d, n, causal in SHAPES:
        cfg = _plan(d, causal, n)
        q, k, v = (torch.randn(1, HEADS, n, d, device=dev).to(torch.float8_e4m3fn)
                   for _ in "qkv")
        vt = _transposed_v(v, interleave=True)
        lse = torch.empty(1, HEADS, n, device=dev)
        ds = [torch.ones(1, HEADS, device=dev) for _ in range(3)]
        pairs = n * (n + 1) // 2 if causal else n * n
        flops = 4 * HEADS * pairs * d
        row, ref, calls = {}, None, {}
        for name, (cls, kw) in _variants(d, causal).items():
            vcfg = _config(cfg, kw)
            fn = jit_cache().get(cls, vcfg)
            o = torch.empty(1, HEADS, n, d, device=dev, dtype=torch.bfloat16)

            def call(fn=fn, cls=cls, o=o):
                cls.launch(fn, q, k, vt, o, lse, *ds, None, d ** -0.5, 0, 0)

            call()
            torch.cuda.synchronize()
            if name == "full":
                ref = o.clone()
            elif name == "lazy":   # another frame: not the same bits
                row["lazy diff"] = ((o.float() - ref.float()).abs().max()
                                    / ref.float().abs().max()).item()
            elif cls is FFPAFwdSm90FP8:  # every schedule computes the same bits
                same = torch.equal(o, ref)
                row[f"{name} equal"] = same
                if not same:
                    print(f"  {name}: output differs from full (max |diff| "
                          f"{(o.float() - ref.float()).abs().max().item():.3g})", flush=True)
            calls[name] = call

        def api():
            return ffpa_cute.attention(q, k, v, is_causal=causal)

        api()
        calls["call"] = api
        for name, ms in experiment.interleaved_ms(calls, dev, flush, rounds=len(calls)).items():
            row[name] = flops / (ms * 1e9)
        row["transpose us"] = bench(lambda: _transposed_v(v, interleave=True), dev,
                                    flush=flush).median_ms * 1e3
        key = f"D={d} N={n}{' causal' if causal else ''}"
        out[key] = row
        print(f"{key}: " + ", ".join(
            f"{k} {v:.3g}" if "diff" in k else f"{k} {v:.0f}" if isinstance(v, float)
            else f"{k} {v}" for k, v in row.items()), flush=True)
    return out


def main(argv=None) -> int:
    return experiment.main("perf.fp8_limits", __doc__, jobs, run, argv)


if __name__ == "__main__":
    sys.exit(main())
