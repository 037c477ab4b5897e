"""E2M1 nibble x 2^offset -> E4M3 byte, exactly, with integer arithmetic only: the weight expansion
of the Hopper W4A8 mode (4-bit weights in HBM, E4M3 operands for FP8 wgmma), as a Triton JIT
routine and its plain-torch reference (the same arithmetic, one element at a time).

Why it is exact (docs/w4a8.md derives the window): every nonzero E2M1 magnitude is
2^(p - 1) x (1 + m / 2) with p = mag >> 1 (0 for the subnormal code 1, which is 2^-1 x 1.0) and one
mantissa bit m. Times 2^j its E4M3 biased exponent is t = p + j + 6 (E4M3 bias 7):
  t >= 1: a normal E4M3 value, byte = t << 3 | m << 2;
  t <= 0: a subnormal, value (2 + m) x 2^(t - 8) = field (2 + m) << (t + 1) in units of 2^-9;
          for j >= -8, t >= -2, and t = -2 is reached only by code 1 (m = 0): field 1.
For j in [-8, 6] every code lands on an E4M3 value (6 x 2^6 = 384 <= 448; 0.5 x 2^-8 = 2^-9, the
smallest subnormal), so no rounding is needed and none happens. Sign: E2M1 bit 3 -> E4M3 bit 7;
codes 0 and 8 give +0 and -0.

Why integers only: with Triton 3.8, booleans (tl.where masks, comparisons) kept alive through an
expansion that feeds tl.dot failed to compile for sm90 ("local_alloc element type bit width must be
a multiple of 8"); the masks here are integers (arithmetic shifts of int32 give 0 / -1).

The float form (the W4A8 mode's kernels use it): place the code's 3 magnitude bits at fp16
mantissa/exponent bits 9..11 and its sign at bit 15. That fp16 is E2M1(code) x 2^-14 exactly:
codes 0 and 1 land on fp16 subnormals (1 << 9 is 2^-15), codes 2..7 on normals with exponent
field p. Times the per-block fp32 2^(14 + j) (e2m1_pow2_scale) it is E2M1(code) x 2^j, exact
(a power-of-two product in fp32's normal range). Its cast to E4M3 is then exact too, so any
correct cast works: the GPU's cvt, or the interpreter's integer one. On sm90 this takes about a
third of the integer form's instructions per weight (docs/w4a8.md).

Cost of the integer form: the probe GEMM of kernels/offline/compile_w4a8.py spends about 30 thread
instructions per weight in its hot loop (sm90, Triton 3.8). The FP8 tensor cores do about 4000 MACs
per SM per clock, so with N tokens per MMA the issue budget is about N / 32 instructions per weight
(8 at N = 256). docs/w4a8.md lists the cheaper formulation (a per-block 8-byte table and PRMT, 4
weights per instruction) the mode's kernel should use; this routine is the exact reference it must match.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_EXPAND_MIN_OFFSET = -8  # E2M1 x 2^j is an E4M3 value for every code iff j in [-8, 6]
E4M3_EXPAND_MAX_OFFSET = 6


def expand_e2m1_to_e4m3_reference(codes: torch.Tensor, offset: torch.Tensor | int) -> torch.Tensor:
    """codes uint8 [...] (E2M1, 0..15), offset int (any integer dtype, broadcast to codes' shape)
    in [-8, 6] -> uint8 [...] E4M3 bytes of E2M1(code) x 2^offset (module docstring), plain torch
    integer arithmetic in int32 (CPU or GPU)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes: expected uint8 E2M1 codes, got {codes.dtype}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("codes: E2M1 codes are 0..15 (one per byte, unpacked)")
    off = torch.as_tensor(offset, device=codes.device)
    if off.is_floating_point():
        raise TypeError(f"offset: expected an integer tensor, got {off.dtype}")
    if off.numel() and (int(off.min()) < E4M3_EXPAND_MIN_OFFSET or int(off.max()) > E4M3_EXPAND_MAX_OFFSET):
        raise ValueError(f"offset: must lie in [{E4M3_EXPAND_MIN_OFFSET}, {E4M3_EXPAND_MAX_OFFSET}] "
                         f"(the exact window), got [{int(off.min())}, {int(off.max())}]")
    c = codes.to(torch.int32)
    j = off.to(torch.int32)
    mag = c & 7
    p = mag >> 1
    m = mag & (p | (mag >> 2)) & 1  # the mantissa bit; 0 for code 1 (0.5 = 2^-1 x 1.0)
    nonzero = (mag | p | (mag >> 2)) & 1
    t = p + j + 6  # E4M3 biased exponent
    normal = (t << 3) | (m << 2)
    sub = ((m + 2) << torch.clamp(t + 3, min=0)) >> 2  # (2 + m) << (t + 1) for t in [-2, 0]
    sub_mask = (t - 1) >> 31  # -1 where t <= 0, else 0 (arithmetic shift)
    mag_byte = (normal & ~sub_mask) | (sub & sub_mask)
    return (((c & 8) << 4) | (mag_byte & -nonzero)).to(torch.uint8)


@triton.jit
def expand_e2m1_to_e4m3(codes, offset):
    """codes: integer tensor of E2M1 codes (0..15); offset: int32 tensor broadcastable to it, in
    [-8, 6] (not checked here: the preparation guarantees it). Returns int32 E4M3 bytes (0..255);
    `.to(tl.uint8).to(tl.float8e4nv, bitcast=True)` makes the MMA operand. Integer ops only."""
    c = codes.to(tl.int32)
    mag = c & 7
    p = mag >> 1
    m = mag & (p | (mag >> 2)) & 1
    nonzero = (mag | p | (mag >> 2)) & 1
    t = p + offset + 6
    normal = (t << 3) | (m << 2)
    sub = ((m + 2) << tl.maximum(t + 3, 0)) >> 2
    sub_mask = (t - 1) >> 31
    mag_byte = (normal & ~sub_mask) | (sub & sub_mask)
    return ((c & 8) << 4) | (mag_byte & (0 - nonzero))


@triton.jit
def e2m1_pow2_scale(offset):
    """int32 offsets j in [-8, 6] -> fp32 2^(14 + j), the factor of e2m1_times_pow2 (exact: normal
    fp32 bits built from the exponent)."""
    return ((offset + (14 + 127)) << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_times_pow2(codes, scale):
    """codes: integer tensor of E2M1 codes (0..15); scale: fp32 2^(14 + j) from e2m1_pow2_scale,
    broadcastable to codes. Returns fp32 E2M1(code) x 2^j exactly (module docstring: the float
    form); -0 for code 8. Cast it to E4M3 with any correct cast (exact: no rounding happens)."""
    c = codes.to(tl.int16)
    h = (((c & 7) << 9) | ((c & 8) << 12)).to(tl.float16, bitcast=True)
    return h.to(tl.float32) * scale

