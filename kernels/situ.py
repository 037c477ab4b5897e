"""Gated activations of the routed experts, plain torch (the reference of the fused epilogue).

The activation is one value, :class:`k3nvfp4.kernels.activation.GatedActivation`; on the GEMM1
output split into gate = first I columns (w1) and up = second I columns (w3), in fp32:
    situ: g' = beta * tanh(g / beta) * sigmoid(g);  u' = linear_beta * tanh(u / linear_beta) (u when None)
          out = g' * u'
    silu: out = g * sigmoid(g) * u
Same numerics as SGLang's SituAndMul.forward_native / SiluAndMul.forward_native when the input is
given in the activation dtype.
"""

from __future__ import annotations

import torch

from .activation import K3_SITU, ActivationKind, GatedActivation, as_gated_activation


def gated_activation_f32(gate: torch.Tensor, up: torch.Tensor, activation: GatedActivation = K3_SITU) -> torch.Tensor:
    """gate, up: [..., I] (any float dtype) -> float32 [..., I]."""
    act = as_gated_activation(activation)
    g = gate.float()
    u = up.float()
    if act.kind is ActivationKind.SITU:
        gp = act.beta * torch.tanh(g / act.beta) * torch.sigmoid(g)
        if act.linear_beta is not None:
            u = act.linear_beta * torch.tanh(u / act.linear_beta)
    else:
        gp = torch.nn.functional.silu(g)
    return gp * u


def situ_and_mul(x: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """x: [..., 2I] (gate then up) -> [..., I] in x's dtype."""
    d = x.shape[-1] // 2
    return gated_activation_f32(x[..., :d], x[..., d:], GatedActivation.situ(beta, linear_beta)).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] (gate then up) -> [..., I] in x's dtype."""
    d = x.shape[-1] // 2
    return gated_activation_f32(x[..., :d], x[..., d:], GatedActivation.silu()).to(x.dtype)
