"""Compile cache: key stability, disk round trip, corrupt entries, fingerprints (no GPU)."""

import dataclasses
import json
import os
import subprocess
import sys


from ffpa_cute import cache as cache_mod
from ffpa_cute.cache import JitCache, fingerprint, key_hash


@dataclasses.dataclass(frozen=True)
class TinyCfg:
    arch: str = "sm_80"
    n: int = 4


class TinyKernel:
    """A real (tiny) CuTe function: compiles in well under a second, exports like a kernel (the
    TVM-FFI convention)."""

    compiles = 0

    @staticmethod
    def arch_of(cfg):
        return cfg.arch

    @classmethod
    def compile(cls, cfg):
        import cutlass
        import cutlass.cute as cute

        from ffpa_cute.common.compat import compile_target
        from ffpa_cute.common.tensors import compile_options

        @cute.jit
        def scale(x: cute.Tensor, s: cutlass.Float32):
            for i in cutlass.range_constexpr(cfg.n):
                x[i] = x[i] * s

        cls.compiles += 1
        fake = cute.runtime.make_fake_compact_tensor(cutlass.Float32, (cfg.n,))
        with compile_target(cfg.arch):
            return cute.compile(scale, fake, 1.0, options=compile_options())  # as kernels


def test_key_hash_is_stable_across_processes():
    cfg = TinyCfg()
    here = key_hash("TinyKernel", cfg)
    code = ("import dataclasses; from ffpa_cute.cache import key_hash\n"
            "@dataclasses.dataclass(frozen=True)\nclass TinyCfg:\n arch: str = 'sm_80'\n n: int = 4\n"
            "print(key_hash('TinyKernel', TinyCfg()))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert here == there
    assert key_hash("TinyKernel", TinyCfg(n=5)) != here
    assert key_hash("OtherKernel", cfg) != here


def test_kernels_outside_the_package_are_filed_with_their_source(tmp_path):
    """A kernel class defined outside ffpa_cute (an experiment's subclass in perf/, this test's
    TinyKernel) is filed under its qualname and its module's source hash, which the directory's
    fingerprint does not cover; the package's own kernels under their qualname alone."""
    import hashlib

    from ffpa_cute.sm90.fwd_sm90 import FFPAFwdSm90

    assert cache_mod.kernel_name(FFPAFwdSm90) == "FFPAFwdSm90"
    src = hashlib.sha256(open(__file__, "rb").read()).hexdigest()[:12]
    assert cache_mod.kernel_name(TinyKernel) == f"TinyKernel@{src}"
    cache = JitCache(tmp_path, disk=True)
    cache.get(TinyKernel, TinyCfg(n=3))
    name = "k" + key_hash(f"TinyKernel@{src}", TinyCfg(n=3)) + ".o"
    assert (cache.entry_dir("sm_80") / name).exists()


def test_fingerprint_changes_with_sources_version_and_arch():
    base = fingerprint("sm_90a", "src", "4.8.1")
    assert fingerprint("sm_90a", "src", "4.8.1") == base
    assert fingerprint("sm_90a", "src2", "4.8.1") != base
    assert fingerprint("sm_90a", "src", "4.9.0") != base
    assert fingerprint("sm_80", "src", "4.8.1") != base
    assert len(cache_mod.source_hash()) == 64


def test_memory_then_disk_round_trip(tmp_path):
    TinyKernel.compiles = 0
    c1 = JitCache(tmp_path, disk=True)
    f1 = c1.get(TinyKernel, TinyCfg())
    assert c1.get(TinyKernel, TinyCfg()) is f1 and c1.stats.mem_hits == 1
    assert c1.stats.compiles == 1
    d = c1.entry_dir("sm_80")
    assert oct(d.stat().st_mode & 0o777) == "0o700"
    objs = list(d.glob("*.o"))
    assert len(objs) == 1
    rec = json.loads((d / "manifest.jsonl").read_text().splitlines()[0])
    assert rec["config"] == {"arch": "sm_80", "n": 4} and rec["kernel"] == "TinyKernel"
    c2 = JitCache(tmp_path, disk=True)  # a "new process": empty memory, same directory
    c2.get(TinyKernel, TinyCfg())
    assert c2.stats.compiles == 0 and c2.stats.disk_loads == 1
    assert TinyKernel.compiles == 1


def test_corrupt_entry_is_recompiled(tmp_path):
    c1 = JitCache(tmp_path, disk=True)
    c1.get(TinyKernel, TinyCfg(n=3))
    (obj,) = c1.entry_dir("sm_80").glob("*.o")
    obj.write_bytes(b"not an object file")
    c2 = JitCache(tmp_path, disk=True)
    c2.get(TinyKernel, TinyCfg(n=3))
    assert c2.stats.compiles == 1 and c2.stats.disk_loads == 0
    c3 = JitCache(tmp_path, disk=True)
    c3.get(TinyKernel, TinyCfg(n=3))
    assert c3.stats.compiles == 0 and c3.stats.disk_loads == 1


def test_fingerprint_change_misses(tmp_path, monkeypatch):
    c1 = JitCache(tmp_path, disk=True)
    c1.get(TinyKernel, TinyCfg(n=2))
    monkeypatch.setattr(cache_mod, "source_hash", lambda: "edited sources")
    c2 = JitCache(tmp_path, disk=True)
    c2.get(TinyKernel, TinyCfg(n=2))
    assert c2.stats.compiles == 1
    assert c2.entry_dir("sm_80") != c1.entry_dir("sm_80")


def test_disk_cache_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("FFPA_CUTE_DISK_CACHE", "0")
    c = JitCache(tmp_path)
    c.get(TinyKernel, TinyCfg(n=1))
    assert not any(tmp_path.rglob("*.o"))


def test_env_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FFPA_CUTE_CACHE_DIR", str(tmp_path / "x"))
    assert JitCache().cache_dir == tmp_path / "x"
    assert os.fspath(cache_mod.default_cache_dir()) == os.fspath(tmp_path / "x")


def test_read_only_cache_dir_loads_and_compiles_in_memory(tmp_path, monkeypatch):
    """A shipped cache may be read-only: entries load, misses compile without writing."""
    warm = JitCache(tmp_path, disk=True)
    warm.get(TinyKernel, TinyCfg(n=1))
    d = warm.entry_dir("sm_80")
    real_open = open

    def no_write_open(path, mode="r", *a, **kw):  # root ignores chmod, so refuse writes here
        if "w" in mode and str(path).startswith(str(d)):
            raise PermissionError(13, "read-only", str(path))
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr("builtins.open", no_write_open)
    ro = JitCache(tmp_path, disk=True)
    assert ro.get(TinyKernel, TinyCfg(n=1)) is not None
    assert ro.stats.disk_loads == 1 and ro.stats.compiles == 0
    assert ro.get(TinyKernel, TinyCfg(n=7)) is not None
    assert ro.stats.compiles == 1
    assert len(list(d.glob("*.o"))) == 1


def test_gpu_job_lists_plan():
    """`tests.gpu_jobs` (every section, the sanitizer workload's among them) plans on the CPU
    as the device's precompile would: the default fused backward, the atomic-free kernels the
    tests pin with `deterministic`, and the gradient kernels in one CTA above 512."""
    import gpu_jobs

    jobs = gpu_jobs.jobs()
    names = {cls.__name__ for cls, _ in jobs}
    assert {"FFPABwdFusedSm90", "FFPABwdDQSm90", "FFPABwdDKSm90", "FFPABwdDVSm90"} <= names
    assert any(cls.__name__ == "FFPABwdDQSm90" and cfg.wide_o for cls, cfg in jobs)


def test_gpu_jobs_pack_takes_only_the_selected_entries(tmp_path, monkeypatch):
    """`python -m tests.gpu_jobs --pack`: the selected jobs' entries and no others, in an xz
    tarball laid out as the cache, which a new cache pointed at its unpacked copy loads
    without compiling (what a device call carries)."""
    import tarfile

    import gpu_jobs

    cache_dir = tmp_path / ".precache"
    c = JitCache(cache_dir, disk=True)
    want, other = TinyCfg(arch="sm_90a", n=4), TinyCfg(arch="sm_90a", n=8)
    c.get(TinyKernel, want)
    c.get(TinyKernel, other)
    monkeypatch.setattr(gpu_jobs, "jobs", lambda sections: [(TinyKernel, want),
                                                            (TinyKernel, TinyCfg("sm_90a", 2))])
    out = tmp_path / "p.tar.xz"
    assert gpu_jobs.pack(str(cache_dir), ("main",), str(out)) == (1, 1)
    with tarfile.open(out) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "dev", filter="data")
    assert names == [f".precache/{c.entry_dir('sm_90a').name}/"
                     f"k{key_hash(cache_mod.kernel_name(TinyKernel), want)}.o"]
    TinyKernel.compiles = 0
    c2 = JitCache(tmp_path / "dev" / ".precache", disk=True)
    c2.get(TinyKernel, want)
    assert c2.stats.compiles == 0 and c2.stats.disk_loads == 1


def test_jit_policy_at_run_time(tmp_path, caplog):
    """Options.jit: "error" raises JitCompileError for a kernel missing from the cache (naming
    it and the precompile command) and still loads what is there; "warn" compiles with a
    warning; a precompiling cache (jit="allow") compiles whatever the options say."""
    import logging

    import pytest

    from ffpa_cute import options

    precompiled = JitCache(tmp_path, disk=True, jit="allow")
    with options.use(jit="error"):
        precompiled.get(TinyKernel, TinyCfg(n=6))
        serving = JitCache(tmp_path, disk=True)   # a later process on the precompiled cache
        serving.get(TinyKernel, TinyCfg(n=6))
        assert serving.stats.disk_loads == 1 and serving.stats.compiles == 0
        with pytest.raises(cache_mod.JitCompileError, match=r"TinyKernel.*precompile"):
            serving.get(TinyKernel, TinyCfg(n=7))
    with options.use(jit="warn"), caplog.at_level(logging.WARNING, logger="ffpa_cute"):
        serving.get(TinyKernel, TinyCfg(n=7))
    assert serving.stats.compiles == 1
    assert any("compiling at run time" in r.getMessage() and "n=7" in r.getMessage()
               for r in caplog.records)
    assert options.from_env({"FFPA_CUTE_JIT": "Error"}).jit == "error"
    with pytest.raises(ValueError, match="FFPA_CUTE_JIT='never': accepted values are allow"):
        options.from_env({"FFPA_CUTE_JIT": "never"})
    with pytest.raises(ValueError, match="Options.jit='off'"):
        options.Options(jit="off")
