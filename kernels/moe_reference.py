"""Plain-torch reference of the fused NVFP4 gated MoE (the oracle of the tests and the demo)."""

from __future__ import annotations

import torch

from . import formats
from .activation import K3_SITU, GatedActivation
from .moe_details.validate import validate_moe_inputs
from .moe_details.weights import NVFP4MoEWeights
from .situ import gated_activation_f32


def fused_moe_nvfp4_reference(
    hidden_states: torch.Tensor,
    weights: NVFP4MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: GatedActivation = K3_SITU,
    routed_scaling_factor: float | None = None,
    out: torch.Tensor | None = None,
    round_gemm1_output: bool = False,
    config=None,
) -> torch.Tensor:
    """Same contract as :func:`k3nvfp4.kernels.moe.fused_moe_nvfp4`, in plain torch.

    Per (token, slot) with expert id e in [0, E) (other ids, e.g. -1, contribute nothing):
      h = x @ dequant(w13[e])^T in fp32, gate half x scale_2[e, 0], up half x scale_2[e, 1];
      a = act(gate, up) in fp32, rounded to the activation dtype (the intermediate);
      y = a @ dequant(w2[e])^T x w2_scale_2[e] in fp32;
    out = (sum over slots of topk_weight x y, in fp32) x routed_scaling_factor, cast to x's dtype
    (SGLang: moe_sum then multiply by routed_scaling_factor; None means 1).
    round_gemm1_output=True also rounds h to the activation dtype before the activation, as the
    two-pass runners (SGLang triton / marlin + SituAndMul) do. ``config`` is accepted and ignored.
    """
    validate_moe_inputs(hidden_states, weights, topk_weights, topk_ids, activation, out)
    M, H = hidden_states.shape
    E, I = weights.num_experts, weights.intermediate_size
    dtype = hidden_states.dtype
    acc = torch.zeros(M, H, dtype=torch.float32, device=hidden_states.device)
    x = hidden_states.float()
    ids = topk_ids.long()
    tw = topk_weights.float()
    w13q, w13s, w13s2, w2q, w2s, w2s2 = weights.to_modelopt()
    for e in range(E):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)  # reference: host sync is fine here
        if tok.numel() == 0:
            continue
        w13 = formats.dequantize_nvfp4(w13q[e], w13s[e], 1.0)
        w13 = torch.cat([w13[:I] * w13s2[e, 0], w13[I:] * w13s2[e, 1]])
        w2 = formats.dequantize_nvfp4(w2q[e], w2s[e], w2s2[e])
        h = x[tok] @ w13.t()
        if round_gemm1_output:
            h = h.to(dtype).float()
        a = gated_activation_f32(h[:, :I], h[:, I:], activation)
        a = a.to(dtype).float()
        y = a @ w2.t()
        acc.index_add_(0, tok, y * tw[tok, slot][:, None])
    if routed_scaling_factor is not None:
        acc = acc * routed_scaling_factor
    result = acc.to(dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result
