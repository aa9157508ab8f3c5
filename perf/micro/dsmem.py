"""DSMEM bandwidth and latency in a 2-CTA cluster (kernel-design.md §8 item 3).

Question. Two designs move data between the two CTAs of a cluster through distributed shared
memory: the paired-CTA backward (§3: P^T 16 KB one way and dS 8 KB the other per step, about
6 + 3 B/MMA-cycle) and the D > 512 forward by split-K (§2 "Generalizing over D": 32 KB of fp32
partial S each way per n_block, about 8 B/MMA-cycle). Neither is viable if DSMEM cannot carry
that next to the MMA work, and a slow round trip makes the exchange a serialization point.

How. grid = all SMs rounded down to even, clusters of 2 (rank 0 and rank 1). Each CTA has a
sender warpgroup (warps 0-3) and a receiver warpgroup (warps 4-7).
  - `stream`: the sender writes `step_bytes` per step into stage s = step % stages of the
    peer's receive ring; the peer's receiver waits on its full[s] mbarrier, reads every 16-byte
    chunk (checks its tag), and releases the stage by a remote arrive on the sender's empty[s].
    Methods: `st_async` (all 128 sender threads, st.async.shared::cluster v4.b32 with
    mbarrier::complete_tx on the peer's full[s]) and `bulk` (one thread,
    cp.async.bulk.shared::cluster.shared::cta of the whole step from local smem, complete_tx).
    The full[s] barrier is armed by the sender with a remote arrive.expect_tx.
    `bidir=False`: rank 0 sends, rank 1 receives. `bidir=True`: both directions at once.
  - `pingpong`: one thread per CTA; rank 0 sends 16 B by st.async, rank 1 answers as soon as
    its barrier flips; `rounds` round trips timed by rank 0's clock64. Waiting by
    mbarrier.try_wait (may suspend the thread; what pipelines use) or by a test_wait spin.

How to read the numbers.
  - `recv_B/clk`: bytes landed per clock at a receiving SM, (steps - 1) * step_bytes over the
    receiver's clock64 window from step 0's full to the last step's full (median over CTAs).
    The design needs about 9 B/clk (bwd, each direction) or 8 (split-K fwd) while the tensor
    core runs; compare with the 128 B/clk smem port.
  - `round_trip_cyc`: cycles for 16 B there and back (two st.async + two mbarrier waits).
    Split-K forward exchanges once per n_block (4096 MMA-cycles at D=512): a round trip under
    a few hundred cycles hides behind the next QK; the bwd P^T/dS handoff likewise per step.
  - `errors`: chunks whose tag was wrong (must be 0; otherwise the protocol is broken and the
    bandwidth is not to be trusted).

Constraints. sm_90a (clusters, st.async, cp.async.bulk shared::cluster); 256 threads per CTA;
step_bytes a multiple of 2048 (16 B per sender thread per store); stages * step_bytes +
step_bytes (bulk source) <= 227 KB.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr
from cutlass._mlir.dialects import nvvm

STAMP_COLS = 8  # per CTA: smid, rank, t first full, t last full, errors, steps recv, unused x2
CHUNK = 16  # bytes per st.async v4.b32


class DsmemBench:
    """A 2-CTA cluster streams step_bytes per step into the peer's smem ring (or ping-pongs)."""

    def __init__(self, mode: str = "stream", method: str = "st_async", step_bytes: int = 16384,
                 stages: int = 4, bidir: bool = False, spin: bool = False):
        assert mode in ("stream", "pingpong") and method in ("st_async", "bulk")
        assert step_bytes % (128 * CHUNK) == 0 and (stages + 1) * step_bytes <= 227 * 1024
        self.mode, self.method, self.bidir, self.spin = mode, method, bidir, spin
        self.step_bytes, self.stages = step_bytes, stages
        self.words = step_bytes // 4  # Int32 words per step
        self.threads = 256
        self.pad = max(16, 116 * 1024 - (stages + 1) * step_bytes)

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mStamps: cute.Tensor, steps: Int32, stream: cuda.CUstream):
        # mStamps [grid, STAMP_COLS] int64, grid even
        @cute.struct
        class Storage:
            full: cute.struct.MemRange[Int64, self.stages]  # receive side, armed by the peer
            empty: cute.struct.MemRange[Int64, self.stages]  # send side, released by the peer
            ring: cute.struct.Align[cute.struct.MemRange[Int32, self.stages * self.words], 128]
            src: cute.struct.Align[cute.struct.MemRange[Int32, self.words], 128]
            pad: cute.struct.MemRange[cutlass.Int8, self.pad]  # > 114 KB: one CTA per SM

        self.storage = Storage
        self.kernel(mStamps, steps).launch(
            grid=[cute.size(mStamps, mode=[0]), 1, 1], block=[self.threads, 1, 1],
            cluster=[2, 1, 1], smem=Storage.size_in_bytes(), stream=stream)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, mStamps: cute.Tensor, steps: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        peer = 1 - rank
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        full, empty = storage.full.data_ptr(), storage.empty.data_ptr()
        ring = storage.ring.get_tensor(cute.make_layout((self.words, self.stages)))
        src = storage.src.get_tensor(cute.make_layout(self.words))
        if warp == 0:
            with cute.arch.elect_one():
                for s in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(full + s, 1)
                    cute.arch.mbarrier_init(empty + s, 1)
                cute.arch.mbarrier_init_fence()
        # bulk source: chunk c holds (c, c, c, c)
        for w in cutlass.range(tidx, self.words, self.threads, unroll=1):
            src[w] = w // 4
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.cluster_arrive()  # barriers initialised on both CTAs before any remote use
        cute.arch.cluster_wait()

        if const_expr(self.mode == "pingpong"):
            if tidx == 0:
                self._pingpong(ring, full, rank, peer, steps, mStamps, bidx)
        else:
            sends = Int32(1) if const_expr(self.bidir) else Int32(rank == 0)
            receives = Int32(1) if const_expr(self.bidir) else Int32(rank == 1)
            if warp < 4:
                if sends != 0:
                    self._send(ring, src, full, empty, peer, steps, tidx)
            elif receives != 0:
                self._receive(ring, full, empty, peer, steps, tidx - 128, mStamps, bidx)
        if tidx == 0:
            mStamps[bidx, 0] = Int64(cute.arch.smid())
            mStamps[bidx, 1] = Int64(rank)
        cute.arch.cluster_arrive()  # neither CTA exits while the peer may still touch its smem
        cute.arch.cluster_wait()

    @cute.jit
    def _chunk_ptr(self, ring: cute.Tensor, s: Int32, chunk: Int32):
        """Local smem address of 16-byte chunk `chunk` of stage s (same offset in the peer)."""
        addr = ring.iterator.toint() + s * self.step_bytes + chunk * CHUNK
        return cute.make_ptr(Int32, addr, cute.AddressSpace.smem, assumed_align=16)

    @cute.jit
    def _send(self, ring: cute.Tensor, src: cute.Tensor, full, empty, peer: Int32, steps: Int32,
              tidx: Int32):
        chunks_per_thread = self.step_bytes // (128 * CHUNK)
        for i in cutlass.range(steps, unroll=1):
            s = i % self.stages
            if i >= self.stages:  # the peer released this stage's previous use
                cute.arch.mbarrier_wait(empty + s, ((i // self.stages) - 1) % 2)
            if tidx == 0:  # one arrive + the byte count the stores will complete
                cute.arch.mbarrier_arrive_and_expect_tx(
                    full + s, self.step_bytes, peer_cta_rank_in_cluster=peer,
                    scope=nvvm.MemScopeKind.CLUSTER)
            if const_expr(self.method == "st_async"):
                for j in cutlass.range_constexpr(chunks_per_thread):
                    c = j * 128 + tidx  # consecutive threads, consecutive chunks
                    cute.arch.store_async_dsmem(self._chunk_ptr(ring, s, c), (i, c, i, c),
                                                full + s, peer)
            else:
                if tidx == 0:
                    dst = cute.arch.map_dsmem_ptr(self._chunk_ptr(ring, s, 0), peer)
                    bar = cute.arch.map_dsmem_ptr(full + s, peer)
                    cute.arch.inline_ptx(
                        "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes"
                        " [{$r0}], [{$r1}], {$r2}, [{$r3}];",
                        read_only_args=[dst.toint(), src.iterator.toint(),
                                        Int32(self.step_bytes), bar.toint()])

    @cute.jit
    def _receive(self, ring: cute.Tensor, full, empty, peer: Int32, steps: Int32, tidx: Int32,
                 mStamps: cute.Tensor, bidx: Int32):
        chunks_per_thread = self.step_bytes // (128 * CHUNK)
        errors = Int32(0)
        t_first = Int64(0)
        for i in cutlass.range(steps, unroll=1):
            s = i % self.stages
            cute.arch.mbarrier_wait(full + s, (i // self.stages) % 2)
            if i == 0:
                t_first = cute.arch.clock64()
            for j in cutlass.range_constexpr(chunks_per_thread):
                c = j * 128 + tidx
                w = c * 4
                tag = ring[w, s] if const_expr(self.method == "st_async") else i
                errors += Int32(tag != i) + Int32(ring[w + 1, s] != c)
            cute.arch.barrier(barrier_id=1, number_of_threads=128)  # all reads of stage s done
            if tidx == 0:
                cute.arch.mbarrier_arrive(empty + s, peer_cta_rank_in_cluster=peer,
                                          scope=nvvm.MemScopeKind.CLUSTER)
        t_last = cute.arch.clock64()
        if errors != 0:
            cute.arch.atomic_add(mStamps.iterator + bidx * STAMP_COLS + 4, Int64(errors))
        if tidx == 0:
            mStamps[bidx, 2] = t_first
            mStamps[bidx, 3] = t_last
            mStamps[bidx, 5] = Int64(steps)

    @cute.jit
    def _wait(self, bar, phase: Int32):
        """mbarrier wait: try_wait (may suspend the thread) or, with spin, a test_wait loop."""
        if const_expr(self.spin):
            while not cute.arch.mbarrier_test_wait(bar, phase):
                pass
        else:
            cute.arch.mbarrier_wait(bar, phase)

    @cute.jit
    def _pingpong(self, ring: cute.Tensor, full, rank: Int32, peer: Int32, rounds: Int32,
                  mStamps: cute.Tensor, bidx: Int32):
        t0 = cute.arch.clock64()
        for r in cutlass.range(rounds, unroll=1):
            # arm this round's phase for the 16 bytes the peer will send (order vs data is free)
            cute.arch.mbarrier_arrive_and_expect_tx(full, CHUNK)
            if rank == 0:
                cute.arch.store_async_dsmem(self._chunk_ptr(ring, 0, 0), (r, 0, r, 0), full, peer)
                self._wait(full, r % 2)
            else:
                self._wait(full, r % 2)
                cute.arch.store_async_dsmem(self._chunk_ptr(ring, 0, 0), (r, 0, r, 0), full, peer)
        t1 = cute.arch.clock64()
        mStamps[bidx, 2] = t0
        mStamps[bidx, 3] = t1
        mStamps[bidx, 5] = Int64(rounds)


def make_args(stamps):
    from cutlass.cute.runtime import from_dlpack

    return (from_dlpack(stamps, assumed_align=16),)


def fake_args(grid: int):
    from cutlass.cute.runtime import make_fake_compact_tensor

    return (make_fake_compact_tensor(Int64, (grid, STAMP_COLS), stride_order=(1, 0),
                                     assumed_align=16),)


def compile(bench: DsmemBench, args, options: str = ""):
    """Compile `bench` for sm_90a over `args` (fake_args on a CPU, make_args on the GPU)."""
    from ffpa_cute.common.compat import compile_target

    with compile_target("sm_90a"):
        return cute.compile(bench, *args, Int32(1), cuda.CUstream(0), options=options)


def run(steps: int = 20000, rounds: int = 10000) -> tuple[list, list]:
    """Every variant on the current GPU: (table rows, notes)."""
    import torch

    from perf.micro import DEVICE, checkpoint, median, row, sm_count, stream, timed

    grid = sm_count() // 2 * 2
    stamps = torch.zeros(grid, STAMP_COLS, dtype=torch.int64, device=DEVICE)
    args = make_args(stamps)
    rows, notes = [], [f"dsmem: grid {grid} CTAs in clusters of 2, steps {steps}"]
    cases = [("stream", m, k, bidir) for m in ("st_async", "bulk") for k in (8192, 16384)
             for bidir in (False, True)]
    cases += [("pingpong", "try_wait", 16384, False), ("pingpong", "spin", 16384, False)]
    for mode, method, step_bytes, bidir in cases:
        if mode == "pingpong":
            bench = DsmemBench(mode, "st_async", spin=method == "spin")
        else:
            bench = DsmemBench(mode, method, step_bytes, bidir=bidir)
        fn = compile(bench, args)
        count = rounds if mode == "pingpong" else steps
        ms = timed(lambda: (stamps.zero_(), fn(*args, count, stream())), reps=1)
        st = stamps.cpu()
        pairs = st[:, 0].view(-1, 2)
        if bool((pairs[:, 0] == pairs[:, 1]).any()):
            notes.append(f"dsmem {mode} {method}: a cluster's two CTAs shared an SM")
        if mode == "pingpong":
            r0 = st[st[:, 1] == 0]
            rt = median((r0[:, 3] - r0[:, 2]).double() / count)
            rows.append(row("dsmem", f"pingpong st_async 16 B, {method}", "round_trip",
                            round(rt, 1), "clk"))
            checkpoint(rows, notes)
            continue
        v = f"{method} {step_bytes // 1024} KB/step {'bidir' if bidir else 'one-way'}"
        recv = st[(st[:, 1] == 1) | bidir]  # receiving CTAs
        bpc = median((count - 1) * step_bytes / (recv[:, 3] - recv[:, 2]).double())
        total = len(recv) * count * step_bytes / ms / 1e6
        rows += [row("dsmem", v, "recv", round(bpc, 1), "B/clk/SM"),
                 row("dsmem", v, "recv_all_SMs", round(total), "GB/s"),
                 row("dsmem", v, "errors", int(st[:, 4].sum()), "chunks")]
        checkpoint(rows, notes)
    return rows, notes
