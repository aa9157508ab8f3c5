"""An executable model of the sm100 forward's mbarrier protocol, built from its config.

The kernel (fwd_sm100.py) has three roles that meet only through mbarriers and the in-order
tensor pipe: the load thread (TMA into the QK and V rings), the MMA thread (tcgen05.mma into the
TMEM score buffers and O) and the 128 softmax threads (S -> P in TMEM, O rescale, epilogue).
Nothing of that can run here (no sm_100 GPU), so this module runs the same programs, in the
same order, over a model of the hardware and checks what a hang or a race would break:

- mbarriers with phases and arrival counts (`FwdConfigSm100.barriers()`: the counts and
  depths the kernel allocates), waits on a phase parity as `mbarrier.try_wait.parity` does, and
  an error when a wait's parity is ambiguous (the barrier two phases past the awaited one);
- TMA loads completing later, in any order; the tensor pipe executing MMAs and
  `tcgen05.commit` arrivals in issue order, later;
- every buffer (ring stage, TMEM score buffer, O) with its readers and writers: a write while
  another role may still read it, or a read of what was not written, is an error.

`run(cfg, blocks, seed)` interleaves the roles at random until all finish; it raises
`ProtocolError` on a deadlock or a hazard. tests/test_sm100_plan.py runs it for hundreds of
steps over many seeds and block counts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .config import FwdConfigSm100


class ProtocolError(AssertionError):
    pass


@dataclass
class Barrier:
    count: int  # arrivals that complete a phase
    pending: int = 0
    phase: int = 0  # completed phases

    def arrive(self, name: str) -> None:
        self.pending += 1
        if self.pending > self.count:
            raise ProtocolError(f"{name}: {self.pending} arrivals for a phase of {self.count}")
        if self.pending == self.count:
            self.pending, self.phase = 0, self.phase + 1

    def done(self, name: str, phase: int) -> bool:
        """Whether phase `phase` has completed, as a parity wait sees it; a wait whose phase is
        two or more behind the barrier would be read as a later one by the hardware."""
        if self.phase > phase + 1:
            raise ProtocolError(f"{name}: waiting for phase {phase}, barrier at {self.phase}")
        return self.phase > phase


@dataclass
class Buffer:
    """What a buffer holds and who may still read it."""

    valid: object = None  # the tag of the data it holds (None: nothing valid)
    readers: set = field(default_factory=set)


class Model:
    def __init__(self, cfg: FwdConfigSm100, blocks: int, seed: int):
        self.cfg, self.blocks, self.rng = cfg, blocks, random.Random(seed)
        self.role_cfg = {"load": cfg, "mma": cfg}  # what each role was built from (tests: faults)
        self.bars = {f"{name}[{i}]": Barrier(arrivals)
                     for name, (n, arrivals) in cfg.barriers().items() for i in range(n)}
        self.bufs: dict[str, Buffer] = {}
        self.tma: list = []  # in-flight loads: (stage buffer, tag, barrier)
        self.pipe: list = []  # the tensor pipe's queue: ("mma", reads, writes) / ("commit", bar)
        self.steps = 0

    # -------------------------------------------------------------- hardware
    def buf(self, name: str) -> Buffer:
        return self.bufs.setdefault(name, Buffer())

    def write(self, name: str, tag, who: str) -> None:
        b = self.buf(name)
        if b.readers - {who}:
            raise ProtocolError(f"{who} writes {name} while {sorted(b.readers)} may read it")
        b.valid = tag

    def read(self, name: str, tag, who: str) -> None:
        if self.buf(name).valid != tag:
            raise ProtocolError(f"{who} reads {name} expecting {tag}, it holds "
                                f"{self.buf(name).valid}")

    def arrive(self, bar: str) -> None:
        self.bars[bar].arrive(bar)

    def done(self, bar: str, phase: int) -> bool:
        return self.bars[bar].done(bar, phase)

    # -------------------------------------------------------------- the roles
    def load(self):
        """The load thread: QK[0], then per block n V[n-1]'s stages after QK[n]'s, as the MMA
        thread consumes them (then V of the last block)."""
        cfg = self.role_cfg["load"]
        qk = v = 0
        for n in range(self.blocks + 1):
            if n < self.blocks:
                for c in range(cfg.num_k_chunks):
                    s, r = qk % cfg.qk_stages, qk // cfg.qk_stages
                    while r and not self.done(f"qk_empty[{s}]", r - 1):
                        yield
                    self.tma.append((f"qk{s}", ("qk", n, c), f"qk_full[{s}]"))
                    self.buf(f"qk{s}").valid = None  # being overwritten
                    qk += 1
                    yield
            if n:
                for j in range(cfg.v_blocks_per_tile):
                    s, r = v % cfg.v_stages, v // cfg.v_stages
                    while r and not self.done(f"v_empty[{s}]", r - 1):
                        yield
                    self.tma.append((f"v{s}", ("v", n - 1, j), f"v_full[{s}]"))
                    self.buf(f"v{s}").valid = None
                    v += 1
                    yield

    def mma(self):
        """The MMA thread: QK[n] into S[n % 2] (commit s_full), then PV[n-1] once P[n-1] is in
        TMEM (commit o_done); each ring stage is released by a commit once its MMAs ran."""
        cfg = self.role_cfg["mma"]
        qk = v = 0
        for n in range(self.blocks + 1):
            if n < self.blocks:
                for c in range(cfg.num_k_chunks):
                    s, r = qk % cfg.qk_stages, qk // cfg.qk_stages
                    while not self.done(f"qk_full[{s}]", r):
                        yield
                    self.pipe.append(("mma", [(f"qk{s}", ("qk", n, c))],
                                      [(f"S{n % 2}", ("S", n) if c == cfg.num_k_chunks - 1
                                        else ("S partial", n))]))
                    self.pipe.append(("commit", f"qk_empty[{s}]", f"qk{s}"))
                    self.buf(f"qk{s}").readers.add("pipe")
                    qk += 1
                    yield
                self.pipe.append(("commit", f"s_full[{n % 2}]", None))
            if n:
                b = n - 1
                while not self.done(f"p_full[{b % 2}]", b // 2):
                    yield
                for j in range(cfg.v_blocks_per_tile):
                    s, r = v % cfg.v_stages, v // cfg.v_stages
                    while not self.done(f"v_full[{s}]", r):
                        yield
                    last = j == cfg.v_blocks_per_tile - 1
                    o_in = (None if b == 0 and j == 0 else ("O", b - 1) if j == 0
                            else ("O partial", b))  # the first MMA overwrites O
                    self.pipe.append(("mma", [(f"v{s}", ("v", b, j)), (f"S{b % 2}", ("P", b)),
                                              ("O", o_in)],
                                      [("O", ("O", b) if last else ("O partial", b))]))
                    self.pipe.append(("commit", f"v_empty[{s}]", f"v{s}"))
                    self.buf(f"v{s}").readers.add("pipe")
                    v += 1
                    yield
                self.pipe.append(("commit", "o_done[0]", None))

    def softmax(self):
        """The softmax threads (one actor: they wait and arrive together): S[n] -> P[n] in
        place, an O rescale when the row max grew (after PV[n-1], before P[n] is published),
        then the epilogue after the last PV."""
        for n in range(self.blocks):
            while not self.done(f"s_full[{n % 2}]", n // 2):
                yield
            self.read(f"S{n % 2}", ("S", n), "softmax")
            yield
            if n and self.rng.random() < 0.3:  # the row max grew past the threshold
                while not self.done("o_done[0]", n - 1):
                    yield
                self.read("O", ("O", n - 1), "softmax")
                self.write("O", ("O", n - 1), "softmax")  # rescaled in place
                yield
            self.write(f"S{n % 2}", ("P", n), "softmax")
            for _ in range(self.cfg.barriers()["p_full"][1]):
                self.arrive(f"p_full[{n % 2}]")
            yield
        if self.blocks:
            while not self.done("o_done[0]", self.blocks - 1):
                yield
            self.read("O", ("O", self.blocks - 1), "epilogue")

    # -------------------------------------------------------------- async units
    def land_tma(self) -> bool:
        if not self.tma:
            return False
        stage, tag, bar = self.tma.pop(self.rng.randrange(len(self.tma)))
        self.write(stage, tag, "TMA")
        self.arrive(bar)
        return True

    def run_pipe(self) -> bool:
        if not self.pipe:
            return False
        op = self.pipe.pop(0)
        if op[0] == "mma":
            for name, tag in op[1]:
                if tag is not None:
                    self.read(name, tag, "pipe")
            for name, tag in op[2]:
                self.write(name, tag, "pipe")
        else:
            _, bar, released = op
            if released is not None:
                self.buf(released).readers.discard("pipe")
            self.arrive(bar)
        return True

    def run(self, max_steps: int = 200000) -> int:
        roles = {"load": self.load(), "mma": self.mma(), "softmax": self.softmax()}
        while roles or self.tma or self.pipe:
            self.steps += 1
            if self.steps > max_steps:
                raise ProtocolError(f"no progress after {max_steps} steps: deadlock "
                                    f"(roles left: {sorted(roles)})")
            choice = self.rng.randrange(len(roles) + 2)
            if choice == len(roles):
                self.land_tma()
            elif choice == len(roles) + 1:
                self.run_pipe()
            else:
                name = sorted(roles)[choice]
                try:
                    next(roles[name])
                except StopIteration:
                    del roles[name]
        return self.steps


def run(cfg: FwdConfigSm100, blocks: int, seed: int = 0) -> int:
    """Model one tile of `blocks` KV blocks; the steps taken (raises ProtocolError)."""
    return Model(cfg, blocks, seed).run()


__all__ = ["ProtocolError", "run"]
