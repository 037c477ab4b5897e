"""Activation quantizers of the FP4 modes written from the formats' specifications, in numpy and
ml_dtypes only: the independent oracle of kernels/act_quant.py and of the Triton quantizers
(kernels/moe_fp4_details/kernels.py). Shares no code with either (no torch, no k3nvfp4 import).

Element and scale types come from ml_dtypes, whose casts round to nearest, ties to even:
  float4_e2m1fn   E2M1 (OCP MX v1.0, section 5.3.3: 1 sign, 2 exponent, 1 mantissa bit, bias 1,
                  no Inf / NaN, max normal 6, one subnormal 0.5)
  float8_e4m3fn   E4M3 (OCP OFP8: bias 7, max normal 448, subnormals k x 2^-9, no Inf)
  float8_e8m0fnu  E8M0 (OCP MX v1.0, section 5.4.1: an unsigned exponent, bias 127, 2^-127 .. 2^127,
                  0xFF = NaN)

NVFP4 (NVIDIA's NVFP4 format: E2M1 elements, one E4M3 scale per 16-element micro-block, a second
FP32 scale above it), per row r of x [R, K]:
  1. second-level scale s_r: the project applies it per token row (the spec's per-tensor FP32
     scale at row granularity, act_quant's docstring). Dynamic: s_r = fp32(amax_r / (6 x 448)),
     the scale that maps the row's largest value to the largest encodable product (E2M1 max 6 x
     E4M3 max 448); where that is 0 (zero row, or underflow) s_r = 1. Static: the given scale,
     rounded to fp32.
  2. block scale: b = E4M3(min(fp32(amax_blk / fp32(s_r x 6)), 448)) - "the block's amax maps to
     E2M1's max 6"; rounded to nearest even by the E4M3 cast; with a static scale a block whose
     ratio exceeds 448 saturates at E4M3's max (OFP8 conversion with saturation), because E4M3fn
     has no Inf. A ratio below 2^-10 rounds to b = 0: the block's elements become +0.
  3. elements: E2M1(fp32(x / fp32(b x s_r))), round to nearest even ("roundTiesToEven" of OCP MX
     v1.0 section 6.3's quantize_to_element_format), saturating at +-6 (section 6.3: values
     beyond the element's max normal are clamped to it), the sign of a value that rounds to zero
     kept (-0.0 is code 8).
  The fp32 operation order of steps 1-3 (divide by s_r x 6, then by b x s_r) is the project's
  documented choice (act_quant docstring: "All divisions are IEEE fp32"); the spec fixes only the
  formats. NVIDIA's own recipe multiplies by an encode scale 2688 / amax instead: mathematically
  the same, not always the same bits, so the oracle follows the project's order.
  Packing: two E2M1 codes per byte, the even element in the low nibble (ModelOpt / PTX layout).

MXFP8 (OCP MX v1.0: blocks of 32, one E8M0 shared scale X, E4M3 elements P_i, value = X x P_i):
  1. shared scale X = 2^k. OCP MX v1.0 section 6.3 gives k = floor(log2(amax)) - emax_elem
     (emax_elem = 8 for E4M3) and clamps the elements that then exceed 448. The project instead
     takes the smallest k with 448 x 2^k >= amax (act_quant docstring: nothing saturates; the
     choice of NVIDIA's MXFP8 recipe). Both are valid MX encodings; this oracle computes the
     project's k exactly (an integer search on exact float64 products, not a log). k + 127 is
     clamped to [1, 254]: 254 is E8M0's largest finite byte; byte 0 (2^-127) is legal in the spec
     but avoided because Triton 3.8 decodes it as 0 (docs/facts.md#triton). An all-zero block gets byte 1.
  2. elements P_i = E4M3(V_i / X): the division by a power of two is exact in float64, then ONE
     rounding to nearest even; clamped to +-448 (section 6.3), a no-op with this X.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

E2M1 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
E2M1_MAX = float(ml_dtypes.finfo(E2M1).max)  # 6
E4M3_MAX = float(ml_dtypes.finfo(E4M3).max)  # 448
NVFP4_BLOCK = 16
MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_MIN_BYTE, E8M0_MAX_BYTE = 1, 254  # the project's clamp (module docstring)


@dataclass(frozen=True)
class NVFP4Rows:
    """NVFP4-quantized rows: codes uint8 [R, K] (0..15, bit 3 = sign), packed uint8 [R, K/2] (low
    nibble = even element), block scale bytes uint8 [R, K/16] (E4M3 bits), row scales float32 [R]."""

    codes: np.ndarray
    packed: np.ndarray
    scale_bits: np.ndarray
    row_scale: np.ndarray

    def dequantize(self, with_row_scale: bool = True) -> np.ndarray:
        """float64 [R, K]: e2m1 x e4m3 (x s_r), exact."""
        R, K = self.codes.shape
        v = e2m1_values(self.codes).reshape(R, K // NVFP4_BLOCK, NVFP4_BLOCK)
        v = v * self.scale_bits.view(E4M3).astype(np.float64)[:, :, None]
        v = v.reshape(R, K)
        return v * self.row_scale.astype(np.float64)[:, None] if with_row_scale else v


@dataclass(frozen=True)
class MXFP8Rows:
    """MXFP8-quantized rows: element bytes uint8 [R, K] (E4M3 bits), E8M0 bytes uint8 [R, K/32]."""

    value_bits: np.ndarray
    e8m0: np.ndarray

    def dequantize(self) -> np.ndarray:
        """float64 [R, K]: e4m3 x 2^(byte - 127), exact."""
        R, K = self.value_bits.shape
        v = self.value_bits.view(E4M3).astype(np.float64).reshape(R, K // MX_BLOCK, MX_BLOCK)
        return (v * self.e8m0.view(E8M0).astype(np.float64)[:, :, None]).reshape(R, K)


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes (uint8 0..15) -> float64, through ml_dtypes' decoding of the 4-bit pattern."""
    return np.asarray(codes, dtype=np.uint8).view(E2M1).astype(np.float64)


def e2m1_codes(y: np.ndarray) -> np.ndarray:
    """float32 -> E2M1 codes (uint8): saturate at +-6, then ml_dtypes' round-to-nearest-even cast;
    the sign bit follows y (so -0.0 and small negatives give code 8)."""
    y = np.asarray(y, dtype=np.float32)
    if np.isnan(y).any():
        raise ValueError("e2m1_codes: NaN has no E2M1 encoding")
    return np.clip(y, -E2M1_MAX, E2M1_MAX).astype(E2M1).view(np.uint8) & 0xF


def e4m3_bits(v: np.ndarray) -> np.ndarray:
    """float32 with |v| <= 448 -> E4M3 bytes, round to nearest even (ml_dtypes)."""
    v = np.asarray(v, dtype=np.float32)
    if not (np.abs(v) <= E4M3_MAX).all():
        raise ValueError("e4m3_bits: a value is NaN or beyond 448 (the caller saturates first)")
    return v.astype(E4M3).view(np.uint8)


def quantize_nvfp4(x: np.ndarray, static_scale: float | None = None) -> NVFP4Rows:
    """NVFP4 rows of x (float32 [R, K], K % 16 == 0), module docstring steps 1-3.
    static_scale: None = dynamic per-row scale; else one scale for every row (rounded to fp32)."""
    x = np.asarray(x, dtype=np.float32)
    R, K = x.shape
    if K % NVFP4_BLOCK or np.isnan(x).any():
        raise ValueError(f"x: expected finite [R, K] with K % 16 == 0, got {x.shape}")
    f32 = np.float32
    with np.errstate(over="ignore", under="ignore", divide="ignore", invalid="ignore"):
        if static_scale is None:
            s = np.abs(x).max(axis=1) / f32(E2M1_MAX * E4M3_MAX)  # step 1 (fp32 division)
            s = np.where(s > 0, s, f32(1.0)).astype(np.float32)
        else:
            s = np.full(R, f32(static_scale), dtype=np.float32)
        xb = x.reshape(R, K // NVFP4_BLOCK, NVFP4_BLOCK)
        amax = np.abs(xb).max(axis=2)
        ratio = amax / (s[:, None] * f32(E2M1_MAX))  # step 2: fp32(s x 6), then the fp32 division
        scale_bits = e4m3_bits(np.minimum(ratio, f32(E4M3_MAX)))
        denom = scale_bits.view(E4M3).astype(np.float32) * s[:, None]  # step 3: fp32(b x s_r)
        flushed = ~(denom > 0)
        y = xb / np.where(flushed, f32(1.0), denom)[:, :, None]
        y = np.where(flushed[:, :, None], f32(0.0), y).astype(np.float32)  # +0, not the sign of x
    codes = e2m1_codes(y.reshape(R, K))
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return NVFP4Rows(codes, packed, scale_bits, s)


def mx_shared_exponent(amax: np.ndarray) -> np.ndarray:
    """Block amax (float32 >= 0) -> int64 k, the smallest with 448 x 2^k >= amax (0 where amax = 0;
    the byte clamp then decides). Found by exact float64 comparisons around frexp's exponent."""
    a = np.asarray(amax, dtype=np.float64)
    _, e = np.frexp(a)  # a = m 2^e, m in [0.5, 1): 448 x 2^(e - 9) = 0.875 x 2^e <= a < 2^e
    k = e.astype(np.int64) - 9
    for _ in range(3):  # settle k on the exact condition (448 x 2^k is exact in float64)
        k = np.where(np.ldexp(E4M3_MAX, k - 1) >= a, k - 1, k)
        k = np.where(np.ldexp(E4M3_MAX, k) < a, k + 1, k)
    return np.where(a > 0, k, 0)


def quantize_mxfp8(x: np.ndarray) -> MXFP8Rows:
    """MXFP8 rows of x (float32 [R, K], K % 32 == 0), module docstring steps 1-2."""
    x = np.asarray(x, dtype=np.float32)
    R, K = x.shape
    if K % MX_BLOCK or np.isnan(x).any():
        raise ValueError(f"x: expected finite [R, K] with K % 32 == 0, got {x.shape}")
    xb = x.reshape(R, K // MX_BLOCK, MX_BLOCK).astype(np.float64)
    amax = np.abs(xb).max(axis=2)
    k = mx_shared_exponent(amax)
    k = np.where(amax > 0, k, E8M0_MIN_BYTE - E8M0_BIAS)
    k = np.clip(k, E8M0_MIN_BYTE - E8M0_BIAS, E8M0_MAX_BYTE - E8M0_BIAS)
    scale = np.ldexp(1.0, k)
    e8m0 = scale.astype(E8M0).view(np.uint8)  # an exact power of two: ml_dtypes' encoding is exact
    y = np.clip(xb / scale[:, :, None], -E4M3_MAX, E4M3_MAX)  # exact in float64 (power of two)
    value_bits = y.reshape(R, K).astype(E4M3).view(np.uint8)  # one rounding, ties to even
    return MXFP8Rows(value_bits, e8m0)
