"""The call contract of the FP4 tensor-core modes, shared by kernels/moe_fp4.py and its plain-torch
reference kernels/moe_fp4_reference.py: argument validation (errors name the argument), the
static / dynamic choice of the intermediate's NVFP4 scale and the static SiTU scale."""

from __future__ import annotations

import torch

from ..activation import GatedActivation, as_gated_activation
from ..moe_details.validate import ACT_DTYPES
from .weights import FP4MMAWeights

ACT_QUANT_MODES = ("nvfp4", "mxfp8")


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


def validate_fp4_inputs(x, weights, topk_weights, topk_ids, activation, out, act_quant) -> None:
    """The call contract of fused_moe_fp4 (module docstring of moe_fp4): errors name the argument."""
    if not isinstance(weights, FP4MMAWeights):
        raise TypeError(f"weights: expected FP4MMAWeights or NVFP4MoEWeights, got {type(weights).__name__}")
    if act_quant not in ACT_QUANT_MODES:
        raise ValueError(f"act_quant: expected one of {ACT_QUANT_MODES}, got {act_quant!r}")
    as_gated_activation(activation)
    if x.dim() != 2 or x.dtype not in ACT_DTYPES:
        raise ValueError(f"hidden_states: expected [M, H] bfloat16/float16/float32, got {tuple(x.shape)} {x.dtype}")
    M, H = x.shape
    if H != weights.hidden_size:
        raise ValueError(f"hidden_states: hidden size {H} does not match the weights' H = {weights.hidden_size}")
    if x.stride(1) != 1:
        raise ValueError("hidden_states: the last dimension must be contiguous (stride 1)")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids: expected int32/int64 [M={M}, k], got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights: expected float32 {tuple(topk_ids.shape)}, got "
                         f"{tuple(topk_weights.shape)} {topk_weights.dtype}")
    if topk_ids.shape[1] < 1:
        raise ValueError("topk_ids: top-k must be >= 1")
    if out is not None and (tuple(out.shape) != (M, H) or out.dtype != x.dtype):
        raise ValueError(f"out: expected shape {(M, H)} and dtype {x.dtype}, got {tuple(out.shape)} {out.dtype}")
    for name, t in {"hidden_states": x, "topk_weights": topk_weights, "topk_ids": topk_ids, "out": out}.items():
        if t is not None and t.device != weights.device:
            raise ValueError(f"{name}: on {t.device}, but the weights are on {weights.device}")
