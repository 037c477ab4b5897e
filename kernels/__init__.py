"""Tensor-level code of kimi-k3-nvfp4: FP4 format codecs, the MXFP4 -> NVFP4 cast, and
the fused NVFP4 MoE kernels. No file I/O here. ``k3nvfp4.kernels.testing`` (imported on its
own) builds seeded random NVFP4 experts and routings for tests, the tuner and benchmarks."""

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

# Fused NVFP4 gated MoE: one entry point, the prepared weights choose the mode (kernels/modes.py).
from .activation import K3_SITU, ActivationKind, GatedActivation  # noqa: E402
from .moe import FP4MMAWeights, MoEConfig, NVFP4MoEWeights, fused_moe_nvfp4, fused_moe_nvfp4_reference  # noqa: E402
from .situ import situ_and_mul, silu_and_mul  # noqa: E402

__all__ += [
    "ActivationKind",
    "FP4MMAWeights",
    "GatedActivation",
    "K3_SITU",
    "MoEConfig",
    "NVFP4MoEWeights",
    "fused_moe_nvfp4",
    "fused_moe_nvfp4_reference",
    "situ_and_mul",
    "silu_and_mul",
]
