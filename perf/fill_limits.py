"""How fast TMA fills an SM's shared memory from L2, alone and multicast over a CTA pair: is
the ~41 B / clock per SM that bounds the D=512 forward (perf-log sessions 2 and 15) the L2's
or the SM's? (issue 20; the gate before a producer warpgroup with K / V multicast.)

    python -m perf.fill_limits --precompile DIR    # CPU: compile the variants into a cache
    python -m perf.fill_limits [--out FILE]        # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)
    FILL_ONLY="mcast 2, 4 stages, 132 CTAs" python -m perf.fill_limits   # one variant

`FillBench`: each CTA (one per SM: its smem keeps a second off) receives `chunks` chunks of
[128 x 64] bf16 (16 KB, the forward's K chunk) into a ring of `stages` stages from an 8 MB
L2-resident source (every CTA reads the same chunks, as the row tiles of one head read its K
and V), one warp doing what a producer and a consumer with no compute would:
  mcast 1  each CTA loads every chunk itself: a stage is refilled as soon as its chunk landed;
  mcast 2  a 2-CTA cluster; chunk p is loaded once, by CTA p % 2, into the same stage of both
           CTAs (`mcast_mask` 0b11), so the L2 serves half the bytes each SM receives; before
           refilling a stage its loader waits on its "empty" barrier for both CTAs' releases
           (one local and one remote `mbarrier.arrive`), each CTA expecting the chunk's bytes
           on its own "full" barrier;
  cluster  mcast 1 launched as 2-CTA clusters (what the cluster launch alone costs).
Each CTA stamps clock64 before its first load and after its last chunk landed; B / clock per
SM counts the bytes each SM receives. Varied: the CTAs (132, 66) and the ring's depth (2-6
stages: 32-96 KB in flight per SM). The CTA is one warp and the whole warp walks the ring:
the TMA copy elects its issuing lane by `elect.sync` over the full warp, which deadlocks when
the other lanes wait at the closing cluster barrier (the first version's clustered variants
hung that way).
Prediction (first version): if the L2's output (~10 TB/s over the chip at 41 B / clock / SM)
is the limit, mcast 2 delivers up to ~2x per SM; if the SM's ingress is, both read ~41. First
run (H100, perf-log 2026-12-06): alone 50.0 B / clock at 2 stages on 66 CTAs, 64.5 at 4 stages
on 132 (so 41 is neither limit for this pattern); the clustered variants hung (fixed above).
For the rerun: the solo rate grows with the bytes in flight (Little's law: ~1000 clocks of
latency at 4 stages) up to an L2 or SM limit; mcast 2 matches it at the same depth where
latency sets the rate and exceeds it where the L2's output does. Rerun (H100, perf-log
2026-12-06 session 31; B / clock per SM received, 132 CTAs): alone 2 / 3 / 4 / 5 / 6 stages 48 /
60 / 68 / 63 / 64; cluster 2 / 4 / 6 stages 47 / 56 / 56; mcast 2 41 / 46 / 46 (66 CTAs: alone 4
stages 75, mcast 2 46). Multicast delivers less per SM than each CTA loading its own copy.
"""

from __future__ import annotations

import dataclasses
import os
from typing import ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from ffpa_cute.common.tensors import KernelEntry, fake_tensor
from perf import experiment

ROWS, COLS = 128, 64          # a chunk: [128 x 64] bf16, 16 KB
SRC_ROWS, SRC_COLS = 8192, 512   # the source: 8 MB, 512 chunks
CHUNK_BYTES = ROWS * COLS * 2
SMEM_FLOOR = 120 * 1024       # each CTA's smem at least this: one CTA per SM


@dataclasses.dataclass(frozen=True)
class FillConfig:
    """arch; mcast: CTAs a chunk is multicast to (1 or 2); stages: the ring's depth; chunks
    per CTA; cluster: launch 2-CTA clusters (always with mcast 2)."""

    arch: str = "sm_90a"
    mcast: int = 1
    stages: int = 4
    chunks: int = 2048
    cluster: bool = False

    KERNEL: ClassVar[str] = "perf.fill_limits:FillBench"


class FillBench(KernelEntry):
    """The fill microbenchmark (module docstring): src [8192, 512] bf16, clocks [CTAs, 2] int64
    (each CTA's first and last stamp); grid = clocks' rows."""

    OPERANDS = ("src", "clocks")
    SCALARS = ()

    @staticmethod
    def fake_inputs(cfg):
        return fake_tensor(BFloat16, 2, 8), fake_tensor(Int64, 2, 2)

    def __init__(self, cfg: FillConfig):
        if (cfg.mcast not in (1, 2) or not 2 <= cfg.stages <= 6 or cfg.chunks % 2
                or cfg.stages % cfg.mcast):
            raise ValueError(f"FillBench: mcast {cfg.mcast} (1 or 2), stages {cfg.stages} "
                             f"(2-6, a multiple of mcast: each stage has one loader), chunks "
                             f"{cfg.chunks} (even)")
        self.cfg = cfg
        self.clustered = cfg.cluster or cfg.mcast == 2

    @cute.jit
    def __call__(self, mSrc: cute.Tensor, mClk: cute.Tensor, stream: cuda.CUstream):
        cfg = self.cfg
        layout = cute.make_layout((ROWS, COLS, cfg.stages), stride=(COLS, 1, ROWS * COLS))
        op = (cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(cfg.mcast == 2)
              else cpasync.CopyBulkTensorTileG2SOp())
        tma = cpasync.make_tiled_tma_atom(op, mSrc, cute.select(layout, mode=[0, 1]),
                                          (ROWS, COLS))
        smem = max(cfg.stages * CHUNK_BYTES + 1024, SMEM_FLOOR)
        self.kernel(tma[0], tma[1], mClk, layout).launch(
            grid=(mClk.shape[0], 1, 1), block=[32, 1, 1], smem=smem, stream=stream,
            **({"cluster": [2, 1, 1]} if const_expr(self.clustered) else {}))

    @cute.kernel
    def kernel(self, tma: cute.CopyAtom, gT: cute.Tensor, mClk: cute.Tensor,
               layout: cute.Layout):
        cfg = self.cfg
        S = cfg.stages
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        alloc = cutlass.memory.SmemAllocator()
        ring = alloc.allocate_tensor(BFloat16, layout, byte_alignment=1024)
        full = alloc.allocate_array(Int64, S)
        empty = alloc.allocate_array(Int64, S)
        rank = cutlass.Int32(0)
        if const_expr(self.clustered):
            rank = cute.arch.block_idx_in_cluster()
        if tidx == 0:
            for s in cutlass.range_constexpr(S):
                cute.arch.mbarrier_init(full + s, 1)
                cute.arch.mbarrier_init(empty + s, cfg.mcast)
            cute.arch.mbarrier_init_fence()
        if const_expr(self.clustered):   # the peer's barriers exist before anything reaches them
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.barrier()
        g = cute.local_tile(gT, (ROWS, COLS), (None, None))   # (128, 64, 64 row blocks, 8)
        ts, tg = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(ring, 0, 2),
                                       cute.group_modes(g, 0, 2))
        n_src = (SRC_ROWS // ROWS) * (SRC_COLS // COLS)
        first = cta // 2 * 7     # each pair starts at its own chunk, the pair on the same one
        t0 = cute.arch.clock64()
        # the whole warp walks the ring (the TMA copy elects its issuing thread with
        # elect.sync over the full warp, so no lane may wait elsewhere meanwhile); one lane
        # arrives on the barriers
        for p in cutlass.range(S, unroll=1):   # the ring's first round
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(full + p, CHUNK_BYTES)
            self._load(tma, tg, ts, full, (first + p) % n_src, p, p % cfg.mcast == rank)
        for p in cutlass.range(cfg.chunks, unroll=1):
            s = p % S
            cute.arch.mbarrier_wait(full + s, (p // S) & 1)
            q = p + S
            if q < cfg.chunks:
                mine = q % cfg.mcast == rank
                if tidx == 0:
                    if const_expr(cfg.mcast == 2):   # release stage s to q's loader
                        cute.arch.mbarrier_arrive(empty + s, q % 2)
                    cute.arch.mbarrier_arrive_and_expect_tx(full + s, CHUNK_BYTES)
                if const_expr(cfg.mcast == 2):
                    if mine:   # both CTAs have read chunk p from stage s
                        cute.arch.mbarrier_wait(empty + s, (p // S) & 1)
                self._load(tma, tg, ts, full, (first + q) % n_src, s, mine)
        t1 = cute.arch.clock64()
        if const_expr(self.clustered):   # no CTA exits while its peer may still signal it
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        if tidx == 0:
            mClk[cta, 0] = t0
            mClk[cta, 1] = t1

    @cute.jit
    def _load(self, tma, tg, ts, full, chunk, s, mine):
        """Chunk `chunk` of the source into stage s: by this CTA alone (mcast 1), or (mcast 2),
        when `mine`, into stage s of both CTAs of the pair."""
        src = tg[None, chunk // (SRC_COLS // COLS), chunk % (SRC_COLS // COLS)]
        if const_expr(self.cfg.mcast == 2):
            if mine:
                cute.copy(tma, src, ts[None, s], tma_bar_ptr=full + s,
                          mcast_mask=cutlass.Int16(3))
        else:
            cute.copy(tma, src, ts[None, s], tma_bar_ptr=full + s)


def variants() -> dict:
    """{label: (config, CTAs)}: the rate against the bytes in flight (2-6 stages of 16 KB) on
    every SM, and on half of them; multicast and the cluster launch alone at 2, 4 and 6."""
    out = {}
    for ctas in (132, 66):
        for stages in (2, 3, 4, 5, 6) if ctas == 132 else (2, 4):
            out[f"mcast 1, {stages} stages, {ctas} CTAs"] = (FillConfig(stages=stages), ctas)
        for stages in (2, 4, 6) if ctas == 132 else (4,):
            out[f"cluster, {stages} stages, {ctas} CTAs"] = (
                FillConfig(stages=stages, cluster=True), ctas)
            out[f"mcast 2, {stages} stages, {ctas} CTAs"] = (
                FillConfig(stages=stages, mcast=2), ctas)
    return out


def jobs() -> list:
    return experiment.bench_jobs(FillBench, (v[0] for v in variants().values()))


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute.launch import jit_cache

    res = {}
    src = torch.randn(SRC_ROWS, SRC_COLS, device=dev, dtype=torch.bfloat16)   # L2-resident
    only = os.environ.get("FILL_ONLY")   # one variant per process: a hang stops only it
    for label, (cfg, ctas) in variants().items():
        if only is not None and label != only:
            continue
        clk = torch.zeros(ctas, 2, device=dev, dtype=torch.int64)
        fn = jit_cache().get(FillBench, cfg)
        r = res[label] = experiment.stamped_rate(lambda: fn(src, clk), clk,
                                                 cfg.chunks * CHUNK_BYTES, dev, flush)
        print(f"{label:32s} {r['bytes_per_clock_sm']:6.1f} B/clk/SM {r['tb_per_s']:6.2f} TB/s "
              f"received ({r['ms']:.3f} ms)", flush=True)
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.fill_limits", __doc__, jobs, run))
