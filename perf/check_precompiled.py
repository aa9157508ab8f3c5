"""Device check: with FFPA_CUTE_CACHE_DIR at a precompiled directory, nothing compiles."""

import json
import torch
import ffpa_cute
from ffpa_cute.cache import jit_cache
for d, causal in ((320, False), (512, True), (1024, False)):
    q, k, v = (torch.randn(1, 2, 257, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert "torch SDPA" not in ffpa_cute.explain(q, k, v, is_causal=causal)
    out = ffpa_cute.attention(q, k, v, is_causal=causal)
    assert torch.isfinite(out).all()
torch.cuda.synchronize()
print(json.dumps(jit_cache().info()))
