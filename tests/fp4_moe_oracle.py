"""Whole-call oracle of the FP4 tensor-core MoE modes (kernels/moe_fp4.py fused_moe_fp4) on the
spec quantizers of tests/fp4_spec.py: numpy float64 throughout, no torch kernels, no k3nvfp4
quantizer, and the static SiTU intermediate scale derived here from the activation's bound.

Per token t, slot j with expert e = topk_ids[t, j] in [0, E) (other ids contribute nothing):
  x_q    = spec quantization of x[t] (nvfp4: dynamic per-row or the static input scale; mxfp8)
  h      = deq(x_q) @ deq(w13[e])^T in float64 (exact: products of short binary numbers)
  g, u   = h[:I] x scale_2[e, 0], h[I:] x scale_2[e, 1] (nvfp4; mxfp8 has them in the E8M0 scales)
  a      = SiTU(g, u) = beta tanh(g / beta) sigmoid(g) x linear_beta tanh(u / linear_beta) (numpy
           float64 tanh; sigmoid(g) = (1 + tanh(g / 2)) / 2), or SiLU(g) x u
  a_q    = spec quantization of fp32(a) (nvfp4: static scale situ_static_scale(), or dynamic; mxfp8)
  y      = deq(a_q) @ deq(w2[e])^T x scale_2_w2[e] x topk_weights[t, j]   (float64)
  out[t] = routed_scaling_factor x sum_j y
The GEMMs are split at the quantized intermediate (gemm1 / gemm2) so that a test can also feed
GEMM2 the kernel's own quantized intermediate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import fp4_spec as spec


def situ_bound(beta: float, linear_beta: float) -> float:
    """sup |SiTU(g, u)| over all real g, u: |beta tanh(g/beta)| < |beta| and 0 < sigmoid(g) < 1,
    so |gate'| < |beta|; |linear_beta tanh(u/linear_beta)| < |linear_beta|; the product of the two
    bounds is approached as g, u -> +inf and never reached."""
    return abs(beta) * abs(linear_beta)


def situ_static_scale(beta: float, linear_beta: float) -> float:
    """The static NVFP4 row scale that maps the SiTU bound onto the largest encodable product
    E2M1 max x E4M3 max (6 x 448, read from ml_dtypes): no block of the intermediate can then
    saturate E4M3 (amax_blk / (s x 6) < 448)."""
    return situ_bound(beta, linear_beta) / (spec.E2M1_MAX * spec.E4M3_MAX)


def gated_activation_f64(g: np.ndarray, u: np.ndarray, activation: str, beta: float,
                         linear_beta: float | None) -> np.ndarray:
    """float64 SiTU / SiLU-and-mul (module docstring)."""
    g = np.asarray(g, dtype=np.float64)
    u = np.asarray(u, dtype=np.float64)
    sigmoid = 0.5 * (1.0 + np.tanh(0.5 * g))  # no overflow for any g
    if activation == "situ":
        gate = beta * np.tanh(g / beta) * sigmoid
        up = u if linear_beta is None else linear_beta * np.tanh(u / linear_beta)
    elif activation == "silu":
        gate, up = g * sigmoid, u
    else:
        raise ValueError(f"activation: {activation!r}")
    return gate * up


@dataclass(frozen=True)
class OracleWeights:
    """Dequantized experts, float64: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], and
    the fp32 scale_2 factors the nvfp4 mode applies after the dots (1 for mxfp8)."""

    w13: np.ndarray
    w2: np.ndarray
    s13: np.ndarray  # [E, 2]
    s2: np.ndarray  # [E]


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n/2] -> E2M1 codes [..., n], the low nibble the even element."""
    p = np.asarray(packed, dtype=np.uint8)
    return np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)


def _blocks(values: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    *lead, K = values.shape
    v = values.reshape(*lead, K // block, block) * scales[..., None]
    return v.reshape(*lead, K)


def oracle_weights(w13: np.ndarray, w13_scale: np.ndarray, w13_scale_2: np.ndarray, w2: np.ndarray,
                   w2_scale: np.ndarray, w2_scale_2: np.ndarray, *, e8m0: tuple | None = None) -> OracleWeights:
    """From the stored tensors (numpy): nibbles uint8 [E, N, K/2]; E4M3 scale BYTES uint8 [E, N, K/16]
    with scale_2 float32 ([E, 2] and [E]) for nvfp4, or e8m0 = (w13 bytes [E, 2I, H/32], w2 bytes
    [E, H, I/32]) for mxfp8 (scale_2 folded in). Decoded with ml_dtypes."""
    v13 = spec.e2m1_values(_nibbles(w13))
    v2 = spec.e2m1_values(_nibbles(w2))
    E = v13.shape[0]
    if e8m0 is None:
        f13 = _blocks(v13, w13_scale.view(spec.E4M3).astype(np.float64), spec.NVFP4_BLOCK)
        f2 = _blocks(v2, w2_scale.view(spec.E4M3).astype(np.float64), spec.NVFP4_BLOCK)
        return OracleWeights(f13, f2, np.asarray(w13_scale_2, np.float64).reshape(E, 2),
                             np.asarray(w2_scale_2, np.float64).reshape(E))
    d13 = _blocks(v13, e8m0[0].view(spec.E8M0).astype(np.float64), spec.MX_BLOCK)
    d2 = _blocks(v2, e8m0[1].view(spec.E8M0).astype(np.float64), spec.MX_BLOCK)
    return OracleWeights(d13, d2, np.ones((E, 2)), np.ones(E))


@dataclass(frozen=True)
class Gemm1:
    """The oracle's GEMM1 + activation per (token, slot) pair p = t k + j: pairs int64 [P] (the
    served ones, in pair order), experts [P], a float64 [P, I]."""

    pairs: np.ndarray
    experts: np.ndarray
    a: np.ndarray


def quantize_activations(x: np.ndarray, mode: str, input_scale: float | None):
    """Spec quantization of the tokens (float32 [M, H]) and their float64 dequantization."""
    if mode == "nvfp4":
        q = spec.quantize_nvfp4(x, input_scale)
        return q, q.dequantize()
    q = spec.quantize_mxfp8(x)
    return q, q.dequantize()


def gemm1(x: np.ndarray, w: OracleWeights, topk_ids: np.ndarray, *, mode: str, activation: str = "situ",
          beta: float = 4.0, linear_beta: float | None = 25.0, input_scale: float | None = None) -> Gemm1:
    """x float32 [M, H], topk_ids int [M, k] -> Gemm1 (module docstring)."""
    _, xd = quantize_activations(x, mode, input_scale)
    g, u, _, _ = _gate_up(xd, w, topk_ids)
    pairs, experts = _served_pairs(topk_ids, w.w13.shape[0])
    return Gemm1(pairs, experts, gated_activation_f64(g, u, activation, beta, linear_beta))


def _served_pairs(topk_ids: np.ndarray, E: int) -> tuple[np.ndarray, np.ndarray]:
    """(pair indices p = t k + j with an expert id in [0, E), their experts), in pair order."""
    ids = np.asarray(topk_ids).reshape(-1)
    pairs = np.nonzero((ids >= 0) & (ids < E))[0]
    return pairs, ids[pairs].astype(np.int64)


def _per_expert(rows: np.ndarray, experts: np.ndarray, mats: np.ndarray) -> np.ndarray:
    """rows float64 [P, K], mats [E, N, K] -> [P, N]: row p times mats[experts[p]]^T, one matmul
    per expert (an einsum over [P, N, K] copies would take gigabytes at the GPU tests' sizes)."""
    out = np.zeros((rows.shape[0], mats.shape[1]))
    for e in np.unique(experts):
        sel = experts == e
        out[sel] = rows[sel] @ mats[e].T
    return out


def _gate_up(xd: np.ndarray, w: OracleWeights, topk_ids: np.ndarray):
    """GEMM1 of the served pairs in float64: g, u [P, I] (scale_2 applied) and the magnitude sums
    sum_h |xd_h| |w13_nh| x scale_2 of each (what bounds fp32 rounding of the dots)."""
    pairs, experts = _served_pairs(topk_ids, w.w13.shape[0])
    I = w.w13.shape[1] // 2
    k = topk_ids.shape[1]
    xs = xd[pairs // k]
    h = _per_expert(xs, experts, w.w13)
    habs = _per_expert(np.abs(xs), experts, np.abs(w.w13))
    s_g, s_u = w.s13[experts, :1], w.s13[experts, 1:]
    return h[:, :I] * s_g, h[:, I:] * s_u, habs[:, :I] * np.abs(s_g), habs[:, I:] * np.abs(s_u)


def quantize_intermediate(a: np.ndarray, mode: str, static_scale: float | None):
    """Spec quantization of the intermediate as the kernels hold it (fp32) -> (quantized rows,
    float64 dequantization including the row scale)."""
    a32 = np.asarray(a, dtype=np.float32)
    if mode == "nvfp4":
        q = spec.quantize_nvfp4(a32, static_scale)
        return q, q.dequantize()
    q = spec.quantize_mxfp8(a32)
    return q, q.dequantize()


def gemm2(a_deq: np.ndarray, g1: Gemm1, w: OracleWeights, topk_weights: np.ndarray, M: int,
          routed_scaling_factor: float | None = None) -> np.ndarray:
    """Dequantized intermediate float64 [P, I] (rows of g1.pairs) -> out float64 [M, H]."""
    k = topk_weights.shape[1]
    y = _per_expert(a_deq, g1.experts, w.w2) * w.s2[g1.experts, None]
    y = y * np.asarray(topk_weights, np.float64).reshape(-1)[g1.pairs, None]
    out = np.zeros((M, w.w2.shape[1]))
    np.add.at(out, g1.pairs // k, y)
    return out * (1.0 if routed_scaling_factor is None else float(routed_scaling_factor))
