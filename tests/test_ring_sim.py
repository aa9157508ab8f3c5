"""The ring algorithm with W ranks simulated by W threads of one process (`ThreadComm`: the
ring's shifts through queues), so it runs on the kernel path of a single GPU as well as on CPU.

`ring.ring_forward` / `ring.ring_backward` take the communication as an object; here each thread
is one rank, its shifts hand copies of the tensors to the next thread. This checks the ring's
block schedule, offsets, merges and the dK / dV accumulators on real kernels where only one GPU
exists (@gpu), and costs no process start-up on CPU. torch.distributed itself is covered by
tests/test_distributed_cpu.py (gloo) and, for a world of one on the GPU, by
`test_world_of_one_nccl`.
"""

from __future__ import annotations

import queue
import threading

import pytest
import torch

import fake_kernels  # tests/ is on sys.path
import ffpa_cute
from ffpa_cute import attention
from ffpa_cute.distributed import ring_attention, shard_sequence, unshard_sequence
from ffpa_cute.distributed.ring import ring_backward, ring_forward
from ffpa_cute.reference import attention_ref, attention_same_dtype, rel_err


class ThreadComm:
    """Rank `rank` of a ring of threads: `shift` puts copies of the tensors in the next rank's
    inbox (per tag) and returns a handle that copies the previous rank's message into `into`."""

    def __init__(self, boxes, rank, world):
        self.boxes, self.rank, self.world = boxes, rank, world

    def shift(self, tensors, into, tag):
        self.boxes[(self.rank + 1) % self.world][tag].put([t.clone() for t in tensors])
        return _Pending(self.boxes[self.rank][tag], into)


class _Pending:
    def __init__(self, box, into):
        self.box, self.into = box, into

    def wait(self):
        for dst, src in zip(self.into, self.box.get(timeout=120)):
            dst.copy_(src)
        return self.into


def run_ring(q, k, v, dout, world, causal, scale=None):
    """Full-sequence q, k, v, dout -> (out, lse, dq, dk, dv) gathered from `world` simulated
    ranks on zig-zag shards."""
    boxes = [{0: queue.Queue(), 2: queue.Queue()} for _ in range(world)]
    results, errors = [None] * world, []

    def rank_main(r):
        try:
            comm = ThreadComm(boxes, r, world)
            ql, kl, vl, dl = (shard_sequence(t, r, world) for t in (q, k, v, dout))
            out, lse = ring_forward(ql, kl, vl, comm, causal=causal, scale=scale)
            grads = ring_backward(ql, kl, vl, out, lse, dl, comm, causal=causal, scale=scale)
            results[r] = (out, lse.unsqueeze(-1), *grads)
        except Exception as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    full = [unshard_sequence([res[i] for res in results]) for i in range(5)]
    full[1] = full[1].squeeze(-1)
    return full


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("route", ["fallback", "kernel"])
def test_threads_ring_cpu(seed, monkeypatch, world, causal, route):
    if route == "kernel":
        fake_kernels.install(monkeypatch)
    n = 2 * world * 5
    q, k, v, dout = (torch.randn(2, h, n, d, dtype=torch.float64)
                     for h, d in ((4, 16), (2, 16), (2, 24), (4, 24)))
    got = run_ring(q, k, v, dout, world, causal, scale=0.4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*leaves, causal=causal, causal_offset=0, scale=0.4)
    ref.backward(dout)
    for g, w in zip(got, (ref, ref_lse, *(t.grad for t in leaves))):
        assert rel_err(g, w) <= 1e-12


# ------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@pytest.mark.parametrize("world,d,hq,hkv,n", [(2, 512, 8, 2, 2048), (4, 512, 4, 1, 4096),
                                             (3, 1024, 2, 2, 1530)])
def test_threads_ring_kernels(seed, world, d, hq, hkv, n):
    """Simulated ranks on one GPU, causal zig-zag, every block on the kernels: out, lse and
    gradients against float64 within the bf16 criterion (2x same-dtype torch + 1e-3)."""
    from ffpa_cute import dispatch
    from ffpa_cute.problem import AttnProblem

    bf16 = torch.bfloat16
    q, k, v, dout = (torch.randn(1, h, n, d, device="cuda", dtype=bf16)
                     for h in (hq, hkv, hkv, hq))
    c = n // (2 * world)
    p = AttnProblem.from_tensors(q[:, :, :2 * c], k[:, :, :c], v[:, :, :c])
    assert dispatch.plan_fwd(p).reason is None and dispatch.plan_bwd(p).reason is None
    got = run_ring(q, k, v, dout, world, causal=True)
    torch.cuda.synchronize()
    grads = {}
    for name, fn, cast in (("ref", attention_ref, torch.float64), ("base", attention_same_dtype,
                                                                   bf16)):
        leaves = [t.to(cast).requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves, causal=True, causal_offset=0)
        out.backward(dout.to(cast))
        grads[name] = [out, lse, *(t.grad for t in leaves)]
    names = ("out", "lse", "dq", "dk", "dv")
    for name, g, r, b in zip(names, got, grads["ref"], grads["base"]):
        if name == "lse":
            assert (g.double() - r).abs().max().item() <= 2e-3
            continue
        err, base = rel_err(g, r), rel_err(b, r)
        assert err <= 2 * base + 1e-3, f"{name}: {err:.3g} vs torch {base:.3g}"


@pytest.mark.gpu
def test_world_of_one_nccl(seed):
    """ring_attention through torch.distributed (NCCL) with a world of one: the same results
    as attention() on the same sequence (one causal block on the same kernels: the same bits
    forward, and backward up to the float32 round trip of the accumulators). The backward is
    pinned to the atomic-free kernels (`deterministic`, the process default: autograd's thread
    plans with it): the fused default's dQ differs run to run by ~2e-5, more than the
    round trip this test bounds."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    previous = ffpa_cute.options.set_default(deterministic=True)
    try:
        q, k, v = (torch.randn(1, h, 2000, 512, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for h in (8, 2, 2))
        out, lse = ring_attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
        out.sum().backward()
        grads = [t.grad.clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        ref, ref_lse = attention(q, k, v, is_causal=True, enable_gqa=True, return_lse=True)
        ref.sum().backward()
        assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
        for g, t in zip(grads, (q, k, v)):
            assert rel_err(g, t.grad) <= 1e-6
    finally:
        ffpa_cute.options.set_default(previous)
        dist.destroy_process_group()
