"""Closed-form, bit-exact MXFP4 -> NVFP4 cast (tensor level).

CONTRACT STUB - to be implemented. See FACTS.md "The closed-form cast".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass(frozen=True)
class MXFP4Weight:
    """One MXFP4 matrix. packed: uint8 [out, in/2] (low nibble = even element);
    scale: uint8 E8M0 [out, in/32]; name: used in error messages (checkpoint tensor name)."""

    packed: torch.Tensor
    scale: torch.Tensor
    name: str = "weight"


@dataclass(frozen=True)
class NVFP4Weight:
    """One NVFP4 matrix. packed: uint8 [out, in/2]; scale: float8_e4m3fn [out, in/16];
    scale_2: float32 0-dim tensor."""

    packed: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor


@dataclass
class CastStats:
    """Exact statistics of a cast, counted in 32-element SOURCE blocks."""

    blocks: int = 0
    exact_blocks: int = 0
    zero_exponent_blocks: int = 0
    out_of_range_blocks: int = 0
    max_abs_err: float = 0.0


def cast_mxfp4_to_nvfp4(
    weights: Sequence[MXFP4Weight], *, backend: str = "auto"
) -> tuple[list[NVFP4Weight], CastStats]:
    """Cast matrices that share ONE scale_2 (w1 and w3 of an expert; or a single w2)."""
    raise NotImplementedError


def cast_expert(
    w1: MXFP4Weight, w3: MXFP4Weight, w2: MXFP4Weight, *, backend: str = "auto"
) -> tuple[NVFP4Weight, NVFP4Weight, NVFP4Weight, CastStats]:
    """Cast one expert: w1 and w3 share scale_2, w2 has its own."""
    raise NotImplementedError
