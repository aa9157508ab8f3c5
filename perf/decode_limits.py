"""What bounds the split-KV decode kernels on an FP8 cache: the keys-as-rows kernel
(`FFPADecodeKeysSm90`, what an e4m3 cache with <= 32 rows per KV head runs) beside the row-tiled
one (`FFPADecodeSm90` with `kv_dtype` e4m3), a variant of the latter without its conversion,
and the 16-bit-cache kernel on the same keys.

    python -m perf.decode_limits --precompile DIR     # CPU: compile the variants into a cache
    python -m perf.decode_limits                      # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

Variants (B=8, Hq 32 / Hkv 4, D=512, page 64, every row at N keys; the kernel alone, without
the merge of the splits):
  bf16       the 16-bit cache (twice the bytes), row-tiled
  keys       the keys-as-rows FP8-cache kernel (routed)
  keys-no-cvt  the same without V's loads and conversion into registers (wrong values)
  e4m3       the row-tiled FP8-cache kernel (routed before the keys-as-rows one; still routed
             for > 32 rows per KV head and causal chunks)
  no-copy    the row-tiled one with no conversion at all: the fence and barrier only (wrong
             values)
  bf16-2x2   the 16-bit cache with rings of 2 K and 2 V stages (80 KB in flight at most, near
             the row-tiled FP8 kernel's 64 KB): how much the bytes in flight alone cost
Experiments only: no-copy and keys-no-cvt compute wrong attention and are never routed.
"""

from __future__ import annotations

import contextlib
import sys

import cutlass.cute as cute

from ffpa_cute.sm90 import config as sm90_config
from ffpa_cute.sm90.decode_keys_sm90 import FFPADecodeKeysSm90
from ffpa_cute.sm90.decode_sm90 import FFPADecodeSm90
from ffpa_cute.sm90.skeleton_sm90 import WG_THREADS
from perf import experiment

B, HQ, HKV, D, PAGE = 8, 32, 4, 512, 64
SEQLENS = (32768, 131072)


class DecodeNoCopy(FFPADecodeSm90):
    """The row-tiled FP8-cache decode with no conversion: the fence and barrier only."""

    @cute.jit
    def _convert(self, conv, s, sb, tidx):
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=conv.barrier_id, number_of_threads=WG_THREADS)


class KeysNoConvert(FFPADecodeKeysSm90):
    """The keys-as-rows decode with no V operand built (its registers as they are: wrong
    values): what the loads and the conversion of V cost."""

    @cute.jit
    def _v_operand(self, sv, tOrV, warp, lane):
        pass


@contextlib.contextmanager
def _row_tiled():
    """Plan the row-tiled decode kernel for an FP8 cache too."""
    keep, sm90_config.KEYS_DECODE = sm90_config.KEYS_DECODE, False
    try:
        yield
    finally:
        sm90_config.KEYS_DECODE = keep


def _cfg(kv, rings=None, keys=False):
    from ffpa_cute import dispatch
    from ffpa_cute.options import Options
    from ffpa_cute.problem import AttnProblem

    p = AttnProblem(dtype="bf16", batch=B, heads_q=HKV, heads_kv=HKV, seqlen_q=HQ // HKV,
                    seqlen_kv=4096, head_dim=D, head_dim_v=D)
    dispatch.clear_plans()
    with contextlib.nullcontext() if keys else _row_tiled():
        plan = dispatch.plan_decode(p, PAGE, target="sm_90a", opts=Options(), kv_dtype=kv)
    dispatch.clear_plans()
    assert plan.reason is None, plan.reason
    if rings:
        import dataclasses

        return dataclasses.replace(plan.cfg, k_stages=rings[0], v_stages=rings[1])
    return plan.cfg


VARIANTS = {"bf16": (FFPADecodeSm90, None, None), "keys": (FFPADecodeKeysSm90, "e4m3", None),
            "keys-no-cvt": (KeysNoConvert, "e4m3", None),
            "e4m3": (FFPADecodeSm90, "e4m3", None), "no-copy": (DecodeNoCopy, "e4m3", None),
            "bf16-2x2": (FFPADecodeSm90, None, (2, 2))}


def _variant_cfg(cls, kv, rings):
    return _cfg(kv, rings, keys=issubclass(cls, FFPADecodeKeysSm90))


def jobs() -> list:
    """Every variant's kernel and config."""
    return [(cls, _variant_cfg(cls, kv, rings)) for cls, kv, rings in VARIANTS.values()]


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute import decode, launch
    from perf.timing import bench

    out = {}
    for n in SEQLENS:
        pages = B * n // PAGE
        k16, v16 = (torch.randn(pages, PAGE, HKV, D, device=dev, dtype=torch.bfloat16)
                    for _ in "kv")
        k8, v8 = (x.to(torch.float8_e4m3fn) for x in (k16, v16))
        table = torch.randperm(pages, device=dev, dtype=torch.int32).view(B, -1)
        q = torch.randn(B, 1, HQ, D, device=dev, dtype=torch.bfloat16)
        lens = torch.full((B,), n, dtype=torch.int32, device=dev)
        row = {}
        for name, (cls, kv, rings) in VARIANTS.items():
            cfg = _variant_cfg(cls, kv, rings)
            kc, vc = (k8, v8) if kv else (k16, v16)
            plan = type("P", (), {"cfg": cfg, "problem": type("Q", (), {"seqlen_q": HQ // HKV})})
            s = decode.num_splits(plan, B, HKV, n, dev)
            ones = torch.ones(B, HKV, device=dev)
            t = decode.kernel_operands(q, kc, vc, lens, table, s, (ones, ones) if kv else None)

            def call(cls=cls, cfg=cfg, t=t, s=s):
                launch.run_job(cls, cfg, t, dict(softmax_scale=D ** -0.5, num_splits=s, nq=1))

            call()
            torch.cuda.synchronize()
            ms = bench(call, dev, flush=flush).median_ms
            nbytes = 2 * B * n * HKV * D * (1 if kv else 2)
            row[name] = {"us": ms * 1e3, "gbps": nbytes / (ms * 1e-3) / 1e9}
        out[f"N={n}"] = row
        print(f"N={n}: " + ", ".join(f"{k} {v['us']:.0f} us {v['gbps']:.0f} GB/s"
                                     for k, v in row.items()), flush=True)
    return out


def main(argv=None) -> int:
    return experiment.main("perf.decode_limits", __doc__, jobs, run, argv)


if __name__ == "__main__":
    sys.exit(main())
