"""The dequant's inline PTX, run on a CPU: the exact asm strings the GPU kernels compile with
(k3nvfp4.kernels.moe_details.fp4: SCALE_PAIR_PTX turns the layout's scale words into bf16x2
pairs, DEQUANT_PTX multiplies the bit-placed nibbles by them), executed by a small emulator of
their opcodes (tests/ptx_emulator.py, Triton's inline_asm_elementwise operand convention), bit for
bit against kernels/formats.py over every E2M1 code in every word position x every finite E4M3
block scale (scale words packed by layout.py, decoded by the asm), and E8M0 scales across the
window from_mxfp4 allows. A mutated asm (one wrong rotation, one wrong mask bit) fails, and so
does an opcode the emulator does not know."""

from __future__ import annotations

import struct

import pytest
import torch

from ptx_emulator import UnsupportedPTX, bf16_to_float, run
from k3nvfp4.kernels import formats
from k3nvfp4.kernels.moe_details import layout
from k3nvfp4.kernels.moe_details.fp4 import DEQUANT_PTX, SCALE_PAIR_PTX

CONSTRAINTS = "=h,=h,=h,=h,=h,=h,=h,=h,r,r"  # as dequant_e2m1_words passes them
PAIR_CONSTRAINTS = "=r,r"  # as decode_scale_words passes them
ASM = DEQUANT_PTX.value if hasattr(DEQUANT_PTX, "value") else str(DEQUANT_PTX)
TABLE = layout.word_bit_tables("cpu")  # [8 element positions (h p j), 16 codes] -> word bits
E2M1 = formats.e2m1_table().tolist()


def _bf16_bits(x: float) -> int:
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    assert b & 0xFFFF == 0, x  # exactly a bf16
    return b >> 16


def _word(codes: list[int]) -> int:
    """The word holding code codes[e] at element position e = 4h + 2p + j."""
    return int(sum(int(TABLE[e, c]) for e, c in enumerate(codes)))


def _expected(codes: list[int], s_lo: float, s_hi: float) -> list[float]:
    """Output o = 4j + 2h + p of the asm: e2m1(code) x the row's layout scale x 2^-126 (the bit
    placement's offset): the weight value x 2^-ACC_SHIFT."""
    out = [0.0] * 8
    for h in range(2):
        for p in range(2):
            for j in range(2):
                e = 4 * h + 2 * p + j
                out[4 * j + 2 * h + p] = E2M1[codes[e]] * (s_hi if h else s_lo) * 2.0 ** -layout.E2M1_BF16_EXP_OFFSET
    return out


def _check(asm: str, codes: list[int], s_lo: float, s_hi: float) -> None:
    got = run(asm, CONSTRAINTS, [_word(codes), _bf16_bits(s_lo) | _bf16_bits(s_hi) << 16])
    want = _expected(codes, s_lo, s_hi)
    for o, (g, w) in enumerate(zip(got, want)):
        gv = bf16_to_float(g)
        assert gv == w and (struct.pack("<f", gv)[3] & 0x80) == (struct.pack("<f", w)[3] & 0x80), (
            f"output {o}: got {gv!r} (bits {g:#06x}), want {w!r}; codes {codes}, scales {s_lo}, {s_hi}")


def _rotl8(x: int) -> int:
    return ((x << 8) | (x >> 24)) & 0xFFFFFFFF


def _pairs(words: torch.Tensor, fmt: layout.ScaleFormat, word: int, asm: str | None = None) -> list[int]:
    """The scale pair asm's bf16x2 pairs of one scale word of a layout tensor: in place, and
    rotated left by a byte first (the kernel's _rotl8, for the word's second pair)."""
    asm = asm or SCALE_PAIR_PTX[fmt.kernel_id]
    w = int(words.flatten()[word]) & 0xFFFFFFFF
    return [run(asm, PAIR_CONSTRAINTS, [w])[0], run(asm, PAIR_CONSTRAINTS, [_rotl8(w)])[0]]


def _layout_scale(e4m3_code: int) -> float:
    """The bf16 scale the kernel multiplies by for an E4M3 code: packed by layout.py into a
    scale word, decoded by the scale pair asm (row g = 0, K steps 0 and 1 both checked)."""
    scale = torch.full((16, 4), e4m3_code, dtype=torch.uint8)
    _, words, _ = layout.pack_nvfp4_scales(torch.zeros(16, 32, dtype=torch.uint8), scale)
    p0, p1 = _pairs(words, layout.E5M3_16, 0)
    assert p0 == p1 and p0 >> 16 == p0 & 0xFFFF, (e4m3_code, hex(p0), hex(p1))
    return bf16_to_float(p0)


def test_scale_pair_asm_every_e4m3_code():
    """Every finite non-negative E4M3 code's E5M3 byte decodes to exactly scale x 2^119
    (subnormal scales included); zero scales decode to a finite value (their nibbles keep only
    their signs, see the next test)."""
    for code in range(1, 0x7F):
        want = float(torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).float()) * 2.0**119
        assert _layout_scale(code) == want, hex(code)
    assert _layout_scale(0) == 2.0**97


def test_every_code_in_every_position_times_every_e4m3_scale():
    scales = [_layout_scale(c) for c in range(1, 0x7F)]  # every finite positive E4M3 code
    for s in scales:
        for e in range(8):
            for code in range(16):
                codes = [0] * 8
                codes[e] = code
                _check(ASM, codes, s, scales[36])  # row g + 8 at a fixed normal scale
                codes2 = [9] * 8
                codes2[e] = code
                _check(ASM, codes2, scales[36], s)  # and the other row half, neighbours non-zero
    zero = _layout_scale(0)  # a zero scale: the layout keeps only the nibbles' signs
    for e in range(8):
        for sign in (0, 8):
            codes = [9] * 8
            codes[e] = sign
            got = run(ASM, CONSTRAINTS, [_word(codes), _bf16_bits(zero) | _bf16_bits(scales[36]) << 16])
            o = 4 * (e % 2) + 2 * (e // 4) + (e // 2) % 2  # output of element e = 4h + 2p + j
            if e // 4 == 0:  # row g: the zero-scale row
                assert got[o] == (0x8000 if sign else 0), (e, hex(got[o]))


def test_e8m0_scales_across_the_window():
    """from_mxfp4's scale bytes for block exponents from the matrix's largest (2^127: scale_2
    takes the rest) down to 126 binades below it, where the smallest product (0.5 x 2^-126 x
    2^(127 - 126)) is still a normal bf16: packed by layout.py, decoded by the scale pair asm
    (32-block 0 in place, 1 rotated), times random words."""
    g = torch.Generator().manual_seed(0)
    for depth in range(0, 127):
        e8m0 = torch.full((16, 2), 254 - depth, dtype=torch.uint8)
        e8m0[:, 1] = 200
        words = layout.pack_e8m0_scale_tiles(e8m0, 119)  # scale_2 = 2^119: the byte is the bf16 field
        p0, p1 = _pairs(words, layout.E8M0_32, 3)
        assert bf16_to_float(p0 & 0xFFFF) == 2.0 ** (127 - depth) and bf16_to_float(p1 >> 16) == 2.0 ** (200 - 254 + 127)
        for _ in range(4):
            codes = torch.randint(0, 16, (8,), generator=g).tolist()
            got = run(ASM, CONSTRAINTS, [_word(codes), p0])
            want = _expected(codes, 2.0 ** (127 - depth), 2.0 ** (127 - depth))
            assert [bf16_to_float(x) for x in got] == want


def test_mutations_and_unknown_opcodes_fail():
    mutated_shift = ASM.replace("shf.l.wrap.b32 r3, $8, $8, 3;", "shf.l.wrap.b32 r3, $8, $8, 4;")
    mutated_mask = ASM.replace("and.b32 o0, $8, 0x81c081c0;", "and.b32 o0, $8, 0x81c081c1;")
    assert mutated_shift != ASM and mutated_mask != ASM
    scales = [_layout_scale(c) for c in (0x38, 0x40)]
    for bad in (mutated_shift, mutated_mask):
        with pytest.raises(AssertionError):
            for e in range(8):
                for code in range(16):
                    codes = [0] * 8
                    codes[e] = code
                    _check(bad, codes, *scales)
    with pytest.raises(UnsupportedPTX, match="cvt.rn.bf16x2.f32"):
        run(ASM.replace("fma.rn.bf16x2 o0, o0, sa, nz;", "cvt.rn.bf16x2.f32 o0, o0, sa;"), CONSTRAINTS, [0, 0])
    pair = SCALE_PAIR_PTX[layout.E5M3_16.kernel_id]
    scale = torch.arange(0x20, 0x60, dtype=torch.uint8).reshape(16, 4)
    _, words, _ = layout.pack_nvfp4_scales(torch.zeros(16, 32, dtype=torch.uint8), scale)
    want = layout.decode_scale_words(words, 64, layout.E5M3_16) * 2.0**119
    for mutated in (pair.replace("0x0ff00ff0", "0x0ff00fe0"), pair.replace("0x70007000", "0x70006000")):
        assert mutated != pair
        with pytest.raises(AssertionError):
            for g in range(8):
                for asm in (pair, mutated):
                    p = _pairs(words, layout.E5M3_16, 2 * g, asm)
                    assert bf16_to_float(p[1] & 0xFFFF) == float(want[g, 1]) and bf16_to_float(p[0] >> 16) == float(want[g + 8, 0])


def test_emulator_bf16_rounding_hand_cases():
    """Hand-computed: round to nearest even at a tie, subnormal results kept, signed zeros."""
    from fractions import Fraction

    from ptx_emulator import round_to_bf16

    assert round_to_bf16(Fraction(1) + Fraction(1, 256)) == 0x3F80  # tie between 1 and 1 + 2^-7: even (1)
    assert round_to_bf16(Fraction(1) + Fraction(3, 256)) == 0x3F82  # tie between 1 + 2^-7 and 1 + 2^-6: even
    assert round_to_bf16(Fraction(1, 2**133)) == 0x0001  # the smallest subnormal
    assert round_to_bf16(Fraction(1, 2**134)) == 0x0000  # half of it: tie to even (zero)
    assert round_to_bf16(Fraction(-3, 2**134)) == 0x8002  # 1.5 x the smallest: tie to even (2)
    out = run("{\nfma.rn.bf16x2 $0, $1, $2, $3;\n}", "=r,r,r,r", [0x8000_3F80, 0x0000_8000, 0x8000_8000])
    assert out == [0x8000_8000]  # 1 x -0 + -0 = -0 (low); -0 x +0 + -0 = -0 (high)
