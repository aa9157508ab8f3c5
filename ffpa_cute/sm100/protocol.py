"""An executable model of the sm100 forward's mbarrier protocol, built from its config.

The kernels (skeleton_sm100.py: the forward, dV, dK, dQ) have three roles per CTA that meet only through mbarriers and the
in-order tensor pipe: the load thread (TMA into the QK and V rings), the MMA thread
(tcgen05.mma into the TMEM score buffers and the accumulator) and the 128 softmax threads (S,
dP -> P / dS in TMEM, the forward's O rescale, epilogue); with `multicast` the row tile's o_split CTAs form a cluster whose QK-ring
stages are filled by one CTA for all and released by all for one. Nothing of that can run here
(no sm_100 GPU), so this module runs the same programs, in the same order, over a model of the
hardware and checks what a hang or a race would break:

- mbarriers with phases, arrival counts and transaction bytes (`FwdConfigSm100.barriers()`:
  the counts and depths the kernel allocates): a phase completes when its arrivals are in and
  its expected bytes have landed; waits read a phase parity as `mbarrier.try_wait.parity`
  does, and a wait whose parity is ambiguous (the barrier two phases past it) is an error;
- TMA loads (multicast: one landing per destination CTA) completing later, in any order; each
  CTA's tensor pipe executing MMAs and `tcgen05.commit` arrivals (multicast: on every CTA of
  the mask) in issue order, later;
- every buffer (ring stage, TMEM score buffer, O) of every CTA with what it holds and who may
  still read it: a write while another unit may still read it, or a read of what was not
  written, is an error.

`run(cfg, blocks, seed)` interleaves all roles and units at random until everything finishes;
it raises `ProtocolError` on a deadlock or a hazard. tests/test_sm100_plan.py runs it over many
seeds and block counts, and checks that it catches injected faults.
"""

from __future__ import annotations

import random

from ..common.protocol import STAGE_BYTES, Barrier, ModelBase, ProtocolError
from .config import FwdConfigSm100


class Model(ModelBase):
    def __init__(self, cfg: FwdConfigSm100, blocks: int, seed: int):
        super().__init__()
        self.cfg, self.blocks, self.rng = cfg, blocks, random.Random(seed)
        self.ctas = cfg.cluster_size
        self.role_cfg = {"load": cfg, "mma": cfg}  # what each role was built from (tests: faults)
        self.bars = {self.bar(r, name, i): Barrier(arrivals) for r in range(self.ctas)
                     for name, (n, arrivals) in cfg.barriers().items() for i in range(n)}
        self.tma: list = []  # in-flight landings: (cta, stage buffer, tag, barrier)
        self.pipes: list[list] = [[] for _ in range(self.ctas)]  # each CTA's tensor pipe
        self.steps = 0

    # -------------------------------------------------------------- hardware
    def commit_targets(self, cta: int, name: str) -> range:
        """The CTAs a tcgen05.commit of `cta` on barrier `name` arrives at."""
        return range(self.ctas) if name == "qk_empty" else range(cta, cta + 1)

    def expected(self, cta: int, chunk: int) -> int:
        """The bytes CTA `cta` expects on a QK stage of chunk `chunk`: the whole stage (its
        owner's copy lands in every CTA)."""
        return STAGE_BYTES

    def owner(self, chunk: int) -> int:
        """The CTA that loads QK chunk `chunk` of every block (for the whole cluster)."""
        return chunk % self.ctas

    # -------------------------------------------------------------- the roles
    def load(self, r: int):
        """CTA r's load thread: per block n its QK-ring stages (each product's chunks), then
        the B operand's stages of block n - lookahead, as the MMA thread consumes them. Every
        CTA waits for its stage's release and expects the stage's bytes; the chunk's owner
        issues the copy to all."""
        cfg = self.role_cfg["load"]
        qk = v = 0
        for n in range(self.blocks + cfg.lookahead):
            if n < self.blocks:
                for p, chunks in enumerate(cfg.product_chunks):
                    for c in range(chunks):
                        s, rnd = qk % cfg.qk_stages, qk // cfg.qk_stages
                        while rnd and not self.done(self.bar(r, "qk_empty", s), rnd - 1):
                            yield
                        self.bars[self.bar(r, "qk_full", s)].arrive(
                            self.bar(r, "qk_full", s), self.expected(r, c))
                        if self.owner(c) == r:
                            for dst in range(self.ctas):
                                self.tma.append((f"{dst}:qk{s}", ("qk", n, p, c),
                                                 self.bar(dst, "qk_full", s)))
                        qk += 1
                        yield
            if n >= cfg.lookahead:
                yield from self.load_b(r, cfg, n - cfg.lookahead, v)
                v += cfg.v_blocks_per_tile

    def load_b(self, r: int, cfg, b: int, v: int):
        """The B operand's stages of block b (v: stages loaded before)."""
        for j in range(cfg.v_blocks_per_tile):
            s, rnd = (v + j) % cfg.v_stages, (v + j) // cfg.v_stages
            while rnd and not self.done(self.bar(r, "v_empty", s), rnd - 1):
                yield
            self.bars[self.bar(r, "v_full", s)].arrive(self.bar(r, "v_full", s), STAGE_BYTES)
            self.tma.append((f"{r}:v{s}", ("v", b, j), self.bar(r, "v_full", s)))
            yield

    def mma(self, r: int):
        """CTA r's MMA thread: block n's score products into their buffers (one product:
        buffer n % 2; two: S into 0 and dP into 1), a commit on s_full; then the accumulator
        MMAs of block n - lookahead once its P / dS is in TMEM (commit o_done); each ring stage
        is released by a commit once its MMAs ran (a QK stage on every CTA of the cluster)."""
        cfg = self.role_cfg["mma"]
        pipe, nbuf = self.pipes[r], cfg.score_bufs
        qk = v = 0
        for n in range(self.blocks + cfg.lookahead):
            if n < self.blocks:
                for p, chunks in enumerate(cfg.product_chunks):
                    buf = n % 2 if nbuf == 2 else p
                    for c in range(chunks):
                        s, rnd = qk % cfg.qk_stages, qk // cfg.qk_stages
                        while not self.done(self.bar(r, "qk_full", s), rnd):
                            yield
                        last = c == chunks - 1
                        pipe.append(("mma", [(f"{r}:qk{s}", ("qk", n, p, c))],
                                     [(f"{r}:S{buf}", ("S", n, p) if last
                                       else ("S partial", n, p))]))
                        pipe.append(("commit", "qk_empty", s, f"{r}:qk{s}"))
                        self.buf(f"{r}:qk{s}").readers.add("pipe")
                        qk += 1
                        yield
                pipe.append(("commit", "s_full", n % nbuf, None))
            if n >= cfg.lookahead:
                b = n - cfg.lookahead
                while not self.done(self.bar(r, "p_full", b % nbuf), b // nbuf):
                    yield
                for j in range(cfg.v_blocks_per_tile):
                    s, rnd = v % cfg.v_stages, v // cfg.v_stages
                    while not self.done(self.bar(r, "v_full", s), rnd):
                        yield
                    last = j == cfg.v_blocks_per_tile - 1
                    o_in = (None if b == 0 and j == 0 else ("O", b - 1) if j == 0
                            else ("O partial", b))  # the first MMA overwrites O
                    pipe.append(("mma", [(f"{r}:v{s}", ("v", b, j)),
                                         (f"{r}:S{b % nbuf}", ("P", b)), (f"{r}:O", o_in)],
                                 [(f"{r}:O", ("O", b) if last else ("O partial", b))]))
                    pipe.append(("commit", "v_empty", s, f"{r}:v{s}"))
                    self.buf(f"{r}:v{s}").readers.add("pipe")
                    v += 1
                    yield
                pipe.append(("commit", "o_done", 0, None))

    def softmax(self, r: int):
        """CTA r's softmax threads (one actor: they wait and arrive together): block n's scores
        (S[n % 2]; two products: S in 0 and dP in 1) -> P / dS over the first of them, an O
        rescale (the forward's: after PV[n-1], before P[n] is published) on some blocks, then
        the epilogue after the last accumulator MMA."""
        cfg, nbuf = self.cfg, self.cfg.score_bufs
        for n in range(self.blocks):
            while not self.done(self.bar(r, "s_full", n % nbuf), n // nbuf):
                yield
            for p in range(len(cfg.products)):
                self.read(f"{r}:S{n % 2 if nbuf == 2 else p}", ("S", n, p), "softmax")
            yield
            if n and cfg.rescales_acc and self.rng.random() < 0.3:  # the forward's rescale
                while not self.done(self.bar(r, "o_done"), n - 1):
                    yield
                self.read(f"{r}:O", ("O", n - 1), "softmax")
                self.write(f"{r}:O", ("O", n - 1), "softmax")  # rescaled in place
                yield
            self.write(f"{r}:S{n % nbuf}", ("P", n), "softmax")
            p_full = self.bar(r, "p_full", n % nbuf)
            for _ in range(cfg.barriers()["p_full"][1]):
                self.bars[p_full].arrive(p_full)
            yield
        if self.blocks:
            while not self.done(self.bar(r, "o_done"), self.blocks - 1):
                yield
            self.read(f"{r}:O", ("O", self.blocks - 1), "epilogue")

    # -------------------------------------------------------------- async units
    def land_tma(self) -> None:
        stage, tag, bar = self.tma.pop(self.rng.randrange(len(self.tma)))
        self.write(stage, tag, "TMA")
        self.bars[bar].complete_tx(STAGE_BYTES)

    def run_pipe(self, r: int) -> None:
        op = self.pipes[r].pop(0)
        if op[0] == "mma":
            for name, tag in op[1]:
                if tag is not None:
                    self.read(name, tag, "pipe")
            for name, tag in op[2]:
                self.write(name, tag, "pipe")
        else:
            _, name, i, released = op
            if released is not None:
                self.buf(released).readers.discard("pipe")
            for dst in self.commit_targets(r, name):
                self.bars[self.bar(dst, name, i)].arrive(self.bar(dst, name, i))

    def run(self, max_steps: int = 400000) -> int:
        roles = {f"{role}{r}": getattr(self, role)(r) for r in range(self.ctas)
                 for role in ("load", "mma", "softmax")}
        while roles or self.tma or any(self.pipes):
            self.steps += 1
            if self.steps > max_steps:
                raise ProtocolError(f"no progress after {max_steps} steps: deadlock "
                                    f"(roles left: {sorted(roles)})")
            units = sorted(roles) + ["tma"] * bool(self.tma) + [
                f"pipe{r}" for r in range(self.ctas) if self.pipes[r]]
            unit = units[self.rng.randrange(len(units))]
            if unit == "tma":
                self.land_tma()
            elif unit.startswith("pipe"):
                self.run_pipe(int(unit[4:]))
            else:
                try:
                    next(roles[unit])
                except StopIteration:
                    del roles[unit]
        return self.steps


def run(cfg: FwdConfigSm100, blocks: int, seed: int = 0) -> int:
    """Model one row tile (its cluster with `multicast`) of `blocks` KV blocks; the steps
    taken (raises ProtocolError)."""
    return Model(cfg, blocks, seed).run()


__all__ = ["Model", "ProtocolError", "run"]
