"""Plain-torch SAME-QUANTIZATION reference of the FP4 tensor-core MoE (kernels/moe_fp4.py): the
activations and the intermediate are quantized by kernels/act_quant.py, the rules the Triton
quantizers implement, so a test against it sees only the kernels' arithmetic (fp32 accumulation
order), and the call contract is the kernels' own (moe_fp4_details/validate.py).

It is not an independent oracle: it shares the quantization rules and the contract with what it
checks. The independent oracle is in the tests: tests/fp4_spec.py (the quantizers written from
the NVFP4 / OCP MX specifications with ml_dtypes and numpy) and tests/fp4_moe_oracle.py (the
whole call on it, float64 dots, float64 SiTU), against which tests/test_fp4_oracle.py checks
act_quant, the Triton quantizers and fused_moe_fp4."""

from __future__ import annotations

import torch

from . import act_quant as aq
from . import formats
from .activation import K3_SITU, GatedActivation
from .moe_details.combine_reference import combine_slots
from .moe_details.validate import validate_moe_inputs
from .moe_fp4_details.validate import input_scale_value, intermediate_is_static
from .moe_fp4_details.weights import FP4_PREPARE_HINT, FP4MMAWeights
from .situ import gated_activation_f32


def fused_moe_fp4_reference(
    hidden_states: torch.Tensor,
    weights: FP4MMAWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: GatedActivation = K3_SITU,
    routed_scaling_factor: float | None = None,
    input_scale: float | torch.Tensor | None = None,
    intermediate_scale: str = "auto",
    out: torch.Tensor | None = None,
    config=None,
) -> torch.Tensor:
    """Same contract as :func:`fused_moe_fp4` (the mode is weights.act_quant), in plain torch
    (``config`` is ignored).

    nvfp4: x_q, x_s = quantize_nvfp4_rows(x) (per token); per (token, slot) with expert e:
      gate = (deq(x_q) @ deq(w1)^T) x x_s x scale_2[e, 0], up likewise with scale_2[e, 1];
      a = act(gate, up) in fp32; a_q, a_s = quantize_nvfp4_rows(a, static scale or dynamic);
      y = (deq(a_q) @ deq(w2)^T) x a_s x w2_scale_2[e] x topk_weight,
    where deq() leaves out the fp32 row / tensor scales (applied to the products, as the kernels do).
    mxfp8: MXFP8 activations and intermediate, MXFP4 weights (E8M0 scales, scale_2 folded in).
    out = (sum over slots in slot order of y) x routed_scaling_factor, cast to x's dtype.
    """
    validate_moe_inputs(hidden_states, weights, topk_weights, topk_ids, activation, out, weights_type=FP4MMAWeights,
                        prepare_hint=FP4_PREPARE_HINT, unit_stride=True)
    act_quant = weights.act_quant  # the mode the weights were prepared for
    M, H = hidden_states.shape
    k = topk_ids.shape[1]
    E, I = weights.num_experts, weights.intermediate_size
    nv = act_quant == "nvfp4"
    static_inter = intermediate_is_static(act_quant, intermediate_scale, activation)
    inter_s = activation.nvfp4_static_scale if static_inter else None
    in_s = input_scale_value(input_scale, act_quant)
    if nv:
        xq, xs, xrs = aq.quantize_nvfp4_rows(hidden_states, in_s)
        xd = aq.dequantize_nvfp4_rows(xq, xs, None)
    else:
        xq, xe = aq.quantize_mxfp8_rows(hidden_states)
        xd = aq.dequantize_mxfp8_rows(xq, xe)
    ids = topk_ids.long()
    ys = torch.zeros(M, k, H, dtype=torch.float32, device=hidden_states.device)
    for e in range(E):
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        if nv:
            w13 = formats.dequantize_nvfp4(weights.w13[e], weights.w13_scale[e], 1.0)
            w2 = formats.dequantize_nvfp4(weights.w2[e], weights.w2_scale[e], 1.0)
        else:
            w13 = formats.dequantize_mxfp4(weights.w13[e], weights.w13_e8m0[e])
            w2 = formats.dequantize_mxfp4(weights.w2[e], weights.w2_e8m0[e])
        h = xd[tok] @ w13.t()
        g, u = h[:, :I], h[:, I:]
        if nv:
            rs = xrs[tok][:, None]
            g = g * rs * weights.w13_scale_2[e, 0]
            u = u * rs * weights.w13_scale_2[e, 1]
        a = gated_activation_f32(g, u, activation)
        if nv:
            a_q, a_s, a_rs = aq.quantize_nvfp4_rows(a, inter_s)
            y = (aq.dequantize_nvfp4_rows(a_q, a_s, None) @ w2.t()) * a_rs[:, None] * weights.w2_scale_2[e]
        else:
            a_q, a_e = aq.quantize_mxfp8_rows(a)
            y = aq.dequantize_mxfp8_rows(a_q, a_e) @ w2.t()
        ys[tok, slot] = y * topk_weights[tok, slot][:, None]
    return combine_slots(ys, routed_scaling_factor, hidden_states.dtype, out)
