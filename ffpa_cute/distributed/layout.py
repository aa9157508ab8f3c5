"""Sequence layouts of context parallelism, and the cross-rank shape check.

Layouts of a global sequence of length N over W ranks (`dim` is the sequence dim, -2 in
[B, H, N, D]):

* "contiguous": rank r holds tokens [r N/W, (r+1) N/W).
* "zigzag": the sequence is cut into 2W equal chunks and rank r holds chunks r and 2W-1-r,
  concatenated in that order (local length 2 N/(2W)). Under a causal mask, a chunk's work grows
  with its index, so pairing an early chunk with a late one gives every rank the same work:
  ring attention's causal schedule needs this layout (`ring.schedule`).

`shard_sequence` / `unshard_sequence` convert a full sequence to one rank's shard and W shards
back (tests and perf.context_parallel use them). `check_shards` is the collective that makes a
shape mismatch between ranks a clear ValueError on every rank instead of a hang or garbage.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

LAYOUTS = ("zigzag", "contiguous")

__all__ = ["LAYOUTS", "check_shards", "shard_sequence", "unshard_sequence"]


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: accepted values are {', '.join(LAYOUTS)}")


def shard_sequence(x: torch.Tensor, rank: int, world_size: int, *, layout: str = "zigzag",
                   dim: int = -2) -> torch.Tensor:
    """Rank `rank`'s shard of the full sequence `x` (along `dim`) in `layout`: a view for
    "contiguous", a new tensor for "zigzag". N must be divisible by W ("contiguous") or 2W
    ("zigzag")."""
    _check_layout(layout)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    parts = world_size * (2 if layout == "zigzag" else 1)
    n = x.shape[dim]
    if n % parts:
        raise ValueError(f"sequence length {n} (dim {dim}) must be divisible by {parts} for "
                         f"the {layout} layout over {world_size} ranks")
    chunks = x.chunk(parts, dim)
    if layout == "contiguous":
        return chunks[rank]
    return torch.cat([chunks[rank], chunks[parts - 1 - rank]], dim)


def unshard_sequence(shards, *, layout: str = "zigzag", dim: int = -2) -> torch.Tensor:
    """The full sequence from the W ranks' shards (a list in rank order), inverse of
    `shard_sequence`."""
    _check_layout(layout)
    if layout == "contiguous":
        return torch.cat(list(shards), dim)
    halves = [s.chunk(2, dim) for s in shards]
    if any(len(h) != 2 or h[0].shape[dim] != h[1].shape[dim] for h in halves):
        raise ValueError("zigzag shards must have an even length along dim "
                         f"{dim}, got {[s.shape[dim] for s in shards]}")
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def check_shards(fn: str, q, k, v, group, flags=()) -> None:
    """Raise the same ValueError on every rank of `group` when the ranks' shards disagree.

    One all_gather of a few integers (shapes, dtype, `flags`): the K/V shards move between
    ranks in fixed-size buffers, so every rank must hold the same shapes, and uneven sequence
    shards are named as such.
    """
    sig = [*q.shape, *k.shape, v.shape[-1], zlib.crc32(str(q.dtype).encode()), *map(int, flags)]
    device = torch.device("cpu") if dist.get_backend(group) == "gloo" else q.device
    mine = torch.tensor(sig, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    rows = [t.tolist() for t in every]
    if all(r == rows[0] for r in rows):
        return
    nq, nkv = [r[2] for r in rows], [r[6] for r in rows]
    if len(set(nq)) > 1 or len(set(nkv)) > 1:
        raise ValueError(f"{fn}: uneven shard lengths across ranks: q lengths {nq}, k/v "
                         f"lengths {nkv} (ranks 0..{len(rows) - 1}); every rank must hold an "
                         "equal shard of the sequence")
    raise ValueError(f"{fn}: q/k/v shapes, dtype or flags differ across ranks (q, k shapes, "
                     f"Dv, dtype hash, flags per rank: {rows}); every rank must call it alike")
