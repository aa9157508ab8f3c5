"""How fast CTAs of a cluster move bytes into each other's shared memory when every SM does it:
the rate that bounds the backward's designs past the L2 limit (docs/design.md section 4, "Past
the L2 limit": D over four CTAs needs ~72 KB each way per block and CTA, the fused kernel's
pair exchanges 32 KB and was measured at 9.4-14.1 B / clock per direction with its schedule
around it).

    python -m perf.dsmem_limits --precompile DIR    # CPU: compile the variants into a cache
    python -m perf.dsmem_limits [--out FILE]        # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

`DsmemBench`: clusters of `cluster` CTAs (one CTA per SM: its smem keeps a second off); each
CTA sends `kb` KB per step into the next CTA of its cluster (rank r -> r + 1 mod cluster) by
16-byte `st.async` from all 128 threads, counted on the receiver's "full" mbarrier of the
step's buffer (`bufs` of them), and receives as much from the previous one; a receiver frees
a buffer by a cluster-scope arrival on its sender's "empty" barrier once the bytes landed, and
a sender writes buffer b again only after that (the fused backward's x_full / x_empty
hand-over). Each CTA stamps clock64 around its `steps` steps: B / clock per SM in each
direction from the SM's own cycles; TB/s over the chip from the wall time. Varied: the
cluster size (2, 4), the message size, the buffers in flight, the CTAs (2-132).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import nvvm

from ffpa_cute.common.tensors import KernelEntry, fake_tensor
from perf import experiment

THREADS = 128
SMEM_FLOOR = 120 * 1024   # each CTA's smem at least this: one CTA per SM


@dataclasses.dataclass(frozen=True)
class DsmemConfig:
    """arch; cluster: CTAs per cluster (2 or 4); kb: KB sent per step (a multiple of 2: 16
    bytes per thread per store); bufs: receive buffers in flight; steps per CTA."""

    arch: str = "sm_90a"
    cluster: int = 2
    kb: int = 32
    bufs: int = 2
    steps: int = 256

    KERNEL: ClassVar[str] = "perf.dsmem_limits:DsmemBench"

    @property
    def stores(self) -> int:
        """16-byte st.async per thread and step."""
        return self.kb * 1024 // (16 * THREADS)


class DsmemBench(KernelEntry):
    """The DSMEM microbenchmark (module docstring): clocks [CTAs, 2] int64 (each CTA's first
    and last stamp); grid = clocks' rows (a multiple of the cluster size)."""

    OPERANDS = ("clocks",)
    SCALARS = ()

    @staticmethod
    def fake_inputs(cfg):
        return (fake_tensor(Int64, 2, 2),)

    def __init__(self, cfg: DsmemConfig):
        if (cfg.cluster not in (2, 4) or cfg.kb % 2 or not 2 <= cfg.kb <= 48
                or not 1 <= cfg.bufs <= 4 or cfg.kb * cfg.bufs > 96):
            raise ValueError(f"DsmemBench: cluster {cfg.cluster} (2 or 4), kb {cfg.kb} (even, "
                             f"2-48), bufs {cfg.bufs} (1-4, kb x bufs <= 96)")
        self.cfg = cfg

    @cute.jit
    def __call__(self, mClk: cute.Tensor, stream: cuda.CUstream):
        cfg = self.cfg
        # receive buffers: value e of a thread's store q at [e, thread, q, buffer]
        r_layout = cute.make_layout((4, THREADS, cfg.stores, cfg.bufs),
                                    stride=(1, 4, 4 * THREADS, 4 * THREADS * cfg.stores))
        smem = max(cfg.bufs * cfg.kb * 1024 + 1024, SMEM_FLOOR)
        self.kernel(mClk, r_layout).launch(grid=(mClk.shape[0], 1, 1), block=[THREADS, 1, 1],
                                           smem=smem, stream=stream, min_blocks_per_mp=1,
                                           cluster=[cfg.cluster, 1, 1])

    @cute.kernel
    def kernel(self, mClk: cute.Tensor, r_layout: cute.Layout):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        rank = cta % cfg.cluster
        dst = (rank + 1) % cfg.cluster          # the CTA this one sends to
        src = (rank + cfg.cluster - 1) % cfg.cluster   # and the one it receives from
        alloc = cutlass.memory.SmemAllocator()
        full = alloc.allocate_array(Int64, cfg.bufs)
        empty = alloc.allocate_array(Int64, cfg.bufs)
        recv = alloc.allocate_tensor(Int32, r_layout, byte_alignment=1024)
        if tidx == 0:
            for b in cutlass.range_constexpr(cfg.bufs):
                cute.arch.mbarrier_init(full + b, 1)    # our arrival (+ the sender's bytes)
                cute.arch.mbarrier_init(empty + b, 1)   # the receiver's arrival
            cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive()   # every barrier exists before anything reaches it
        cute.arch.cluster_wait()
        t0 = cute.arch.clock64()
        for i in cutlass.range(cfg.steps, unroll=1):
            b = i % cfg.bufs
            if i >= cfg.bufs:   # the receiver freed buffer b (step i - bufs)
                cute.arch.mbarrier_wait(empty + b, (i // cfg.bufs - 1) & 1)
            if tidx == 0:       # our buffer b expects the sender's bytes of this step
                cute.arch.mbarrier_arrive_and_expect_tx(full + b, cfg.kb * 1024)
            for q in cutlass.range_constexpr(cfg.stores):
                cute.arch.store_async_dsmem(recv[None, tidx, q, b].iterator,
                                            (Int32(i), Int32(q), Int32(tidx), Int32(b)),
                                            full + b, dst)
            cute.arch.mbarrier_wait(full + b, (i // cfg.bufs) & 1)   # its bytes landed
            cute.arch.barrier()
            if tidx == 0:       # the sender may write buffer b again
                cute.arch.mbarrier_arrive(empty + b, src, scope=nvvm.MemScopeKind.CLUSTER)
        t1 = cute.arch.clock64()
        cute.arch.cluster_arrive()   # no CTA leaves while a peer may still write its smem
        cute.arch.cluster_wait()
        if tidx == 0:
            mClk[cta, 0] = t0
            mClk[cta, 1] = t1


def variants() -> dict:
    """{label: (config, CTAs)}."""
    out = {}
    for ctas in (2, 16, 132):
        for kb in (8, 16, 32):
            out[f"pair, {kb} KB x 2, {ctas} CTAs"] = (DsmemConfig(kb=kb), ctas)
    out["pair, 32 KB x 1, 132 CTAs"] = (DsmemConfig(kb=32, bufs=1), 132)
    out["pair, 16 KB x 4, 132 CTAs"] = (DsmemConfig(kb=16, bufs=4), 132)
    for ctas in (4, 132):
        out[f"ring of 4, 32 KB x 2, {ctas} CTAs"] = (DsmemConfig(cluster=4, kb=32), ctas)
    return out


def jobs() -> list:
    return experiment.bench_jobs(DsmemBench, (v[0] for v in variants().values()))


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute.launch import jit_cache

    res = {}
    for label, (cfg, ctas) in variants().items():
        ctas -= ctas % cfg.cluster
        clk = torch.zeros(ctas, 2, device=dev, dtype=torch.int64)
        fn = jit_cache().get(DsmemBench, cfg)
        # each CTA sends steps x kb KB, and receives as much
        r = res[label] = experiment.stamped_rate(lambda: fn(clk), clk,
                                                 cfg.steps * cfg.kb * 1024, dev, flush)
        print(f"{label:36s} {r['bytes_per_clock_sm']:6.1f} B/clk/SM each way "
              f"{r['tb_per_s']:6.2f} TB/s  ({r['ms']:.3f} ms)", flush=True)
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.dsmem_limits", __doc__, jobs, run))
