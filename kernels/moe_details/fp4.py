"""The one FP4 dequant routine of the Triton kernels: kernel-layout words (layout.py) x bf16
block scales -> bf16 weights x 2^-ACC_SHIFT, exact.

Per 32-bit word (8 weights): 5 rotations + 6 logic ops place the E2M1 bits into four bf16x2
registers, and 4 bf16x2 multiplies by the block scales (the 2^126 compensation is folded into
the scales by layout.py) finish the job. On a GPU this is inline PTX with one element per word
(so the result cannot depend on Triton's register order); in Triton's CPU interpreter (no
inline asm) the same bits come from plain integer ops and the product from fp32, which is
exact, so both paths give identical values. ``tile_e2m1_bf16`` turns the dequantized words back into a logical
[rows, k] tile by reshapes and a permute only: with the layout's byte order this permute is the
MMA A-operand register layout itself, so Triton emits no data movement for it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .layout import MAG_MASK, SIGN_MASK, WORD_ROTATIONS


def _ptx() -> str:
    """Operands: $0..$7 the 8 bf16 results (output o = 2j + h of the word, low half first),
    $8 the word, $9 / $10 the bf16 block scales of rows g / g + 8."""
    rot = sorted({r for pair in WORD_ROTATIONS for r in pair if r})
    lines = [".reg .b32 " + ", ".join([f"r{r}" for r in rot] + [f"o{o}" for o in range(4)] + ["m", "sa", "sb", "nz"]) + ";"]
    lines += [f"shf.l.wrap.b32 r{r}, $8, $8, {r};" for r in rot]
    # ptxas folds these broadcasts into the HFMA2/HMUL2 operand selects (.H0_H0): no instruction.
    lines += ["mov.b32 sa, {$9, $9};", "mov.b32 sb, {$10, $10};", "mov.b32 nz, 0x80008000;"]
    for o, (rs, rm) in enumerate(WORD_ROTATIONS):
        src_s = "$8" if rs == 0 else f"r{rs}"
        src_m = "$8" if rm == 0 else f"r{rm}"
        if rs == rm:
            lines.append(f"and.b32 o{o}, {src_s}, {SIGN_MASK | MAG_MASK:#010x};")
        else:
            lines.append(f"and.b32 m, {src_m}, {MAG_MASK:#010x};")
            lines.append(f"and.b32 o{o}, {src_s}, {SIGN_MASK:#010x};")
            lines.append(f"or.b32 o{o}, o{o}, m;")
        # fma with a -0 addend is the exact product, signed zeros included, and exists on sm80
        # (mul.bf16x2 is sm90+); on sm90 ptxas emits one HMUL2/HFMA2 either way.
        lines.append(f"fma.rn.bf16x2 o{o}, o{o}, {'sa' if o % 2 == 0 else 'sb'}, nz;")
        lines.append(f"mov.b32 {{${2 * o}, ${2 * o + 1}}}, o{o};")
    return "{\n" + "\n".join(lines) + "\n}"


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
    """bf16x2 bits (uint32) -> (low, high) bf16 values times scale (exact: fp32 product)."""
    lo = (o << 16).to(tl.float32, bitcast=True)
    hi = (o & 0xFFFF0000).to(tl.float32, bitcast=True)
    return (lo * scale).to(tl.bfloat16), (hi * scale).to(tl.bfloat16)


@triton.jit
def dequant_e2m1_words(words, scale_lo, scale_hi, USE_ASM: tl.constexpr):
    """words: int32 kernel-layout words (layout.py), any shape; scale_lo / scale_hi: bf16 block
    scales (layout.py form) of each word's rows g and g + 8, same shape. Returns the 8 weights
    of each word as bf16 tensors of that shape, x 2^-ACC_SHIFT, in the order
    (j, h, p) = (K offset 8j, row half h, K parity p) with p fastest. One element per word, so
    the result does not depend on how Triton orders registers. USE_ASM: inline PTX (GPU),
    else plain Triton (interpreter), with identical values."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            DEQUANT_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", [words, scale_lo, scale_hi],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
        )
    else:
        w = words.to(tl.uint32, bitcast=True)
        sa = scale_lo.to(tl.float32)
        sb = scale_hi.to(tl.float32)
        e0, e1 = _halves_times(_place(w, _RS0, _RM0), sa)  # j 0, h 0
        e2, e3 = _halves_times(_place(w, _RS1, _RM1), sb)  # j 0, h 1
        e4, e5 = _halves_times(_place(w, _RS2, _RM2), sa)  # j 1, h 0
        e6, e7 = _halves_times(_place(w, _RS3, _RM3), sb)  # j 1, h 1
        return e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def tile_e2m1_bf16(e0, e1, e2, e3, e4, e5, e6, e7, R: tl.constexpr, G: tl.constexpr, S: tl.constexpr):
    """The 8 outputs of dequant_e2m1_words for words [R, G, 32 S] (lane 4g + t, K step s) ->
    the logical bf16 tile [16 R, 16 S G]: row 16 r + 8 h + g, K 64 q + 16 s + 8 j + 2 t + p."""
    x = tl.join(tl.join(tl.join(e0, e1), tl.join(e2, e3)), tl.join(tl.join(e4, e5), tl.join(e6, e7)))
    x = tl.reshape(x, (R, G, 8, 4, S, 2, 2, 2))  # r q g t s p h j
    x = tl.permute(x, (0, 6, 2, 1, 4, 7, 3, 5))  # r h g q s j t p
    return tl.reshape(x, (R * 16, G * S * 16))
