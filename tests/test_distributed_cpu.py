"""Context parallelism on the CPU: 2 and 3 gloo processes, float64 through the fallback.

Each world size is spawned once (process start-up dominates the cost) and runs every case in
`CASES`; a case's result per rank ("ok" or the traceback) comes back through a JSON file and is
asserted by its own test. Every case does all its collectives before asserting, so a failing
check on one rank cannot leave the others waiting.

The truth is `reference.attention_ref` in float64 on the full sequence (the same seeded tensors
on every rank), autograd for the gradients; each rank compares its own shard of out, lse, dq,
dk, dv (relative error <= 1e-12), and the shards gathered and unsharded must equal the full
out. The kernel route is exercised with the fake kernels of `fake_kernels` (dispatch plans a
"kernel" for every block: kernel_forward with each block's causal offset, run_bwd with the
global out and lse).
"""

from __future__ import annotations

import datetime
import json
import logging
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fake_kernels  # tests/ is on sys.path (also in the spawned processes: sys.path is sent)
from ffpa_cute.distributed import (ring_attention, shard_sequence, ulysses_attention,
                                   unshard_sequence)
from ffpa_cute.reference import attention_ref, rel_err

F64 = torch.float64
WORLDS = (2, 3)
TOL = 1e-12


def full_inputs(hq, hkv, nq, nkv, d=16, dv=24, seed=0):
    """The same q, k, v, out-gradient and lse-gradient on every rank."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((2, hq, nq, d), (2, hkv, nkv, d), (2, hkv, nkv, dv), (2, hq, nq, dv), (2, hq, nq))
    return [torch.randn(s, generator=gen, dtype=F64) for s in shapes]


def check_parallel(fn, rank, world, *, hq, hkv, nq, nkv, causal, layout, group=None, **kw):
    """fn's shards of out / lse / grads (of a loss through out and lse) against the float64
    reference on the full sequence."""
    q, k, v, g, h = full_inputs(hq, hkv, nq, nkv)

    def shard(t):
        return shard_sequence(t, rank, world, layout=layout)

    local = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    if fn is ulysses_attention:
        kw["layout"] = layout
    out, lse = fn(*local, group, is_causal=causal, enable_gqa=hq != hkv, return_lse=True, **kw)
    ((out * shard(g)).sum() + (lse * shard(h.unsqueeze(-1)).squeeze(-1)).sum()).backward()
    parts = [torch.empty_like(out) for _ in range(world)]
    dist.all_gather(parts, out.detach(), group=group)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attention_ref(*leaves, causal=causal, causal_offset=0 if causal else None,
                                 scale=kw.get("scale"))
    ((ref * g).sum() + (ref_lse * h).sum()).backward()
    assert out.dtype == F64 and lse.dtype == F64 and lse.requires_grad
    assert rel_err(unshard_sequence(parts, layout=layout), ref) <= TOL
    for name, got, want in (("out", out, ref), ("lse", lse.unsqueeze(-1), ref_lse.unsqueeze(-1)),
                            ("dq", local[0].grad, leaves[0].grad),
                            ("dk", local[1].grad, leaves[1].grad),
                            ("dv", local[2].grad, leaves[2].grad)):
        err = rel_err(got, shard(want))
        assert err <= TOL, f"{name}: relative error {err:.3g}"


# ---------------------------------------------------------------------------------- cases


def ring_causal_gqa(rank, world):
    check_parallel(ring_attention, rank, world, hq=4, hkv=2, nq=10 * world, nkv=10 * world,
                   causal=True, layout="zigzag")


def ring_causal_mqa_odd_chunks(rank, world):
    """Chunks of 3 rows (odd), MQA."""
    check_parallel(ring_attention, rank, world, hq=3, hkv=1, nq=6 * world, nkv=6 * world,
                   causal=True, layout="zigzag", scale=0.3)


def ring_full(rank, world):
    """Not causal, Nq != Nkv both ways (cross attention), contiguous shards."""
    for nq, nkv in ((7, 5), (3, 8)):
        check_parallel(ring_attention, rank, world, hq=3, hkv=3, nq=nq * world,
                       nkv=nkv * world, causal=False, layout="contiguous")


def ring_full_gqa_zigzag(rank, world):
    check_parallel(ring_attention, rank, world, hq=4, hkv=2, nq=8 * world, nkv=8 * world,
                   causal=False, layout="zigzag")


def ring_kernel_route(rank, world):
    """Every block through the (fake) kernel path: offsets, slices, global out/lse passed."""
    with fake_kernels.installed() as fake:
        check_parallel(ring_attention, rank, world, hq=4, hkv=2, nq=6 * world, nkv=6 * world,
                       causal=True, layout="zigzag")
    assert len(fake.fwd_calls) == world and len(fake.bwd_calls) == world
    first = fake.fwd_calls[0]
    assert first.causal and first.causal_offset == 0 and first.seqlen_q == 6  # local rows
    assert all(not p.causal for p in fake.fwd_calls[1:])  # later steps: two 3 x 3 chunk pairs
    assert [p.seqlen_q * p.seqlen_kv for p in fake.bwd_calls[1:]] == [18] * (world - 1)


def ring_subgroup(rank, world):
    """A group of ranks 1..W-1 (group ranks differ from global ranks; W=2: a world of one)."""
    group = dist.new_group(list(range(1, world)))
    if rank == 0:
        return
    check_parallel(ring_attention, rank - 1, world - 1, hq=2, hkv=1, nq=4 * (world - 1),
                   nkv=4 * (world - 1), causal=True, layout="zigzag", group=group)


def ulysses_causal(rank, world):
    check_parallel(ulysses_attention, rank, world, hq=6, hkv=6, nq=5 * world, nkv=5 * world,
                   causal=True, layout="contiguous")


def ulysses_mqa_zigzag(rank, world):
    """One K/V head for W ranks (repeated), the zig-zag layout the ring uses."""
    check_parallel(ulysses_attention, rank, world, hq=6, hkv=1, nq=4 * world, nkv=4 * world,
                   causal=True, layout="zigzag")


def ulysses_gqa_full(rank, world):
    check_parallel(ulysses_attention, rank, world, hq=2 * world, hkv=world, nq=3 * world,
                   nkv=5 * world, causal=False, layout="contiguous")


def _raises(exc, match, fn, *args, **kw):
    with pytest.raises(exc, match=match):
        fn(*args, **kw)


def errors(rank, world):
    """Bad shards raise the same clear error on every rank (no hang)."""
    q, k, v, *_ = full_inputs(6, 1, 4 + 2 * rank, 4 + 2 * rank)  # uneven lengths
    for fn in (ring_attention, ulysses_attention):
        _raises(ValueError, "uneven shard lengths across ranks", fn, q, k, v, is_causal=True,
                enable_gqa=True)
    q, k, v, *_ = full_inputs(4, 2, 6, 6, seed=1)
    q, k, v, *_ = full_inputs(6, 3, 6, 6, seed=2)  # K/V heads 1, 2, 3 on ranks 0, 1, 2
    _raises(ValueError, "differ across ranks", ring_attention, q, k[:, :rank + 1],
            v[:, :rank + 1], enable_gqa=True)
    _raises(ValueError, "one even local length", ring_attention, q[..., :5, :], k[..., :5, :],
            v[..., :5, :], is_causal=True, enable_gqa=True)
    _raises(TypeError, "share one dtype", ring_attention, q, k.float(), v, enable_gqa=True)
    _raises(ValueError, r"4-D", ring_attention, q[0], k[0], v[0], enable_gqa=True)
    _raises(TypeError, "group must be None", ring_attention, q, k, v, "world", enable_gqa=True)
    _raises(TypeError, "return_lse must be a bool", ring_attention, q, k, v, enable_gqa=True,
            return_lse=1)
    _raises(ValueError, rf"q heads \({world + 1}\) divisible by the world size \({world}\)",
            ulysses_attention, *full_inputs(world + 1, 1, 6, 6)[:3], enable_gqa=True)
    _raises(ValueError, "layout='ring'", ulysses_attention, q, k, v, enable_gqa=True,
            layout="ring")


def perf_smoke(rank, world):
    """python -m perf.context_parallel on this gloo world (tiny, float64, --check)."""
    from perf import context_parallel

    for mode in ("ring", "ulysses"):
        stats = context_parallel.main(
            ["--mode", mode, "--device", "cpu", "--dtype", "fp64", "--seqlen", str(12 * world),
             "--head-dim", "16", "--heads", str(world), "--kv-heads", "1", "--causal",
             "--iters", "1", "--warmup", "0", "--check"])
        assert stats["fwd"] > 0 and stats["bwd"] > 0 and stats["fwd_tflops"] > 0
        if rank == 0:
            assert all(e <= TOL for e in stats["check"].values()), stats["check"]
        if mode == "ring":
            n = 12 * world
            assert stats["pairs"] * world == n * (n + 1) // 2  # balanced: the same per rank
            assert 0 <= stats["fwd_hidden"] <= 1 and stats["kv_bytes_per_step"] == 2 * 12 * 16 * 8


CASES = {f.__name__: f for f in (ring_causal_gqa, ring_causal_mqa_odd_chunks, ring_full,
                                 ring_full_gqa_zigzag, ring_kernel_route, ring_subgroup,
                                 ulysses_causal, ulysses_mqa_zigzag, ulysses_gqa_full, errors,
                                 perf_smoke)}


def _worker(rank, world, init_file, result_file):
    torch.set_num_threads(1)
    logging.getLogger("ffpa_cute").setLevel(logging.ERROR)  # the CPU fallback's notice
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, case in CASES.items():
        try:
            case(rank, world)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    dist.destroy_process_group()
    with open(f"{result_file}.{rank}", "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{world: [per-rank {case: "ok" | traceback}]}, one spawn per world size."""
    out = {}
    for world in WORLDS:
        path = tmp_path_factory.mktemp(f"gloo{world}")
        mp.spawn(_worker, args=(world, str(path / "init"), str(path / "result")), nprocs=world)
        out[world] = [json.loads((path / f"result.{r}").read_text()) for r in range(world)]
    return out


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world", WORLDS)
def test_context_parallel(results, world, case):
    for rank, res in enumerate(results[world]):
        assert res[case] == "ok", f"rank {rank} of {world}:\n{res[case]}"
