"""Tensor-level code of kimi-k3-nvfp4: FP4 format codecs, the MXFP4 -> NVFP4 cast, and
the fused NVFP4 MoE kernels. No file I/O here."""

from . import formats
from .cast import CastStats, MXFP4Weight, NVFP4Weight, cast_expert, cast_mxfp4_to_nvfp4

__all__ = [
    "formats",
    "CastStats",
    "MXFP4Weight",
    "NVFP4Weight",
    "cast_expert",
    "cast_mxfp4_to_nvfp4",
]
