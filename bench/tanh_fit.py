"""Derive the odd polynomial of the kernels' tanh below TANH_POLY_MAX (kernels/moe_details/activation.py).

tanh(x) = x + x^3 P(x^2) on 0 <= x <= T. P (n coefficients) minimises the maximum RELATIVE error
of tanh: rel(x) = x^3 / tanh(x) * (P(x^2) - f(x^2)), f = (tanh(x) - x) / x^3, by Lawson's
iteratively reweighted least squares on Chebyshev nodes, with mpmath (40 digits) as the truth so
that f does not cancel. Prints the float64 fit's error and the fp32 coefficients, then the error
of the fp32 evaluation (Horner, with and without FMA contraction) on a dense grid, in 2^-24.

    .venv/bin/python -P bench/tanh_fit.py [--max 0.75] [--terms 5]
"""

from __future__ import annotations

import argparse

import mpmath as mp
import numpy as np


def fit(T: float, n: int, nodes: int = 4000, iterations: int = 300) -> tuple[np.ndarray, float]:
    """Coefficients (float64, lowest power first) of P and the fit's max relative error."""
    mp.mp.dps = 40
    x = T * (0.5 - 0.5 * np.cos(np.pi * (np.arange(nodes) + 0.5) / nodes))
    x = np.append(x, T)
    f = np.array([float((mp.tanh(mp.mpf(v)) - v) / mp.mpf(v) ** 3) for v in x])
    wt = np.array([float(mp.mpf(v) ** 3 / mp.tanh(mp.mpf(v))) for v in x])
    A = np.vander(x * x, n, increasing=True)
    w = np.full(x.shape, 1.0 / x.size)
    for _ in range(iterations):  # Lawson: weights grow where the error is largest -> minimax
        sw = np.sqrt(w) * wt
        c, *_ = np.linalg.lstsq(A * sw[:, None], f * sw, rcond=None)
        err = np.abs(wt * (A @ c - f))
        w = w * err / np.sum(w * err)
    return c, float(err.max())


def fp32_error(c32: np.ndarray, T: float, points: int = 2_000_001) -> tuple[float, float]:
    """Max relative error (in 2^-24) of x + (x z) P(z), z = x^2, evaluated in fp32 on (0, T]:
    (with FMA contraction, as the GPU compiles it; without, as the interpreter runs it)."""
    x = np.linspace(0.0, T, points, dtype=np.float32)[1:]
    z = x * x
    ref = np.tanh(x.astype(np.float64))

    def fma(a, b, d):  # one rounding: exact in float64 for fp32 operands' product
        return (a.astype(np.float64) * b + d).astype(np.float32)

    out = []
    for contract in (True, False):
        p = np.full_like(x, c32[-1])
        for ci in c32[-2::-1]:
            p = fma(p, z, np.float32(ci)) if contract else (p * z + np.float32(ci)).astype(np.float32)
        x3 = x * z
        t = fma(x3, p, x) if contract else (x + x3 * p).astype(np.float32)
        out.append(float((np.abs(t - ref) / ref).max() / 2.0**-24))
    return out[0], out[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max", type=float, default=0.75, help="T: the polynomial serves |x| < T")
    ap.add_argument("--terms", type=int, default=5, help="coefficients of P")
    args = ap.parse_args(argv)
    c, err = fit(args.max, args.terms)
    c32 = c.astype(np.float32)
    print(f"float64 fit: max relative error {err:.3g} ({err / 2.0**-24:.3f} x 2^-24)")
    print("TANH_POLY = (" + ", ".join(repr(float(v)) for v in c32) + ")")
    with_fma, without = fp32_error(c32, args.max)
    print(f"fp32 evaluation: {with_fma:.2f} x 2^-24 with FMA, {without:.2f} x 2^-24 without")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
