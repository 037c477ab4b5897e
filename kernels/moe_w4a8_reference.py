"""Plain-torch SAME-QUANTIZATION reference of the Hopper W4A8 MoE (kernels/moe_w4a8.py): the tokens and
the intermediate are quantized by kernels/act_quant.quantize_e4m3_groups (the rule the Triton
quantizers implement, bit for bit), the weights expanded by moe_details/e4m3_expand's torch
reference, and the arithmetic follows the kernels' order (per 128-column group an E4M3 product
times the tokens' scale, added in fp32; the row factor after the K loop), so a test against it
sees the kernels' fp32 summation order only.

It is not an independent oracle: it shares the quantization rules and the weight preparation with
what it checks. The independent oracle is tests/w4a8_oracle.py (numpy + ml_dtypes, float64),
against which tests/test_moe_w4a8.py checks the kernels."""

from __future__ import annotations

import torch

from . import act_quant as aq
from .activation import K3_SITU, GatedActivation
from .moe_details.combine_reference import combine_slots
from .moe_details.validate import validate_moe_inputs
from .moe_w4a8_details.weights import W4A8_PREPARE_HINT, W4A8MoEWeights
from .situ import gated_activation_f32


def _grouped_gemm(xq: torch.Tensor, xs: torch.Tensor, w_e4m3: torch.Tensor, group: int) -> torch.Tensor:
    """fp32 [R, N] = sum over groups g of (xq[:, g] @ w[:, g]^T) x xs[:, g] (E4M3 values as fp32)."""
    R, K = xq.shape
    acc = torch.zeros(R, w_e4m3.shape[0], dtype=torch.float32, device=xq.device)
    for gi, k0 in enumerate(range(0, K, group)):
        acc += (xq[:, k0:k0 + group].float() @ w_e4m3[:, k0:k0 + group].float().t()) * xs[:, gi:gi + 1]
    return acc


def fused_moe_w4a8_reference(
    hidden_states: torch.Tensor,
    weights: W4A8MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: GatedActivation = K3_SITU,
    routed_scaling_factor: float | None = None,
    out: torch.Tensor | None = None,
    config=None,
) -> torch.Tensor:
    """Same contract as :func:`k3nvfp4.kernels.moe_w4a8.fused_moe_w4a8`, in plain torch (``config``
    is ignored). Per (token, slot) with expert e: xq, xs = quantize_e4m3_groups(x);
    h = grouped(xq, xs, E4M3(w13[e])) x w13_row_scale[e]; a = act(gate, up) in fp32;
    aq, as = quantize_e4m3_groups(a); y = grouped(aq, as, E4M3(w2[e])) x w2_row_scale[e] x
    topk_weight; out = (sum over slots in slot order of y) x routed_scaling_factor, cast."""
    validate_moe_inputs(hidden_states, weights, topk_weights, topk_ids, activation, out, weights_type=W4A8MoEWeights,
                        prepare_hint=W4A8_PREPARE_HINT, unit_stride=True)
    M, H = hidden_states.shape
    k = topk_ids.shape[1]
    E, I = weights.num_experts, weights.intermediate_size
    g = aq.E4M3_GROUP
    xq, xs = aq.quantize_e4m3_groups(hidden_states, g)
    m13, m2 = weights.matrices()
    w13_all = m13.expand_e4m3().view(torch.float8_e4m3fn)  # [E, 2I, H]
    w2_all = m2.expand_e4m3().view(torch.float8_e4m3fn)  # [E, H, I]
    ids = topk_ids.long()
    ys = torch.zeros(M, k, H, dtype=torch.float32, device=hidden_states.device)
    for e in range(E):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        h = _grouped_gemm(xq[tok], xs[tok], w13_all[e], g) * weights.w13_row_scale[e][None, :]
        a = gated_activation_f32(h[:, :I], h[:, I:], activation)
        a_q, a_s = aq.quantize_e4m3_groups(a, g)
        y = _grouped_gemm(a_q, a_s, w2_all[e], g) * weights.w2_row_scale[e][None, :]
        ys[tok, slot] = y * topk_weights[tok, slot][:, None]
    return combine_slots(ys, routed_scaling_factor, hidden_states.dtype, out)
