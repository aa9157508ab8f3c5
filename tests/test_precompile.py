"""Precompile on a machine without a GPU, then a fresh cache over that directory compiles nothing."""

import pytest

from ffpa_cute import precompile
from ffpa_cute.cache import JitCache


def test_precompile_then_load_without_compiling(tmp_path):
    cache, plans = precompile.precompile("sm_90a", [320, 1024], ["bf16"], (False,), tmp_path,
                                         progress=False)
    assert len(plans) == 2 and cache.stats.compiles == 2
    fresh = JitCache(tmp_path, disk=True)
    for plan in plans:
        fresh.get(plan.kernel_cls, plan.cfg)
    assert fresh.stats.compiles == 0 and fresh.stats.disk_loads == 2


def test_cli(tmp_path, capsys):
    assert precompile.main(["--arch", "sm_120", "--head-dims", "512", "--dtypes", "fp16",
                            "--causal", "yes", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 kernels for sm_120a" in out and "1 compiled" in out
    assert len(list(tmp_path.rglob("*.o"))) == 1


def test_plans_dedupe_and_skip_uncovered():
    plans = precompile.plans_for("sm_80", [512, 512, 128], ["bf16", "fp32"], (False, True))
    assert len(plans) == 2  # D=128 and fp32 have no kernel; duplicates collapse


def test_bad_arch():
    with pytest.raises(ValueError, match="--arch"):
        precompile.normalize_arch("sm_70")
