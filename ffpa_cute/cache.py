"""Compile cache: an in-memory dict plus a persistent on-disk cache of compiled kernels.

Key: `(kernel class qualname, cfg)` where cfg is a frozen dataclass of Python scalars (shape
*classes*, never tensors or sizes), so the key is stable across processes and pickles cleanly;
a class defined outside the package (an experiment's kernel) is filed under its qualname and its
module's source hash (`kernel_name`).

Disk layout: `$FFPA_CUTE_CACHE_DIR/<fingerprint>/<key hash>.o`, where the fingerprint
hashes the kernel sources (`common/`, `sm*/`), the cutlass-dsl version and the target arch, so a change
to any of them starts a fresh directory. Each entry is written under a per-key `flock` (racing
processes compile a key once), through a temporary name and `os.replace` (readers never see a
partial file); an entry that fails to load is deleted and recompiled. Directories are created
0700. `manifest.jsonl` records key -> file for humans. Turn the disk cache off with
`FFPA_CUTE_DISK_CACHE=0`.

The compiled `.o` files are what `python -m ffpa_cute.precompile` ships: compiled on a machine
without a GPU (CUTE_DSL_ARCH + fake tensors) and loaded on the GPU machine without compiling.
Kernels use cutlass-dsl's TVM-FFI calling convention, so an entry is exported with its TVM-FFI
wrapper and loaded with `cute.runtime.load_module(path, enable_tvm_ffi=True)`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import sys
import tempfile
import threading
import time

log = logging.getLogger("ffpa_cute")
_PKG_DIR = pathlib.Path(__file__).resolve().parent


def default_cache_dir() -> pathlib.Path:
    env = os.environ.get("FFPA_CUTE_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "ffpa_cute"


def kernel_sources() -> list[pathlib.Path]:
    """The files that shape generated code: the kernel families and their shared helpers.

    The API, dispatch and cache modules are left out on purpose: a compiled entry is fully
    described by its config (the key), so editing them must not invalidate shipped caches.
    """
    return sorted(p for p in _PKG_DIR.rglob("*.py")
                  if p.relative_to(_PKG_DIR).parts[0] == "common"
                  or p.relative_to(_PKG_DIR).parts[0].startswith("sm"))


def source_hash() -> str:
    """sha256 over the kernel sources (path + contents), sorted."""
    h = hashlib.sha256()
    for p in kernel_sources():
        h.update(str(p.relative_to(_PKG_DIR)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def cutlass_dsl_version() -> str:
    try:
        from importlib.metadata import version

        return version("nvidia-cutlass-dsl")
    except Exception:  # noqa: BLE001  (not installed as a distribution, e.g. --target staging)
        try:
            import cutlass

            return getattr(cutlass, "__version__", "unknown")
        except Exception:  # noqa: BLE001
            return "unknown"


def fingerprint(arch: str, src_hash: str | None = None, dsl_version: str | None = None) -> str:
    """Directory name for one (sources, cutlass-dsl version, target arch).

    The Python version is left out on purpose: an entry is a C-ABI object file (host stub +
    cubin) that any interpreter loads, and precompiling on a CI box with another Python than the
    GPU machine's must still hit.
    """
    parts = [src_hash or source_hash(), dsl_version or cutlass_dsl_version(), arch]
    return arch + "-" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def key_hash(kernel_name: str, cfg) -> str:
    """Stable across processes: built from the dataclass fields, never from id() or pickle."""
    fields = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    return hashlib.sha256(f"{kernel_name}|{type(cfg).__name__}|{fields}".encode()).hexdigest()[:32]


def kernel_name(kernel_cls) -> str:
    """The name a kernel class's entries are filed under: its qualname, and for a class defined
    outside this package (an experiment's subclass in perf/, a test's) also a hash of its
    module's source, which the directory's fingerprint (this package's kernel sources) does
    not cover: an edited experiment kernel then compiles anew instead of loading the old one."""
    name = kernel_cls.__qualname__
    if not kernel_cls.__module__.startswith(__package__ + "."):
        path = getattr(sys.modules.get(kernel_cls.__module__), "__file__", None)
        if path:
            name += "@" + hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()[:12]
    return name


def _mkdir_private(path: pathlib.Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)


@dataclasses.dataclass
class CacheStats:
    mem_hits: int = 0
    disk_loads: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0


class JitCompileError(RuntimeError):
    """A kernel missing from the cache while `Options.jit` is "error" (no compile at run time)."""


class JitCache:
    """`get(kernel_cls, cfg)` returns a callable compiled kernel, compiling at most once.

    kernel_cls must provide `compile(cfg)` (returns a cute compiled function, built from fake
    tensors, no GPU needed) and `arch_of(cfg)` (the target, e.g. "sm_90"). `jit`: what a compile
    is allowed to do ("allow", "warn", "error": `Options.jit`); None (the process cache) reads
    the options in force at each compile; precompiling passes "allow".
    """

    def __init__(self, cache_dir: pathlib.Path | str | None = None, disk: bool | None = None,
                 jit: str | None = None):
        self._dir = pathlib.Path(cache_dir) if cache_dir else None
        self._disk = disk
        self._jit = jit
        self._mem: dict = {}
        self._lock = threading.Lock()
        self.stats = CacheStats()
        self._fingerprints: dict[str, str] = {}

    @property
    def cache_dir(self) -> pathlib.Path:
        return self._dir or default_cache_dir()

    @property
    def disk_enabled(self) -> bool:
        if self._disk is not None:
            return self._disk
        return os.environ.get("FFPA_CUTE_DISK_CACHE", "1") != "0"

    def entry_dir(self, arch: str) -> pathlib.Path:
        if arch not in self._fingerprints:
            self._fingerprints[arch] = fingerprint(arch)
        return self.cache_dir / self._fingerprints[arch]

    def get(self, kernel_cls, cfg):
        key = (kernel_cls.__qualname__, cfg)
        fn = self._mem.get(key)
        if fn is not None:
            self.stats.mem_hits += 1
            return fn
        with self._lock:
            fn = self._mem.get(key)
            if fn is None:
                fn = self._load_or_compile(kernel_cls, cfg)
                self._mem[key] = fn
        return fn

    def _compile(self, kernel_cls, cfg):
        policy = self._jit
        if policy is None:
            from .options import current

            policy = current().jit
        if policy != "allow":
            what = (f"{kernel_cls.__qualname__} {cfg} for {kernel_cls.arch_of(cfg)} is not in "
                    f"{self.cache_dir if self.disk_enabled else 'the cache (disk cache off)'}")
            hint = ("precompile it (python -m ffpa_cute.precompile --arch ... --head-dims ... "
                    "--cache-dir DIR, then FFPA_CUTE_CACHE_DIR=DIR)")
            if policy == "error":
                raise JitCompileError(f"ffpa_cute: {what}, and Options.jit='error' forbids "
                                      f"compiling at run time: {hint}")
            log.warning("ffpa_cute: compiling at run time: %s; %s", what, hint)
        t0 = time.perf_counter()
        fn = kernel_cls.compile(cfg)
        dt = time.perf_counter() - t0
        self.stats.compiles += 1
        self.stats.compile_seconds += dt
        log.info("ffpa_cute: compiled %s %s in %.1f s", kernel_cls.__qualname__, cfg, dt)
        return fn

    def _load_or_compile(self, kernel_cls, cfg):
        if not self.disk_enabled:
            return self._compile(kernel_cls, cfg)
        name = "k" + key_hash(kernel_name(kernel_cls), cfg)
        d = self.entry_dir(kernel_cls.arch_of(cfg))
        obj = d / f"{name}.o"
        try:
            _mkdir_private(d)
            lockf = open(d / f"{name}.lock", "w")
        except OSError:
            # A read-only cache (e.g. a precompiled directory baked into an image): use what is
            # there, compile in memory what is not.
            fn = self._load(obj, name, delete_bad=False) if obj.exists() else None
            return fn if fn is not None else self._compile(kernel_cls, cfg)
        with lockf:
            fcntl.flock(lockf, fcntl.LOCK_EX)  # one compiler per key across processes
            try:
                if obj.exists():
                    fn = self._load(obj, name)
                    if fn is not None:
                        return fn
                fn = self._compile(kernel_cls, cfg)
                self._store(fn, d, name, kernel_cls, cfg)
                return fn
            finally:
                fcntl.flock(lockf, fcntl.LOCK_UN)

    def _load(self, obj: pathlib.Path, name: str, delete_bad: bool = True):
        import cutlass.cute as cute

        try:
            fn = getattr(cute.runtime.load_module(str(obj), enable_tvm_ffi=True), name)
        except Exception as e:  # noqa: BLE001  (corrupt or foreign entry: recompile)
            log.warning("ffpa_cute: cache entry %s unusable (%s); recompiling", obj, e)
            if delete_bad:
                with contextlib.suppress(OSError):
                    obj.unlink()
            return None
        self.stats.disk_loads += 1
        return fn

    def _store(self, fn, d: pathlib.Path, name: str, kernel_cls, cfg) -> None:
        try:
            with tempfile.TemporaryDirectory(dir=d, prefix=".tmp-") as tmp:
                fn.export_to_c(os.path.join(tmp, name + ".o"), name)
                os.replace(os.path.join(tmp, name + ".o"), d / (name + ".o"))  # atomic
            rec = {"file": name + ".o", "kernel": kernel_cls.__qualname__,
                   "config": dataclasses.asdict(cfg), "time": time.time()}
            with open(d / "manifest.jsonl", "a") as f:
                f.write(json.dumps(rec, sort_keys=True) + "\n")
        except Exception as e:  # noqa: BLE001  (a read-only or full disk must not break a call)
            log.warning("ffpa_cute: could not write cache entry %s in %s: %s", name, d, e)

    def clear_memory(self) -> None:
        self._mem.clear()

    def info(self) -> dict:
        return {"cache_dir": str(self.cache_dir), "disk": self.disk_enabled,
                "entries_in_memory": len(self._mem), **dataclasses.asdict(self.stats)}


_CACHE: JitCache | None = None


def jit_cache() -> JitCache:
    """The process-wide cache (directory read from the environment at first use)."""
    global _CACHE
    if _CACHE is None:
        _CACHE = JitCache()
    return _CACHE


def cache_info() -> dict:
    return jit_cache().info()
