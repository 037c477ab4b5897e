"""The kernel layout's nibble and scale-word maps (layout.py) as Triton kernels, for tensors on a
CUDA device: one program per 16-row x 64-K tile reads its 512 source bytes once and writes its
512 layout bytes (or its scale words) once, so preparation runs at copy speed with no temporaries.

The bit placement comes in as constexprs derived from layout.word_bit_tables() (the one definition
of it): per element e = 4h + 2p + j of a word, the bit where its 3 magnitude bits start (MT) and
its sign bit (ST). The host twin is layout_host.py; tests/test_layout.py runs both (these in
Triton's interpreter) against the reference implementation bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_ROWS, TILE_K_BYTES, TILE_WORDS = 16, 32, 128


def _placement(word_bits: torch.Tensor) -> dict:
    """word_bits int64 [8, 16] -> {"MT0".."MT7", "ST0".."ST7"}: start bit of element e's
    magnitude (code bits 0..2, contiguous) and its sign bit (code bit 3)."""
    wt = word_bits.cpu().tolist()
    out = {}
    for e in range(8):
        mt = (wt[e][1]).bit_length() - 1
        st = (wt[e][8]).bit_length() - 1
        if wt[e][2] != 1 << (mt + 1) or wt[e][4] != 1 << (mt + 2) or wt[e][15] != wt[e][7] | wt[e][8]:
            raise ValueError(f"word_bits: element {e}'s magnitude bits are not contiguous")
        out[f"MT{e}"], out[f"ST{e}"] = mt, st
    return out


@triton.jit
def _contrib(b, MT_LO: tl.constexpr, ST_LO: tl.constexpr, MT_HI: tl.constexpr, ST_HI: tl.constexpr):
    """Word bits of source byte b (uint32): its low nibble (p = 0) and high nibble (p = 1)."""
    lo = b & 15
    hi = b >> 4
    return ((lo & 7) << MT_LO) | ((lo >> 3) << ST_LO) | ((hi & 7) << MT_HI) | ((hi >> 3) << ST_HI)


@triton.jit
def _code_byte(word, MT_LO: tl.constexpr, ST_LO: tl.constexpr, MT_HI: tl.constexpr, ST_HI: tl.constexpr):
    """Inverse of _contrib: the source byte (uint32) whose nibbles the word holds."""
    lo = ((word >> MT_LO) & 7) | (((word >> ST_LO) & 1) << 3)
    hi = ((word >> MT_HI) & 7) | (((word >> ST_HI) & 1) << 3)
    return lo | (hi << 4)


@triton.jit
def _nibbles_kernel(src, tiles, half_k, k_tiles, UNPACK: tl.constexpr,
                    MT0: tl.constexpr, MT1: tl.constexpr, MT2: tl.constexpr, MT3: tl.constexpr,
                    MT4: tl.constexpr, MT5: tl.constexpr, MT6: tl.constexpr, MT7: tl.constexpr,
                    ST0: tl.constexpr, ST1: tl.constexpr, ST2: tl.constexpr, ST3: tl.constexpr,
                    ST4: tl.constexpr, ST5: tl.constexpr, ST6: tl.constexpr, ST7: tl.constexpr):
    """Program (unit, K tile): src uint8 [U, 16, half_k] <-> tiles int32 [U, k_tiles, 128]."""
    pid = tl.program_id(0).to(tl.int64)
    unit = pid // k_tiles
    kt = pid % k_tiles
    w = tl.arange(0, 128)  # word (g, t, s)
    g = w // 16
    t = (w // 4) % 4
    s = w % 4
    row0 = src + unit * 16 * half_k + g * half_k  # row g (h = 0); h = 1 is 8 rows further
    col0 = kt * 32 + 8 * s + t  # j = 0; j = 1 is 4 bytes further
    m0 = col0 < half_k
    m1 = col0 + 4 < half_k
    tile_words = tiles + pid * 128 + w
    if UNPACK:
        word = tl.load(tile_words).to(tl.uint32, bitcast=True)
        tl.store(row0 + col0, _code_byte(word, MT0, ST0, MT2, ST2).to(tl.uint8), mask=m0)
        tl.store(row0 + col0 + 4, _code_byte(word, MT1, ST1, MT3, ST3).to(tl.uint8), mask=m1)
        tl.store(row0 + 8 * half_k + col0, _code_byte(word, MT4, ST4, MT6, ST6).to(tl.uint8), mask=m0)
        tl.store(row0 + 8 * half_k + col0 + 4, _code_byte(word, MT5, ST5, MT7, ST7).to(tl.uint8), mask=m1)
    else:
        # element e = 4h + 2p + j: byte (h, j) holds p = 0 (low nibble) and p = 1 (high)
        a = tl.load(row0 + col0, mask=m0, other=0).to(tl.uint32)
        b = tl.load(row0 + col0 + 4, mask=m1, other=0).to(tl.uint32)
        c = tl.load(row0 + 8 * half_k + col0, mask=m0, other=0).to(tl.uint32)
        d = tl.load(row0 + 8 * half_k + col0 + 4, mask=m1, other=0).to(tl.uint32)
        word = (_contrib(a, MT0, ST0, MT2, ST2) | _contrib(b, MT1, ST1, MT3, ST3)
                | _contrib(c, MT4, ST4, MT6, ST6) | _contrib(d, MT5, ST5, MT7, ST7))
        tl.store(tile_words, word.to(tl.int32, bitcast=True))


def pack_nibbles(src: torch.Tensor, out: torch.Tensor, word_bits: torch.Tensor) -> None:
    """src uint8 [U, 16, k/2] -> out uint8 [U, KT, 512] (contiguous, same device)."""
    U, KT = out.shape[0], out.shape[1]
    _nibbles_kernel[(U * KT,)](src, out.view(torch.int32), src.shape[2], KT, UNPACK=False, **_placement(word_bits))


def unpack_nibbles(tiles: torch.Tensor, out: torch.Tensor, word_bits: torch.Tensor) -> None:
    """tiles uint8 [U, KT, 512] -> out uint8 [U, 16, k/2] (contiguous, same device)."""
    U, KT = tiles.shape[0], tiles.shape[1]
    _nibbles_kernel[(U * KT,)](out, tiles.view(torch.int32), out.shape[2], KT, UNPACK=True, **_placement(word_bits))


@triton.jit
def _scales_kernel(codes, words, luts, units_per_lut, groups, k_tiles, UNPACK: tl.constexpr,
                   HAS_LUT: tl.constexpr, WPL: tl.constexpr, SHIFT: tl.constexpr):
    """Program (unit, K tile): codes uint8 [U, 16, groups] <-> words int32 [U, k_tiles, 8 * WPL]
    (layout.py: word (g, i) = pairs (rows g, g + 8) of group 2i in place, 2i + 1 rotated right 8)."""
    pid = tl.program_id(0).to(tl.int64)
    unit = pid // k_tiles
    kt = pid % k_tiles
    x = tl.arange(0, 8 * WPL)
    g = x // WPL
    i = x % WPL
    row0 = codes + unit * 16 * groups + g * groups
    col0 = kt * 2 * WPL + 2 * i  # par = 0; par = 1 is the next group
    m0 = col0 < groups
    m1 = col0 + 1 < groups
    word_ptr = words + pid * 8 * WPL + x
    if UNPACK:
        w = tl.load(word_ptr).to(tl.uint32, bitcast=True)
        rot = (w << 8) | (w >> 24)
        tl.store(row0 + col0, ((w >> SHIFT) & 0xFF).to(tl.uint8), mask=m0)
        tl.store(row0 + 8 * groups + col0, ((w >> (SHIFT + 16)) & 0xFF).to(tl.uint8), mask=m0)
        tl.store(row0 + col0 + 1, ((rot >> SHIFT) & 0xFF).to(tl.uint8), mask=m1)
        tl.store(row0 + 8 * groups + col0 + 1, ((rot >> (SHIFT + 16)) & 0xFF).to(tl.uint8), mask=m1)
    else:
        c00 = tl.load(row0 + col0, mask=m0, other=0)
        c10 = tl.load(row0 + 8 * groups + col0, mask=m0, other=0)
        c01 = tl.load(row0 + col0 + 1, mask=m1, other=0)
        c11 = tl.load(row0 + 8 * groups + col0 + 1, mask=m1, other=0)
        if HAS_LUT:  # padding stays 0: the LUT maps only the loaded bytes
            lut = luts + (unit // units_per_lut) * 256
            c00 = tl.where(m0, tl.load(lut + c00.to(tl.int32)), 0)
            c10 = tl.where(m0, tl.load(lut + c10.to(tl.int32)), 0)
            c01 = tl.where(m1, tl.load(lut + c01.to(tl.int32)), 0)
            c11 = tl.where(m1, tl.load(lut + c11.to(tl.int32)), 0)
        direct = (c00.to(tl.uint32) << SHIFT) | (c10.to(tl.uint32) << (SHIFT + 16))
        rot = (c01.to(tl.uint32) << SHIFT) | (c11.to(tl.uint32) << (SHIFT + 16))
        word = direct | (rot >> 8) | (rot << 24)
        tl.store(word_ptr, word.to(tl.int32, bitcast=True))


def tile_scale_bytes(codes: torch.Tensor, k_tiles: int, words_per_lane: int, shift: int,
                     luts: torch.Tensor | None = None, units_per_lut: int = 1) -> torch.Tensor:
    """codes uint8 [U, 16, G] -> int32 [U, k_tiles, 8 * words_per_lane]; unit u's bytes first
    through luts[u // units_per_lut] (luts uint8 [L, 256]) if given (layout_host.tile_scale_bytes)."""
    U, _, G = codes.shape
    out = torch.empty(U, k_tiles, 8 * words_per_lane, dtype=torch.int32, device=codes.device)
    if U:
        _scales_kernel[(U * k_tiles,)](codes, out, codes if luts is None else luts, max(1, units_per_lut), G, k_tiles,
                                       UNPACK=False, HAS_LUT=luts is not None, WPL=words_per_lane, SHIFT=shift)
    return out


def untile_scale_bytes(words: torch.Tensor, groups: int, words_per_lane: int, shift: int) -> torch.Tensor:
    """Inverse of tile_scale_bytes (without the lut): int32 [U, KT, 8 * wpl] -> uint8 [U, 16, groups]."""
    U, k_tiles, _ = words.shape
    out = torch.empty(U, TILE_ROWS, groups, dtype=torch.uint8, device=words.device)
    if U:
        _scales_kernel[(U * k_tiles,)](out, words, out, 1, groups, k_tiles, UNPACK=True, HAS_LUT=False,
                                       WPL=words_per_lane, SHIFT=shift)
    return out
