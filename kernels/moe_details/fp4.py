"""The one FP4 dequant routine of the Triton kernels: kernel-layout words (layout.py) x bf16
block scales -> bf16 weights x 2^-ACC_SHIFT, exact.

Per 32-bit word (8 weights): 5 rotations + 6 logic ops place the E2M1 bits into four bf16x2
registers, and 4 ``mul.bf16x2`` apply the block scales (2^126 compensation folded in by
layout.py). On a GPU this is inline PTX; in Triton's CPU interpreter (no inline asm) the same
bits are computed with plain integer ops and the product in fp32, which is exact, so both paths
give identical values. ``tile_e2m1_bf16`` turns the dequantized words back into a logical
[rows, k] tile by reshapes and a permute only: with the layout's byte order this permute is the
MMA A-operand register layout itself, so Triton emits no data movement for it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .layout import MAG_MASK, SIGN_MASK, WORD_ROTATIONS


def _ptx() -> str:
    rot = sorted({r for pair in WORD_ROTATIONS for r in pair if r})
    lines = [".reg .b32 " + ", ".join([f"r{r}" for r in rot] + ["m0", "m1", "m2", "m3", "sa", "sb"]) + ";",
             ".reg .b16 s0, s1;"]
    lines += [f"shf.l.wrap.b32 r{r}, $4, $4, {r};" for r in rot]
    # $5 holds (scale of rows g, scale of rows g+8); ptxas folds the broadcasts into HMUL2 operand selects.
    lines += ["mov.b32 {s0, s1}, $5;", "mov.b32 sa, {s0, s0};", "mov.b32 sb, {s1, s1};"]
    for o, (rs, rm) in enumerate(WORD_ROTATIONS):
        src_s = "$4" if rs == 0 else f"r{rs}"
        src_m = "$4" if rm == 0 else f"r{rm}"
        if rs == rm:
            lines.append(f"and.b32 $${o}, {src_s}, {SIGN_MASK | MAG_MASK:#010x};")
        else:
            lines.append(f"and.b32 m{o}, {src_m}, {MAG_MASK:#010x};")
            lines.append(f"and.b32 $${o}, {src_s}, {SIGN_MASK:#010x};")
            lines.append(f"or.b32 $${o}, $${o}, m{o};")
        lines.append(f"mul.rn.bf16x2 $${o}, $${o}, {'sa' if o % 2 == 0 else 'sb'};")
    return "{\n" + "\n".join(lines).replace("$$", "$") + "\n}"


DEQUANT_PTX = tl.constexpr(_ptx())
_SIGN = tl.constexpr(SIGN_MASK)
_MAG = tl.constexpr(MAG_MASK)
_R = [tl.constexpr(r) for pair in WORD_ROTATIONS for r in pair]
_RS0, _RM0, _RS1, _RM1, _RS2, _RM2, _RS3, _RM3 = _R


@triton.jit
def _rotl(x, r: tl.constexpr):
    if r == 0:
        return x
    else:
        return (x << r) | (x >> (32 - r))


@triton.jit
def _place(w, rs: tl.constexpr, rm: tl.constexpr):
    return (_rotl(w, rs) & _SIGN) | (_rotl(w, rm) & _MAG)


@triton.jit
def _halves_times(o, scale):
    """bf16x2 bits (uint32) -> (low, high) values as fp32, times scale (exact)."""
    lo = (o << 16).to(tl.float32, bitcast=True)
    hi = (o & 0xFFFF0000).to(tl.float32, bitcast=True)
    return lo * scale, hi * scale


@triton.jit
def _interleave4(a, b, c, d):
    """[A, B, n] x 4 -> [A, B, 4n] with a, b, c, d as elements 0, 1, 2, 3 of each group."""
    x = tl.join(tl.join(a, c), tl.join(b, d))
    return tl.reshape(x, (a.shape[0], a.shape[1], a.shape[2] * 4))


@triton.jit
def dequant_e2m1_words(packed, scale, USE_ASM: tl.constexpr):
    """packed: uint8 [A, B, 4n], n kernel-layout words (byte 4w + i = byte i of word w);
    scale: bf16 of the same shape, element 4w + i = block scale (layout.py form) of the word's
    rows g (i even) and g + 8 (i odd). Returns (r0, r1), bf16 [A, B, 4n] each: element 4w + i of
    r0 is the weight (row half i // 2, K parity i % 2) at K offset 0 of the word, r1 the same at
    K offset 8 - x 2^-ACC_SHIFT. USE_ASM: inline PTX (GPU), else plain Triton (interpreter)."""
    if USE_ASM:
        r0, r1 = tl.inline_asm_elementwise(
            DEQUANT_PTX, "=r,=r,=r,=r,r,r,r", [packed, scale],
            dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4,
        )
        return r0, r1
    else:
        A: tl.constexpr = packed.shape[0]
        B: tl.constexpr = packed.shape[1]
        n: tl.constexpr = packed.shape[2] // 4
        b = tl.reshape(packed.to(tl.uint32), (A, B, n, 2, 2))
        lo_pair, hi_pair = tl.split(b)  # byte index 2x + y: split y
        b0, b2 = tl.split(lo_pair)
        b1, b3 = tl.split(hi_pair)
        w = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
        s = tl.reshape(scale.to(tl.float32), (A, B, n, 2, 2))
        s_y0, s_y1 = tl.split(s)  # element 2x + y: (0, 2) and (1, 3)
        sa, _ = tl.split(s_y0)  # element 0: rows g
        sb, _ = tl.split(s_y1)  # element 1: rows g + 8
        o0l, o0h = _halves_times(_place(w, _RS0, _RM0), sa)
        o1l, o1h = _halves_times(_place(w, _RS1, _RM1), sb)
        o2l, o2h = _halves_times(_place(w, _RS2, _RM2), sa)
        o3l, o3h = _halves_times(_place(w, _RS3, _RM3), sb)
        r0 = _interleave4(o0l, o0h, o1l, o1h)
        r1 = _interleave4(o2l, o2h, o3l, o3h)
        return r0.to(tl.bfloat16), r1.to(tl.bfloat16)


@triton.jit
def tile_e2m1_bf16(r0, r1, R: tl.constexpr, G: tl.constexpr, S: tl.constexpr):
    """Dequantized words of R row tiles x G K tiles x S K steps (each [R, G, 128 S]) -> the
    logical bf16 tile [16 R, 16 S G]: row 16 r + 8 h + g, K 64 q + 16 s + 8 j + 2 t + p."""
    x = tl.join(r0, r1)  # [R, G, 128 S, 2 (j)]
    x = tl.reshape(x, (R, G, 8, 4, S, 2, 2, 2))  # r q g t s h p j
    x = tl.permute(x, (0, 5, 2, 1, 4, 7, 3, 6))  # r h g q s j t p
    return tl.reshape(x, (R * 16, G * S * 16))
