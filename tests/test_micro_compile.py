"""perf/micro on a CPU: every microbenchmark compiles for sm_90a with the instructions it claims,
without spills; the GPU-side drivers (`run`) run end to end on synthetic stamps.

The kernels themselves only run on an H200 (`python -m perf.micro`); nothing here launches one.
"""

import re
import shutil
import subprocess

import pytest
import torch

from perf import micro
from perf.micro import dsmem, smem_port, wgmma_order


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx into the working directory


def _ptxas(ptx: str):
    """(spill stores, spill loads, registers) from `ptxas -arch=sm_90a -v`, or None."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    r = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-", "-o", "/dev/null"], input=ptx,
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return None
    st = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    return int(st.group(1)), int(st.group(2)), int(regs.group(1))


def _check_common(ptx: str):
    assert ".target sm_90a" in ptx
    assert ".local" not in ptx, "local memory in PTX"
    assert "%clock64" in ptx
    res = _ptxas(ptx)
    if res is not None:
        assert res[:2] == (0, 0), f"spills {res}"


@pytest.mark.parametrize("n,mma,fill", [(128, True, True), (256, True, False), (64, True, True),
                                        (128, False, True)])
def test_smem_port_compiles(n, mma, fill):
    fn = smem_port.compile(smem_port.SmemPortBench(n, mma, fill),
                           smem_port.fake_args(n, 64, 4096, 132), options="--keep-ptx")
    ptx = fn.__ptx__
    _check_common(ptx)
    assert ("wgmma.mma_async.sync.aligned.m64n%dk16.f32.bf16.bf16" % n in ptx) == mma
    assert "cp.async.bulk.tensor.2d.shared::cta.global" in ptx  # A/B once; fill stream in B
    if mma:  # one warm-up group and the timed loop's group of k_tile/16 = 4 WGMMAs
        assert ptx.count("wgmma.mma_async") == 8
        assert "wgmma.wait_group.sync.aligned 	1" in ptx
    if mma and fill:  # the producer polls the consumer's stop barrier
        assert "mbarrier.test_wait" in ptx and "mbarrier.arrive.shared" in ptx
        # the fill stream issues 2 boxes of 128 x 64 per 32 KB tile, besides A and B
        assert ptx.count("cp.async.bulk.tensor") >= 4


def test_wgmma_order_compiles():
    chains = (8, 2)
    fn = wgmma_order.compile(wgmma_order.WgmmaOrderBench(chains),
                             wgmma_order.fake_args(132), options="--keep-ptx")
    ptx = fn.__ptx__
    _check_common(ptx)
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k16") == wgmma_order.GROUPS * sum(chains)
    assert ptx.count("wgmma.commit_group") == 2 * wgmma_order.GROUPS
    for g in range(wgmma_order.GROUPS):  # one stamp per retired group
        assert f"wgmma.wait_group.sync.aligned 	{g};" in ptx


@pytest.mark.parametrize("mode,method,bidir,spin", [("stream", "st_async", False, False),
                                                    ("stream", "bulk", True, False),
                                                    ("pingpong", "st_async", False, False),
                                                    ("pingpong", "st_async", False, True)])
def test_dsmem_compiles(mode, method, bidir, spin):
    fn = dsmem.compile(dsmem.DsmemBench(mode, method, bidir=bidir, spin=spin),
                       dsmem.fake_args(132), options="--keep-ptx")
    ptx = fn.__ptx__
    _check_common(ptx)
    assert "mapa.shared::cluster" in ptx and "barrier.cluster.arrive" in ptx
    if method == "st_async":
        assert "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32" in ptx
    else:
        assert "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes" in ptx
    if mode == "stream":  # the sender arms the peer's full barrier; the receiver frees remotely
        assert "mbarrier.arrive.expect_tx.release.cluster.shared::cluster" in ptx
        assert re.search(r"mbarrier\.arrive\.\S*cluster\S*shared::cluster", ptx)
    if spin:
        assert "mbarrier.test_wait" in ptx and "mbarrier.try_wait" not in ptx


def test_runtime_args_compile():
    """What `run` compiles on the GPU: kernels over from_dlpack tensors (CPU ones here)."""
    bf = torch.bfloat16
    st = torch.zeros(4, smem_port.STAMP_COLS, dtype=torch.int64)
    args = smem_port.make_args(torch.zeros(64, 64, dtype=bf), torch.zeros(128, 64, dtype=bf),
                               torch.zeros(1024, 128, dtype=bf), st)
    assert "wgmma.mma_async" in smem_port.compile(
        smem_port.SmemPortBench(128, True, True), args, options="--keep-ptx").__ptx__
    st = torch.zeros(4, dsmem.STAMP_COLS, dtype=torch.int64)
    assert "st.async" in dsmem.compile(dsmem.DsmemBench(), dsmem.make_args(st),
                                       options="--keep-ptx").__ptx__


# ---------------------------------------------------------------- drivers on synthetic stamps
SMS = 8


def _fake_env(monkeypatch, module, kernel):
    """Run `module.run` on the CPU: `kernel(bench, *torch_args)` writes plausible stamps."""
    monkeypatch.setattr(micro, "DEVICE", "cpu")
    monkeypatch.setattr(micro, "sm_count", lambda: SMS)
    monkeypatch.setattr(micro, "sync", lambda: None)
    monkeypatch.setattr(micro, "stream", lambda: None)
    monkeypatch.setattr(micro, "timed", lambda call, reps=3: (call(), 1.0)[1])
    monkeypatch.setattr(module, "make_args", lambda *ts: ts)
    monkeypatch.setattr(module, "compile", lambda bench, args: lambda *a: kernel(bench, *a))


def _smem_port_kernel(bench, a, b, fill, st, iters, n_fill, stream):
    st[:, 0] = torch.arange(len(st))
    st[:, 1], st[:, 2] = 1000, 1000 + iters * bench.k_blocks * bench.n // 2
    st[:, 3], st[:, 4], st[:, 5] = 900, 900 + 32768, 32  # 32 tiles of 32 KB: 32 B/clk


def _wgmma_order_kernel(bench, st, d0, d1, stream):
    g = wgmma_order.GROUPS
    for w, (chain, delay) in enumerate(zip(bench.chains, (d0, d1))):
        st[:, w, 0], st[:, w, 1], st[:, w, 2], st[:, w, 3] = 7, 100, 100 + delay, 150 + delay
        start = 100 + (0 if w == 0 else g * bench.chains[0] * 64)  # issue order, FIFO
        for k in range(g):
            st[:, w, 4 + k] = start + (k + 1) * chain * 64


def _dsmem_kernel(bench, st, count, stream):
    st[:, 0] = torch.arange(len(st))
    st[:, 1] = torch.arange(len(st)) % 2
    st[:, 2], st[:, 3] = 0, (count - 1) * bench.step_bytes // 16  # 16 B/clk; round trip 1/16
    st[:, 5] = count


def _check_rows(rows, bench):
    from perf.micro.__main__ import _table

    assert rows and all(r["benchmark"] == bench and r["metric"] != "error" for r in rows)
    assert _table(rows).count("\n") == len(rows) + 1


def test_smem_port_driver(monkeypatch):
    _fake_env(monkeypatch, smem_port, _smem_port_kernel)
    rows, notes = smem_port.run(iters=10, fill_tiles=4, l2_mb=1, hbm_mb=2)
    _check_rows(rows, "smem_port")
    got = {(r["variant"], r["metric"]): r["value"] for r in rows}
    assert got[("n128 mma", "cyc/wgmma")] == 64.0 and got[("n256 mma", "mma_smem")] == 80.0
    assert got[("n128 mma+fill L2 1MB", "total_smem")] == 96.0 + 32.0
    assert got[("fill HBM 2MB", "fill")] == 32.0


def test_wgmma_order_driver(monkeypatch):
    _fake_env(monkeypatch, wgmma_order, _wgmma_order_kernel)
    rows, notes = wgmma_order.run(reps=2)
    _check_rows(rows, "wgmma_order")
    together = {r["metric"]: r["value"] for r in rows if r["variant"].startswith("together")}
    assert together["first_done_frac"] == 0.5 and together["interleaved_groups"] == 0
    assert together["tc_busy"] == 1.0
    assert any("WG1.g3@" in n for n in notes)


def test_dsmem_driver(monkeypatch):
    _fake_env(monkeypatch, dsmem, _dsmem_kernel)
    rows, notes = dsmem.run(steps=100, rounds=16)
    _check_rows(rows, "dsmem")
    got = {(r["variant"], r["metric"]): r["value"] for r in rows}
    assert got[("st_async 16 KB/step one-way", "recv")] == 16.0
    assert got[("bulk 8 KB/step bidir", "errors")] == 0
    assert ("pingpong st_async 16 B, spin", "round_trip") in got


def test_cli_table_and_arguments():
    from perf.micro.__main__ import _table, main

    rows = [micro.row("b", "v", "m", 1.5, "clk")]
    assert _table(rows).splitlines()[-1] == "| b | v | m | 1.5 | clk |"
    with pytest.raises(SystemExit):
        main(["--which", "nope"])


@pytest.mark.parametrize("mode", ["hang", "crash"])
def test_cli_keeps_partial_rows(tmp_path, monkeypatch, mode):
    """A child that hangs (deadlocked kernel) or dies keeps the variants it checkpointed."""
    from perf.micro import __main__ as cli

    fake = tmp_path / "fake_python.sh"
    fake.write_text('#!/bin/bash\nout="${@: -1}"\n'
                    """echo '{"rows": [{"benchmark": "b", "variant": "v", "metric": "m", """
                    """"value": 1, "unit": "u"}], "notes": ["n"]}' > "$out.partial"\n"""
                    + ("sleep 20\n" if mode == "hang" else "echo 'boom' >&2; exit 3\n"))
    fake.chmod(0o755)
    monkeypatch.setattr(cli.sys, "executable", str(fake))
    rows, notes = cli._spawn("b", 10, timeout=1)
    assert [r["metric"] for r in rows] == ["m", "error"] and notes == ["n"]
    assert ("timed out" in rows[-1]["value"]) == (mode == "hang")
