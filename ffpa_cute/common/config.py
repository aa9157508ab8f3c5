"""Compile keys of the kernels every family shares (common/delta.py); imports no cutlass."""

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


__all__ = ["DeltaConfig"]
