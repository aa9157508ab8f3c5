"""The pieces of an executable mbarrier-protocol model (sm100/protocol.py models the sm100
kernels, sm90/fused_protocol.py the fused sm90 backward): barriers with phases, arrival counts
and transaction bytes, and buffers that know what they hold and who may still read them. A
model runs a kernel's roles as generators over these and raises `ProtocolError` on a hang or a
hazard."""

from __future__ import annotations

from dataclasses import dataclass, field

STAGE_BYTES = 1  # the model's unit of a stage's transaction bytes


class ProtocolError(AssertionError):
    pass


@dataclass
class Barrier:
    count: int  # arrivals that complete a phase
    pending: int = 0
    tx: int = 0  # expected bytes not yet landed in the current phase (may go negative)
    phase: int = 0  # completed phases

    def _settle(self) -> None:
        if self.pending == self.count and self.tx == 0:
            self.pending, self.phase = 0, self.phase + 1

    def arrive(self, name: str, expect_tx: int = 0) -> None:
        self.pending += 1
        self.tx += expect_tx
        if self.pending > self.count:
            raise ProtocolError(f"{name}: {self.pending} arrivals for a phase of {self.count}")
        self._settle()

    def complete_tx(self, nbytes: int) -> None:
        self.tx -= nbytes
        self._settle()

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


class ModelBase:
    """What every protocol model shares: named barriers (`bars`, "cta:name[i]") and buffers
    (`bufs`), writes that may not overlap another unit's reads, reads that must find the data
    they expect (`hold`: the reader keeps reading until `release`), parity waits."""

    def __init__(self):
        self.bars: dict[str, Barrier] = {}
        self.bufs: dict[str, Buffer] = {}

    @staticmethod
    def bar(cta: int, name: str, i: int = 0) -> str:
        return f"{cta}:{name}[{i}]"

    def buf(self, name: str) -> Buffer:
        return self.bufs.setdefault(name, Buffer())

    def write(self, name: str, tag, who: str) -> None:
        b = self.buf(name)
        if b.readers - {who}:
            raise ProtocolError(f"{who} writes {name} while {sorted(b.readers)} may read it")
        b.valid = tag

    def read(self, name: str, tag, who: str, hold: bool = False) -> None:
        b = self.buf(name)
        if b.valid != tag:
            raise ProtocolError(f"{who} reads {name} expecting {tag}, it holds {b.valid}")
        if hold:
            b.readers.add(who)

    def release(self, who: str) -> None:
        """`who` has stopped reading every buffer it held."""
        for b in self.bufs.values():
            b.readers.discard(who)

    def done(self, bar: str, phase: int) -> bool:
        return self.bars[bar].done(bar, phase)

    def interleave(self, roles: dict, hardware: dict, max_steps: int) -> int:
        """Run `roles` (name -> generator, one step per `next`) and the hardware's units (name
        -> (has work?, one step)) in a random order until every role has finished and no unit
        has work left; each unit moves at a speed drawn per run from `self.rng` (skewed
        timings: one warpgroup far ahead of another, landings slow or fast). Returns the steps
        taken; raises ProtocolError after `max_steps` (a deadlock)."""
        speed = {u: self.rng.choice((0.1, 0.5, 1.0, 4.0)) for u in [*sorted(roles), *hardware]}
        self.steps = 0
        while roles or any(busy() for busy, _ in hardware.values()):
            self.steps += 1
            if self.steps > max_steps:
                raise ProtocolError(f"no progress after {max_steps} steps: deadlock "
                                    f"(roles left: {sorted(roles)})")
            units = sorted(roles) + [u for u, (busy, _) in hardware.items() if busy()]
            unit = self.rng.choices(units, [speed[u] for u in units])[0]
            if unit in hardware:
                hardware[unit][1]()
                continue
            try:
                next(roles[unit])
            except StopIteration:
                del roles[unit]
        return self.steps


__all__ = ["Barrier", "Buffer", "ModelBase", "ProtocolError", "STAGE_BYTES"]
