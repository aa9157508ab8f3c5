"""Context-parallel attention benchmark: ring (or Ulysses) attention across torchrun ranks.

    torchrun --nproc-per-node=8 -m perf.context_parallel --seqlen 131072 --head-dim 512 --causal
    python -m perf.context_parallel --seqlen 16384 --head-dim 512 --causal       # world size 1
    torchrun --nproc-per-node=2 -m perf.context_parallel --device cpu --dtype fp64 \\
        --seqlen 48 --head-dim 16 --heads 2 --iters 1 --check                       # CPU, gloo

Without torchrun (no RANK in the environment) it runs as a world of one. Prints, per rank:
forward and backward time (median ms over --iters, after --warmup), TFLOPS per rank, and for the
ring the overlap figure: the same ring with no transfers (`ring.LocalComm`: each rank computes
exactly its blocks on its own shards), the transfers alone (the K/V shifts, and the backward's
dK / dV shifts), and the share of the transfer time hidden behind compute:
hidden = (compute + comm - ring) / comm. K/V bytes per step and the transfers' GB/s are printed
too (docs/design.md, "Context parallelism", compares them with the compute per step).

FLOPs are counted on the global problem, 4 * B * Hq * pairs * D forward (pairs: N^2, or
N (N + 1) / 2 causal) and 2.5x that backward, divided by the world size for the per-rank
figure. The ring is timed through `ring.ring_forward` / `ring.ring_backward` (the algorithm,
without the API's one cross-rank shape check). --check gathers out and the gradients and
compares them on rank 0 with single-device `ffpa_cute.attention` on the full sequence (relative
Frobenius error); --baseline times that single-device call on rank 0 (the per-GPU target).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from ffpa_cute import attention
from ffpa_cute.distributed import ring_attention, ulysses_attention
from ffpa_cute.distributed.layout import shard_sequence, unshard_sequence
from ffpa_cute.distributed.ring import (LocalComm, RingComm, ring_backward, ring_forward,
                                        schedule)
from ffpa_cute.reference import rel_err
from perf.flops import BWD_FACTOR, attn_flops_fwd, valid_pairs

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp64": torch.float64}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m perf.context_parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("ring", "ulysses"), default="ring")
    p.add_argument("--seqlen", type=int, default=131072, help="global sequence length N")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--iters", type=int, default=10, help="timed calls per measurement")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls before each measurement")
    p.add_argument("--no-backward", action="store_true", help="time the forward only")
    p.add_argument("--check", action="store_true",
                   help="compare with single-device attention on rank 0 (gathers everything)")
    p.add_argument("--baseline", action="store_true",
                   help="time single-device attention on the full sequence on rank 0")
    return p


def _setup(device_arg: str):
    """(device, group): the torchrun world, or a world of one without torchrun."""
    cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        if "RANK" in os.environ:
            dist.init_process_group(backend)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device, dist.group.WORLD


def _timed(fn, args, device, group, setup=None) -> float:
    """Median ms of fn() over args.iters calls after args.warmup; with a group, its ranks start
    each call together; `setup()` runs untimed before each call."""
    for _ in range(args.warmup):
        if setup is not None:
            setup()
        fn()
    times = []
    for _ in range(args.iters):
        if setup is not None:
            setup()
        if group is not None:
            dist.barrier(group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _inputs(args, rank, world, device, layout):
    """Local shards (and, with --check or --baseline, the full tensors they come from)."""
    dtype = DTYPES[args.dtype]
    hkv = args.kv_heads or args.heads
    shapes = [(args.batch, h, args.seqlen, args.head_dim) for h in (args.heads, hkv, hkv,
                                                                     args.heads)]
    if args.check or args.baseline:
        gen = torch.Generator(device=device).manual_seed(0)  # the same full tensors everywhere
        full = [torch.randn(s, generator=gen, device=device, dtype=dtype) for s in shapes]
        local = [shard_sequence(t, rank, world, layout=layout).contiguous() for t in full]
        return local, full
    gen = torch.Generator(device=device).manual_seed(1 + rank)
    n = args.seqlen // world
    local = [torch.randn(s[:2] + (n, s[3]), generator=gen, device=device, dtype=dtype)
             for s in shapes]
    return local, None


def _ring_times(args, q, k, v, dout, device, group):
    """Ring forward / backward with and without transfers, and the transfers alone (ms)."""
    ring = RingComm(group)
    local = LocalComm(ring.rank, ring.world)
    kw = dict(causal=args.causal, scale=None)
    out, lse = ring_forward(q, k, v, ring, **kw)
    t = {"fwd": _timed(lambda: ring_forward(q, k, v, ring, **kw), args, device, group),
         "fwd_compute": _timed(lambda: ring_forward(q, k, v, local, **kw), args, device, group)}
    bufs = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(2)]

    def kv_shifts():
        kv = (k, v)
        for step in range(ring.world - 1):
            kv = ring.shift(kv, bufs[step % 2], tag=0).wait()

    t["fwd_comm"] = _timed(kv_shifts, args, device, group)
    if not args.no_backward:
        grads = [(torch.empty(k.shape, dtype=torch.float32, device=device),
                  torch.empty(v.shape, dtype=torch.float32, device=device)) for _ in range(3)]

        def bwd_shifts():
            kv_shifts()
            for step in range(ring.world if ring.world > 1 else 0):
                ring.shift(grads[2], grads[step % 2], tag=2).wait()

        t["bwd"] = _timed(lambda: ring_backward(q, k, v, out, lse, dout, ring, **kw), args,
                          device, group)
        t["bwd_compute"] = _timed(lambda: ring_backward(q, k, v, out, lse, dout, local, **kw),
                                  args, device, group)
        t["bwd_comm"] = _timed(bwd_shifts, args, device, group)
    return t


def _ulysses_times(args, q, k, v, dout, device, group):
    kw = dict(is_causal=args.causal, enable_gqa=q.shape[1] != k.shape[1])
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    outs = []

    def fwd():
        with torch.no_grad():
            ulysses_attention(q, k, v, group, **kw)

    t = {"fwd": _timed(fwd, args, device, group)}
    if not args.no_backward:
        t["bwd"] = _timed(lambda: outs.pop().backward(dout), args, device, group,
                          setup=lambda: outs.append(ulysses_attention(*leaves, group, **kw)))
    return t


def _check(args, local, full, device, group, layout):
    """Relative errors of the gathered out / dq / dk / dv against single-device attention."""
    q, k, v, dout = (t.detach().requires_grad_(i < 3) for i, t in enumerate(local))
    kw = dict(is_causal=args.causal, enable_gqa=q.shape[1] != k.shape[1])
    if args.mode == "ulysses":
        out = ulysses_attention(q, k, v, group, layout=layout, **kw)
    else:
        out = ring_attention(q, k, v, group, **kw)
    out.backward(dout)
    world = dist.get_world_size(group)
    gathered = []
    for t in (out, q.grad, k.grad, v.grad):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.contiguous(), group=group)
        gathered.append(unshard_sequence(parts, layout=layout))
    if dist.get_rank(group) != 0:
        return None
    leaves = [t.detach().clone().requires_grad_() for t in full[:3]]
    ref = attention(*leaves, **kw)
    ref.backward(full[3])
    names = ("out", "dq", "dk", "dv")
    return {n: rel_err(g, r) for n, g, r in zip(names, gathered, [ref] + [t.grad
                                                                         for t in leaves])}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    device, group = _setup(args.device)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout = "zigzag" if args.mode == "ring" else "contiguous"
    (q, k, v, dout), full = _inputs(args, rank, world, device, layout)
    n = q.shape[-2]
    times = (_ring_times if args.mode == "ring" else _ulysses_times)(args, q, k, v, dout, device,
                                                                     group)
    flops = attn_flops_fwd(args.batch, args.heads, args.seqlen, args.seqlen, args.head_dim,
                           args.causal) / world
    stats = {"rank": rank, **times,
             "fwd_tflops": flops / (times["fwd"] * 1e-3) / 1e12}
    if "bwd" in times:
        stats["bwd_tflops"] = BWD_FACTOR * flops / (times["bwd"] * 1e-3) / 1e12
    if args.mode == "ring":
        stats["pairs"] = sum(valid_pairs(r.stop - r.start, c.stop - c.start, blk_causal, off)
                             for s in range(world)
                             for r, c, blk_causal, off in schedule(rank, (rank - s) % world,
                                                                   n, n, args.causal))
        for d in ("fwd", "bwd"):
            if d in times and world > 1:
                comm = times[f"{d}_comm"]
                hidden = (times[f"{d}_compute"] + comm - times[d]) / comm if comm > 0 else 1.0
                stats[f"{d}_hidden"] = max(0.0, min(1.0, hidden))
        step_bytes = 2 * k.numel() * k.element_size()
        stats["kv_bytes_per_step"] = step_bytes
        if world > 1:
            stats["kv_gbps"] = step_bytes * (world - 1) / (times["fwd_comm"] * 1e-3) / 1e9
    if args.check:
        errs = _check(args, (q, k, v, dout), full, device, group, layout)
        if errs is not None:
            stats["check"] = errs
    if args.baseline and rank == 0:
        leaves = [t.detach().requires_grad_() for t in full[:3]]
        kw = dict(is_causal=args.causal, enable_gqa=args.heads != (args.kv_heads or args.heads))
        t_solo = _timed(lambda: attention(*full[:3], **kw), args, device, None)
        stats["single_fwd_tflops"] = flops * world / (t_solo * 1e-3) / 1e12
        if not args.no_backward:
            outs = []
            t_bwd = _timed(lambda: outs.pop().backward(full[3]), args, device, None,
                           setup=lambda: outs.append(attention(*leaves, **kw)))
            stats["single_bwd_tflops"] = BWD_FACTOR * flops * world / (t_bwd * 1e-3) / 1e12
    every = [None] * world
    dist.all_gather_object(every, stats, group=group)
    if rank == 0:
        _print(args, world, device, every)
    return stats


def _print(args, world, device, every) -> None:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{args.mode} attention: B={args.batch} Hq={args.heads} "
          f"Hkv={args.kv_heads or args.heads} N={args.seqlen} D={args.head_dim} "
          f"{'causal' if args.causal else 'full'} {args.dtype}, world {world}, {gpu}")
    for s in every:
        line = f"rank {s['rank']}: fwd {s['fwd']:.2f} ms {s['fwd_tflops']:.4g} TFLOPS"
        if "bwd" in s:
            line += f" | bwd {s['bwd']:.2f} ms {s['bwd_tflops']:.4g} TFLOPS"
        if "fwd_compute" in s:
            line += (f" | compute only fwd {s['fwd_compute']:.2f}"
                     + (f" bwd {s['bwd_compute']:.2f}" if "bwd_compute" in s else "")
                     + f" ms, comm only fwd {s['fwd_comm']:.2f}"
                     + (f" bwd {s['bwd_comm']:.2f}" if "bwd_comm" in s else "") + " ms")
        for d in ("fwd", "bwd"):
            if f"{d}_hidden" in s:
                line += f", {d} comm hidden {100 * s[f'{d}_hidden']:.0f}%"
        if "pairs" in s:
            line += f", pairs {s['pairs']}"
        print(line)
    s0 = every[0]
    if "kv_bytes_per_step" in s0:
        print(f"K/V per ring step: {s0['kv_bytes_per_step'] / 2**20:.1f} MiB"
              + (f", {s0['kv_gbps']:.1f} GB/s measured" if "kv_gbps" in s0 else ""))
    if "single_fwd_tflops" in s0:
        line = f"single device, full sequence: fwd {s0['single_fwd_tflops']:.4g} TFLOPS"
        if "single_bwd_tflops" in s0:
            line += f", bwd {s0['single_bwd_tflops']:.4g} TFLOPS"
        ratio = statistics.mean(s["fwd_tflops"] for s in every) / s0["single_fwd_tflops"]
        print(line + f"; ring fwd per rank / single = {100 * ratio:.0f}%")
    if "check" in s0:
        print("check vs single device (relative error): "
              + ", ".join(f"{k} {v:.2e}" for k, v in s0["check"].items()))


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
