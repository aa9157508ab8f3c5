"""A cache directory filled by `python -m ffpa_cute.precompile` on a machine without a GPU makes a
GPU process compile nothing.

Run: precompile on the CPU box into DIR, bring DIR to the GPU machine, then
`FFPA_CUTE_PRECOMPILED_DIR=DIR pytest -m gpu tests/test_precompiled_gpu.py`.
"""

import os
import subprocess
import sys

import pytest

DIR = os.environ.get("FFPA_CUTE_PRECOMPILED_DIR")

CHILD = r"""
import json, os, torch, ffpa_cute
from ffpa_cute.cache import jit_cache
for d, causal in ((320, False), (512, True), (1024, False)):
    q, k, v = (torch.randn(1, 2, 257, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert "torch SDPA" not in ffpa_cute.explain(q, k, v, is_causal=causal)
    out = ffpa_cute.attention(q, k, v, is_causal=causal)
    assert torch.isfinite(out).all()
torch.cuda.synchronize()
print(json.dumps(jit_cache().info()))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not DIR, reason="set FFPA_CUTE_PRECOMPILED_DIR to a precompiled cache")
def test_precompiled_directory_means_zero_compiles():
    import json

    env = dict(os.environ, FFPA_CUTE_CACHE_DIR=DIR)
    env.pop("FFPA_CUTE_ARCH", None)
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["compiles"] == 0, info
    assert info["disk_loads"] == 3, info
