"""Do WGMMAs from two warpgroups on one SM run in issue order? (kernel-design.md §8 item 2)

Question. F1 (kernel-design.md §2, "Issue order") gets overlap without ping-pong only if the
tensor core drains WGMMAs roughly in the order the warpgroups issued them: the S-WG issues
QK[n+1] (2048 MMA-cycles), then the O-WGs issue PV[n], and softmax[n+1] must hide under PV[n].
If instead the tensor core interleaves the two warpgroups' chains (round-robin per SMSP), QK[n+1]
finishes late (about when PV[n] does), softmax[n+1] starts late, and F1 needs an explicit
ordering barrier as FA3's ping-pong has.

How. Two consumer warpgroups (WG0 = warps 0-3, WG1 = warps 4-7) on one SM, one CTA per SM
(grid = #SMs; every CTA runs the same experiment, CTA 0's timeline is printed). Both WGs
read the same resident smem tiles A[64 x 64] and B[N x 64] (bf16, 128B swizzle, K-major).
After a CTA barrier (t_base), WG w spins `delay_w` cycles, then issues GROUPS commit groups of
`chain_w` `m64nNk16` WGMMAs each, all into one accumulator, without waiting. It then retires
them one by one with `wait_group(GROUPS-1-g)` and stamps clock64 after each: done[g] is when
WG w saw its group g complete (groups of one WG complete in order).

Scenarios (`python -m perf.micro --which wgmma_order`; chains at N=128, 64 cycles per WGMMA):
  - `together`    : chains 8 / 8 (4 groups: 2048 cycles per WG), both start at once.
  - `f1`          : WG0 ("S-WG", QK[n+1]) 8 x 4 first; WG1 ("O-WG", PV[n]) 8 x 4 issued 256
                    cycles later: the F1 order. Issue order: WG0 done near 2048, WG1 near 4096.
  - `late_short`  : WG0 8 x 4 (2048 cycles), WG1 2 x 4 (512) issued 256 cycles later. Does a
                    late short chain overtake a long one?
  - `early_short` : WG0 2 x 4 (512 cycles) first, WG1 8 x 4 issued 64 cycles later. Is an early
                    short chain slowed down by a later long one? (FIFO: WG0 done near 512.)

How to read the numbers (per scenario, medians over CTAs; cycles from t_base):
  - `wg0_done`, `wg1_done`: cycles at which each WG's last group completed.
  - `first_done_frac` = (earlier of the two finishes - first issue) / (later finish - first
    issue). Issue order (FIFO): about 0.5 in `together` and `f1`. Interleaving: close to 1.0.
  - `late_short`: `wg1_done < wg0_done` means the late short chain overtook the long one
    (interleaving); `wg1_done > wg0_done` means it waited behind it (issue order).
  - `interleaved_groups`: how many groups of the WG that finished last completed before the
    other WG finished (0 = strictly one after the other; GROUPS - 1 or so = interleaved).
  - `tc_busy`: issued MMA-cycles (GROUPS * chains * N/2) over the span from first issue to last
    completion: about 1.0 means the tensor core never idled, whatever the order.
  The printed timeline (CTA 0) lists every group completion of both WGs in time order.

Constraints. sm_90a only; 256 threads; over 114 KB of smem so one CTA per SM; N in
{64, 128, 256}; chains are compile-time, delays run-time (cycles).
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64
from cutlass.cute.nvgpu import warpgroup

GROUPS = 4  # commit groups per WG
K_TILE = 64  # resident k-tile: 4 k16 steps, reused cyclically along each chain
STAMP_COLS = 4 + GROUPS  # per (CTA, WG): smid, t_base, issue start, issue end, done[0..G-1]

SCENARIOS = {  # name: ((chain WG0, chain WG1), (delay WG0, delay WG1) in cycles)
    "together": ((8, 8), (0, 0)),
    "f1": ((8, 8), (0, 256)),
    "late_short": ((8, 2), (0, 256)),
    "early_short": ((2, 8), (0, 64)),
}


class WgmmaOrderBench:
    """Two warpgroups issue WGMMA chains on one SM; per-group completion stamps."""

    def __init__(self, chains: tuple[int, int] = (8, 8), n: int = 128):
        assert n in (64, 128, 256) and all(c >= 1 for c in chains)
        self.chains, self.n = tuple(chains), n
        self.threads = 256

    # ------------------------------------------------------------------ host
    @cute.jit
    def __call__(self, mStamps: cute.Tensor, delay0: Int32, delay1: Int32,
                 stream: cuda.CUstream):
        # mStamps [grid, 2, STAMP_COLS] int64
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K, Float32, (1, 1, 1), (64, self.n))
        atom = warpgroup.make_smem_layout_atom(warpgroup.SmemLayoutAtomKind.K_SW128,
                                               cutlass.BFloat16)
        sA_layout = cute.tile_to_shape(atom, (64, K_TILE), (0, 1))
        sB_layout = cute.tile_to_shape(atom, (self.n, K_TILE), (0, 1))

        @cute.struct
        class Storage:
            sA: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16,
                                                       cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16,
                                                       cute.cosize(sB_layout)], 1024]
            pad: cute.struct.MemRange[cutlass.Int8, 100 * 1024]  # > 114 KB: one CTA per SM

        self.storage = Storage
        self.kernel(tiled_mma, mStamps, delay0, delay1, sA_layout, sB_layout).launch(
            grid=[cute.size(mStamps, mode=[0]), 1, 1], block=[self.threads, 1, 1],
            smem=Storage.size_in_bytes(), stream=stream)

    # ---------------------------------------------------------------- device
    @cute.kernel
    def kernel(self, tiled_mma: cute.TiledMma, mStamps: cute.Tensor, delay0: Int32,
               delay1: Int32, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
        storage = cutlass.memory.SmemAllocator().allocate(self.storage)
        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)  # (64, K_TILE)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)  # (N, K_TILE)
        # Operands: any finite values do; written by threads, so fence into the async proxy.
        for i in cutlass.range(tidx, cute.size(sA), self.threads, unroll=1):
            sA[i] = cutlass.BFloat16(0.125)
        for i in cutlass.range(tidx, cute.size(sB), self.threads, unroll=1):
            sB[i] = cutlass.BFloat16(0.25)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()

        wg_tidx = tidx % 128
        thr_mma = tiled_mma.get_slice(wg_tidx)
        # (MMA, MMA_M=1, MMA_K=4) and (MMA, MMA_N=1, MMA_K=4) smem descriptors
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        # (MMA, MMA_M=1, MMA_N=1): 64*N/128 fp32 per thread
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((64, self.n)), Float32)
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)  # set outside the branches below
        if wg == 0:
            self._chain(tiled_mma, tCrA, tCrB, acc, self.chains[0], delay0, mStamps, bidx, 0,
                        wg_tidx)
        else:
            self._chain(tiled_mma, tCrA, tCrB, acc, self.chains[1], delay1, mStamps, bidx, 1,
                        wg_tidx)

    @cute.jit
    def _chain(self, tiled_mma: cute.TiledMma, tCrA: cute.Tensor, tCrB: cute.Tensor,
               acc: cute.Tensor, chain: cutlass.Constexpr[int], delay: Int32,
               mStamps: cute.Tensor, bidx: Int32, wg: cutlass.Constexpr[int], wg_tidx: Int32):
        k_blocks = cute.size(tCrA, mode=[2])
        cute.arch.barrier(barrier_id=1, number_of_threads=self.threads)  # both WGs line up
        t_base = cute.arch.clock64()
        while cute.arch.clock64() - t_base < Int64(delay):
            pass
        t_issue0 = cute.arch.clock64()
        for _g in cutlass.range_constexpr(GROUPS):
            warpgroup.fence()
            for k in cutlass.range_constexpr(chain):
                kb = k % k_blocks
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb], tCrB[None, None, kb], acc)
            warpgroup.commit_group()
        t_issue1 = cute.arch.clock64()
        done = cute.make_rmem_tensor((GROUPS,), Int64)
        for g in cutlass.range_constexpr(GROUPS):
            warpgroup.wait_group(GROUPS - 1 - g)
            done[g] = cute.arch.clock64()
        if wg_tidx == 0:
            mStamps[bidx, wg, 0] = Int64(cute.arch.smid())
            mStamps[bidx, wg, 1] = t_base
            mStamps[bidx, wg, 2] = t_issue0
            mStamps[bidx, wg, 3] = t_issue1
            for g in cutlass.range_constexpr(GROUPS):
                mStamps[bidx, wg, 4 + g] = done[g]
            if acc[0] == Float32(-1.0):  # never true; keeps the accumulator live
                mStamps[bidx, wg, 0] = Int64(-1)


def make_args(stamps):
    from cutlass.cute.runtime import from_dlpack

    return (from_dlpack(stamps, assumed_align=16),)


def fake_args(grid: int):
    from cutlass.cute.runtime import make_fake_compact_tensor

    return (make_fake_compact_tensor(Int64, (grid, 2, STAMP_COLS), stride_order=(2, 1, 0),
                                     assumed_align=16),)


def compile(bench: WgmmaOrderBench, args, options: str = ""):
    """Compile `bench` for sm_90a over `args` (fake_args on a CPU, make_args on the GPU)."""
    from ffpa_cute.common.compat import compile_target

    with compile_target("sm_90a"):
        return cute.compile(bench, *args, Int32(0), Int32(0), cuda.CUstream(0), options=options)


def run(reps: int = 5, n: int = 128) -> tuple[list, list]:
    """Every scenario on the current GPU: (table rows, notes with CTA 0's timelines)."""
    import torch

    from perf.micro import DEVICE, checkpoint, median, row, sm_count, stream, sync

    sms = sm_count()
    stamps = torch.zeros(sms, 2, STAMP_COLS, dtype=torch.int64, device=DEVICE)
    args = make_args(stamps)
    rows, notes, compiled = [], [f"wgmma_order: grid {sms}, N={n}, {GROUPS} groups per WG"], {}
    for name, (chains, delays) in SCENARIOS.items():
        if chains not in compiled:
            compiled[chains] = compile(WgmmaOrderBench(chains, n), args)
        runs = []
        for _ in range(reps):
            stamps.zero_()
            compiled[chains](*args, delays[0], delays[1], stream())
            sync()
            runs.append(stamps.cpu())
        st = torch.cat(runs)  # (reps * grid, 2, STAMP_COLS)
        base = torch.minimum(st[:, 0, 1], st[:, 1, 1])
        issue = torch.minimum(st[:, 0, 2], st[:, 1, 2])
        fin0, fin1 = st[:, 0, -1], st[:, 1, -1]
        first = (torch.minimum(fin0, fin1) - issue).double()
        frac = first / (torch.maximum(fin0, fin1) - issue).double()
        later = torch.where((fin1 >= fin0)[:, None], st[:, 1, 4:], st[:, 0, 4:])
        overlap = (later < torch.minimum(fin0, fin1)[:, None]).sum(dim=1)
        busy = GROUPS * (chains[0] + chains[1]) * n // 2  # MMA-cycles of work issued
        span = (torch.maximum(fin0, fin1) - issue).double()
        v = f"{name} chains {chains[0]}x{GROUPS}/{chains[1]}x{GROUPS} delay {delays[1]}"
        rows += [row("wgmma_order", v, "wg0_done", median(fin0 - base), "clk"),
                 row("wgmma_order", v, "wg1_done", median(fin1 - base), "clk"),
                 row("wgmma_order", v, "first_done_frac", round(median(frac), 3), ""),
                 row("wgmma_order", v, "interleaved_groups", median(overlap), f"of {GROUPS}"),
                 row("wgmma_order", v, "tc_busy", round(busy / median(span), 3), "of span")]
        events = sorted([(int(st[0, w, 4 + g] - base[0]), f"WG{w}.g{g}")
                         for w in range(2) for g in range(GROUPS)])
        issue_rel = [(int(st[0, w, 2] - base[0]), int(st[0, w, 3] - base[0])) for w in range(2)]
        notes.append(f"wgmma_order {name} CTA0: issue WG0 {issue_rel[0]} WG1 {issue_rel[1]}; "
                     + ", ".join(f"{e}@{t}" for t, e in events))
        checkpoint(rows, notes)
    return rows, notes
