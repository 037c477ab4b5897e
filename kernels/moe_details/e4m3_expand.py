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

(A float form, E2M1 bits placed in an fp16 times the block's fp32 2^(14 + j), served the
interpreter until 2026-12-06; the kernels now take fragment_tile's plain-Triton twin there, and
the float form is gone. Its loop cost is quoted below for comparison.)

The table + PRMT form (the mode's kernels use it on a GPU; below the reference routines): one
8-byte table of E4M3 bytes per block, then per 32-bit word of 8 nibbles two PRMT lookups and two
sign PRMTs, as inline PTX (E4M3_TABLE_PTX, E4M3_LOOKUP_PTX), with a plain-Triton twin of the same
bits. fragment_tile (the mode's kernels) runs the lookup with pack = 4 on weights stored in wgmma's
A-fragment order (moe_w4a8_details/fragment.py), so each lookup output is one fragment register:
GEMM1's sm90 decode loop takes about 2.0 thread instructions per weight (blocks of 32; 3.1 with
pack = 1 and the tile through shared memory, 8.8 for the float form, about 27 for the integer
form; docs/w4a8.md, Triton 3.8). The FP8 tensor cores do
about 4000 MACs per SM per clock, so with N tokens per MMA the issue budget is about N / 32
instructions per weight (8 at N = 256).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

E4M3_EXPAND_MIN_OFFSET = -8  # E2M1 x 2^j is an E4M3 value for every code iff j in [-8, 6]
E4M3_EXPAND_MAX_OFFSET = 6
# From j = -5 up every nonzero code lands on a NORMAL E4M3 value (0.5 x 2^-5 = 2^-6, E4M3's smallest
# normal), so a block's table is linear in j: the "normal" table (E4M3_NORMAL_TABLE_PTX) is exact
# for offsets in [-5, 6], the "full" one (E4M3_TABLE_PTX) for the whole window.
E4M3_NORMAL_MIN_OFFSET = -5
E4M3_TABLES = ("full", "normal")


def is_normal_table(table: str, name: str = "table") -> bool:
    """Whether an E4M3 table name (E4M3_TABLES) is the normal one; any other name is refused,
    naming ``name`` (the kernels' NORMAL constexpr, the cost table's section, the weights' field)."""
    if table not in E4M3_TABLES:
        raise ValueError(f"{name}: expected one of {E4M3_TABLES}, got {table!r}")
    return table == "normal"


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


# ---------------------------------------------------------------------------------------------
# The GPU form: a per-block byte table and PRMT (inline PTX; the interpreter takes its plain-Triton twin).
#
# For one block with offset j the E4M3 bytes of E2M1(mag) x 2^j, mag = 0..7, are a table of 8
# bytes in two registers (tlo: mags 0..3, thi: mags 4..7). With B = 8 j + 48 (the E4M3 byte of
# 2^(j - 1)) and every entry normal (j >= -5) the table is linear in j, one multiply-add per word:
#     [0, B, B + 8, B + 12 | B + 16, B + 20, B + 24, B + 28]
#     tlo = j x 0x08080800 + 0x3C383000,  thi = j x 0x08080808 + 0x4C484440
# (no byte carries for j in [-7, 6]: every entry of thi lies in [8, 124]). Below, E4M3 bytes 0..15
# are the values k x 2^-9 (subnormals, then exponent field 1), so the subnormal entries are the
# integers E2M1(mag) x 2^(j + 9):
#     j = -6: tlo = 0x0C080400 (= 0x03020100 << 2), thi as the formula (all normal);
#     j = -7: tlo = 0x06040200 (<< 1), thi as the formula (0x14100C08: 8, 12, 16, 20);
#     j = -8: tlo = 0x03020100 (<< 0), thi = 0x0C080604 (the formula's 0x0C080400 | 0x0604).
# So tlo = j < -5 ? 0x03020100 << (j + 8) : formula, and thi = formula | (j == -8 ? 0x0604 : 0),
# with the conditions as arithmetic-shift masks (no predicates): 11 PTX instructions per block.
#
# Per 32-bit word w of 8 nibbles (nibble n = element n, bits 4n..4n+3, the packed byte order:
# low nibble = even element), two outputs of 4 E4M3 bytes (lo: elements 0..3, hi: 4..7):
#   - magnitudes: PRMT's default mode picks byte (s & 7) of {thi, tlo} for each selector nibble
#     s of its low 16 bits, but s & 8 would replicate that byte's sign instead; so the selectors
#     are the nibbles with the sign bits cleared (one AND for both halves, one shift for hi);
#   - signs: PRMT's sign-replicate mode makes a byte 0xFF / 0x00 from the top bit of a source
#     byte. Element 2i + 1's sign is the top bit of w's byte i, element 2i's that of (w << 4)'s
#     byte i; selectors 0xD9C8 (elements 0..3) and 0xFBEA (4..7) over {w, w << 4};
#   - one LOP3 per output: magnitude | (sign bytes & 0x80808080).
# 9 PTX instructions per 8 weights; tests/test_e4m3_prmt_ptx.py runs these exact strings in
# tests/ptx_emulator.py against expand_e2m1_to_e4m3_reference over every code in every nibble
# position x every offset of the window.

E4M3_TABLE_PTX = """{
.reg .b32 nlo, slo, sh, m6, m8;
mad.lo.u32 nlo, $2, 0x08080800, 0x3C383000;
mad.lo.u32 $1, $2, 0x08080808, 0x4C484440;
add.u32 sh, $2, 8;
mov.b32 slo, 0x03020100;
shl.b32 slo, slo, sh;
add.u32 m6, $2, 5;
shr.s32 m6, m6, 31;
lop3.b32 $0, slo, nlo, m6, 0xe4;
add.u32 m8, $2, 7;
shr.s32 m8, m8, 31;
lop3.b32 $1, $1, 0x0604, m8, 0xf8;
}"""
# lop3 0xe4: c ? a : b; 0xf8: a | (b & c)

# The table of a matrix whose every block has j >= -5 (E4M3_NORMAL_MIN_OFFSET: every entry a
# normal E4M3 value): the two multiply-adds alone. The preparation chooses it per matrix
# (moe_w4a8_details/prep.py: W4A8Weights.table), because one block at -6 .. -8 needs the full one.
E4M3_NORMAL_TABLE_PTX = """{
mad.lo.u32 $0, $2, 0x08080800, 0x3C383000;
mad.lo.u32 $1, $2, 0x08080808, 0x4C484440;
}"""

E4M3_LOOKUP_PTX = """{
.reg .b32 m, mh, w4, slo, shi, vlo, vhi;
and.b32 m, $2, 0x77777777;
shl.b32 w4, $2, 4;
prmt.b32 vlo, $3, $4, m;
shr.b32 mh, m, 16;
prmt.b32 vhi, $3, $4, mh;
prmt.b32 slo, w4, $2, 0xD9C8;
prmt.b32 shi, w4, $2, 0xFBEA;
lop3.b32 $0, vlo, slo, 0x80808080, 0xf8;
lop3.b32 $1, vhi, shi, 0x80808080, 0xf8;
}"""

_TABLE_PTX = tl.constexpr(E4M3_TABLE_PTX)
_NORMAL_TABLE_PTX = tl.constexpr(E4M3_NORMAL_TABLE_PTX)
_LOOKUP_PTX = tl.constexpr(E4M3_LOOKUP_PTX)


@triton.jit
def e4m3_block_tables(offset, USE_ASM: tl.constexpr, NORMAL: tl.constexpr = False):
    """int32 offsets j (any shape, one per block) -> (tlo, thi) uint32 of that shape: the E4M3
    bytes of E2M1(mag) x 2^j for mag 0..3 (tlo, byte mag) and 4..7 (thi). j in [-8, 6], or with
    NORMAL in [-5, 6] (the normal table: two multiply-adds instead of 11 instructions; wrong bytes
    below -5, so only for a matrix the preparation chose it for). USE_ASM: the inline PTX above
    (pack 1, so the result does not depend on Triton's register order), else the same arithmetic
    in plain Triton (the interpreter), bit for bit."""
    if USE_ASM:
        if NORMAL:
            return tl.inline_asm_elementwise(_NORMAL_TABLE_PTX, "=r,=r,r", [offset], dtype=(tl.uint32, tl.uint32),
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise(_TABLE_PTX, "=r,=r,r", [offset], dtype=(tl.uint32, tl.uint32),
                                             is_pure=True, pack=1)
    else:
        j = offset.to(tl.int32)  # int32 arithmetic: no product or sum here leaves its range
        nlo = j * 0x08080800 + 0x3C383000
        nhi = j * 0x08080808 + 0x4C484440
        if NORMAL:
            return nlo.to(tl.uint32, bitcast=True), nhi.to(tl.uint32, bitcast=True)
        else:
            slo = 0x03020100 << tl.minimum(j + 8, 2)  # used only where j + 8 <= 2
            m6 = (j + 5) >> 31  # -1 where j < -5 (arithmetic shift)
            m8 = (j + 7) >> 31  # -1 where j == -8
            thi = nhi | (m8 & 0x0604)
            tlo = (slo & m6) | (nlo & (-1 - m6))
            return tlo.to(tl.uint32, bitcast=True), thi.to(tl.uint32, bitcast=True)


@triton.jit
def _lookup_byte(w, t64, n: tl.constexpr):
    """E4M3 byte of nibble n of w (plain Triton: PRMT's byte pick, then the sign)."""
    s = ((w >> (4 * n)) & 7).to(tl.uint64)
    mag = ((t64 >> (8 * s)) & 0xFF).to(tl.uint32)
    return mag | (((w >> (4 * n + 3)) & 1) << 7)


@triton.jit
def expand_e2m1_words_e4m3(words, tlo, thi, USE_ASM: tl.constexpr):
    """words int32 (any shape; 8 E2M1 nibbles each, nibble n = element n) and their blocks'
    tables (e4m3_block_tables, same shape) -> (lo, hi) uint32: the E4M3 bytes of elements 0..3
    (lo, byte n) and 4..7 (hi, byte n - 4). USE_ASM: the inline PTX above, one word per call;
    else plain Triton with the same bits (the interpreter)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(_LOOKUP_PTX, "=r,=r,r,r,r", [words, tlo, thi],
                                         dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        w = words.to(tl.uint32, bitcast=True)
        t64 = tlo.to(tl.uint64) | (thi.to(tl.uint64) << 32)
        lo = (_lookup_byte(w, t64, 0) | (_lookup_byte(w, t64, 1) << 8) | (_lookup_byte(w, t64, 2) << 16)
              | (_lookup_byte(w, t64, 3) << 24))
        hi = (_lookup_byte(w, t64, 4) | (_lookup_byte(w, t64, 5) << 8) | (_lookup_byte(w, t64, 6) << 16)
              | (_lookup_byte(w, t64, 7) << 24))
        return lo, hi


# The lookup with pack = 4 (fragment_tile, the weights in fragment order): four copies of each
# operand per call, so its two outputs are registers of 4 E4M3 bytes (element i in byte i), each
# one A-fragment register. Operands: $2..$5 the word, then the tables: one block ($6..$9 low half,
# $10..$13 high half) for both outputs, or (blocks of 16) $6 / $10 for the nibbles 0..3 and
# $14 / $18 for 4..7.
FRAGMENT_LOOKUP_PTX_32 = E4M3_LOOKUP_PTX.replace("$4", "$10").replace("$3", "$6")
FRAGMENT_LOOKUP_PTX_16 = (E4M3_LOOKUP_PTX.replace("prmt.b32 vlo, $3, $4, m;", "prmt.b32 vlo, $6, $10, m;")
                          .replace("prmt.b32 vhi, $3, $4, mh;", "prmt.b32 vhi, $14, $18, mh;"))
_FRAG_PTX_32 = tl.constexpr(FRAGMENT_LOOKUP_PTX_32)
_FRAG_PTX_16 = tl.constexpr(FRAGMENT_LOOKUP_PTX_16)


@triton.jit
def _bytes4(x, R: tl.constexpr, Q: tl.constexpr):
    """uint32 [R, 128 Q] -> its bytes uint8 [R, 128 Q, 4], byte i at index i (join(a, b)[..., y] is a
    for y = 0: so the inner joins pair bytes 0 / 2 and 1 / 3)."""
    b = tl.join(tl.join(((x >> 0) & 0xFF).to(tl.uint8), ((x >> 16) & 0xFF).to(tl.uint8)),
                tl.join(((x >> 8) & 0xFF).to(tl.uint8), ((x >> 24) & 0xFF).to(tl.uint8)))
    return tl.reshape(b, (R, 128 * Q, 4))


@triton.jit
def fragment_tile(words, off_a, off_b, R: tl.constexpr, Q: tl.constexpr, WB: tl.constexpr, USE_ASM: tl.constexpr,
                  NORMAL: tl.constexpr = False):
    """E4M3 tile [16 R, 64 Q] (row 16 r + 8 h + g, K 64 q + 32 s + 16 half + 4 t + i) of Q 64-K
    steps' words int32 [R, 128 Q] in the fragment order (moe_w4a8_details/fragment.py: word
    128 q + ((g x 4 + t) x 2 + s) x 2 + h), and their blocks' int32 offsets [R, 128 Q] (off_a: the
    nibbles 0..3, off_b: 4..7; the same tensor for blocks of 32). USE_ASM: the table + PRMT PTX with
    pack = 4, each output register one wgmma A-fragment register; else plain Triton with the same
    bits (the interpreter). NORMAL: the normal table (e4m3_block_tables; every offset >= -5)."""
    ta_lo, ta_hi = e4m3_block_tables(off_a, USE_ASM, NORMAL)
    if WB == 16:
        tb_lo, tb_hi = e4m3_block_tables(off_b, USE_ASM, NORMAL)
    else:
        tb_lo, tb_hi = ta_lo, ta_hi
    if USE_ASM:
        shape: tl.constexpr = (R, 128 * Q, 4)  # four copies: pack = 4 gives one register per operand copy
        ops = [tl.broadcast_to(words[:, :, None], shape), tl.broadcast_to(ta_lo[:, :, None], shape),
               tl.broadcast_to(ta_hi[:, :, None], shape)]
        if WB == 16:
            ops += [tl.broadcast_to(tb_lo[:, :, None], shape), tl.broadcast_to(tb_hi[:, :, None], shape)]
            lo8, hi8 = tl.inline_asm_elementwise(_FRAG_PTX_16, "=r,=r" + ",r" * 20, ops, dtype=(tl.uint8, tl.uint8),
                                                 is_pure=True, pack=4)
        else:
            lo8, hi8 = tl.inline_asm_elementwise(_FRAG_PTX_32, "=r,=r" + ",r" * 12, ops, dtype=(tl.uint8, tl.uint8),
                                                 is_pure=True, pack=4)
    else:
        lo, _ = expand_e2m1_words_e4m3(words, ta_lo, ta_hi, False)
        _, hi = expand_e2m1_words_e4m3(words, tb_lo, tb_hi, False)
        lo8 = _bytes4(lo, R, Q)
        hi8 = _bytes4(hi, R, Q)
    x = tl.join(lo8, hi8)  # [R, 128 Q = (q, g, t, s, h), 4 (i), 2 (half)]
    x = tl.reshape(x, (R, Q, 8, 4, 2, 2, 4, 2))  # r q g t s h i half
    x = tl.permute(x, (0, 5, 2, 1, 4, 7, 3, 6))  # r h g q s half t i
    return tl.reshape(x, (16 * R, 64 * Q)).to(tl.float8e4nv, bitcast=True)
