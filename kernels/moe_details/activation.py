"""The gated activations of GEMM1's epilogue, in fp32, shared by both kernel families: SiTU
(docs/facts.md#situ: beta tanh(g / beta) sigmoid(g) x the linear-capped up, linear_beta tanh(u / linear_beta))
and SiLU-and-mul. Written with exp of non-positive arguments only, so no input overflows.

tanh keeps fp32 relative accuracy at every magnitude (tests/test_situ_accuracy.py sweeps the
whole fp32 range against float64): (1 - e) / (1 + e) with e = exp(-2|x|) cancels as |x| -> 0
(relative error ~6e-8 / |x|, exactly 0 below ~2^-25), so below TANH_POLY_MAX an odd polynomial
takes over, whose coefficients come from bench/tanh_fit.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..activation import ACT_SILU, ACT_SITU  # noqa: F401 - the ids gated_act's ACT takes (0, 1)

# tanh(x) = x + x^3 P(x^2) on |x| < 0.75: P's coefficients (fp32, lowest power first), a minimax
# fit of the relative error (bench/tanh_fit.py: 3.2e-8 in float64, <= 1.9 x 2^-24 evaluated in
# fp32). At |x| >= 0.75 the exp form stays within 2.8 x 2^-24 (tests/test_situ_accuracy.py).
TANH_POLY_MAX = 0.75
TANH_POLY = (-0.3333306908607483, 0.13326521217823029, -0.0533902570605278, 0.019664907827973366,
             -0.004769484978169203)
_T = tl.constexpr(TANH_POLY_MAX)
_C0, _C1, _C2, _C3, _C4 = (tl.constexpr(c) for c in TANH_POLY)


@triton.jit
def _sigmoid(x):
    # exp of a non-positive argument only: no overflow for large |x|.
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _tanh(x):
    a = tl.abs(x)
    # One clamp serves both forms: at |x| >= 16 tanh is 1.0 in fp32 (e < 2^-46), so -2|x| never
    # overflows, and the polynomial, whose value is discarded there, stays finite (no inf - inf on
    # a lane that is thrown away). NaN propagates (min.NaN: a GPU's plain min would return 16).
    s = tl.minimum(a, 16.0, propagate_nan=tl.PropagateNan.ALL)
    # |x| >= 0.75: tanh(|x|) = (1 - e) / (1 + e), e = exp(-2|x|) <= 0.22, little cancellation.
    e = tl.exp(-2.0 * s)
    t_exp = (1.0 - e) / (1.0 + e)
    # |x| < 0.75 (where s = |x|): the odd polynomial x + x^3 P(x^2).
    z = s * s
    p = (((_C4 * z + _C3) * z + _C2) * z + _C1) * z + _C0
    t = tl.where(a < _T, s + (s * z) * p, t_exp)
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
