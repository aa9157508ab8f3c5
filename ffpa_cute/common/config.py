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
    FP8 forward's P V WGMMA reads V as): target arch and D (a multiple of 16)."""

    arch: str
    head_dim: int

    KERNEL: ClassVar[str] = "ffpa_cute.common.transpose:Transpose8"


@dataclass(frozen=True)
class CombineConfig:
    """Compile key of the split-KV decode's combine kernel (common/combine.py): target arch,
    the output dtype ("bf16" / "fp16") and Dv (a multiple of 4)."""

    arch: str
    dtype: str
    head_dim_v: int

    KERNEL: ClassVar[str] = "ffpa_cute.common.combine:SplitCombine"


__all__ = ["CombineConfig", "DeltaConfig", "TransposeConfig"]
