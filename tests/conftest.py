"""Shared test setup: markers, seeding, an isolated compile cache, a clean routing state.

Markers:
  gpu  - needs CUDA; skipped automatically when torch.cuda.is_available() is False.
  slow - the full numerical grid; run with `-m slow` (the default tier is a documented subset).
"""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

# --keep-ptx compiles write <kernel function>.<arch>.ptx into CuTe DSL's dump directory and
# read it back; the DSL fixes that directory at its first compile (the working directory then),
# so parallel test processes (pytest-xdist) could overwrite each other's files of the same
# name. One directory per test process, set before the DSL is imported. The workers inherit
# the controller's environment (where this file ran first), so the directory is keyed by the
# process that made it, not by the variable being set; a directory the caller chose is the
# parent of the per-process ones.
if os.environ.get("FFPA_CUTE_TEST_DUMP_PID") != str(os.getpid()):
    _parent = os.environ.get("FFPA_CUTE_TEST_DUMP_PARENT", os.environ.get("CUTE_DSL_DUMP_DIR"))
    if _parent:
        os.environ["FFPA_CUTE_TEST_DUMP_PARENT"] = _parent
        os.makedirs(_parent, exist_ok=True)
    os.environ["CUTE_DSL_DUMP_DIR"] = tempfile.mkdtemp(prefix="ffpa_cute_ptx-", dir=_parent)
    os.environ["FFPA_CUTE_TEST_DUMP_PID"] = str(os.getpid())
    atexit.register(shutil.rmtree, os.environ["CUTE_DSL_DUMP_DIR"], True)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: full grid; the fast tier covers a subset")


def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto` (pyproject's addopts): one per CPU this process may use, at most
    8 (each compiling worker holds ~1-2 GB; more would not fit a small machine's memory)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(cpus or 1, 8))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """One fresh FFPA_CUTE_CACHE_DIR per test run, so no stale .o from another build is used.

    Honours an explicitly set FFPA_CUTE_CACHE_DIR (CI may point it at a warm, shipped cache).
    """
    if os.environ.get("FFPA_CUTE_CACHE_DIR"):
        yield os.environ["FFPA_CUTE_CACHE_DIR"]
        return
    path = str(tmp_path_factory.mktemp("ffpa_cute_cache"))
    os.environ["FFPA_CUTE_CACHE_DIR"] = path
    yield path
    os.environ.pop("FFPA_CUTE_CACHE_DIR", None)


@pytest.fixture(autouse=True)
def _clean_routing(monkeypatch):
    """Each test starts unpatched, non-strict, with empty plan/log caches."""
    from ffpa_cute import interface, sdpa_patch

    monkeypatch.delenv("FFPA_CUTE_STRICT", raising=False)
    interface._clear_caches()
    yield
    sdpa_patch.unpatch_sdpa()
    interface._clear_caches()


@pytest.fixture
def seed():
    """Seed torch's CPU and CUDA generators; returns the seed for messages."""
    torch.manual_seed(0)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(0)
    return 0
