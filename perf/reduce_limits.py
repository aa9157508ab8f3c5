"""How fast an SM can add fp32 into global memory, and whether the limit is the SM's or the L2's:
the fused backward's dQ reduction (64 KB per block and CTA at D=512) sets its period (perf-log
2026-12-05, session 25), at ~13 B / clock per SM by TMA from smem and by `red.global` from
registers alike.

    python -m perf.reduce_limits --precompile DIR    # CPU: compile the variants into a cache
    python -m perf.reduce_limits [--out FILE]        # GPU: time them (FFPA_CUTE_CACHE_DIR=DIR)

`ReduceBench`: each CTA (one per SM: its smem keeps a second off) adds `pieces` pieces of
64 x 32 fp32 (8 KB, the fused kernel's dQ piece) into a [R, 256] fp32 tensor, piece p of CTA c
at row block (c + C (p / 8)) mod R / 64 (C CTAs), column block p mod 8, by
  "tma":  one `cp.reduce.async.bulk.tensor` per piece from one of `bufs` 8 KB staging buffers
          (staged once: the rate of the reductions alone), warp 0 waiting before each until
          all but `bufs - 1` of its bulk groups have read their buffer, as the kernel does;
  "red":  every thread 16 values of the piece by four 16-byte `red.global.add.v4.f32`;
  "both": pieces alternately by the two paths (warp 0 issues the TMA one, then the warpgroup
          reduces the next from registers).
Each CTA stamps clock64 before its first piece and after its last completed (bulk groups
waited for, a fence for the reds), so B / clock per SM comes from the SM's own cycles; the
kernel's wall time gives the chip's bytes per second. Varied: the CTAs (1-132: does the rate
per SM fall when more SMs add at once, i.e. is the L2 the limit), `bufs` (1-8: is it the
queue's depth), loads beside the reductions (`loads`: one 8 KB TMA load per piece reduced,
as the fused backward streams Q / dO: what the L2 gives both; the TB/s then count the
reductions, as many bytes again are loaded), the rows R: every CTA into the same 64 rows (R =
64), or each into its own k
row blocks of 64 KB (R = 64 C k; k = 1 or 4: the whole tensor stays in L2, 8 / 34 MB at 132
CTAs; k = pieces / 8: every piece its own 8 KB, 553 MB, so the adds go to DRAM).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync

from ffpa_cute.common.tensors import KernelEntry, fake_tensor, vec4_ptx
from perf import experiment

T, W = 64, 32          # a piece: rows, fp32 columns (8 KB)
COLS = 256             # the tensor's columns: 8 pieces per row block
THREADS = 128
LOAD_BUFS = 4          # `loads`: 8 KB load buffers in flight
SRC_ROWS = 64 * 256    # `loads`' source: 16 MB of fp32, read by every CTA
SMEM_FLOOR = 120 * 1024   # each CTA's smem at least this: one CTA per SM

_RED_ADD_F32X4 = vec4_ptx("red.global.add.v4.f32 [{$r0}], {a, b, c, d};", "f32")


@dataclasses.dataclass(frozen=True)
class ReduceConfig:
    """arch; mode "tma" | "red" | "both"; bufs: staging buffers (tma, both); pieces per CTA;
    loads ("tma" only): each piece reduced is paired with an 8 KB TMA load of a piece of src
    into one of LOAD_BUFS buffers (the fused backward streams as many Q / dO bytes as it
    reduces dQ bytes): what the L2 sustains of both at once."""

    arch: str = "sm_90a"
    mode: str = "tma"
    bufs: int = 2
    pieces: int = 512
    loads: bool = False

    KERNEL: ClassVar[str] = "perf.reduce_limits:ReduceBench"


class ReduceBench(KernelEntry):
    """The reduction microbenchmark (module docstring): dst [R, 256] fp32, src [R', 256] fp32
    (read with `loads`, piece p of every CTA at row block p / 8 mod R' / 64: all CTAs read the
    same rows, as the CTA pairs of one head read the same Q / dO blocks), clocks [CTAs, 2] int64
    (each CTA's first and last stamp); grid = clocks' rows."""

    OPERANDS = ("dst", "src", "clocks")
    SCALARS = ()

    @staticmethod
    def fake_inputs(cfg):
        return fake_tensor(Float32, 2, 4), fake_tensor(Float32, 2, 4), fake_tensor(Int64, 2, 2)

    def __init__(self, cfg: ReduceConfig):
        if (cfg.mode not in ("tma", "red", "both") or not 1 <= cfg.bufs <= 8
                or (cfg.loads and cfg.mode != "tma")):
            raise ValueError(f"ReduceBench: mode {cfg.mode!r}, bufs {cfg.bufs}, loads "
                             f"{cfg.loads} (loads with mode 'tma' only)")
        self.cfg = cfg

    @cute.jit
    def __call__(self, mDst: cute.Tensor, mSrc: cute.Tensor, mClk: cute.Tensor,
                 stream: cuda.CUstream):
        cfg = self.cfg
        s_layout = cute.make_layout((T, W, cfg.bufs), stride=(W, 1, T * W))
        l_layout = cute.make_layout((T, W, LOAD_BUFS), stride=(W, 1, T * W))
        tma = cpasync.make_tiled_tma_atom(cpasync.CopyReduceBulkTensorTileS2GOp(), mDst,
                                          cute.select(s_layout, mode=[0, 1]), (T, W))
        tma_ld = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mSrc,
                                             cute.select(l_layout, mode=[0, 1]), (T, W))
        smem = max((cfg.bufs + LOAD_BUFS) * T * W * 4 + 2048, SMEM_FLOOR)
        self.kernel(tma[0], tma[1], tma_ld[0], tma_ld[1], mDst, mSrc, mClk, s_layout,
                    l_layout).launch(grid=(mClk.shape[0], 1, 1), block=[THREADS, 1, 1],
                                     smem=smem, stream=stream)

    @cute.kernel
    def kernel(self, tma: cute.CopyAtom, gT: cute.Tensor, tma_ld: cute.CopyAtom,
               gL: cute.Tensor, mDst: cute.Tensor, mSrc: cute.Tensor, mClk: cute.Tensor,
               s_layout: cute.Layout, l_layout: cute.Layout):
        cfg = self.cfg
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        warp = tidx // 32
        alloc = cutlass.memory.SmemAllocator()
        sbuf = alloc.allocate_tensor(Float32, s_layout, byte_alignment=1024)
        lbuf = alloc.allocate_tensor(Float32, l_layout, byte_alignment=1024)
        bars = alloc.allocate_array(Int64, LOAD_BUFS)
        if tidx == 0:
            for b in cutlass.range_constexpr(LOAD_BUFS):
                cute.arch.mbarrier_init(bars + b, 1)
            cute.arch.mbarrier_init_fence()
        for e in cutlass.range(tidx, T * W * cfg.bufs, THREADS):   # staged once
            sbuf[e % (T * W) // W, e % W, e // (T * W)] = Float32(1.0)
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier()
        row_blocks = mDst.shape[0] // T
        ctas = mClk.shape[0]
        g = cute.local_tile(gT, (T, W), (None, None))   # (T, W, row blocks, 8)
        ts, tg = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(sbuf, 0, 2),
                                       cute.group_modes(g, 0, 2))
        gp = cute.local_tile(mDst, (T, W), (None, None))
        gl = cute.local_tile(gL, (T, W), (None, None))   # (T, W, row blocks, 8)
        tls, tlg = cpasync.tma_partition(tma_ld, 0, cute.make_layout(1),
                                         cute.group_modes(lbuf, 0, 2), cute.group_modes(gl, 0, 2))
        src_blocks = mSrc.shape[0] // T
        row, col = tidx // 2, (tidx % 2) * 16
        t0 = cute.arch.clock64()
        step = 2 if const_expr(cfg.mode == "both") else 1
        for p0 in cutlass.range(0, cfg.pieces, step, unroll=1):
            if const_expr(cfg.mode != "red"):
                if warp == 0:
                    cute.arch.cp_async_bulk_wait_group(cfg.bufs - 1, read=True)
                    cute.copy(tma, ts[None, (p0 // step) % cfg.bufs],
                              tg[None, (cta + ctas * (p0 // 8)) % row_blocks, p0 % 8])
                    cute.arch.cp_async_bulk_commit_group()
                    if const_expr(cfg.loads):   # the piece's load, LOAD_BUFS in flight
                        b = p0 % LOAD_BUFS
                        if p0 >= LOAD_BUFS:
                            cute.arch.mbarrier_wait(bars + b, (p0 // LOAD_BUFS - 1) & 1)
                        with cute.arch.elect_one():
                            cute.arch.mbarrier_arrive_and_expect_tx(bars + b, T * W * 4)
                        cute.copy(tma_ld, tlg[None, (p0 // 8) % src_blocks, p0 % 8],
                                  tls[None, b], tma_bar_ptr=bars + b)
            if const_expr(cfg.mode != "tma"):
                q = p0 + (step - 1)
                piece = gp[None, None, (cta + ctas * (q // 8)) % row_blocks, q % 8]
                for j in cutlass.range_constexpr(4):
                    ptr = cute.domain_offset((row, col + 4 * j), piece).iterator
                    v = Float32(1.0)
                    cute.arch.inline_ptx(_RED_ADD_F32X4, read_only_args=[ptr, v, v, v, v])
        if const_expr(cfg.mode != "red"):
            if warp == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=False)
                if const_expr(cfg.loads):   # each buffer's last load landed
                    for b in cutlass.range_constexpr(LOAD_BUFS):
                        loads_b = (cfg.pieces - b + LOAD_BUFS - 1) // LOAD_BUFS
                        if const_expr(loads_b > 0):
                            cute.arch.mbarrier_wait(bars + b, (loads_b - 1) & 1)
        cute.arch.fence_acq_rel_gpu()
        cute.arch.barrier()
        if tidx == 0:
            mClk[cta, 0] = t0
            mClk[cta, 1] = cute.arch.clock64()


def variants() -> dict:
    """{label: (config, CTAs, row blocks per CTA k, or 0: every CTA into the same 64 rows)}."""
    out = {}
    for ctas in (1, 16, 66, 132):
        for k in (1, 4, 64):
            for bufs in (1, 2, 4, 8) if k == 1 else (2,):
                out[f"tma bufs {bufs}, {ctas} CTAs, k {k}"] = (ReduceConfig(bufs=bufs), ctas, k)
            out[f"red, {ctas} CTAs, k {k}"] = (ReduceConfig(mode="red"), ctas, k)
            out[f"both bufs 2, {ctas} CTAs, k {k}"] = (ReduceConfig(mode="both"), ctas, k)
    for ctas in (66, 132):   # as many bytes loaded as reduced
        for k in (1, 4):
            out[f"tma bufs 2 + loads, {ctas} CTAs, k {k}"] = (ReduceConfig(loads=True), ctas, k)
    out["tma bufs 2, 132 CTAs, same 64 rows"] = (ReduceConfig(bufs=2), 132, 0)
    out["red, 132 CTAs, same 64 rows"] = (ReduceConfig(mode="red"), 132, 0)
    return out


def jobs() -> list:
    return experiment.bench_jobs(ReduceBench, (v[0] for v in variants().values()))


def run(dev, flush) -> dict:
    import torch

    from ffpa_cute.launch import jit_cache

    res = {}
    src = torch.randn(SRC_ROWS, COLS, device=dev, dtype=torch.float32)   # 16 MB: L2-resident
    for label, (cfg, ctas, k) in variants().items():
        rows = T * ctas * k if k else T
        dst = torch.zeros(rows, COLS, device=dev, dtype=torch.float32)
        clk = torch.zeros(ctas, 2, device=dev, dtype=torch.int64)
        fn = jit_cache().get(ReduceBench, cfg)
        r = res[label] = experiment.stamped_rate(lambda: fn(dst, src, clk), clk,
                                                 cfg.pieces * T * W * 4, dev, flush)
        print(f"{label:40s} {r['bytes_per_clock_sm']:6.1f} B/clk/SM {r['tb_per_s']:6.2f} TB/s "
              f" ({r['ms']:.3f} ms)", flush=True)
    return res


if __name__ == "__main__":
    raise SystemExit(experiment.main("perf.reduce_limits", __doc__, jobs, run))
