"""Compile keys of the kernels every family shares (common/delta.py, transpose.py, combine.py);
imports no cutlass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class DeltaConfig:
    """Compile key of the Delta = rowsum(dO * O) kernel: target arch ("sm_80", "sm_90a",
    "sm_120a", ...), dtype, head dim (a multiple of 8)."""

    arch: str
    dtype: str
    head_dim: int

    KERNEL: ClassVar[str] = "ffpa_cute.common.delta:RowDot"


@dataclass(frozen=True)
class TransposeConfig:
    """Compile key of the 8-bit transpose kernel ([B, H, N, D] -> [B, H, D, N] bytes, what the
    FP8 forward's P V WGMMA reads V as): target arch and D (a multiple of 16). `interleave`:
    the keys of each 16-key group in the order the sm90 FP8 forward stores P (common/
    transpose.py, Note [Interleaved keys])."""

    arch: str
    head_dim: int
    interleave: bool = False

    KERNEL: ClassVar[str] = "ffpa_cute.common.transpose:Transpose8"


@dataclass(frozen=True)
class CombineConfig:
    """Compile key of the split-KV decode's combine kernel (common/combine.py): target arch,
    the output dtype ("bf16" / "fp16") and Dv (a multiple of 4)."""

    arch: str
    dtype: str
    head_dim_v: int

    KERNEL: ClassVar[str] = "ffpa_cute.common.combine:SplitCombine"


def deepest_rings(make, reason_of, min_k: int = 4):
    """The ring depths the forward-shaped planners pick (sm90: min_k 4, sm100: 3): the deepest
    V ring (4, 3, 2) that fits beside a min_k-deep score (K / QK) ring, then the deepest score
    ring (min_k..8) beside it. `make(k, v)` builds the config, `reason_of` is its
    can_implement; raises ValueError with the reason when none fits."""
    def fits(k, v):
        return reason_of(make(k, v)) is None

    v = next((v for v in (4, 3, 2) if fits(min_k, v)), None)
    if v is None:
        raise ValueError(reason_of(make(min_k, 2)))
    return make(max(k for k in range(min_k, 9) if fits(k, v)), v)


__all__ = ["CombineConfig", "DeltaConfig", "TransposeConfig", "deepest_rings"]
