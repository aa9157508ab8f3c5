"""Ring attention: each rank holds a sequence shard of q, k, v; the K/V shards circulate around
the ring of ranks and every rank attends its queries to each of them in turn.

Forward (W ranks, rank r, step s = 0 .. W-1): the rank holds the K/V shard of rank
src = (r - s) mod W. It starts the transfer of that shard to rank r+1 (and the receipt of the
next one from rank r-1), computes the blocks `schedule` lists for (r, src) with
`blockwise.block_forward` (kernel or fallback, any causal offset), merges each block's
(out, lse) into running float32 accumulators (`merge.merge_into`, exact), then waits for the
transfer. Blocks the causal mask hides entirely are never computed.

Backward (the FlashAttention ring backward): a second pass around the ring with the global out
and lse saved by the forward. At each step the rank computes its block gradients given them
(`blockwise.block_backward`), adds dq locally, and adds dk / dv to the accumulator that travels
with the K/V shard: float32 dk / dv arrive from rank r-1 holding the earlier ranks' shares of
that shard, the rank adds its own and passes them on; after W steps every accumulator is back
with its owner.

Communication: `dist.batch_isend_irecv` (P2P: send to r+1, receive from r-1), double-buffered
(step s receives into the buffer step s-1 sent from). With NCCL the transfers run on NCCL's own
stream, which waits for the issuing stream only when they are posted, and `work.wait()` makes
the compute stream wait without blocking the host: the transfer of the next shard overlaps the
current blocks without a stream of our own. With gloo (CPU) the same calls run on gloo's
threads. Tags keep the K/V and the dK/dV messages apart (gloo matches by tag).

Causal attention needs the zig-zag layout (`layout.shard_sequence`): rank r holds global
chunks r and 2W-1-r of 2W, so for r's queries [a | b] (a = chunk r, b = chunk 2W-1-r):
  s = 0:       local causal attention (offset 0): a sees its own chunk causally, b sees a
               fully and itself causally, and nothing sees the later chunk b from a;
  src < r:     both halves see src's first chunk fully and its second chunk not at all;
  src > r:     only b sees anything: both of src's chunks, fully.
Every step after the first costs each rank two chunk-pairs: the load is balanced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import options as _options
from ..blockwise import block_backward, block_forward
from ..math_attention import compute_dtype
from ..merge import merge_into
from ..validate import check_args, check_return_lse
from .layout import check_shards

__all__ = ["LocalComm", "RingComm", "ring_attention", "ring_backward", "ring_forward",
           "schedule"]


# ------------------------------------------------------------------------------ communication


class _Pending:
    """Transfers in flight; `wait()` returns the receive buffers once they have arrived."""

    def __init__(self, works, received):
        self.works, self.received = works, received

    def wait(self):
        for w in self.works:
            w.wait()
        return self.received


class RingComm:
    """P2P shifts around the ring of `group`: each rank sends to the next and receives from
    the previous one."""

    def __init__(self, group=None):
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)

    def shift(self, tensors, into, tag: int) -> _Pending:
        """Start sending `tensors` to rank + 1 and receiving the same shapes from rank - 1 into
        `into`; message i uses tag `tag + i`."""
        nxt, prv = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=nxt, tag=tag + i)
               for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=prv, tag=tag + i)
                for i, t in enumerate(into)]
        return _Pending(dist.batch_isend_irecv(ops), into)


class LocalComm:
    """No communication: a shift "receives" the tensors it was given. The ring loop with this
    object runs rank `rank`'s blocks of a `world`-rank ring on its own shards, i.e. the
    compute of the ring without its transfers (perf.context_parallel's overlap figure)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def shift(self, tensors, into, tag: int) -> _Pending:
        return _Pending((), tuple(tensors))


# ------------------------------------------------------------------------------------ schedule


def schedule(rank: int, src: int, n: int, m: int, causal: bool):
    """The blocks rank `rank` computes with rank `src`'s K/V shard: a list of
    (query rows, key rows, causal, offset), rows as slices of the local shards (n query rows,
    m key rows; causal: zig-zag shards, n == m even). Hidden blocks are left out; the own shard
    (src == rank, step 0) is one block over every row."""
    if not causal:
        return [(slice(0, n), slice(0, m), False, 0)]
    every, half = slice(0, n), n // 2
    if src == rank:
        return [(every, every, True, 0)]
    if src < rank:
        return [(every, slice(0, half), False, 0)]
    return [(slice(half, n), every, False, 0)]


def _rows(t, rows):
    return t[:, :, rows]


# ----------------------------------------------------------------------------------- forward


def ring_forward(q, k, v, comm, *, causal: bool, scale, strict=None):
    """(out [B, Hq, n, Dv] in q.dtype, lse [B, Hq, n] float32 (float64 for float64 inputs)) of
    the local queries against every rank's K/V shard; `comm` is a RingComm (or LocalComm)."""
    rank, world, n = comm.rank, comm.world, q.shape[-2]
    acc_dtype = compute_dtype(q.dtype)
    out = lse = None
    buffers = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(2 if world > 1 else 0)]
    kv = (k, v)
    for step in range(world):
        pending = comm.shift(kv, buffers[step % 2], tag=0) if step + 1 < world else None
        for rows, cols, blk_causal, offset in schedule(rank, (rank - step) % world, n,
                                                       k.shape[-2], causal):
            o, s = block_forward(_rows(q, rows), _rows(kv[0], cols), _rows(kv[1], cols),
                                 causal=blk_causal, offset=offset, scale=scale, strict=strict)
            if out is None:  # step 0's block covers every row: it starts the accumulators
                out, lse = o.to(acc_dtype), s.to(acc_dtype, copy=True)
            else:
                merge_into(_rows(out, rows), _rows(lse, rows), o, s)
        if pending is not None:
            kv = pending.wait()
    return out.to(q.dtype), lse


# ---------------------------------------------------------------------------------- backward


def ring_backward(q, k, v, out, lse, dout, comm, *, causal: bool, scale, dlse=None):
    """(dq, dk, dv) in the inputs' dtypes for the local shards, given the forward's global out
    and lse of the local queries; dk / dv travel around the ring in float32 (float64 for
    float64 inputs) and reach their owner after `comm.world` steps."""
    rank, world, n = comm.rank, comm.world, q.shape[-2]
    acc_dtype = compute_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    grad_bufs = [(torch.empty(k.shape, dtype=acc_dtype, device=k.device),
                  torch.empty(v.shape, dtype=acc_dtype, device=v.device))
                 for _ in range(2 if world > 1 else 0)]
    kv_bufs = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(2 if world > 1 else 0)]
    kv, grads_in = (k, v), None
    for step in range(world):
        pending = comm.shift(kv, kv_bufs[step % 2], tag=0) if step + 1 < world else None
        blocks = []
        for rows, cols, blk_causal, offset in schedule(rank, (rank - step) % world, n,
                                                       k.shape[-2], causal):
            g = block_backward(_rows(q, rows), _rows(kv[0], cols), _rows(kv[1], cols),
                               _rows(out, rows), _rows(lse, rows), _rows(dout, rows),
                               causal=blk_causal, offset=offset, scale=scale,
                               dlse=None if dlse is None else _rows(dlse, rows))
            _rows(dq, rows).add_(g[0])
            blocks.append((cols, g[1], g[2]))
        if grads_in is None:  # this shard's accumulator starts here
            dkv = (torch.zeros(k.shape, dtype=acc_dtype, device=k.device),
                   torch.zeros(v.shape, dtype=acc_dtype, device=v.device))
        else:  # the earlier ranks' shares of this shard, received meanwhile
            dkv = grads_in.wait()
        for cols, dk_blk, dv_blk in blocks:
            _rows(dkv[0], cols).add_(dk_blk)
            _rows(dkv[1], cols).add_(dv_blk)
        grads_in = comm.shift(dkv, grad_bufs[step % 2], tag=2) if world > 1 else None
        if pending is not None:
            kv = pending.wait()
    dk, dv = grads_in.wait() if grads_in is not None else dkv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Ring forward; its backward is the ring backward (lse's gradient, when the loss reads
    it, through each block's Delta: Note [The gradient of lse] in math_attention.py)."""

    @staticmethod
    def forward(ctx, q, k, v, comm, causal, scale, strict):
        out, lse = ring_forward(q, k, v, comm, causal=causal, scale=scale, strict=strict)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = (comm, causal, scale)
        # the backward may run on autograd's device thread, which does not see `options.use`
        ctx.options = _options.current()
        ctx.set_materialize_grads(False)  # None for an output the loss does not read
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        comm, causal, scale = ctx.ring
        # every rank runs the ring backward (its collectives pair up across ranks), so a
        # missing gradient is a zero one here, never a skip
        dout = torch.zeros_like(out) if dout is None else dout
        with _options.use(ctx.options):
            grads = ring_backward(q, k, v, out, lse, dout, comm, causal=causal, scale=scale,
                                  dlse=dlse)
        grads = [g if need else None for g, need in zip(grads, ctx.needs_input_grad)]
        return (*grads, None, None, None, None)


# ---------------------------------------------------------------------------------- public


def ring_attention(q, k, v, group=None, *, is_causal=False, scale=None, enable_gqa=False,
                   strict=None, return_lse=False):
    """Exact attention over a sequence sharded across the ranks of `group` (None: WORLD).

    q [B, Hq, n, D], k [B, Hkv, m, D], v [B, Hkv, m, Dv]: this rank's shards; every rank holds
    shards of the same shapes. Returns this rank's rows of the attention of the gathered
    queries over the gathered keys: out [B, Hq, n, Dv], and with `return_lse` also lse
    [B, Hq, n] (float32; float64 for float64 inputs); both are differentiable.

    is_causal=True needs the zig-zag layout (`shard_sequence(x, rank, W)`, the default layout)
    and self-attention shards (n == m, n even); without it any layout works, as long as q and
    k/v rows of a rank belong together only through the layout the caller unshards with.
    Causal means query i sees key j iff j <= i in the global sequence. `scale`, `enable_gqa`
    and `strict` as in `ffpa_cute.attention`; every block routes like it (kernel or fallback).
    Gradients: the ring backward (dk / dv return to their owner around the ring).
    """
    err = (check_args(q, k, v, None, 0.0, is_causal, scale, enable_gqa)
           or check_return_lse(return_lse, 0.0))
    if err is not None:
        raise err
    _check_common("ring_attention", q, group)
    n, m = q.shape[-2], k.shape[-2]
    if is_causal and (n != m or n % 2):
        raise ValueError(f"ring_attention(is_causal=True) needs zig-zag self-attention shards: "
                         f"q and k/v of one even local length, got q {n}, k/v {m}")
    check_shards("ring_attention", q, k, v, group, flags=(is_causal,))
    comm = RingComm(group)
    out, lse = _RingAttention.apply(q, k, v, comm, is_causal, scale, strict)
    return (out, lse) if return_lse else out


def _check_common(fn, q, group):
    """What ring and Ulysses attention both require beyond `check_args`."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{fn} needs an initialized torch.distributed process group "
                           "(torch.distributed.init_process_group)")
    if q.dim() != 4:
        raise ValueError(f"{fn} takes [B, H, N, D] shards (4-D), got q of shape "
                         f"{tuple(q.shape)}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be None (WORLD) or a torch.distributed ProcessGroup, got "
                        f"{type(group).__name__}")
