"""Key-padding masks (ffpa_cute/dense_mask.py): `attention` with a dense mask that only drops
keys, against torch SDPA given the same mask, on the GPU.

    python -m perf.dense_mask [--d 512] [--batch 4] [--heads 32] [--seqlen 4096]
                              [--cases images,causal] [--out FILE]

Cases (bf16, B x H x N x D, not causal; the route each takes, dense_mask.KeptKeys.route), each
timed forward and forward + backward:
  shared       one bool row [1, 1, 1, N] keeping 7/8 of the keys (scattered): `gather`
               (index_select once), then the unmasked call;
  prefix       the same row keeping the first 7/8: `prefix` (views of k and v, no copy);
  batch        bool [B, 1, 1, N], element b keeping N (8 - b) / 8 scattered keys: `rows` (an
               index_select and a call per element);
  hf           transformers' form of right padding: float [B, 1, N, N], 0 and finfo.min,
               element b keeping its first N (8 - b) / 8 keys, the row repeated over the
               queries: `prefix rows` (a call per element on views);
  many         bool [8 B, 1, 1, N / 4], element b keeping its first (N / 4)(8 - b % 8) / 8
               keys: `varlen` (more elements than dense_mask.PER_ELEMENT_MAX);
  causal       a causal bool [N, N] tensor (row prefixes: one causal call), with `kernel`
               the same call by is_causal=True;
  images       Gemma's bidirectional image blocks inside causal text: bool [N, N], four
               blocks of N / 16 rows (row prefixes: nine calls, four unmasked, five causal),
               with `ours, rows copied` (forward): each call's out and lse written apart and
               copied into the whole, instead of written in place, and `ours, dQ per call`
               (forward + backward): the key-run backward's calls each with their own dQ
               accumulator and Delta instead of one shared;
and for `shared` also `kernel`, the unmasked call on keys gathered beforehand (what the route
costs beyond the kernel). Variants timed in rotated rounds (perf.experiment.interleaved_ms, L2
flushed); TFLOPS on the kept pairs (4 Hq Nq D times the keys kept summed over the batch;
forward + backward 3.5x that); err: relative Frobenius error of out against a float32
reference of the masked attention on two heads, ours and SDPA's. SDPA runs the first of
cuDNN, memory-efficient, math that takes the call (named in the output).
"""

from __future__ import annotations

import argparse
import json


def _masks(b: int, n: int):
    """{case: (batch, keys, mask on the CPU, keep [batch, keys])} (module docstring); right
    padding and the image blocks are perf.sweep's `keypad` / `images` (perf.cases.keep)."""
    import torch

    from .cases import Case, keep

    g = torch.Generator(device="cpu").manual_seed(1)
    shared = torch.zeros(n, dtype=torch.bool)
    shared[torch.randperm(n, generator=g)[: n * 7 // 8]] = True
    prefix = torch.arange(n) < n * 7 // 8
    rows = torch.zeros(b, n, dtype=torch.bool)
    for i in range(b):
        rows[i, torch.randperm(n, generator=g)[: n * (8 - i % 8) // 8]] = True
    pre = keep(Case("keypad", "bf16", b, 1, 1, n, n, 512, mask="keypad"))[:, 0, 0]
    hf = torch.zeros(b, 1, n, n, dtype=torch.bfloat16)
    hf.masked_fill_(~pre[:, None, None, :], torch.finfo(torch.bfloat16).min)
    bm, nm = 8 * b, n // 4
    many = torch.arange(nm)[None] < torch.tensor([nm * (8 - i % 8) // 8 for i in range(bm)])[
        :, None]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    images = keep(Case("images", "bf16", 1, 1, 1, n, n, 512, mask="images"))[0, 0]
    return {"shared": (b, n, shared[None, None, None], shared.expand(b, n)),
            "causal": (b, n, causal, causal.expand(b, n, n)),
            "images": (b, n, images, images.expand(b, n, n)),
            "prefix": (b, n, prefix[None, None, None], prefix.expand(b, n)),
            "batch": (b, n, rows[:, None, None], rows),
            "hf": (b, n, hf, pre),
            "many": (bm, nm, many[:, None, None], many)}


def _sdpa(mask):
    """The SDPA call on `mask` and the backend that takes it."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make(be):
        def call(q, k, v):
            with sdpa_kernel([be]):
                return torch._C._nn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return call
    return [(name, make(be)) for name, be in (("cuDNN", SDPBackend.CUDNN_ATTENTION),
                                              ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                                              ("math", SDPBackend.MATH))]


def _ref(q, k, v, keep, heads=2):
    """(heads, float32 masked attention of those query heads) from perf.accuracy (keep: [B,
    Nkv] or [B, Nq, Nkv])."""
    import torch

    from perf import accuracy

    keep = keep.to(q.device)
    mask = keep[:, None, None, :] if keep.dim() == 2 else keep[:, None]
    hs = list(range(heads))
    return hs, accuracy.ref_forward(q, k, v, causal=False, heads=hs, mask=mask,
                                    ref_dtype=torch.float32)


def _err(out, ref):
    from perf import accuracy

    heads, r = ref
    return accuracy.fwd_error(out, r, heads)


def run(d: int, b: int, h: int, n: int, cases=None) -> dict:
    import torch

    import ffpa_cute
    from perf.experiment import interleaved_ms
    from perf.timing import L2Flusher

    dev = torch.device("cuda")
    flush = L2Flusher(dev)
    res = {}
    for name, (b, n, mask, keep) in _masks(b, n).items():
        if cases and name not in cases:
            continue
        q, k, v, dout = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16)
                         for _ in range(4))
        mask = mask.to(dev)
        kept = int(keep.sum()) * (1 if keep.dim() == 3 else n) // n   # kept pairs / Nq
        flops = 4 * h * n * kept * d
        ref = _ref(q, k, v, keep)
        fns = {"ours": lambda m=mask: ffpa_cute.attention(q, k, v, attn_mask=m)}
        backend = None
        for be, call in _sdpa(mask):
            try:
                call(q, k, v)
                fns[f"sdpa {be}"], backend = (lambda c=call: c(q, k, v)), be
                break
            except RuntimeError:
                continue
        if name == "causal":
            fns["kernel"] = lambda: ffpa_cute.attention(q, k, v, is_causal=True)
        if name == "images":   # each call's out and lse written apart, then copied in
            fns["ours, rows copied"] = _rows_copied(fns["ours"])
        if name == "shared":
            idx = keep[0].nonzero().squeeze(1).to(dev)
            ks, vs = k.index_select(2, idx), v.index_select(2, idx)
            fns["kernel"] = lambda: ffpa_cute.attention(q, ks, vs)
        err = {f: _err(fn(), ref) for f, fn in fns.items()}
        fwd = interleaved_ms(fns, dev, flush)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def train(fn_q):
            return lambda: fn_q(*leaves).backward(dout)
        trains = {"ours": train(lambda a, c, e, m=mask: ffpa_cute.attention(a, c, e,
                                                                            attn_mask=m))}
        if backend is not None:
            trains[f"sdpa {backend}"] = train(dict(_sdpa(mask))[backend])
        if name == "images":   # the key-run backward with each call's own dQ and Delta
            trains["ours, dQ per call"] = _per_call_dq(trains["ours"])
        for fn in trains.values():
            fn()
        both = interleaved_ms(trains, dev, flush)
        res[name] = dict(batch=b, seqlen=n, kept=kept, fwd_ms=fwd,
                         fwd_tflops={f: flops / t / 1e9 for f, t in fwd.items()},
                         fwd_bwd_ms=both,
                         fwd_bwd_tflops={f: 3.5 * flops / t / 1e9 for f, t in both.items()},
                         err=err, route=ffpa_cute.explain(q, k, v, attn_mask=mask)[:200])
        print(f"{name:7s} B {b} N {n} kept {kept / b / n:.3f}: fwd " + "  ".join(
            f"{f} {t:.3f} ms {flops / t / 1e9:.0f} TF err {err[f]:.1e}" for f, t in fwd.items())
            + " | fwd+bwd " + "  ".join(f"{f} {t:.3f} ms {3.5 * flops / t / 1e9:.0f} TF"
                                        for f, t in both.items()), flush=True)
        print(f"        route: {res[name]['route']}", flush=True)
    return res


def _per_call_dq(fn):
    """fn with the key-run backward's calls each zeroing, casting and computing their own dQ
    accumulator and Delta (dense_mask._shared_dq_width answering None): what sharing saves."""
    from ffpa_cute import dense_mask

    return _patched(fn, dense_mask, "_shared_dq_width", lambda plans: None)


def _rows_copied(fn):
    """fn with each forward call of the row runs writing its own out and lse, copied into the
    whole afterwards (launch._writable answering None): what writing in place saves."""
    from ffpa_cute import launch

    return _patched(fn, launch, "_writable", lambda plan, out, lse: (None, None))


def _patched(fn, module, name: str, value):
    """fn run with module.name set to value."""
    def call():
        saved = getattr(module, name)
        setattr(module, name, value)
        try:
            return fn()
        finally:
            setattr(module, name, saved)
    return call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m perf.dense_mask", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--cases", help="comma-separated subset of the cases (default: all)")
    ap.add_argument("--out", metavar="FILE")
    a = ap.parse_args(argv)
    res = dict(d=a.d, batch=a.batch, heads=a.heads, seqlen=a.seqlen,
               cases=run(a.d, a.batch, a.heads, a.seqlen,
                         a.cases.split(",") if a.cases else None))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
