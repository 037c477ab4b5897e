"""The gated activations of GEMM1's epilogue, in fp32, shared by both kernel families: SiTU
(FACTS.md: beta tanh(g / beta) sigmoid(g) x the linear-capped up, linear_beta tanh(u / linear_beta))
and SiLU-and-mul. Written with exp of non-positive arguments only, so no input overflows."""

from __future__ import annotations

import triton
import triton.language as tl

ACT_SITU = 0
ACT_SILU = 1


@triton.jit
def _sigmoid(x):
    # exp of a non-positive argument only: no overflow for large |x|.
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _tanh(x):
    # tanh(|x|) = (1 - e) / (1 + e), e = exp(-2|x|) <= 1: no overflow for any x.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def gated_act(g, u, beta, linear_beta, ACT: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr):
    """fp32 gate/up -> fp32 activation (SiTU or SiLU-and-mul)."""
    if ACT == 0:
        gp = beta * _tanh(g / beta) * _sigmoid(g)
        if HAS_LINEAR_BETA:
            u = linear_beta * _tanh(u / linear_beta)
    else:
        gp = g * _sigmoid(g)
    return gp * u
