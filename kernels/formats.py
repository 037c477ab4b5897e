"""Codecs of the block-scaled FP4 formats: E2M1 nibbles, E8M0 and E4M3 scales.

MXFP4 (OCP):  value = e2m1(nibble) * 2^(e8m0 - 127), one E8M0 byte per 32 elements.
NVFP4:        value = e2m1(nibble) * e4m3(scale) * scale_2, one E4M3 per 16 elements
              and one FP32 ``scale_2`` per tensor.

Both pack two E2M1 codes per byte, the LOW nibble holding the EVEN element. Every
function here is plain torch (CPU or GPU); the Triton kernels share the same rules
through ``moe_details/fp4.py``.
"""

from __future__ import annotations

import torch

MXFP4_BLOCK = 32
NVFP4_BLOCK = 16

E8M0_BIAS = 127
E8M0_NAN = 255

# E4M3 (fn) holds 2^k exactly for k in [E4M3_MIN_EXP2, E4M3_MAX_EXP2].
E4M3_MIN_EXP2 = -9
E4M3_MAX_EXP2 = 8
E4M3_MAX = 448.0

E2M1_MAX = 6.0
# Magnitudes of E2M1 codes 0..7; bit 3 is the sign (code 8 is -0).
_E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 E2M1 values as float32 [16], indexed by code (``-0.0`` at code 8)."""
    mags = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Split packed bytes into codes.

    packed: uint8 [..., n/2]  ->  uint8 [..., n] with codes 0..15, low nibble first.
    """
    _check_dtype(packed, torch.uint8, "packed")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes two per byte: uint8 [..., n] (n even, codes 0..15) -> uint8 [..., n/2]."""
    _check_dtype(codes, torch.uint8, "codes")
    if codes.shape[-1] % 2:
        raise ValueError(f"codes: last dim {codes.shape[-1]} must be even to pack two per byte")
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] & 0x0F) | ((pairs[..., 1] & 0x0F) << 4)


def e2m1_to_float(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, 0..15) -> float32 of the same shape (signed zero kept)."""
    _check_dtype(codes, torch.uint8, "codes")
    return e2m1_table(codes.device)[codes.long()]


def float_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to the nearest E2M1 code, ties to even, saturating at +-6.

    x: float [...]  ->  uint8 codes [...]. The sign bit follows ``x`` (``-0.0`` -> code 8).
    NaN is refused.
    """
    x = x.float()
    if torch.isnan(x).any():
        raise ValueError("float_to_e2m1: input contains NaN")
    mag = x.abs().clamp(max=E2M1_MAX)
    # Representable magnitudes and the midpoints between neighbours. At a midpoint the
    # code with an even mantissa (even code index) wins.
    grid = torch.tensor(_E2M1_MAGNITUDES, dtype=torch.float32, device=x.device)
    mids = (grid[1:] + grid[:-1]) / 2
    idx = torch.bucketize(mag, mids)  # a tie lands on the lower neighbour...
    tie = (idx < 7) & (mag == mids[idx.clamp(max=6)])
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)  # ...move it up when that one is odd
    sign = torch.signbit(x).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def e8m0_to_exponent(scale: torch.Tensor, name: str = "weight_scale") -> torch.Tensor:
    """E8M0 bytes -> int32 exponents k = byte - 127. Refuses 255 (NaN), naming ``name``."""
    _check_dtype(scale, torch.uint8, name)
    if (scale == E8M0_NAN).any():
        n = int((scale == E8M0_NAN).sum())
        raise ValueError(f"{name}: {n} E8M0 scale byte(s) are 255 (NaN); the checkpoint is corrupt")
    return scale.to(torch.int32) - E8M0_BIAS


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8) -> float32 2^(byte-127); byte 255 -> NaN, byte 0 -> 2^-127."""
    _check_dtype(scale, torch.uint8, "scale")
    k = scale.to(torch.float32) - E8M0_BIAS
    out = torch.exp2(k)
    return torch.where(scale == E8M0_NAN, torch.full_like(out, float("nan")), out)


def e4m3_to_float(scale: torch.Tensor) -> torch.Tensor:
    """E4M3 scales (float8_e4m3fn, or their uint8 bit patterns) -> float32."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e4m3fn)
    _check_dtype(scale, torch.float8_e4m3fn, "scale")
    return scale.to(torch.float32)


def exp2_to_e4m3(k: torch.Tensor, name: str = "weight_scale") -> torch.Tensor:
    """Exact powers of two 2^k as float8_e4m3fn; k must lie in [-9, 8] (E4M3's exact range)."""
    if k.numel() and (int(k.min()) < E4M3_MIN_EXP2 or int(k.max()) > E4M3_MAX_EXP2):
        raise ValueError(
            f"{name}: exponents [{int(k.min())}, {int(k.max())}] outside E4M3's exact range "
            f"[{E4M3_MIN_EXP2}, {E4M3_MAX_EXP2}]"
        )
    return torch.exp2(k.to(torch.float32)).to(torch.float8_e4m3fn)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> float32.

    packed: uint8 [..., out, in/2]; scale: uint8 E8M0 [..., out, in/32]  ->  float32 [..., out, in].
    """
    values = e2m1_to_float(unpack_e2m1(packed))
    _check_blocks(values, scale, MXFP4_BLOCK, "scale")
    blocks = values.reshape(*scale.shape, MXFP4_BLOCK)
    return (blocks * e8m0_to_float(scale).unsqueeze(-1)).reshape(values.shape)


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | float) -> torch.Tensor:
    """NVFP4 -> float32.

    packed: uint8 [..., out, in/2]; scale: float8_e4m3fn [..., out, in/16];
    scale_2: float32, broadcastable to the leading dims (a scalar per tensor, or [E] per
    expert)  ->  float32 [..., out, in].
    """
    values = e2m1_to_float(unpack_e2m1(packed))
    _check_blocks(values, scale, NVFP4_BLOCK, "scale")
    blocks = values.reshape(*scale.shape, NVFP4_BLOCK)
    out = (blocks * e4m3_to_float(scale).unsqueeze(-1)).reshape(values.shape)
    s2 = torch.as_tensor(scale_2, dtype=torch.float32, device=out.device)
    return out * s2.reshape(*s2.shape, *([1] * (out.dim() - s2.dim())))


def _check_dtype(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def _check_blocks(values: torch.Tensor, scale: torch.Tensor, block: int, name: str) -> None:
    expected = (*values.shape[:-1], values.shape[-1] // block)
    if values.shape[-1] % block or tuple(scale.shape) != expected:
        raise ValueError(
            f"{name}: shape {tuple(scale.shape)} does not match {block}-element blocks of a "
            f"{tuple(values.shape)} weight (expected {expected})"
        )
