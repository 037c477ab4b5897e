"""Input validation shared by fused_moe_nvfp4 and its reference (errors name the argument)."""

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
) -> None:
    if not isinstance(weights, NVFP4MoEWeights):
        raise TypeError(
            f"weights: expected NVFP4MoEWeights (build it with NVFP4MoEWeights.from_modelopt), "
            f"got {type(weights).__name__}"
        )
    as_gated_activation(activation)
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states: expected [M, H], got shape {tuple(hidden_states.shape)}")
    if hidden_states.dtype not in ACT_DTYPES:
        raise TypeError(f"hidden_states: expected bfloat16, float16 or float32, got {hidden_states.dtype}")
    M, H = hidden_states.shape
    if H != weights.hidden_size:
        raise ValueError(f"hidden_states: hidden size {H} does not match the weights' H = {weights.hidden_size}")
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
