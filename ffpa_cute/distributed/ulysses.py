"""Ulysses attention (DeepSpeed-Ulysses): an all-to-all turns sequence shards into head shards,
each rank runs ordinary attention over the whole sequence for its H/W heads, and a second
all-to-all turns the result back into sequence shards.

Per rank and call: three all-to-alls in (q, k, v) and one out (plus one for the lse), each
moving (W-1)/W of the tensor; no overlap with compute, but the attention itself is one
unsplit call (`ffpa_cute.attention`: kernel or fallback, with its own backward). It needs
Hq divisible by W; K/V heads divisible by W, or fewer K/V heads than ranks with W divisible by
Hkv (GQA / MQA: each K/V head is then repeated W / Hkv times before the exchange).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..interface import attention
from ..validate import check_args, check_return_lse
from .layout import LAYOUTS, check_shards, shard_sequence, unshard_sequence
from .ring import _check_common

__all__ = ["ulysses_attention"]


def _seq_to_heads(x, group, world):
    """[B, H, n, D] sequence shard -> [B, H/W, W n, D] head shard (the sequence in rank order)."""
    b, h, n, d = x.shape
    send = x.reshape(b, world, h // world, n, d).transpose(0, 1).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: rank j's rows of our heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // world, world * n, d)


def _heads_to_seq(y, group, world):
    """[B, H/W, W n, D] head shard -> [B, H, n, D] sequence shard (inverse of _seq_to_heads)."""
    b, hl, big_n, d = y.shape
    send = y.reshape(b, hl, world, big_n // world, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[j]: head group j of our rows
    return recv.transpose(0, 1).reshape(b, world * hl, big_n // world, d)


class _AllToAll(torch.autograd.Function):
    """One of the two exchanges (`to_heads`: sequence shard -> head shard, else back); its
    gradient is the other one."""

    @staticmethod
    def forward(ctx, x, group, world, to_heads: bool):
        ctx.comm = (group, world, to_heads)
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group, world)

    @staticmethod
    def backward(ctx, grad):
        group, world, to_heads = ctx.comm
        back = _heads_to_seq if to_heads else _seq_to_heads
        return back(grad.contiguous(), group, world), None, None, None


def _to_global_order(y, world, layout):
    """Head-shard rows (shards in rank order) -> the global sequence order."""
    if layout == "contiguous":
        return y
    return unshard_sequence(list(y.chunk(world, dim=-2)), layout=layout)


def _to_shard_order(y, world, layout):
    if layout == "contiguous":
        return y
    return torch.cat([shard_sequence(y, r, world, layout=layout) for r in range(world)], -2)


def ulysses_attention(q, k, v, group=None, *, is_causal=False, scale=None, enable_gqa=False,
                      strict=None, return_lse=False, layout="contiguous"):
    """Exact attention over a sequence sharded across the ranks of `group` (None: WORLD),
    through all-to-alls from sequence shards to head shards and back.

    q [B, Hq, n, D], k [B, Hkv, m, D], v [B, Hkv, m, Dv]: this rank's shards, the same shapes
    on every rank, in `layout` ("contiguous": rank r holds rows [r n, (r+1) n); "zigzag": as
    `ring_attention`, so one sharding serves both). Returns this rank's rows of the attention of
    the gathered sequence: out [B, Hq, n, Dv], and with `return_lse` (out, lse [B, Hq, n]).
    is_causal: query i sees key j iff j <= i globally (needs n == m). `scale`, `enable_gqa`,
    `strict` as in `ffpa_cute.attention`; gradients through autograd (the all-to-alls'
    backward is the reverse all-to-all).
    """
    err = (check_args(q, k, v, None, 0.0, is_causal, scale, enable_gqa)
           or check_return_lse(return_lse, 0.0))
    if err is not None:
        raise err
    _check_common("ulysses_attention", q, group)
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: accepted values are {', '.join(LAYOUTS)}")
    world = dist.get_world_size(group)
    hq, hkv, n, m = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    if hq % world:
        raise ValueError(f"ulysses_attention needs q heads ({hq}) divisible by the world size "
                         f"({world}); use ring_attention otherwise")
    if hkv % world and world % hkv:
        raise ValueError(f"ulysses_attention needs k/v heads ({hkv}) divisible by the world "
                         f"size ({world}), or the world size divisible by them")
    if is_causal and n != m:
        raise ValueError(f"ulysses_attention(is_causal=True) needs self-attention shards of "
                         f"one length, got q {n}, k/v {m}")
    check_shards("ulysses_attention", q, k, v, group, flags=(is_causal,))
    if hkv % world:  # fewer K/V heads than ranks: repeat each so every rank gets its own
        k, v = (t.repeat_interleave(world // hkv, dim=1) for t in (k, v))
    heads = [_to_global_order(_AllToAll.apply(t, group, world, True), world, layout)
             for t in (q, k, v)]
    res = attention(*heads, is_causal=is_causal, scale=scale,
                    enable_gqa=heads[0].shape[1] != heads[1].shape[1], strict=strict,
                    return_lse=return_lse)
    out, lse = res if return_lse else (res, None)
    out = _AllToAll.apply(_to_shard_order(out, world, layout), group, world, False)
    if not return_lse:
        return out
    lse = _AllToAll.apply(_to_shard_order(lse.unsqueeze(-1), world, layout), group, world, False)
    return out, lse.squeeze(-1)
