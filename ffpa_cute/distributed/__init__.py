"""Context parallelism on torch.distributed: attention over a sequence sharded across ranks.

* `ring_attention(q, k, v, group, is_causal=...)`: K/V shards circulate around the ring with
  P2P transfers overlapped with compute; partial results combine exactly through the
  log-sum-exp; causal runs on the zig-zag layout, so every rank does the same work; the
  backward sends dK / dV back around the ring (`ring.py`).
* `ulysses_attention(...)`: all-to-all from sequence shards to head shards and back
  (DeepSpeed-Ulysses), for heads >= ranks (`ulysses.py`).
* `shard_sequence` / `unshard_sequence`: the layouts ("zigzag", "contiguous"; `layout.py`).

Both route every attention call like `ffpa_cute.attention` (kernel where one serves it, else
the native fallback), so the same code runs exactly, if slowly, on CPU tensors with gloo.
Process groups are the caller's: pass `group` (None: the default group).
"""

from .layout import shard_sequence, unshard_sequence
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["ring_attention", "shard_sequence", "ulysses_attention", "unshard_sequence"]
