"""The W4A8 mode's GPU expansion, run on a CPU: the exact inline PTX strings of
kernels/moe_details/e4m3_expand.py (E4M3_TABLE_PTX: one block's offset -> its 8-byte E4M3 table;
E4M3_LOOKUP_PTX: a word of 8 E2M1 nibbles + its block's table -> 8 E4M3 bytes by PRMT), executed
by tests/ptx_emulator.py with Triton's inline_asm_elementwise operand convention, bit for bit
against expand_e2m1_to_e4m3_reference (itself checked against ml_dtypes in test_e4m3_expand.py)
over every code in every nibble position x every offset of the exact window [-8, 6]. A mutated asm
(a wrong selector, a wrong constant) fails, and so does an opcode the emulator does not know."""

from __future__ import annotations

import pytest
import torch

from ptx_emulator import UnsupportedPTX, run
from k3nvfp4.kernels.moe_details.e4m3_expand import (E4M3_EXPAND_MAX_OFFSET, E4M3_EXPAND_MIN_OFFSET, E4M3_LOOKUP_PTX,
                                                     E4M3_NORMAL_MIN_OFFSET, E4M3_NORMAL_TABLE_PTX, E4M3_TABLE_PTX,
                                                     expand_e2m1_to_e4m3_reference)

OFFSETS = range(E4M3_EXPAND_MIN_OFFSET, E4M3_EXPAND_MAX_OFFSET + 1)
NORMAL_OFFSETS = range(E4M3_NORMAL_MIN_OFFSET, E4M3_EXPAND_MAX_OFFSET + 1)
TABLE_CONSTRAINTS = "=r,=r,r"  # as e4m3_block_tables passes them
LOOKUP_CONSTRAINTS = "=r,=r,r,r,r"  # as expand_e2m1_words_e4m3 passes them


def _bytes(x: int) -> list[int]:
    return [(x >> (8 * i)) & 0xFF for i in range(4)]


def _reference(codes: list[int], j: int) -> list[int]:
    return expand_e2m1_to_e4m3_reference(torch.tensor(codes, dtype=torch.uint8), j).tolist()


def _word(codes: list[int]) -> int:
    return sum(c << (4 * n) for n, c in enumerate(codes))


def _words_covering_every_code_at_every_position() -> list[list[int]]:
    """16 words: word c holds code (c + n) % 16 at nibble n, so each code sits at each position once;
    plus words mixing signs and magnitudes differently across the two halves."""
    words = [[(c + n) % 16 for n in range(8)] for c in range(16)]
    words += [[(5 * c + 3 * n) % 16 for n in range(8)] for c in range(16)]
    return words


def _tables(j: int, asm: str = E4M3_TABLE_PTX) -> tuple[int, int]:
    tlo, thi = run(asm, TABLE_CONSTRAINTS, [j & 0xFFFFFFFF])
    return tlo, thi


@pytest.mark.parametrize("j", list(OFFSETS))
def test_block_table_is_the_reference_bytes(j):
    tlo, thi = _tables(j)
    assert _bytes(tlo) + _bytes(thi) == _reference(list(range(8)), j), (j, hex(tlo), hex(thi))


@pytest.mark.parametrize("j", list(OFFSETS))
def test_lookup_expands_every_code_at_every_position(j):
    tlo, thi = _tables(j)
    for codes in _words_covering_every_code_at_every_position():
        lo, hi = run(E4M3_LOOKUP_PTX, LOOKUP_CONSTRAINTS, [_word(codes), tlo, thi])
        assert _bytes(lo) + _bytes(hi) == _reference(codes, j), (j, codes, hex(lo), hex(hi))


def test_the_table_has_the_linear_normal_form():
    """Hand-computed: j = 0 gives the E4M3 bytes of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (0x30 = 2^-1,
    0x38 = 1, 0x3C = 1.5, 0x40 = 2, 0x44 = 3, 0x48 = 4, 0x4C = 6); j = -8 the subnormals k x 2^-9."""
    assert _tables(0) == (0x3C383000, 0x4C484440)
    assert _tables(-8) == (0x03020100, 0x0C080604)


@pytest.mark.parametrize("bad, new", [
    ("0xD9C8", "0xD9C9"),                  # a wrong sign selector
    ("0xFBEA", "0xBFEA"),
    ("0x77777777", "0xFFFFFFFF"),          # selectors with their sign bits: sign-replicate mode
    ("shl.b32 w4, $2, 4;", "shl.b32 w4, $2, 3;"),
])
def test_a_mutated_lookup_fails(bad, new):
    asm = E4M3_LOOKUP_PTX.replace(bad, new)
    assert asm != E4M3_LOOKUP_PTX
    failures = 0
    for j in OFFSETS:
        tlo, thi = _tables(j)
        for codes in _words_covering_every_code_at_every_position():
            lo, hi = run(asm, LOOKUP_CONSTRAINTS, [_word(codes), tlo, thi])
            failures += _bytes(lo) + _bytes(hi) != _reference(codes, j)
    assert failures > 0


@pytest.mark.parametrize("bad, new", [("0x0604", "0x0404"), ("add.u32 m6, $2, 5;", "add.u32 m6, $2, 6;"),
                                      ("0x3C383000", "0x3C383800")])
def test_a_mutated_table_fails(bad, new):
    asm = E4M3_TABLE_PTX.replace(bad, new)
    assert asm != E4M3_TABLE_PTX
    assert any(_bytes(t[0]) + _bytes(t[1]) != _reference(list(range(8)), j) for j in OFFSETS
               for t in [_tables(j, asm)])


@pytest.mark.parametrize("j", list(OFFSETS))
def test_normal_table_is_the_reference_bytes_from_minus5(j):
    """E4M3_NORMAL_TABLE_PTX (the two multiply-adds, for matrices whose offsets are all >= -5): the
    reference bytes over its range, expanded by the lookup over every code at every position; below
    -5 (the subnormal E4M3 entries) it is wrong, which is why the preparation chooses per matrix."""
    tlo, thi = _tables(j, E4M3_NORMAL_TABLE_PTX)
    table_ok = _bytes(tlo) + _bytes(thi) == _reference(list(range(8)), j)
    if j not in NORMAL_OFFSETS:
        assert not table_ok, (j, hex(tlo), hex(thi))
        return
    assert table_ok, (j, hex(tlo), hex(thi))
    assert (tlo, thi) == _tables(j)  # the full table's bytes where both apply
    for codes in _words_covering_every_code_at_every_position():
        lo, hi = run(E4M3_LOOKUP_PTX, LOOKUP_CONSTRAINTS, [_word(codes), tlo, thi])
        assert _bytes(lo) + _bytes(hi) == _reference(codes, j), (j, codes, hex(lo), hex(hi))


def test_a_mutated_normal_table_fails():
    asm = E4M3_NORMAL_TABLE_PTX.replace("0x08080808", "0x08080800")
    assert asm != E4M3_NORMAL_TABLE_PTX
    assert any(_bytes(t[0]) + _bytes(t[1]) != _reference(list(range(8)), j) for j in NORMAL_OFFSETS
               for t in [_tables(j, asm)])


def test_an_unknown_opcode_is_refused():
    with pytest.raises(UnsupportedPTX):
        run(E4M3_LOOKUP_PTX.replace("and.b32 m,", "bfe.u32 m,"), LOOKUP_CONSTRAINTS, [0, 0, 0])
