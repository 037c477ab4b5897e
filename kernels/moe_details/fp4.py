"""The one shared NVFP4 dequant routine of the Triton kernels (E2M1 nibbles x E4M3 scales).

Same rules as ``kernels/formats.py`` (plain torch): E2M1 codes 0..7 = 0, .5, 1, 1.5, 2, 3, 4, 6,
bit 3 is the sign; E4M3 (fn) = s.eeee.mmm with bias 7, subnormals m * 2^-9. Decoded with
integer ops only (no lookup table, no float8 dtype support needed, no denormal arithmetic),
so it runs the same on Hopper, Ampere and the CPU interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def e2m1_to_f32(code):
    """E2M1 codes (int32 0..15) -> float32 (exact)."""
    e = (code >> 1) & 3
    m = code & 1
    # 2 * |value| is an integer: m for e == 0, (2 + m) << (e - 1) otherwise.
    twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
    mag = twice.to(tl.float32) * 0.5
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def e4m3_to_f32(byte):
    """E4M3 (fn) bit patterns (int32 0..255) -> float32 (exact; NaN pattern not special-cased,
    ModelOpt scales are finite and non-negative)."""
    e = (byte >> 3) & 15
    m = byte & 7
    # Normal: fp32 bits with exponent e - 7 + 127 and the 3 mantissa bits on top.
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9
    mag = tl.where(e == 0, sub, normal)
    return tl.where((byte & 128) != 0, -mag, mag)


@triton.jit
def dequant_nvfp4_planes(packed, scale):
    """One tile of packed NVFP4 weights -> the two nibble planes as float32.

    packed: uint8 tile (byte j holds elements 2j (low nibble) and 2j+1 (high nibble));
    scale: float32 tile of the same shape, the decoded E4M3 scale (e4m3_to_f32) of each byte's
    16-block (decode once per block, then broadcast). Returns (even, odd): float32 values of
    elements 2j and 2j+1, scale applied (exact: an E2M1 x E4M3 product has <= 5 significant
    bits, so it is also exact in bf16/fp16). The caller feeds them to tl.dot against the even and
    odd activation columns, which avoids interleaving nibbles in registers.
    """
    p = packed.to(tl.int32)
    even = e2m1_to_f32(p & 15) * scale
    odd = e2m1_to_f32(p >> 4) * scale
    return even, odd
