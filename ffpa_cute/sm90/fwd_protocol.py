"""An executable model of the forward's K ring under `shared_kv` (skeleton_sm90.py), built from
its config.

With `shared_kv` a K chunk that holds V's columns has two readers: QK[i] (the S warpgroup) and
PV[i] (the accumulator warpgroup owning those columns), and its last reader refills it with block
i + 2's chunk. Chunks past Dv are read by QK only and refilled by the S warpgroup with block
i + 1's. The P hand-over is the skeleton's (p_full / p_empty per buffer, P[i] published after
`publish_after` chunks of QK[i + 1]). This module runs the three warpgroups of one CTA as
`_score_tile`, `_acc_tile` and shared_ring.py's `_shared_pv`, `_refill_shared` and
`_refill_shared_v` order their steps, over common/protocol.py's model of the hardware, and
checks what a hang or a race would break: parity waits, TMA loads landing later in any order
(a stage is being written from the load's issue until it lands), WGMMAs reading from issue
until their warpgroup's wait_group, and every read finding the block it expects.
`run(cfg, blocks, seed)` interleaves the units at random speeds; tests/test_shared_kv.py runs
it over seeds and block counts and checks that it catches injected faults.
"""

from __future__ import annotations

import random

from ..common.protocol import STAGE_BYTES, Barrier, ModelBase
from .config import FwdConfigSm90


class SharedKVModel(ModelBase):
    """One CTA on a row tile of `blocks` key blocks. `faults` (tests: the model must catch
    them): "s_refills_v" (the S warpgroup refills V chunks after QK, as the plain ring does),
    "refill_before_wait" (an accumulator warpgroup refills before its PV has retired),
    "skip_slot" (block i's V chunks in slot 0 for every i)."""

    def __init__(self, cfg: FwdConfigSm90, blocks: int, seed: int, faults=()):
        super().__init__()
        if not cfg.shared_kv:
            raise ValueError("the model is of the shared_kv ring")
        self.cfg, self.n, self.rng, self.faults = cfg, blocks, random.Random(seed), set(faults)
        self.C, self.cv = cfg.num_k_chunks, cfg.v_chunks
        self.bars = {f"c{s}": Barrier(1) for s in range(cfg.k_stages)}
        self.bars.update({f"{x}{b}": Barrier(1 if x == "full" else 2)
                          for x in ("full", "empty") for b in (0, 1)})
        self.landing: list = []

    def stage(self, i: int, c: int) -> tuple[int, int]:
        """(stage, fill) of chunk c of block i: the stage's fill-th load (from 0) brings it, so
        its barrier's phase `fill` completes then (`RingSkeletonSm90._shared_stage` gives the
        same stage and fill % 2, the parity the kernel waits for)."""
        if c < self.cv:
            slot = 0 if "skip_slot" in self.faults else i % 2
            return slot * self.cv + c, i // 2
        return 2 * self.cv + c - self.cv, i

    def wait(self, bar: str, phase: int):
        """Until phase `phase` (from 0) of `bar` has completed; phase -1: at once (a parity
        wait on the phase before a fresh barrier's first)."""
        while phase >= 0 and not self.done(bar, phase):
            yield

    def load(self, i: int, c: int) -> None:
        """The TMA of chunk c of block i into its stage: the stage is written until it lands."""
        s, _ = self.stage(i, c)
        name = f"k{s}"
        self.write(name, None, "TMA")   # in flux: nobody may be reading it
        self.bars[f"c{s}"].arrive(name, STAGE_BYTES)
        self.landing.append((name, ("k", i, c), f"c{s}"))

    def land(self) -> None:
        name, tag, bar = self.landing.pop(self.rng.randrange(len(self.landing)))
        self.write(name, tag, "TMA")
        self.bars[bar].complete_tx(STAGE_BYTES)

    def read_chunk(self, i: int, c: int, who: str):
        s, phase = self.stage(i, c)
        yield from self.wait(f"c{s}", phase)
        self.read(f"k{s}", ("k", i, c), who, hold=True)

    # -------------------------------------------------------------- the warpgroups
    def score(self):
        """WG0 (`_score_tile` with `shared_kv`)."""
        n, C, cv, pa = self.n, self.C, self.cv, self.cfg.publish_after
        for j in range(C + cv):   # block 0, then block 1's V chunks
            if j < n * C:
                self.load(j // C, j % C)
        yield
        for i in range(n):
            for c in range(C):
                if c == pa and i > 0:
                    self.bars[f"full{(i - 1) % 2}"].arrive("full")
                yield from self.read_chunk(i, c, f"S.wgmma{c}")   # one commit group per chunk
                yield
                if c > 0:   # wait_group(1): chunk c - 1's WGMMAs retired
                    yield
                    self.release(f"S.wgmma{c - 1}")
                    self.refill_s(i, c - 1)
            if pa == C and i > 0:
                self.bars[f"full{(i - 1) % 2}"].arrive("full")
            yield
            self.release(f"S.wgmma{C - 1}")   # wait_group(0)
            self.refill_s(i, C - 1)
            yield                        # the score step
            b = i % 2
            yield from self.wait(f"empty{b}", i // 2 - 1)   # PV[i - 2] done
            self.write(f"p{b}", ("p", i), "S")
        if n > 0:
            self.bars[f"full{(n - 1) % 2}"].arrive("full")
        b = n % 2
        yield from self.wait(f"empty{b}", n // 2 - 1)
        self.write(f"p{b}", ("factors", n), "S")
        self.bars[f"full{b}"].arrive("full")

    def refill_s(self, i: int, c: int) -> None:
        if c >= self.cv and i + 1 < self.n:
            self.load(i + 1, c)
        elif c < self.cv and "s_refills_v" in self.faults and i + 2 < self.n:
            self.load(i + 2, c)

    def acc(self, half: int):
        """WG1 / WG2 (`_acc_tile`, `_shared_pv`, `_refill_shared_v`)."""
        n, per, who = self.n, self.cv // 2, f"O{half}.wgmma"
        for i in range(n):
            b = i % 2
            yield from self.wait(f"full{b}", i // 2)
            self.read(f"p{b}", ("p", i), who, hold=True)
            for j in range(per):
                yield from self.read_chunk(i, half * per + j, who)
            yield
            early = "refill_before_wait" in self.faults
            if early:
                self.refill_v(half, i)
            yield
            self.release(who)            # wait_group(0)
            self.bars[f"empty{b}"].arrive("empty")
            if not early:
                self.refill_v(half, i)
        b = n % 2
        yield from self.wait(f"full{b}", n // 2)
        self.read(f"p{b}", ("factors", n), f"O{half}")

    def refill_v(self, half: int, i: int) -> None:
        if "s_refills_v" in self.faults:
            return
        per = self.cv // 2
        if i + 2 < self.n:
            for j in range(per):
                self.load(i + 2, half * per + j)

    def run(self, max_steps: int = 200000) -> int:
        roles = {"S": self.score(), "O0": self.acc(0), "O1": self.acc(1)}
        return self.interleave(roles, {"land": (lambda: bool(self.landing), self.land)},
                               max_steps)


def run(cfg: FwdConfigSm90, blocks: int, seed: int = 0, faults=()) -> int:
    """Model one CTA of a `shared_kv` forward over `blocks` key blocks; the steps taken (raises
    ProtocolError)."""
    return SharedKVModel(cfg, blocks, seed, faults).run()


__all__ = ["SharedKVModel", "run"]
