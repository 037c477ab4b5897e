"""The one FP4 dequant routine of the Triton kernels: kernel-layout words (layout.py) x block
scales (one byte each) -> bf16 weights x 2^-ACC_SHIFT, exact.

Per 32-bit word (8 weights): 5 rotations + 6 logic ops place the E2M1 bits into four bf16x2
registers, and 4 bf16x2 multiplies by the block scales (the 2^126 compensation is folded into
the scales by layout.py) finish the job. The scales arrive as scale words of 4 bytes; one LOP3
(and a rotation for every second pair) turns them into the bf16x2 pairs the multiplies take. On a GPU this is inline PTX with one element per word
(so the result cannot depend on Triton's register order); in Triton's CPU interpreter (no
inline asm) the same bits come from plain integer ops and the product from fp32, which is
exact, so both paths give identical values. ``tile_e2m1_bf16`` turns the dequantized words back into a logical
[rows, k] tile by reshapes and a permute only: with the layout's byte order this permute is the
MMA A-operand register layout itself, so Triton emits no data movement for it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .layout import E5M3_16, E8M0_32, MAG_MASK, SIGN_MASK, WORD_ROTATIONS, ScaleFormat


def _ptx() -> str:
    """Operands: $0..$7 the 8 bf16 results (output o = 2j + h of the word, low half first),
    $8 the word, $9 the bf16x2 block scales of rows g (low half) and g + 8 (high half)."""
    rot = sorted({r for pair in WORD_ROTATIONS for r in pair if r})
    lines = [".reg .b32 " + ", ".join([f"r{r}" for r in rot] + [f"o{o}" for o in range(4)] + ["m", "sa", "sb", "nz"]) + ";",
             ".reg .b16 sl, sh;"]
    lines += [f"shf.l.wrap.b32 r{r}, $8, $8, {r};" for r in rot]
    # ptxas folds these broadcasts into the HFMA2/HMUL2 operand selects (.H0_H0): no instruction.
    lines += ["mov.b32 {sl, sh}, $9;", "mov.b32 sa, {sl, sl};", "mov.b32 sb, {sh, sh};", "mov.b32 nz, 0x80008000;"]
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


def _pair_ptx(fmt: ScaleFormat) -> str:
    """Operands: $0 the bf16x2 scale pair, $1 the scale word (rotated for its second pair). One
    lop3 ``(a & mask) | fill``: ptxas keeps the fill in a register (two immediates in one PTX
    lop3), where Triton's and + or would cost two LOP3s."""
    return f"lop3.b32 $0, $1, {fmt.mask:#010x}, {fmt.fill:#010x}, 0xea;"  # 0xea: (a & b) | c


DEQUANT_PTX = tl.constexpr(_ptx())
SCALE_PAIR_PTX = {fmt.kernel_id: _pair_ptx(fmt) for fmt in (E5M3_16, E8M0_32)}
_E5M3_PTX = tl.constexpr(SCALE_PAIR_PTX[E5M3_16.kernel_id])
_E8M0_PTX = tl.constexpr(SCALE_PAIR_PTX[E8M0_32.kernel_id])
_E5M3_MASK = tl.constexpr(E5M3_16.mask)
_E5M3_FILL = tl.constexpr(E5M3_16.fill)
_E8M0_MASK = tl.constexpr(E8M0_32.mask)
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
def decode_scale_words(sw, SCALE_FMT: tl.constexpr, USE_ASM: tl.constexpr):
    """uint32 scale words (layout.py), rotated left by a byte where the word's second pair is
    wanted -> uint32 bf16x2 block scales (low half row g, high half row g + 8) x 2^(126 - ACC_SHIFT),
    as dequant_e2m1_words takes them. SCALE_FMT: ScaleFormat.kernel_id (0 E5M3_16, 1 E8M0_32)."""
    if USE_ASM:
        if SCALE_FMT == 0:
            return tl.inline_asm_elementwise(_E5M3_PTX, "=r,r", [sw], dtype=tl.uint32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_E8M0_PTX, "=r,r", [sw], dtype=tl.uint32, is_pure=True, pack=1)
    else:
        if SCALE_FMT == 0:
            return (sw & _E5M3_MASK) | _E5M3_FILL
        else:
            return sw & _E8M0_MASK


@triton.jit
def dequant_e2m1_words(words, scales, USE_ASM: tl.constexpr):
    """words: int32 kernel-layout words (layout.py), any shape; scales: uint32 bf16x2 block
    scales of each word's rows g (low half) and g + 8 (high half), same shape (decode_scales).
    Returns the 8 weights of each word as bf16 tensors of that shape, x 2^-ACC_SHIFT, in the
    order (j, h, p) = (K offset 8j, row half h, K parity p) with p fastest. One element per
    word, so the result does not depend on how Triton orders registers. USE_ASM: inline PTX
    (GPU), else plain Triton (interpreter), with identical values."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            DEQUANT_PTX, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [words, scales],
            dtype=(tl.bfloat16,) * 8, is_pure=True, pack=1,
        )
    else:
        w = words.to(tl.uint32, bitcast=True)
        sa = (scales << 16).to(tl.float32, bitcast=True)
        sb = (scales & 0xFFFF0000).to(tl.float32, bitcast=True)
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
