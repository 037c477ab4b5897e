"""Gated activations of the routed experts, plain torch (the reference of the fused epilogue).

SiTU (Kimi-K3 "situ"), on the GEMM1 output split into gate = first I columns (w1) and up =
second I columns (w3), computed in fp32:
    g' = beta * tanh(g / beta) * sigmoid(g);  u' = linear_beta * tanh(u / linear_beta) (u when None)
    out = g' * u'
SiLU-and-mul: out = g * sigmoid(g) * u. Same numerics as SGLang's SituAndMul.forward_native /
SiluAndMul.forward_native when the input is given in the activation dtype.
"""

from __future__ import annotations

import torch

ACTIVATIONS = ("situ", "silu")


def gated_activation_f32(
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str = "situ",
    beta: float = 4.0,
    linear_beta: float | None = 25.0,
) -> torch.Tensor:
    """gate, up: [..., I] (any float dtype) -> float32 [..., I]."""
    g = gate.float()
    u = up.float()
    if activation == "situ":
        gp = beta * torch.tanh(g / beta) * torch.sigmoid(g)
        if linear_beta is not None:
            u = linear_beta * torch.tanh(u / linear_beta)
    elif activation == "silu":
        gp = torch.nn.functional.silu(g)
    else:
        raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {activation!r}")
    return gp * u


def situ_and_mul(x: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """x: [..., 2I] (gate then up) -> [..., I] in x's dtype."""
    d = x.shape[-1] // 2
    return gated_activation_f32(x[..., :d], x[..., d:], "situ", beta, linear_beta).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I] (gate then up) -> [..., I] in x's dtype."""
    d = x.shape[-1] // 2
    return gated_activation_f32(x[..., :d], x[..., d:], "silu").to(x.dtype)
