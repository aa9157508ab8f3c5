"""Kernel launch arguments packed without DLPack (common/tensors.py `RawTensorArg`): byte for
byte what `from_dlpack(...).mark_layout_dynamic(...)` hands the compiled host function, and the
executor of a real compiled kernel turns both into the same argument buffers."""

import ctypes

import pytest
import torch

from ffpa_cute.common import tensors
from ffpa_cute.common.tensors import RawTensorArg, dlpack_args, launch_args, raw_args_match

BF16 = torch.bfloat16


def views():
    base = torch.randn(3, 4, 40, 584, dtype=BF16)
    return [
        base[..., :512],                                  # sliced rows (row stride 584)
        base[1:, 1:, 3:, 64:576],                         # storage offset on every mode
        base.transpose(1, 2)[:, :, :2, :512],             # [B, N, H, D] memory as [B, H, N, D]
        torch.randn(1, 1, 1, 320, dtype=torch.float16),  # size-1 modes
        torch.randn(2, 8, 129),                           # lse / delta (fp32, three modes)
        torch.randn(2, 8, 132)[:, 1:, 4:],
    ]


def test_raw_args_match_dlpack():
    assert raw_args_match(*views())
    assert tensors._raw_args_ok()
    assert all(isinstance(a, RawTensorArg) for a in launch_args(*views()))


def test_mismatch_falls_back_to_dlpack(monkeypatch, caplog):
    tensors._raw_args_ok.cache_clear()
    monkeypatch.setattr(tensors, "raw_args_match", lambda *t: False)
    try:
        args = launch_args(*views())
        assert not any(isinstance(a, RawTensorArg) for a in args)
        assert "from_dlpack" in caplog.text
    finally:
        tensors._raw_args_ok.cache_clear()


@pytest.fixture(scope="module")
def wgmma_fwd():
    """A compiled WGMMA forward (sm_90a, CPU) and arguments for it."""
    import os

    from ffpa_cute.problem import AttnProblem
    from ffpa_cute.sm90.config import plan_fwd
    from ffpa_cute.sm90.fwd_sm90 import FFPAFwdSm90

    before = os.environ.get("CUTE_DSL_ARCH")
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    try:
        p = AttnProblem(dtype="bf16", batch=2, heads_q=4, heads_kv=2, seqlen_q=40, seqlen_kv=77,
                        head_dim=512, head_dim_v=512, causal=True)
        fn = FFPAFwdSm90.compile(plan_fwd(p, "sm_90a"))
    finally:
        if before is None:
            os.environ.pop("CUTE_DSL_ARCH")
        else:
            os.environ["CUTE_DSL_ARCH"] = before
    q = torch.randn(2, 4, 40, 584, dtype=BF16)[..., :512]
    k, v = (torch.randn(2, 2, 77, 512, dtype=BF16) for _ in range(2))
    out, lse = torch.empty(2, 4, 40, 512, dtype=BF16), torch.empty(2, 4, 40)
    return fn, (q, k, v, out, lse)


def test_executor_sees_the_same_arguments(wgmma_fwd):
    """A compiled WGMMA forward's executor: the same argument bytes from both packings."""
    import cuda.bindings.driver as cuda

    fn, ts = wgmma_fwd
    got = []
    for args in (dlpack_args(*ts), [RawTensorArg(t) for t in ts]):
        exe, _ = fn.execution_args.generate_execution_args(
            (*args, 0.125, 37, cuda.CUstream(0)), {})
        n = [48] * 4 + [40]
        got.append([ctypes.string_at(a, m) for a, m in zip(exe, n)] + [len(exe)])
    assert got[0] == got[1] and got[0][-1] == 8


def test_direct_launch_storage_matches_the_executor(wgmma_fwd):
    """`DirectLaunch`: its reused argument storage (tensors re-pointed in place, scale, offset,
    stream handle) holds the bytes the executor's own generation gives, call after call."""
    fn, ts = wgmma_fwd
    direct = tensors.DirectLaunch(fn, 5, [t.dim() for t in ts])
    assert direct.matches(fn, ts, 0.125, 37, 0x7F00)
    q2 = torch.randn(2, 4, 41, 512, dtype=BF16).transpose(1, 2)  # other shape and strides
    assert direct.matches(fn, (q2, *ts[1:]), 0.5, -3, 0)
    assert direct.descs[0].raw_bytes() == RawTensorArg(q2).raw_bytes()
    wrong = tensors.DirectLaunch(fn, 5, [t.dim() for t in ts])
    wrong.exe_args = wrong.exe_args[:-1]  # a layout the executor does not use: refused
    assert not wrong.matches(fn, ts, 0.125, 37, 0)


@pytest.mark.parametrize("t", views()[:1])
def test_raw_arg_is_cheaper(t):
    import time

    def cost(f, n=300):
        f()
        start = time.perf_counter()
        for _ in range(n):
            f()
        return time.perf_counter() - start

    assert cost(lambda: RawTensorArg(t)) < cost(lambda: dlpack_args(t))
