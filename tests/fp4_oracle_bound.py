"""How far a correct FP4-mode kernel call may lie from the float64 oracle (tests/fp4_moe_oracle.py),
elementwise, derived from the oracle's own numbers: numpy only, no torch, no k3nvfp4 import.

The oracle models every quantization step of the call exactly (the tokens' NVFP4 / MXFP8 codes,
the intermediate's scales and codes, flushes and saturation; bit for bit against the kernels in
tests/test_fp4_oracle.py). What a kernel does differently is arithmetic only:
  (1) GEMM1 sums H products in fp32, then multiplies by the row scale and scale_2 (nvfp4);
  (2) the activation runs in fp32 on the kernel's g, u;
  (3) the intermediate is quantized from the kernel's fp32 a, so a value within (1)-(2)'s error
      of a rounding boundary (E2M1 / E4M3 element, E4M3 block scale, E8M0 exponent, the dynamic
      row scale) may take the neighbouring code: the kernel's dequantized value is only known to
      lie in a window [lo, hi] around the oracle's;
  (4) GEMM2 sums I products in fp32, the scales, routing weight, split-K slices, the k slots and
      routed_scaling_factor multiply / add in fp32;
  (5) the output is rounded to its dtype.

Bounds (u = U_ACC, gamma_n = n u / (1 - n u), Higham's bound for any summation order):
  (1) |g_kernel - g| <= gamma_{H+4} sum_h |xd_h| |w_nh| x |scale_2| =: dg (same for u: du);
  (2) |a_kernel - a| <= dG (|U| + dU) + |G| dU + EPS_ACT (|a| + that), where a = G(g) U(u) and
      dG <= |G'(g)| dg + c_G dg^2, dU <= |U'(u)| du + c_U du^2 (Taylor, c = max |f''| / 2);
  (3) each quantizer is monotone in its input and the block scale / row scale / shared exponent
      are monotone in the block's and row's amax, so the codes the kernel can produce from any
      a_kernel within (2)'s interval lie between those of the interval's ends: [lo, hi] is the
      set of e x P for e between the ends' codes and P between the ends' scales (a bilinear
      form: its extremes are the corners); a block whose scale may flush adds 0;
  (4) |out_kernel - out| <= rsf sum_slots |tw| |s2| (sum_i |w2_hi| max(hi_i - d_i, d_i - lo_i)
      + gamma_{I+k+8} sum_i |w2_hi| max(|lo_i|, |hi_i|)), d = the oracle's dequantized intermediate;
  (5) plus OUT_UNIT[dtype] (|out| + (4)) for the cast to the output dtype (one ulp: the
      interpreter's fp32 -> bf16 cast truncates, a GPU's rounds to nearest).
Widening factors of 2^-22 .. 2^-40 on the window's ends cover the fp32 roundings of the kernels'
quantizers (s x 6, b x s, the divisions) and float64's own.

U_ACC = 2^-23 (one whole fp32 ulp per operation, not half: a tensor core's block-scaled MMA need not
round to nearest) and EPS_ACT = 32 x 2^-24 (the GPU's bound of tests/test_situ_accuracy.py for
the kernels' fp32 SiTU / SiLU) hold on a GPU and in the interpreter alike, so the GPU tests and
the interpreter tests assert the same bound.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import fp4_moe_oracle as oracle
import fp4_spec as spec

U_ACC = 2.0**-23
EPS_ACT = 32 * 2.0**-24
# One whole ulp of the output dtype, relative: a GPU's cast rounds to nearest (half an ulp), Triton's
# interpreter truncates fp32 -> bf16 (docs/facts.md#triton), and the bound is the same for both.
OUT_UNIT = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
_TINY = 2.0**-147  # fp32 subnormal rounding of the activation (absolute)


def gamma(n: int) -> float:
    """Higham's gamma_n for U_ACC: the relative bound of an n-term fp32 sum / product chain."""
    return n * U_ACC / (1 - n * U_ACC)


def curvatures(activation: str, beta: float, linear_beta: float | None) -> tuple[float, float]:
    """(c_G, c_U) >= max |G''| / 2 and max |U''| / 2, from term-wise bounds of the derivatives:
    SiTU G = beta tanh(g / beta) sigmoid(g): G'' = -2/beta sech^2 tanh sigma + 2 sech^2 sigma(1 - sigma)
    + beta tanh sigma(1 - sigma)(1 - 2 sigma), with |sech^2 tanh| <= 0.385, sigma(1 - sigma) <= 1/4,
    |sigma(1 - sigma)(1 - 2 sigma)| <= 0.0963; SiLU G'' = sigma(1 - sigma)(2 + g(1 - 2 sigma)), |G''| <= 1/2;
    U = lb tanh(u / lb): |U''| = 2 / lb |sech^2 tanh| <= 0.77 / lb; U = u: 0. (checked on a grid
    by tests/test_situ_accuracy.py)"""
    if activation == "silu":
        return 0.25, 0.0
    c_g = (0.77 / beta + 0.5 + 0.0963 * beta) / 2
    return c_g, 0.0 if linear_beta is None else 0.77 / linear_beta / 2


def gate_up_terms(g: np.ndarray, u: np.ndarray, activation: str, beta: float, linear_beta: float | None):
    """float64 (G, G', U, U') of the gated activation a = G(g) U(u) (fp4_moe_oracle's formula)."""
    sig = 0.5 * (1.0 + np.tanh(0.5 * g))
    if activation == "silu":
        return g * sig, sig + g * sig * (1 - sig), u, np.ones_like(u)
    t = np.tanh(g / beta)
    G, dG = beta * t * sig, (1 - t * t) * sig + beta * t * sig * (1 - sig)
    if linear_beta is None:
        return G, dG, u, np.ones_like(u)
    tu = np.tanh(u / linear_beta)
    return G, dG, linear_beta * tu, 1 - tu * tu


def activation_error(g, u, dg, du, activation: str, beta: float, linear_beta: float | None) -> np.ndarray:
    """(2) of the module docstring: the bound on |a_kernel - a| [P, I]."""
    G, dG1, U, dU1 = gate_up_terms(g, u, activation, beta, linear_beta)
    c_g, c_u = curvatures(activation, beta, linear_beta)
    eg = np.abs(dG1) * dg + c_g * dg * dg
    eu = np.abs(dU1) * du + c_u * du * du
    prop = eg * (np.abs(U) + eu) + np.abs(G) * eu
    return prop + EPS_ACT * (np.abs(G * U) + prop) + _TINY


def _f32(v: np.ndarray, rel: float, up: bool) -> np.ndarray:
    """fp32 rounding (to nearest) of v widened by the relative margin rel, away from v's interval:
    a monotone rounding of a lower / upper end is a lower / upper end of the rounded values."""
    v = np.asarray(v, np.float64)
    w = v * np.where((v >= 0) == up, 1 + rel, 1 - rel)
    with np.errstate(over="ignore"):
        return w.astype(np.float32).astype(np.float64)


def _e2m1(y: np.ndarray) -> np.ndarray:
    y = np.clip(np.asarray(y, np.float32), -spec.E2M1_MAX, spec.E2M1_MAX)
    return y.astype(spec.E2M1).astype(np.float64)


def _e4m3(y: np.ndarray) -> np.ndarray:
    y = np.clip(np.asarray(y, np.float32), -spec.E4M3_MAX, spec.E4M3_MAX)
    return y.astype(spec.E4M3).astype(np.float64)


def _corners(a_lo, a_hi, p_lo, p_hi, elem) -> tuple[np.ndarray, np.ndarray]:
    """The window of elem(fp32(a / P)) x P for a in [a_lo, a_hi], P in [p_lo, p_hi] (P > 0)."""
    with np.errstate(over="ignore", under="ignore"):
        y_lo = np.minimum(a_lo / p_lo, a_lo / p_hi)
        y_hi = np.maximum(a_hi / p_lo, a_hi / p_hi)
    e_lo, e_hi = elem(_f32(y_lo, 2.0**-40, False)), elem(_f32(y_hi, 2.0**-40, True))
    c = np.stack([e_lo * p_lo, e_lo * p_hi, e_hi * p_lo, e_hi * p_hi])
    return c.min(axis=0), c.max(axis=0)


def _union(a_lo, a_hi, steps: np.ndarray, scale_of, blk: int, elem) -> tuple[np.ndarray, np.ndarray]:
    """The union over every block-scale candidate (steps int [R, C / blk, 2]: the first and last
    candidate's index; scale_of(index) -> (P_lo, P_hi) per block, 0 for a flushed block) of the
    candidate's window: the block scale is discrete, so each candidate is taken on its own (one
    bilinear window over all of them would mix a code of one scale with another scale)."""
    lo = np.full(a_lo.shape, np.inf)
    hi = np.full(a_lo.shape, -np.inf)
    for d in range(int((steps[..., 1] - steps[..., 0]).max()) + 1):
        idx = np.minimum(steps[..., 0] + d, steps[..., 1])
        p_lo, p_hi = (np.repeat(v, blk, axis=1) for v in scale_of(idx))
        flushed = p_hi == 0
        c_lo, c_hi = _corners(a_lo, a_hi, np.where(flushed, 1.0, p_lo), np.where(flushed, 1.0, p_hi), elem)
        lo = np.minimum(lo, np.where(flushed, 0.0, c_lo))
        hi = np.maximum(hi, np.where(flushed, 0.0, c_hi))
    return lo, hi


def intermediate_window(a: np.ndarray, da: np.ndarray, mode: str, static_scale: float | None):
    """(3) of the module docstring: a float64 [P, I] with error bound da -> (lo, hi) float64 [P, I],
    the dequantized values (row scale included) the kernel's intermediate may take."""
    R, C = a.shape
    a_lo, a_hi = a - da, a + da
    mag_lo, mag_hi = np.maximum(np.abs(a) - da, 0.0), np.abs(a) + da
    blk = spec.NVFP4_BLOCK if mode == "nvfp4" else spec.MX_BLOCK
    b_lo = mag_lo.reshape(R, C // blk, blk).max(axis=2)
    b_hi = mag_hi.reshape(R, C // blk, blk).max(axis=2)
    if mode == "mxfp8":
        def exponent(amax):
            k = spec.mx_shared_exponent(amax.astype(np.float32))
            k = np.where(amax > 0, k, spec.E8M0_MIN_BYTE - spec.E8M0_BIAS)
            return np.clip(k, spec.E8M0_MIN_BYTE - spec.E8M0_BIAS, spec.E8M0_MAX_BYTE - spec.E8M0_BIAS)
        steps = np.stack([exponent(_f32(b_lo, 2.0**-40, False)), exponent(_f32(b_hi, 2.0**-40, True))], axis=-1)
        return _union(a_lo, a_hi, steps, lambda k: (np.ldexp(1.0, k),) * 2, blk, _e4m3)
    if static_scale is not None:
        s_lo = s_hi = np.full((R, 1), float(np.float32(static_scale)))
    else:
        r_lo, r_hi = mag_lo.max(axis=1, keepdims=True), mag_hi.max(axis=1, keepdims=True)
        if ((r_lo == 0) & (r_hi > 0)).any():
            raise ValueError("intermediate_window: a row's amax may or may not be 0 (row scale 1 or tiny)")
        nvmax = spec.E2M1_MAX * spec.E4M3_MAX
        s_lo = np.where(r_hi > 0, _f32(r_lo / nvmax, 2.0**-40, False), 1.0)
        s_hi = np.where(r_hi > 0, _f32(r_hi / nvmax, 2.0**-40, True), 1.0)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        ratio_lo = _f32(b_lo / (s_hi * spec.E2M1_MAX), 2.0**-22, False)
        ratio_hi = _f32(b_hi / (s_lo * spec.E2M1_MAX), 2.0**-22, True)

    def e4m3_byte(r):  # monotone: positive E4M3 values increase with their byte
        return np.minimum(r, spec.E4M3_MAX).astype(np.float32).astype(spec.E4M3).view(np.uint8).astype(np.int64)

    steps = np.stack([e4m3_byte(ratio_lo), e4m3_byte(ratio_hi)], axis=-1)

    def block_scales(byte):
        b = byte.astype(np.uint8).view(spec.E4M3).astype(np.float64)
        return b * s_lo * (1 - 2.0**-22), b * s_hi * (1 + 2.0**-22)

    return _union(a_lo, a_hi, steps, block_scales, blk, _e2m1)


@dataclass(frozen=True)
class WholeCall:
    """The oracle of one call with its bound. out, bound: float64 [M, H] (|kernel - out| <= bound
    elementwise); unquantized: the same call with the float64 intermediate (not quantized);
    a: the float64 intermediate [P, I] (served pairs, pair order); window_lo / window_hi / deq:
    float64 [P, I], the kernel's possible dequantized intermediate values and the oracle's;
    flushed_blocks: the fraction of the intermediate's blocks the oracle flushes to 0 (nvfp4);
    gemm1: the served pairs and their experts; out_dtype: the call's output dtype's name."""

    out: np.ndarray
    a: np.ndarray
    bound: np.ndarray
    unquantized: np.ndarray
    window_lo: np.ndarray
    window_hi: np.ndarray
    deq: np.ndarray
    flushed_blocks: float
    gemm1: oracle.Gemm1
    out_dtype: str

    @property
    def open_fraction(self) -> float:
        """The fraction of intermediate values whose code (element or block scale) the kernel's
        rounding may change: windows wider than 2^-10 relative (a code step is >= 1/8 relative;
        the dynamic row scale's own window is ~1e-5)."""
        if not self.deq.size:
            return 0.0
        width = self.window_hi - self.window_lo
        return float((width > 2.0**-10 * np.maximum(np.abs(self.window_lo), np.abs(self.window_hi))).mean())


def whole_call(x: np.ndarray, w: oracle.OracleWeights, topk_weights: np.ndarray, topk_ids: np.ndarray, *,
               mode: str, activation: str = "situ", beta: float = 4.0, linear_beta: float | None = 25.0,
               input_scale: float | None = None, intermediate_static_scale: float | None = None,
               routed_scaling_factor: float | None = None, out_dtype: str = "float32") -> WholeCall:
    """The float64 oracle of fused_moe_fp4 with its elementwise bound (module docstring).
    x float32 [M, H] (the call's input, exactly); topk_weights float32 [M, k]; topk_ids int [M, k];
    intermediate_static_scale: the nvfp4 intermediate's static row scale (None = dynamic)."""
    M, H = x.shape
    E, two_i, _ = w.w13.shape
    I = two_i // 2
    k = topk_ids.shape[1]
    _, xd = oracle.quantize_activations(x, mode, input_scale)
    g, u, g_mag, u_mag = oracle._gate_up(xd, w, topk_ids)
    pairs, experts = oracle._served_pairs(topk_ids, E)
    g1 = oracle.Gemm1(pairs, experts, oracle.gated_activation_f64(g, u, activation, beta, linear_beta))
    da = activation_error(g, u, gamma(H + 4) * g_mag, gamma(H + 4) * u_mag, activation, beta, linear_beta)
    q, deq = oracle.quantize_intermediate(g1.a, mode, intermediate_static_scale)
    lo, hi = intermediate_window(g1.a, da, mode, intermediate_static_scale)
    if not ((lo <= deq) & (deq <= hi)).all():  # the oracle's own fp32(a) lies in the window
        raise AssertionError("whole_call: the oracle's intermediate falls outside its own window")
    scale_bits = q.scale_bits if mode == "nvfp4" else None
    flushed = float((scale_bits == 0).mean()) if scale_bits is not None and scale_bits.size else 0.0
    out, bound = gemm2_with_bound(deq, lo, hi, g1, w, topk_weights, M, routed_scaling_factor, out_dtype)
    unquantized = oracle.gemm2(g1.a, g1, w, topk_weights, M, routed_scaling_factor)
    return WholeCall(out, g1.a, bound, unquantized, lo, hi, deq, flushed, g1, out_dtype)


def gemm2_with_bound(deq: np.ndarray, lo: np.ndarray, hi: np.ndarray, g1: oracle.Gemm1, w: oracle.OracleWeights,
                     topk_weights: np.ndarray, M: int, routed_scaling_factor: float | None,
                     out_dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(4) and (5) of the module docstring: GEMM2 of the dequantized intermediate deq float64 [P, I]
    (rows of g1.pairs) -> (out, bound) float64 [M, H], where the kernel's intermediate may be any
    values in [lo, hi] (lo = hi = deq: the kernel's own intermediate, arithmetic only)."""
    k = topk_weights.shape[1]
    I = deq.shape[1]
    out = oracle.gemm2(deq, g1, w, topk_weights, M, routed_scaling_factor)
    w2_abs = np.abs(w.w2)
    dev = np.maximum(hi - deq, deq - lo)
    mag = np.maximum(np.abs(lo), np.abs(hi))
    per_pair = (oracle._per_expert(dev, g1.experts, w2_abs)
                + gamma(I + k + 8) * oracle._per_expert(mag, g1.experts, w2_abs))
    per_pair *= (np.abs(w.s2[g1.experts]) * np.abs(np.asarray(topk_weights, np.float64).reshape(-1)[g1.pairs]))[:, None]
    pre = np.zeros((M, w.w2.shape[1]))
    np.add.at(pre, g1.pairs // k, per_pair)
    pre *= 1.0 if routed_scaling_factor is None else abs(float(routed_scaling_factor))
    return out, pre + OUT_UNIT[out_dtype] * (np.abs(out) + pre)


def decode_intermediate(mode: str, rows: np.ndarray, q: np.ndarray, scales: np.ndarray,
                        row_scale: np.ndarray | float | None) -> np.ndarray:
    """A kernel's stored intermediate, decoded with ml_dtypes -> float64 [len(rows), I] (row scale
    included): nvfp4 q = packed E2M1 uint8 [R, I/2], scales = E4M3 bytes [R, I/16], row_scale fp32
    [R] (dynamic) or the static scale; mxfp8 q = E4M3 bytes [R, I], scales = E8M0 bytes [R, I/32]."""
    if mode == "nvfp4":
        rs = np.asarray(row_scale, np.float32)
        rs = np.full(len(rows), rs, np.float32) if rs.ndim == 0 else rs[rows]
        codes = oracle._nibbles(q[rows])
        return spec.NVFP4Rows(codes, q[rows], scales[rows], rs).dequantize()
    return spec.MXFP8Rows(q[rows], scales[rows]).dequantize()
