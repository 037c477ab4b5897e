"""The FP4 tensor-core modes' own call options, shared by kernels/moe_fp4.py and its plain-torch
reference kernels/moe_fp4_reference.py: the static / dynamic choice of the intermediate's NVFP4
scale and the static input scale. The rest of the call contract is the one of every mode
(moe_details/validate.py)."""

from __future__ import annotations

import torch

from ..activation import GatedActivation
from .weights import FP4_ACT_QUANT_MODES as ACT_QUANT_MODES


def intermediate_is_static(act_quant: str, intermediate_scale: str, activation: GatedActivation) -> bool:
    """True: static NVFP4 scale of the intermediate (fused in GEMM1's epilogue), at
    activation.nvfp4_static_scale (the activation's bound / (6 x 448))."""
    if intermediate_scale not in ("auto", "static", "dynamic"):
        raise ValueError(f"intermediate_scale: expected 'auto', 'static' or 'dynamic', got {intermediate_scale!r}")
    if act_quant != "nvfp4":
        if intermediate_scale != "auto":
            raise ValueError("intermediate_scale: only for act_quant='nvfp4' (MXFP8 scales are per 32-block)")
        return False
    bounded = activation.bound is not None
    if intermediate_scale == "static" and not bounded:
        raise ValueError(f"intermediate_scale='static': activation {activation.describe()} has no bound, so no "
                         "static scale exists; use 'dynamic' or 'auto'")
    return bounded and intermediate_scale != "dynamic"


def input_scale_value(input_scale: float | torch.Tensor | None, act_quant: str) -> float | None:
    """The static NVFP4 activation scale as a python float (None: dynamic); errors name input_scale."""
    if input_scale is None:
        return None
    if act_quant != "nvfp4":
        raise ValueError("input_scale: only for act_quant='nvfp4' (MXFP8 has no per-tensor scale)")
    if isinstance(input_scale, torch.Tensor):
        if input_scale.numel() != 1:
            raise ValueError(f"input_scale: expected one scale (take the max over experts), got shape "
                             f"{tuple(input_scale.shape)}")
        input_scale = float(input_scale.reshape(()))  # host sync; a float avoids it
    s = float(input_scale)
    if not (s > 0 and s < float("inf")):
        raise ValueError(f"input_scale: must be a finite positive scale, got {s}")
    return s
