"""Kernels use cutlass-dsl's TVM-FFI calling convention (CPU, no GPU): a compiled kernel is a
TVM-FFI function that takes torch tensors, with the stream taken from the caller's environment;
the compile cache exports it with its TVM-FFI wrapper and loads it back as a callable."""

import pytest

from ffpa_cute.cache import JitCache
from ffpa_cute.common.config import DeltaConfig
from ffpa_cute.dispatch import kernel_class


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx next to the working directory


def test_compiled_kernel_is_a_tvm_ffi_function_that_exports_and_loads(tmp_path):
    import tvm_ffi

    cfg = DeltaConfig("sm_90a", "bf16", 512)
    cls = kernel_class(cfg)
    fn = cls.compile(cfg, options="--keep-ptx")
    assert "ld.global" in fn.__ptx__  # the device code is the kernel's, as without TVM-FFI
    cache = JitCache(tmp_path / "c", disk=True)
    cache.get(cls, cfg)
    assert cache.stats.compiles == 1 and len(list((tmp_path / "c").rglob("*.o"))) == 1
    fresh = JitCache(tmp_path / "c", disk=True)
    loaded = fresh.get(cls, cfg)
    assert fresh.stats.disk_loads == 1 and fresh.stats.compiles == 0
    assert isinstance(loaded, tvm_ffi.Function)
