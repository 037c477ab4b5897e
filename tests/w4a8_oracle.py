"""Float64 oracle of the Hopper W4A8 numerics (issue 38), numpy and ml_dtypes only: no torch, no
k3nvfp4 import, no code shared with kernels/ or their quantizers (nor with tests/fp4_spec.py).

Formats, decoded by ml_dtypes (its casts round to nearest, ties to even):
  E2M1 (float4_e2m1fn): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; bit 3 = sign.
  E4M3 (float8_e4m3fn): normals m x 2^e, 1 <= m < 2 with 3 mantissa bits, e in [-6, 8], max 448;
                        subnormals k x 2^-9, k = 1..7; no Inf.
  E8M0 (float8_e8m0fnu): 2^(byte - 127), byte 255 = NaN.

Weights: E2M1 x 2^j in E4M3 (module-level derivation, asserted over every code by the tests).
  A nonzero E2M1 magnitude is 2^p or 3 x 2^p: {0.5, 1, 2, 4} = 2^{-1, 0, 1, 2} and {1.5, 3, 6} =
  3 x 2^{-1, 0, 1}. 2^a is an E4M3 value iff -9 <= a <= 8; 3 x 2^a iff a >= -9 (a multiple of the
  subnormal step 2^-9) and 3 x 2^a <= 448, i.e. a <= 7. Times 2^j, every code is exact iff
  j - 1 >= -9 and j + 2 <= 8 (powers) and j - 1 >= -9 and j + 1 <= 7 (threes): **j in [-8, 6]**.
  So a weight row keeps one reference exponent r (a power of two applied to the accumulator row in
  the epilogue; the weights sit on the MMA's M side) and each block b of exponent k_b (MXFP4: its
  E8M0; power-of-two NVFP4: log2 of its E4M3 block scale) expands to the E4M3 bytes of
  E2M1 x 2^(k_b - r), exact for every content iff
      -8 <= k_b - r <= 6.
  The oracle's row reference is r = k_max - 6 (k_max the largest exponent of the row's blocks that
  hold a nonzero code), raised to -126 when lower so that the fp32 factor 2^r is a normal number:
  the largest block sits at the top of the window, and a block is exact for every content iff
      k_max - 14 <= k_b   (with the raise: k_b >= r - 8),
  i.e. iff its exponent lies within 14 binades below the row's largest. No block lies above the
  window (k_b <= k_max). A block below it can still be exact for its particular codes (all zero,
  or no code that falls off the subnormal grid k x 2^-9): `block_exact` answers that from the
  values. The documented handling of the blocks below the window ("round"): each is re-encoded at
  the bottom of the window, j = -8, with codes E2M1_RNE(v x 2^(k_b - r + 8)) (ties to even;
  |v x 2^(k_b - r + 8)| <= 3, no saturation); lossy, counted. For j <= -9 the values E2M1 x 2^j
  that are E4M3 values are exactly those the re-encoding keeps (both grids are k x 2^-9 with
  k <= 6 there, and 5 x 2^-9 is no E2M1 x 2^j), so a block exact at its own offset is unchanged.

Activations and the SiTU intermediate: E4M3 with one scale per row per `group` columns (group = K
is one scale per token; the last group of a row may be shorter than `group`). Scale kinds:
  "fp32": s = fp32(amax / 448) (DeepSeek-V3's recipe), "pow2": the smallest 2^k with 448 x 2^k >=
  amax (computed exactly); a group with amax = 0 gets s = 1. Elements: E4M3_RNE(fp32(x / s)),
  clamped to +-448 first (fp32 division can land one ulp above 448).
MXFP8 (K3's native activation numerics; the reference arm): groups of 32, the shared scale the
  smallest 2^k with 448 x 2^k >= amax, clamped to E8M0 bytes [1, 254], elements E4M3_RNE(x / 2^k).

SiTU (Kimi-K3): a = beta tanh(g / beta) sigmoid(g) x linear_beta tanh(u / linear_beta); |a| <
beta x linear_beta (both factors strictly bounded), so an intermediate group's amax is below it.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

E2M1 = ml_dtypes.float4_e2m1fn
E4M3 = ml_dtypes.float8_e4m3fn
E8M0 = ml_dtypes.float8_e8m0fnu
E4M3_MAX = float(ml_dtypes.finfo(E4M3).max)  # 448
EXACT_OFFSETS = range(-8, 7)  # j with E2M1 x 2^j exact in E4M3 for every code (docstring)
WINDOW_TOP = EXACT_OFFSETS[-1]  # 6: the row's largest block sits here
WINDOW_BOTTOM = EXACT_OFFSETS[0]  # -8
E4M3_MIN_NORMAL = float(ml_dtypes.finfo(E4M3).smallest_normal)  # 2^-6
E2M1_MIN_NONZERO = 0.5
# The lowest offset at which every nonzero E2M1 magnitude x 2^j is a NORMAL E4M3 value: 0.5 x 2^j >= 2^-6.
NORMAL_BOTTOM = int(np.log2(E4M3_MIN_NORMAL / E2M1_MIN_NONZERO))  # -5
FP32_MIN_NORMAL_EXP = -126
MX_BLOCK = 32


def e2m1_values(codes: np.ndarray) -> np.ndarray:
    """E2M1 codes (uint8 0..15) -> float64 (signed zeros kept)."""
    return (np.asarray(codes, dtype=np.uint8) & 0xF).view(E2M1).astype(np.float64)


def nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n/2] -> codes uint8 [..., n], the low nibble the even element."""
    p = np.asarray(packed, dtype=np.uint8)
    return np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)


def e4m3_values(bits: np.ndarray) -> np.ndarray:
    """E4M3 bytes -> float64."""
    return np.asarray(bits, dtype=np.uint8).view(E4M3).astype(np.float64)


def exact_e4m3_bits(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float64 values -> (E4M3 bytes of the nearest value, bool mask: the value is that E4M3 value)."""
    v = np.asarray(values, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        bits = np.clip(v, -E4M3_MAX, E4M3_MAX).astype(E4M3)
    exact = bits.astype(np.float64) == v
    return bits.view(np.uint8), exact


def expand_e2m1(codes: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """E4M3 bytes of E2M1(codes) x 2^offset (broadcast); raises where that is not an E4M3 value."""
    v = e2m1_values(codes)
    bits, exact = exact_e4m3_bits(np.ldexp(v, np.asarray(offset, dtype=np.int64)))
    if not exact.all():
        raise ValueError(f"expand_e2m1: {int((~exact).sum())} values are not E4M3 values")
    # the sign of zero follows the E2M1 code (ldexp keeps -0.0, ml_dtypes encodes it as 0x80)
    return bits


def block_exact(codes: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """codes [..., B] of blocks, offset [...] -> bool [...]: every element of the block times
    2^offset is an E4M3 value (the data-dependent condition; all-zero blocks are always exact)."""
    v = e2m1_values(codes)
    _, exact = exact_e4m3_bits(np.ldexp(v, np.asarray(offset, dtype=np.int64)[..., None]))
    return exact.all(axis=-1)


@dataclass(frozen=True)
class W4A8Matrix:
    """One weight matrix [N, K] as the W4A8 kernel would read it: E4M3 bytes uint8 [N, K] (the
    expansion of each block's nibbles by its offset), offsets int64 [N, K/B], row exponents
    int64 [N], the counts of blocks outside the window (all / lossy ones rounded), and the table
    the kernel may build: "normal" when every block holding a nonzero code has all eight E2M1
    magnitudes x 2^offset normal E4M3 values (the kernel's two-instruction table), else "full"."""

    e4m3: np.ndarray
    offsets: np.ndarray
    row_exponent: np.ndarray
    block: int
    out_of_window: int
    rounded: int
    table: str

    def dequantize(self) -> np.ndarray:
        """float64 [N, K] = e4m3 x 2^r (exact)."""
        return np.ldexp(e4m3_values(self.e4m3), self.row_exponent[:, None])


def row_reference_exponent(k: np.ndarray, nonzero: np.ndarray) -> np.ndarray:
    """k int [N, nb] block exponents, nonzero bool [N, nb] (the block holds a nonzero code) ->
    r int64 [N] = max(k_max - 6, -126); rows without a nonzero code get r = -126 (their blocks
    are all zero, any offset is exact)."""
    kmax = np.where(nonzero, k, np.iinfo(np.int64).min // 2).max(axis=1)
    return np.maximum(kmax - WINDOW_TOP, FP32_MIN_NORMAL_EXP).astype(np.int64)


def w4a8_matrix(codes: np.ndarray, k: np.ndarray, block: int, out_of_window: str = "round") -> W4A8Matrix:
    """codes uint8 [N, K], block exponents int [N, K/block] -> W4A8Matrix (module docstring).

    Every block holding a nonzero code below the window (k_b - r < -8; none can lie above it) is
    re-encoded at offset -8 with codes E2M1_RNE(v x 2^(k_b - r + 8)); `out_of_window` counts them,
    `rounded` those whose values changed (a block whose values are exact at its own offset is also
    exact re-encoded: both grids are k x 2^-9 there). All-zero blocks (also those re-encoding
    emptied) get offset clip(j, -5, 6): any offset is exact for them, and none forces the full table.
    out_of_window: "round" (lossy, counted) or "refuse" (ValueError when a block would change)."""
    if out_of_window not in ("round", "refuse"):
        raise ValueError(f"out_of_window: {out_of_window!r}")
    N, K = codes.shape
    k = np.asarray(k, dtype=np.int64)
    cb = np.asarray(codes, dtype=np.uint8).reshape(N, K // block, block)
    nonzero = (cb & 7).any(axis=2)
    r = row_reference_exponent(k, nonzero)
    j = k - r[:, None]
    assert (j[nonzero] <= WINDOW_TOP).all()
    outside = (j < WINDOW_BOTTOM) & nonzero
    new_codes = cb.copy()
    v = e2m1_values(cb[outside]) * np.ldexp(1.0, j[outside] - WINDOW_BOTTOM)[:, None]
    new_codes[outside] = v.astype(E2M1).view(np.uint8) & 0xF  # |v| <= 3: RNE, no saturation
    changed = (e2m1_values(new_codes[outside]) != v).any(axis=1)
    if changed.any() and out_of_window == "refuse":
        raise ValueError(f"w4a8_matrix: {int(changed.sum())} blocks lie more than 14 binades below their row's largest")
    j_used = np.clip(j, WINDOW_BOTTOM, WINDOW_TOP)
    holds = (new_codes & 7).any(axis=2)
    j_used = np.where(holds, j_used, np.maximum(j_used, NORMAL_BOTTOM))
    bits = expand_e2m1(new_codes, j_used[..., None])
    normal = (np.ldexp(E2M1_MIN_NONZERO, j_used[holds]) >= E4M3_MIN_NORMAL).all()
    return W4A8Matrix(bits.reshape(N, K), j_used, r, block, int(outside.sum()), int(changed.sum()),
                      "normal" if normal else "full")


def w4a8_from_mxfp4(packed: np.ndarray, e8m0: np.ndarray, out_of_window: str = "round") -> W4A8Matrix:
    """MXFP4 (packed uint8 [N, K/2], E8M0 bytes uint8 [N, K/32]) -> W4A8Matrix."""
    e = np.asarray(e8m0, dtype=np.uint8)
    if (e == 255).any():
        raise ValueError("w4a8_from_mxfp4: E8M0 byte 255 (NaN)")
    return w4a8_matrix(nibbles(packed), e.astype(np.int64) - 127, MX_BLOCK, out_of_window)


def w4a8_from_pow2_nvfp4(packed: np.ndarray, scale_bits: np.ndarray, out_of_window: str = "round") -> W4A8Matrix:
    """Power-of-two NVFP4 (packed uint8 [N, K/2], E4M3 block-scale bytes uint8 [N, K/16]; the
    scale_2 stays a separate epilogue factor) -> W4A8Matrix. A zero block scale makes the block
    zero: its codes are treated as zero. Non-power-of-two scales raise."""
    s = e4m3_values(scale_bits)
    m, e = np.frexp(s)
    if ((s != 0) & (m != 0.5)).any() or (s < 0).any() or np.isnan(s).any():
        raise ValueError("w4a8_from_pow2_nvfp4: a block scale is not a positive power of two")
    codes = nibbles(packed)
    N, K = codes.shape
    zero = np.repeat(s == 0, 16, axis=1)
    codes = np.where(zero, 0, codes).astype(np.uint8)
    k = np.where(s == 0, 0, e - 1)
    return w4a8_matrix(codes, k, 16, out_of_window)


# ---------------------------------------------------------------------------------------------
# Activations


def pow2_scale(amax: np.ndarray) -> np.ndarray:
    """float64 [...] >= 0 -> the smallest 2^k with 448 x 2^k >= amax (1 where amax = 0), exact."""
    a = np.asarray(amax, dtype=np.float64)
    _, e = np.frexp(np.where(a > 0, a, 1.0))
    k = e.astype(np.int64) - 9  # 448 x 2^(e-9) = 0.875 x 2^e <= a... settle on the exact condition
    for _ in range(3):
        k = np.where(np.ldexp(E4M3_MAX, k - 1) >= a, k - 1, k)
        k = np.where(np.ldexp(E4M3_MAX, k) < a, k + 1, k)
    return np.where(a > 0, np.ldexp(1.0, k), 1.0)


@dataclass(frozen=True)
class E4M3Rows:
    """Rows quantized to E4M3 with one float32 scale per group: bits uint8 [R, K], scales
    float32 [R, ceil(K / group)]."""

    bits: np.ndarray
    scales: np.ndarray
    group: int

    def dequantize(self) -> np.ndarray:
        """float64 [R, K] = e4m3 x scale."""
        s = np.repeat(self.scales.astype(np.float64), self.group, axis=1)[:, : self.bits.shape[1]]
        return e4m3_values(self.bits) * s


def quantize_e4m3_groups(x: np.ndarray, group: int, scale_kind: str = "fp32") -> E4M3Rows:
    """x float32 [R, K] -> E4M3Rows, one scale per row per `group` columns (module docstring)."""
    x = np.asarray(x, dtype=np.float32)
    R, K = x.shape
    if not np.isfinite(x).all():
        raise ValueError("quantize_e4m3_groups: x holds NaN or Inf")
    n = -(-K // group)
    pad = np.zeros((R, n * group), dtype=np.float32)
    pad[:, :K] = x
    xb = pad.reshape(R, n, group)
    amax = np.abs(xb).max(axis=2)
    if scale_kind == "fp32":
        s = (amax / np.float32(E4M3_MAX)).astype(np.float32)
        s = np.where(s > 0, s, np.float32(1.0)).astype(np.float32)
    elif scale_kind == "pow2":
        s = pow2_scale(amax).astype(np.float32)  # powers of two from 2^-135 up: fp32 holds them
    else:
        raise ValueError(f"scale_kind: {scale_kind!r}")
    with np.errstate(over="ignore", under="ignore"):
        y = np.clip(xb / s[:, :, None], -E4M3_MAX, E4M3_MAX).astype(np.float32)
    bits = y.astype(E4M3).view(np.uint8).reshape(R, n * group)[:, :K]
    return E4M3Rows(np.ascontiguousarray(bits), s, group)


def quantize_mxfp8(x: np.ndarray) -> np.ndarray:
    """x float32 [R, K] (K % 32 == 0) -> float64 [R, K], MXFP8 quantize-dequantize (docstring)."""
    x = np.asarray(x, dtype=np.float32)
    R, K = x.shape
    xb = x.reshape(R, K // MX_BLOCK, MX_BLOCK).astype(np.float64)
    s = pow2_scale(np.abs(xb).max(axis=2))
    s = np.clip(s, 2.0**-126, 2.0**127)
    y = np.clip(xb / s[:, :, None], -E4M3_MAX, E4M3_MAX).astype(E4M3).astype(np.float64)
    return (y * s[:, :, None]).reshape(R, K)


# ---------------------------------------------------------------------------------------------
# The gated expert


def situ(g: np.ndarray, u: np.ndarray, beta: float = 4.0, linear_beta: float = 25.0) -> np.ndarray:
    """float64 SiTU (module docstring); sigmoid(g) = (1 + tanh(g / 2)) / 2 never overflows."""
    g = np.asarray(g, dtype=np.float64)
    u = np.asarray(u, dtype=np.float64)
    return beta * np.tanh(g / beta) * 0.5 * (1.0 + np.tanh(0.5 * g)) * linear_beta * np.tanh(u / linear_beta)


def situ_bound(beta: float = 4.0, linear_beta: float = 25.0) -> float:
    """sup |SiTU| = |beta| x |linear_beta|, approached as g, u -> +inf, never reached."""
    return abs(beta) * abs(linear_beta)


def expert_w4a8(x: np.ndarray, w13: W4A8Matrix, w2: W4A8Matrix, group: int, scale_kind: str = "fp32",
                beta: float = 4.0, linear_beta: float = 25.0) -> np.ndarray:
    """One gated expert as W4A8 computes it, float64: x float32 [M, H]; w13 [2I, H] (gate rows,
    then up rows), w2 [H, I] -> float64 [M, H]. The activations and the fp32 SiTU output are
    quantized per `group` columns; the GEMMs are exact (float64 of exact products)."""
    I = w13.e4m3.shape[0] // 2
    h = quantize_e4m3_groups(x, group, scale_kind).dequantize() @ w13.dequantize().T
    a = situ(h[:, :I], h[:, I:], beta, linear_beta).astype(np.float32)
    return quantize_e4m3_groups(a, group, scale_kind).dequantize() @ w2.dequantize().T
