"""The one call contract of every MoE mode and its reference (errors name the argument): the W4A16
family (moe.py, moe_reference.py) and the FP4 tensor-core family (moe_fp4.py,
moe_fp4_reference.py) check their arguments here, each with its prepared-weights type."""

from __future__ import annotations

import torch

from ..activation import GatedActivation, as_gated_activation
from .weights import NVFP4MoEWeights

ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def validate_moe_inputs(
    hidden_states: torch.Tensor,
    weights: NVFP4MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: GatedActivation,
    out: torch.Tensor | None,
    *,
    weights_type: type = NVFP4MoEWeights,
    prepare_hint: str = "NVFP4MoEWeights.from_modelopt / from_mxfp4",
    unit_stride: bool = False,
) -> None:
    """hidden_states [M, H] bf16/fp16/fp32 (last dim contiguous); weights: a ``weights_type`` with
    the same H (``prepare_hint`` names how it is built); topk_weights float32 [M, k]; topk_ids
    int32/int64 [M, k]; activation: a GatedActivation; out [M, H] in hidden_states' dtype or None;
    every tensor on the weights' device; unit_stride: hidden_states' last dimension contiguous."""
    if not isinstance(weights, weights_type):
        raise TypeError(f"weights: expected {weights_type.__name__} (build it with {prepare_hint}), "
                        f"got {type(weights).__name__}")
    as_gated_activation(activation)
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states: expected [M, H], got shape {tuple(hidden_states.shape)}")
    if hidden_states.dtype not in ACT_DTYPES:
        raise TypeError(f"hidden_states: expected bfloat16, float16 or float32, got {hidden_states.dtype}")
    M, H = hidden_states.shape
    if H != weights.hidden_size:
        raise ValueError(f"hidden_states: hidden size {H} does not match the weights' H = {weights.hidden_size}")
    if unit_stride and hidden_states.stride(1) != 1:  # the FP4 modes' quantizers read whole rows
        raise ValueError("hidden_states: the last dimension must be contiguous (stride 1)")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M:
        raise ValueError(f"topk_ids: expected [M={M}, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids: expected int32 or int64, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights: shape {tuple(topk_weights.shape)} does not match topk_ids {tuple(topk_ids.shape)} "
            "(top-k mismatch)"
        )
    if topk_weights.dtype != torch.float32:
        raise TypeError(f"topk_weights: expected float32, got {topk_weights.dtype}")
    if topk_ids.shape[1] < 1:
        raise ValueError("topk_ids: top-k must be >= 1")
    named = {"hidden_states": hidden_states, "topk_weights": topk_weights, "topk_ids": topk_ids}
    if out is not None:
        named["out"] = out
        if tuple(out.shape) != (M, H) or out.dtype != hidden_states.dtype:
            raise ValueError(
                f"out: expected shape {(M, H)} and dtype {hidden_states.dtype}, got {tuple(out.shape)} {out.dtype}"
            )
    for name, t in named.items():
        if t.device != weights.device:
            raise ValueError(f"{name}: on {t.device}, but the weights are on {weights.device}")
