"""An executable model of the fused sm90 backward's protocol (bwd_fused_sm90.py), built from
its config.

The kernel's hand-overs are its own: the pair's exchange of partial scores (st.async into the
peer's buffer, x_full / x_empty across the cluster; with `scatter` each of the cluster_d CTAs
sends every peer its owned groups, then the gathered P^T / dS^T groups through the same
buffers, two phases per block), P^T / dS^T from the S warpgroup to the dV
and dK warpgroups (p_full / p_empty), and Q / dO rings refilled by their last reader with no
"empty" barrier. This module runs the three warpgroups of every CTA as the kernel orders their
steps, over a model of the hardware (common/protocol.py), and checks what a hang or a race
would break:

- mbarriers with phases, arrival counts and transaction bytes; a parity wait two phases behind
  its barrier is an error (the hardware would read it as a later phase);
- TMA loads and the peer's st.async stores landing later, in any order;
- dQ's staged pieces read by TMA reductions (bulk groups) finishing in any order, a
  `wait_group.read n` passing once every group but the newest n has read its buffer;
- WGMMAs reading their operands from issue until the issuing warpgroup's wait_group(0); every
  buffer (K_r, V_r, the ring stages, P^T, dS^T, the exchange and dQ staging buffers) knows what
  it holds and who may still read it: a write while another unit may read it, or a read of
  anything but the expected block's data, is an error.

`run(cfg, blocks, seed)` interleaves every warpgroup, landing and reduction at random (each
unit at a speed drawn per run, so skewed timings are explored too) until all finish,
raising `ProtocolError` on a deadlock or a hazard; tests/test_bwd_fused.py runs it over seeds,
block counts and ring depths, and checks that it catches injected faults. The roles below
follow `FFPABwdFusedSm90._score_wg`, `_grad_wg` and `_grad_dq` step for step (each
`dq_grads`): a change to any of them belongs here too.
"""

from __future__ import annotations

import random

from ..common.protocol import STAGE_BYTES, Barrier, ModelBase
from .fused_config import FUSED_DQ_PIECE, BwdFusedConfigSm90

WG_THREADS = 128


class FusedModel(ModelBase):
    """Every CTA of a cluster (the pair, or `cluster_d`) on one key tile of `blocks` query
    blocks. `faults`: names of steps to drop or alter (tests: the model must catch them).
    `alternating`: the S warpgroup's dQ pieces (`dq_grads` 0) take the staging buffers in
    issue order across chunks and blocks, each waiting only for the group two back (the order
    `dq_grads` 1's pieces take), instead of its per-chunk order whose first piece waits for
    every group."""

    def __init__(self, cfg: BwdFusedConfigSm90, blocks: int, seed: int, faults=(),
                 alternating: bool = False):
        super().__init__()
        self.cfg, self.blocks, self.rng = cfg, blocks, random.Random(seed)
        self.faults, self.alternating = set(faults), alternating
        self.pieces = [w // FUSED_DQ_PIECE for w in cfg.dq_chunks]
        # (CTA, issuing warpgroup) -> its bulk groups, as issued, and those still reading:
        # a bulk group belongs to the thread that committed it
        self.order: dict[tuple, list] = {}
        self.groups: dict[tuple, set] = {}
        self.ranks = range(cfg.cluster_d)
        counts = {"kv": (1, 2), "q": (cfg.q_stages, 1), "do": (cfg.do_stages, 1),
                  "p_full": (1, WG_THREADS), "p_empty": (1, 8), "x_full": (1, 1),
                  "x_empty": (1, cfg.cluster_d - 1)}
        if "p_empty_count" in self.faults:  # one warp's arrival too few
            counts["p_empty"] = (1, 9)
        self.bars = {self.bar(r, name, i): Barrier(c) for r in self.ranks
                     for name, (k, c) in counts.items() for i in range(k)}
        self.landing: list = []  # in flight: (buffer, tag, barrier)

    # -------------------------------------------------------------- hardware
    def wait(self, bar: str, phase: int):
        while not self.done(bar, phase):
            yield

    def arrive(self, bar: str, times: int = 1, expect: int = 0) -> None:
        for t in range(times):
            self.bars[bar].arrive(bar, expect if t == 0 else 0)

    def load(self, r: int, ring: str, pos: int, block) -> None:
        """A TMA load of `block` into the stage of ring position pos of CTA r's ring (`ring`
        "q" or "do"), its bytes expected on the stage's barrier."""
        i = pos % (self.cfg.q_stages if ring == "q" else self.cfg.do_stages)
        self.arrive(self.bar(r, ring, i), expect=STAGE_BYTES)
        self.landing.append((f"{r}:{ring}{i}", (ring, block), self.bar(r, ring, i)))

    # -------------------------------------------------------------- the warpgroups
    def score(self, r: int):
        """WG0 of CTA r (`_score_wg`)."""
        cfg, me, n, j = self.cfg, f"S{r}", self.blocks, 0
        mma = me + ".wgmma"   # its WGMMAs' reads, held until its wait_group(0)
        own_dq = cfg.dq_grads == 0   # else the dV / dK warpgroups form dQ (`grad`)
        qs, ds = cfg.q_stages, cfg.do_stages
        kv = self.bar(r, "kv")
        for name in ("k", "v"):
            self.arrive(kv, expect=STAGE_BYTES)
            self.landing.append((f"{r}:{name}", (name, j), kv))
        for i in range(qs):
            if i < max(n, 1):
                self.load(r, "q", i, (j, i))
        for i in range(ds):
            if i < n:
                self.load(r, "do", i, (j, i))
        yield
        yield from self.wait(kv, 0)
        yield from self.scores(r, "q", 0, (j, 0), qs, j)
        self.release(mma)                                 # wait_group(0)
        if n > 0:
            yield from self.send(r, "S", 0)
        for i in range(n):
            b = i
            yield from self.scores(r, "do", b, (j, i), ds, j)
            if own_dq and i > 0:   # dQ(i-1)'s later chunks (at i == 0 a stale tile, dropped)
                self.read(f"{r}:dst", ("ds", b - 1), mma, hold=True)
                self.read(f"{r}:k", ("k", j), mma, hold=True)
            yield                                         # wait_group: dP^T done
            # dP^T's partial into the peers' buffers; our x_full armed for both parts
            for p in self.peers(r):
                self.landing.append((f"{p}:xdP.{r}", ("x", r, b), self.bar(p, "x_full")))
            self.arrive(self.bar(r, "x_full"), expect=2 * (len(self.ranks) - 1) * STAGE_BYTES)
            yield
            self.release(mma)                             # wait_group(0)
            if own_dq and i > 0:   # dQ(i-1)'s later chunks reduced
                yield from self.reduce(r, b - 1, range(1, len(self.pieces)))
            yield from self.wait(self.bar(r, "x_full"), self.phase(b))
            for p in self.peers(r):
                self.read(f"{r}:xS.{p}", ("x", p, b), me + "x", hold=True)
                self.read(f"{r}:xdP.{p}", ("x", p, b), me + "x", hold=True)
            yield                                         # the S threads' barrier
            self.release(me + "x")
            for p in self.peers(r):
                self.arrive(self.bar(p, "x_empty"))       # remote, cluster scope
            if cfg.scatter:
                yield from self.gather(r, b)
            if "no_p_empty_wait" not in self.faults and b > 0:
                yield from self.wait(self.bar(r, "p_empty"), b - 1)
            self.write(f"{r}:pt", ("p", b), me)
            self.write(f"{r}:dst", ("ds", b), me)
            nxt = min(i + 1, n - 1)
            self.arrive(self.bar(r, "p_full"), WG_THREADS)
            yield
            yield from self.scores(r, "q", nxt, (j, nxt), qs, j)
            if own_dq:   # dQ(i)'s first chunk
                self.read(f"{r}:dst", ("ds", b), mma, hold=True)
                self.read(f"{r}:k", ("k", j), mma, hold=True)
            yield
            self.release(mma)                             # wait_group(0)
            if i + 1 < n:
                yield from self.send(r, "S", b + 1)
            if own_dq:
                yield from self.reduce(r, b, [0])         # dQ(i)'s first chunk
        if own_dq and n > 0:   # the last block's later dQ chunks
            self.read(f"{r}:dst", ("ds", n - 1), mma, hold=True)
            self.read(f"{r}:k", ("k", j), mma, hold=True)
            yield
            self.release(mma)
            yield from self.reduce(r, n - 1, range(1, len(self.pieces)))
        yield from self.bulk_wait(r, me, 0)   # every piece read before the CTA exits

    def peers(self, r: int) -> list:
        return [p for p in self.ranks if p != r]

    def phase(self, b: int, second: bool = False) -> int:
        """The exchange barriers' phase of block b: one per block, or with `scatter` two (the
        partials', then the gathered P^T / dS^T groups')."""
        return 2 * b + second if self.cfg.scatter else b

    def send(self, r: int, part: str, b: int):
        """Block b's S^T partial (part "S") into the peers' buffers by st.async (with
        `scatter` only the groups each owns: one landing per peer still), once every peer has
        read what we sent for block b - 1 (x_empty), counted on the peer's x_full."""
        if "no_x_empty_wait" not in self.faults and b > 0:
            yield from self.wait(self.bar(r, "x_empty"), self.phase(b - 1, second=True))
        for p in self.peers(r):
            self.landing.append((f"{p}:x{part}.{r}", ("x", r, b), self.bar(p, "x_full")))
        yield

    def gather(self, r: int, b: int):
        """`_gather` (`scatter`): our x_full armed for the peers' P^T / dS^T groups; once every
        peer has read our partials (x_empty, the block's first phase) ours sent into their
        exchange buffers (where our S^T partial lay: the same smem), theirs waited for
        (x_full's second phase) and read, the S threads' barrier, x_empty's second phase on
        every peer."""
        me = f"S{r}"
        self.arrive(self.bar(r, "x_full"), expect=(len(self.ranks) - 1) * STAGE_BYTES)
        if "gather_before_read" not in self.faults:
            yield from self.wait(self.bar(r, "x_empty"), self.phase(b))
        for p in self.peers(r):
            self.landing.append((f"{p}:xS.{r}", ("g", r, b), self.bar(p, "x_full")))
        yield
        yield from self.wait(self.bar(r, "x_full"), self.phase(b, second=True))
        for p in self.peers(r):
            self.read(f"{r}:xS.{p}", ("g", p, b), me + "g", hold=True)
        yield                                             # the S threads' barrier
        self.release(me + "g")
        for p in self.peers(r):
            self.arrive(self.bar(p, "x_empty"))

    def reduce(self, r: int, b: int, chunks):
        """`_dq_reduce` of block b's chunks: per piece, the wait for its staging buffer, the S
        threads' writes, then a TMA reduction reading the buffer until its group finishes."""
        per_block = sum(self.pieces)
        for c in chunks:
            for p in range(self.pieces[c]):
                if self.alternating:
                    buf, unread = (b * per_block + sum(self.pieces[:c]) + p) % 2, 1
                else:
                    buf, unread = p % 2, (0 if p == 0 else 1)
                    if "chunk_wait_one" in self.faults:   # no drain at a chunk's start
                        unread = 1
                if "no_dq_wait" not in self.faults:
                    yield from self.bulk_wait(r, f"S{r}", unread)
                self.stage_piece(r, f"S{r}", buf, ("dq", b, c, p))
            yield

    def stage_piece(self, r: int, who: str, buf: int, tag) -> None:
        """A dQ piece written into staging buffer buf of CTA r by warpgroup `who`, then read by
        the TMA reduction of a new bulk group of `who`'s until that group finishes."""
        self.write(f"{r}:dq{buf}", tag, who)
        self.issue_piece(r, who, buf, tag)

    def issue_piece(self, r: int, who: str, buf: int, tag) -> None:
        """The TMA reduction of the piece in staging buffer buf of CTA r, a new bulk group of
        `who`'s reading it until that group finishes."""
        order = self.order.setdefault((r, who), [])
        group = f"{who}.bulk{len(order)}"
        self.read(f"{r}:dq{buf}", tag, group, hold=True)
        order.append(group)
        self.groups.setdefault((r, who), set()).add(group)

    def bulk_wait(self, r: int, who: str, unread: int):
        """`cp.async.bulk.wait_group.read unread` by warpgroup `who` of CTA r: every group it
        issued but the newest `unread` has finished reading."""
        issued = self.order.get((r, who), [])
        must = issued[:len(issued) - unread] if unread else issued
        live = self.groups.get((r, who), set())
        while any(g in live for g in must):
            yield

    def scores(self, r: int, ring: str, pos: int, block, stages: int, j: int):
        """`_scores`: wait the stage of ring position pos, then the WGMMAs reading it (and
        tile j's K_r or V_r) are in flight."""
        s, mma = pos % stages, f"S{r}.wgmma"
        yield from self.wait(self.bar(r, ring, s), pos // stages)
        self.read(f"{r}:{ring}{s}", (ring, block), mma, hold=True)
        kv = "k" if ring == "q" else "v"
        self.read(f"{r}:{kv}", (kv, j), mma, hold=True)
        yield

    def grad(self, r: int, which: int):
        """WG1 (which 0: dV, the dO ring) / WG2 (which 1: dK, the Q ring) of CTA r
        (`_grad_wg`, and `_grad_dq` when it forms a share of dQ)."""
        cfg, n, j = self.cfg, self.blocks, 0
        ring, stages = ("do", cfg.do_stages) if which == 0 else ("q", cfg.q_stages)
        a = "pt" if which == 0 else "dst"
        me = f"{'dV' if which == 0 else 'dK'}{r}"
        mma = me + ".wgmma"
        early = "refill_before_wait" in self.faults
        share = cfg.dq_shares[which][1] if cfg.dq_grads else 0
        for i in range(n):
            s = i % stages
            yield from self.wait(self.bar(r, "p_full"), i)
            yield from self.wait(self.bar(r, ring, s), i // stages)
            self.read(f"{r}:{a}", ("p" if which == 0 else "ds", i), mma, hold=True)
            self.read(f"{r}:{ring}{s}", (ring, (j, i)), mma, hold=True)
            if early and i + stages < n:
                self.load(r, ring, i + stages, (j, i + stages))
            yield
            if share:
                yield from self.grad_dq(r, which, i, share, mma, early)
                continue
            self.release(mma)                             # wait_group(0)
            self.arrive(self.bar(r, "p_empty"), 4)        # lane 0 of each warp
            if not early and i + stages < n:
                self.load(r, ring, i + stages, (j, i + stages))
            yield
        if share:
            yield from self.bulk_wait(r, me, 0)   # every piece read before the CTA exits

    def grad_dq(self, r: int, which: int, i: int, share: int, mma: str, early: bool):
        """`_grad_dq`: this warpgroup's share of block i's dQ, an atom at a time (its WGMMA
        reading dS^T and K_r), each piece through a staging buffer and a TMA reduction; the
        ring stage refilled after the first atom's wait, P^T / dS^T released after the
        last's."""
        cfg, n, j = self.cfg, self.blocks, 0
        ring, stages = ("do", cfg.do_stages) if which == 0 else ("q", cfg.q_stages)
        me = f"{'dV' if which == 0 else 'dK'}{r}"
        atom = cfg.atom_cols // FUSED_DQ_PIECE
        pieces, both = share // FUSED_DQ_PIECE, cfg.dq_grads == 1
        atoms = pieces // atom
        for t in range(atoms):
            self.read(f"{r}:dst", ("ds", i), mma, hold=True)
            self.read(f"{r}:k", ("k", j), mma, hold=True)
            for p in range(atom):
                k = t * atom + p
                own = cfg.dq_buffers // 2 if cfg.dq_grads == 2 else cfg.dq_buffers
                buf = (i * pieces + k) % own + (0 if both else which * own)
                if p == 0:
                    if t == 0 and "grad_release_early" in self.faults:
                        self.arrive(self.bar(r, "p_empty"), 4)
                    yield
                    self.release(mma)                     # wait_group(0)
                    if t == 0 and not early and i + stages < n:
                        self.load(r, ring, i + stages, (j, i + stages))
                    if t == atoms - 1 and "grad_release_early" not in self.faults:
                        self.arrive(self.bar(r, "p_empty"), 4)
                single = cfg.dq_buffers > 2   # the stores, then the wait (one barrier)
                unread = (own - 2 if single else (1 if both else 0)) + (
                    "grad_wait_lax" in self.faults)
                tag = ("dq", i, which, k)
                if single:
                    self.write(f"{r}:dq{buf}", tag, me)
                    yield
                    if "no_dq_wait" not in self.faults:
                        yield from self.bulk_wait(r, me, unread)
                    self.issue_piece(r, me, buf, tag)
                    yield
                    continue
                if "no_dq_wait" not in self.faults:
                    yield from self.bulk_wait(r, me, unread)
                self.stage_piece(r, me, buf, tag)
                yield

    # -------------------------------------------------------------- the interleaving
    def land(self) -> None:
        name, tag, bar = self.landing.pop(self.rng.randrange(len(self.landing)))
        self.write(name, tag, "TMA / st.async")
        self.bars[bar].complete_tx(STAGE_BYTES)

    def run(self, max_steps: int = 200000) -> int:
        roles = {}
        for r in self.ranks:
            roles[f"S{r}"] = self.score(r)
            roles[f"dV{r}"] = self.grad(r, 0)
            roles[f"dK{r}"] = self.grad(r, 1)
        return self.interleave(roles, {"land": (lambda: bool(self.landing), self.land),
                                       "bulk": (lambda: any(self.groups.values()), self.bulk)},
                               max_steps)

    def bulk(self) -> None:
        """A TMA reduction has read its piece (any of those still reading)."""
        reading = sorted(g for live in self.groups.values() for g in live)
        done = reading[self.rng.randrange(len(reading))]
        for live in self.groups.values():
            live.discard(done)
        self.release(done)


def run(cfg: BwdFusedConfigSm90, blocks: int, seed: int = 0, faults=(),
        alternating: bool = False) -> int:
    """Model the cluster (cfg.cluster_d CTAs) on one key tile of `blocks` query blocks
    (`alternating`: the schedule `FusedModel` names); the steps taken (raises
    ProtocolError)."""
    return FusedModel(cfg, blocks, seed, faults, alternating).run()


__all__ = ["FusedModel", "run"]
