"""Does TMA filling shared memory slow WGMMA SS operand reads? (kernel-design.md §8 item 1)

Question. The F1 forward (kernel-design.md §2) needs about 152-160 B of smem traffic per
MMA-cycle: WGMMA SS operand reads plus TMA fills of the K/V ring plus P. If TMA writes and
WGMMA operand reads share one 128 B/clk port, F1 is smem-bound (ceiling about 630-660 TFLOPS);
if they do not, it is MMA-bound and 650+ is open. This benchmark measures it directly.

How. One CTA per SM (grid = #SMs; over 114 KB of smem each, so no two CTAs share an SM).
  - warps 0-3 (one consumer warpgroup) loop `iters` times over a k-tile of `k_tile/16`
    `m64nNk16` bf16 SS WGMMAs on resident smem tiles A[64 x k_tile] and B[N x k_tile]
    (128B swizzle, K-major, as in the attention kernels), accumulating into registers.
    One commit group per k-tile, `wait_group(1)` keeps two groups in flight. Thread 0 stamps
    clock64 after a warm-up group and after the last `wait_group(0)`.
  - warp 4 (producer) in the `fill` variants streams 32 KB tiles ([128 x 128] bf16, 128B
    swizzle: one K/V ring chunk of F1) from a gmem buffer with TMA (cp.async.bulk.tensor) into
    `fill_stages` smem stages (as many as fit) that the MMA never reads. It keeps all stages in
    flight: before reusing a stage it waits for that stage's previous load on its mbarrier
    (complete_tx). With MMA on, it runs until the consumer arrives on a `stop` mbarrier,
    then drains.

Variants (`python -m perf.micro --which smem_port`), N in {64, 128, 256}:
  - `nN mma`              : WGMMA alone; ideally N/2 cycles per WGMMA.
  - `nN mma+fill L2 16MB` : WGMMA with the TMA stream from a 16 MB buffer (L2-resident: the
                            highest fill rate an SM gets when all SMs pull at once).
  - `nN mma+fill HBM 1024MB`: the same from a 1 GB buffer (HBM-bound, about 17 B/clk/SM).
  - `fill L2 16MB`, `fill HBM 1024MB`: the TMA stream alone (its own ceiling).
  SS operand demand at full rate, (A 2 KB + B 32*N B) / (N/2 cycles): 128 B/clk at N=64
  (the whole port), 96 at N=128, 80 at N=256.

How to read the numbers (per SM, medians over CTAs).
  - `cyc/wgmma`: clock64 cycles per m64nNk16; `ideal cyc/wgmma` = N/2.
  - `mma_smem` = (2048 + 32*N) B / `cyc/wgmma`: operand bytes WGMMA pulls out of smem.
  - `fill`: TMA bytes written per clock over the producer's window.
  - `total_smem` = mma_smem + fill (in `mma+fill`).
  - `tflops_wall`: 2*64*N*16 FLOP per WGMMA, all SMs, over CUDA-event wall time;
    `sm_clock`: MMA-window cycles / wall time (an estimate of the SM clock under load).
  - `fill_all_SMs` (fill-only): the stream's aggregate GB/s.
  Reading: if `mma+fill` keeps `cyc/wgmma` at the `mma` value while `total_smem` passes 128,
  fills do not take operand-read bandwidth (F1 is MMA-bound). If `cyc/wgmma` grows so that
  `total_smem` stays near one ceiling (about 128), they share the port and F1's smem budget
  (§2, "Cycle budget per n_block") is the binding limit. N=64 (128 B/clk of operands alone)
  gives the sharpest signal; at N=128/256 a fill below 32/48 B/clk cannot push the total
  past 128, so an unchanged `cyc/wgmma` there is inconclusive.

Constraints.
  - sm_90a only (WGMMA, TMA). 160 threads, no setmaxnreg: registers are not a limit.
  - N in {64, 128, 256}; k_tile a multiple of 64 (one 128B-swizzle atom); fill tile fixed at
    [128 x 128] bf16 (32 KB); smem = 8 KB A + N*k_tile*2 B + fill_stages*32 KB <= 227 KB
    (fill_stages defaults to the most that fit: 6 at N=64 and 128, 5 at N=256, k_tile 64).
  - The fill buffer is a row-major bf16 [rows x 128] tensor, rows a multiple of 128.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

FILL_ROWS, FILL_COLS = 128, 128  # one 32 KB fill tile = one F1 K/V ring chunk
SMEM_CAP = 232448  # bytes of smem one CTA may use on sm_90
STAMP_COLS = 8  # per CTA: smid, mma t0, mma t1, fill t0, fill t1, fill tiles, sink, unused


class SmemPortBench:
    """One CTA per SM: a WGMMA SS loop, optionally racing a TMA fill stream."""

    def __init__(self, n: int = 128, mma: bool = True, fill: bool = False, k_tile: int = 64,
                 fill_stages: int | None = None):
        assert n in (64, 128, 256) and k_tile % 64 == 0 and (mma or fill)
        self.n, self.mma, self.fill, self.k_tile = n, mma, fill, k_tile
        self.k_blocks = k_tile // 16  # WGMMAs per commit group
        self.threads = 160  # warps 0-3: MMA warpgroup; warp 4: TMA producer
        self.fill_bytes = FILL_ROWS * FILL_COLS * 2
        operand_bytes = 2 * (64 + n) * k_tile
        # as many fill stages as fit (6 at n128, 5 at n256): the most bytes in flight per SM
        free = SMEM_CAP - operand_bytes - 1024  # 1 KB: barriers and alignment
        self.fill_stages = fill_stages or free // self.fill_bytes
        assert 1 <= self.fill_stages and self.fill_stages * self.fill_bytes <= free

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mFill: cute.Tensor,
                 mStamps: cute.Tensor, iters: Int32, fill_tiles: Int32, stream: cuda.CUstream):
        # mA [64, k_tile], mB [N, k_tile], mFill [rows, 128]: bf16, K (last) mode contiguous.
        # mStamps [grid, STAMP_COLS] int64.
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128,
                                               cutlass.BFloat16)  # 8 rows x 64 bf16, Swizzle<3,4,3>
        self.sA_layout = cute.tile_to_shape(atom, (64, self.k_tile), (0, 1))
        self.sB_layout = cute.tile_to_shape(atom, (self.n, self.k_tile), (0, 1))
        self.sF_layout = cute.tile_to_shape(atom, (FILL_ROWS, FILL_COLS, self.fill_stages),
                                            (0, 1, 2))
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K, Float32, (1, 1, 1), (64, self.n))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tA = cpasync.make_tiled_tma_atom(g2s, mA, self.sA_layout, (64, self.k_tile))
        tma_b, tB = cpasync.make_tiled_tma_atom(g2s, mB, self.sB_layout, (self.n, self.k_tile))
        tma_f, tF = cpasync.make_tiled_tma_atom(
            g2s, mFill, cute.select(self.sF_layout, mode=[0, 1]), (FILL_ROWS, FILL_COLS))

        @cute.struct
        class Storage:
            bar_ab: cute.struct.MemRange[Int64, 1]
            bar_fill: cute.struct.MemRange[Int64, self.fill_stages]
            bar_stop: cute.struct.MemRange[Int64, 1]
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16,
                                                       cute.cosize(self.sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16,
                                                       cute.cosize(self.sB_layout)], 1024]
            sF: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16,
                                                       cute.cosize(self.sF_layout)], 1024]

        self.storage = Storage
        grid = cute.size(mStamps, mode=[0])
        self.kernel(tiled_mma, tma_a, tA, tma_b, tB, tma_f, tF, mStamps, iters, fill_tiles,
                    self.sA_layout, self.sB_layout, self.sF_layout).launch(
            grid=[grid, 1, 1], block=[self.threads, 1, 1], smem=Storage.size_in_bytes(),
            stream=stream)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, tma_a: cute.CopyAtom, tA: cute.Tensor,
               tma_b: cute.CopyAtom, tB: cute.Tensor, tma_f: cute.CopyAtom, tF: cute.Tensor,
               mStamps: cute.Tensor, iters: Int32, fill_tiles: Int32,
               sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout,
               sF_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        bar_ab = storage.bar_ab.data_ptr()
        bar_fill = storage.bar_fill.data_ptr()
        bar_stop = storage.bar_stop.data_ptr()
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)  # (64, k_tile)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)  # (N, k_tile)
        sF = storage.sF.get_tensor(sF_layout.outer, swizzle=sF_layout.inner)  # (128, 128, S)

        if warp == 4:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_f)
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(bar_ab, 1)
                cute.arch.mbarrier_init(bar_stop, 1)
                for s in cutlass.range_constexpr(self.fill_stages):
                    cute.arch.mbarrier_init(bar_fill + s, 1)
                cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        if warp == 4:
            # Resident operands, loaded once: A [64, k_tile] and B [N, k_tile] (tile (0, 0)).
            tAsA, tAgA = cpasync.tma_partition(
                tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                cute.group_modes(cute.local_tile(tA, (64, self.k_tile), (0, 0)), 0, 2))
            tBsB, tBgB = cpasync.tma_partition(
                tma_b, 0, cute.make_layout(1), cute.group_modes(sB, 0, 2),
                cute.group_modes(cute.local_tile(tB, (self.n, self.k_tile), (0, 0)), 0, 2))
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(
                    bar_ab, 2 * (64 + self.n) * self.k_tile)
            cute.copy(tma_a, tAgA, tAsA, tma_bar_ptr=bar_ab)
            cute.copy(tma_b, tBgB, tBsB, tma_bar_ptr=bar_ab)
            if const_expr(self.fill):
                self._fill(tma_f, tF, sF, bar_fill, bar_stop, mStamps, bidx, fill_tiles)
        else:
            cute.arch.mbarrier_wait(bar_ab, 0)
            if const_expr(self.mma):
                self._mma(tiled_mma, sA, sB, bar_stop, mStamps, tidx, bidx, iters)
            if tidx == 0:
                mStamps[bidx, 0] = Int64(cute.arch.smid())

    @cute.jit
    def _mma(self, tiled_mma: cute.TiledMma, sA: cute.Tensor, sB: cute.Tensor, bar_stop,
             mStamps: cute.Tensor, tidx: Int32, bidx: Int32, iters: Int32):
        thr_mma = tiled_mma.get_slice(tidx)
        # (MMA, MMA_M=1, MMA_K=k_tile/16) and (MMA, MMA_N=1, MMA_K) smem descriptors
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        # (MMA, MMA_M=1, MMA_N=1): 64*N/128 fp32 per thread
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((64, self.n)), Float32)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
        # warm-up group: fills the pipe, takes the first-touch latency out of the window
        warpgroup.fence()
        for k in cutlass.range_constexpr(self.k_blocks):
            cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
            tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        t0 = cute.arch.clock64()
        for _ in cutlass.range(iters, unroll=1):
            warpgroup.fence()
            for k in cutlass.range_constexpr(self.k_blocks):
                cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
            warpgroup.commit_group()
            warpgroup.wait_group(1)
        warpgroup.wait_group(0)
        t1 = cute.arch.clock64()
        if tidx == 0:
            mStamps[bidx, 1] = t0
            mStamps[bidx, 2] = t1
            mStamps[bidx, 6] = Int64(acc[0])  # keeps the accumulator (and the MMAs) live
            if const_expr(self.fill):
                cute.arch.mbarrier_arrive(bar_stop)

    @cute.jit
    def _fill(self, tma_f: cute.CopyAtom, tF: cute.Tensor, sF: cute.Tensor, bar_fill, bar_stop,
              mStamps: cute.Tensor, bidx: Int32, fill_tiles: Int32):
        # (TMA, n_tiles) over gmem and (TMA, fill_stages) over smem
        gF = cute.local_tile(tF, (FILL_ROWS, FILL_COLS), (None, 0))  # (128, 128, n_tiles)
        tFsF, tFgF = cpasync.tma_partition(tma_f, 0, cute.make_layout(1),
                                           cute.group_modes(sF, 0, 2), cute.group_modes(gF, 0, 2))
        n_tiles = cute.size(gF, mode=[2])
        grid, _, _ = cute.arch.grid_dim()
        # each CTA streams its own slice first: a buffer larger than L2 is then read from HBM
        first = bidx * (n_tiles // grid)
        stages = self.fill_stages
        t0 = cute.arch.clock64()
        count = Int32(0)
        keep = Int32(1)
        while keep != 0:
            s = count % stages
            if count >= stages:  # reuse: the stage's previous load must have landed
                cute.arch.mbarrier_wait(bar_fill + s, ((count // stages) - 1) % 2)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar_fill + s, self.fill_bytes)
            cute.copy(tma_f, tFgF[None, (first + count) % n_tiles], tFsF[None, s],
                      tma_bar_ptr=bar_fill + s)
            count += 1
            keep = Int32(count < fill_tiles)
            if const_expr(self.mma):
                if cute.arch.mbarrier_test_wait(bar_stop, 0):
                    keep = Int32(0)
        # drain: wait for the last load of every stage still in flight
        for s in cutlass.range_constexpr(stages):
            uses = (count - s + stages - 1) // stages  # loads issued into stage s
            if uses > 0:
                cute.arch.mbarrier_wait(bar_fill + s, (uses - 1) % 2)
        t1 = cute.arch.clock64()
        if cute.arch.lane_idx() == 0:
            mStamps[bidx, 3] = t0
            mStamps[bidx, 4] = t1
            mStamps[bidx, 5] = Int64(count)


def make_args(a, b, fill, stamps):
    """cute tensors for torch tensors (static layouts, 16-byte aligned)."""
    from cutlass.cute.runtime import from_dlpack

    return tuple(from_dlpack(t, assumed_align=16) for t in (a, b, fill, stamps))


def fake_args(n: int, k_tile: int, fill_rows: int, grid: int):
    """Compile-time stand-ins with the static layouts `make_args` produces."""
    from cutlass.cute.runtime import make_fake_compact_tensor as fake

    bf16 = cutlass.BFloat16
    return (fake(bf16, (64, k_tile), stride_order=(1, 0), assumed_align=16),
            fake(bf16, (n, k_tile), stride_order=(1, 0), assumed_align=16),
            fake(bf16, (fill_rows, FILL_COLS), stride_order=(1, 0), assumed_align=16),
            fake(Int64, (grid, STAMP_COLS), stride_order=(1, 0), assumed_align=16))


def compile(bench: SmemPortBench, args, options: str = ""):
    """Compile `bench` for sm_90a over `args` (fake_args on a CPU, make_args on the GPU)."""
    from ffpa_cute.common.compat import compile_target

    with compile_target("sm_90a"):
        return cute.compile(bench, *args, Int32(1), Int32(1), cuda.CUstream(0), options=options)


def run(iters: int = 20000, fill_tiles: int = 4000, k_tile: int = 64, l2_mb: int = 16,
        hbm_mb: int = 1024) -> tuple[list, list]:
    """All variants on the current GPU: (table rows, notes)."""
    import torch

    from perf.micro import DEVICE, checkpoint, median, row, sm_count, stream, timed

    sms = sm_count()
    bf16 = dict(dtype=torch.bfloat16, device=DEVICE)
    stamps = torch.zeros(sms, STAMP_COLS, dtype=torch.int64, device=DEVICE)
    sources = {f"L2 {l2_mb}MB": l2_mb << 20, f"HBM {hbm_mb}MB": hbm_mb << 20}  # fill buffers
    fills = {k: torch.randn(v // (2 * FILL_COLS), FILL_COLS, **bf16) for k, v in sources.items()}
    rows, notes = [], [f"smem_port: grid {sms} CTAs (1 per SM), iters {iters}, k_tile {k_tile}"]
    cases = [(n, True, None) for n in (64, 128, 256)]
    cases += [(n, True, src) for n in (64, 128, 256) for src in sources]
    cases += [(128, False, src) for src in sources]
    for n, mma, src in cases:
        a, b = torch.randn(64, k_tile, **bf16), torch.randn(n, k_tile, **bf16)
        fill = fills[src] if src else fills[f"L2 {l2_mb}MB"]
        variant = ("mma" if mma else "fill") + (f"+fill {src}" if mma and src else "")
        variant = f"n{n} {variant}" if mma else f"fill {src}"
        stamps.zero_()
        args = make_args(a, b, fill, stamps)
        fn = compile(SmemPortBench(n, mma, src is not None, k_tile), args)
        n_fill = fill_tiles if not mma else 2**30  # with MMA the stream stops on the stop barrier
        ms = timed(lambda: fn(*args, iters, n_fill, stream()))
        st = stamps.cpu()
        name = "smem_port"
        if mma:
            cyc = median((st[:, 2] - st[:, 1]).double() / (iters * (k_tile // 16)))
            mma_bytes = 2 * 64 * 16 + 2 * n * 16  # A + B per m64nNk16
            flops = sms * (iters + 1) * (k_tile // 16) * 2 * 64 * n * 16
            rows += [row(name, variant, "cyc/wgmma", round(cyc, 2), "clk"),
                     row(name, variant, "ideal cyc/wgmma", n // 2, "clk"),
                     row(name, variant, "mma_smem", round(mma_bytes / cyc, 1), "B/clk/SM"),
                     row(name, variant, "tflops_wall", round(flops / ms / 1e9, 1), "TFLOPS"),
                     row(name, variant, "sm_clock", round(median(st[:, 2] - st[:, 1]) / ms / 1e3),
                         "MHz")]
        if src:
            fill_bpc = median(st[:, 5].double() * FILL_ROWS * FILL_COLS * 2
                              / (st[:, 4] - st[:, 3]).double())
            rows.append(row(name, variant, "fill", round(fill_bpc, 1), "B/clk/SM"))
            if mma:
                rows.append(row(name, variant, "total_smem", round(fill_bpc + mma_bytes / cyc, 1),
                                "B/clk/SM"))
            else:
                gbs = float(st[:, 5].sum()) * FILL_ROWS * FILL_COLS * 2 / ms / 1e6
                rows.append(row(name, variant, "fill_all_SMs", round(gbs), "GB/s"))
        if len(set(st[:, 0].tolist())) != sms:
            notes.append(f"smem_port {variant}: CTAs did not land on {sms} distinct SMs")
        checkpoint(rows, notes)
    return rows, notes
