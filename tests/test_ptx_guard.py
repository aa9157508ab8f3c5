"""The default kernels' PTX is the PTX the GPU tests ran (tests/ptx_guard.py explains)."""

import json

import pytest

import ptx_guard  # tests/ is on sys.path (pytest rootdir-relative import)

RECORD = json.loads(ptx_guard.RECORD.read_text())


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --keep-ptx writes the .ptx next to the working directory
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


@pytest.mark.parametrize("name", sorted(ptx_guard.kernels()))
def test_default_kernel_code_is_the_verified_code(name):
    cls, cfg = ptx_guard.kernels()[name]
    assert name in RECORD, f"{name}: not in tests/ptx_verified.json (python -m tests.ptx_guard)"
    entry = RECORD[name]
    assert entry["config"] == repr(cfg), f"{name}: the planner's config changed: {cfg}"
    assert ptx_guard.ptx_sha(cls, cfg) == entry["sha256"], (
        f"{name}: PTX differs from the code verified at {entry['verified_at']}; run the GPU tests "
        "on it, then `python -m tests.ptx_guard --verified-at <commit>`")
