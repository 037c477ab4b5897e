"""The kernel-native FP4 weight layout: nibbles bit-placed for a 2-instruction E2M1 -> bf16 decode,
tiled so that each thread's 16-byte load lands in Hopper's MMA A-operand registers.

Tile: 16 weight rows x 64 K elements = 512 bytes. The MMA A fragment (mma.sync m16n8k16, and
each warp's share of wgmma m64nNk16 with A in registers) gives lane ``l = 4g + t`` of a warp, per
16-wide K step ``s``, rows g and g+8 at K offsets 2t, 2t+1, 2t+8, 2t+9: 8 weights. Those 8
nibbles form one 32-bit word; the 4 words of the 4 K steps of a tile are the lane's 16 bytes:

    byte offset in the tile = 16 * (4g + t) + 4 * s + i,   i = byte of the word

so 32 lanes x 16 bytes cover the tile contiguously. A matrix [N, K] is stored as
[N/16, K/64, 512] bytes (row tiles outer, K tiles inner), K zero-padded to a multiple of 64.

Bits: word bit positions are chosen so that each of the 4 bf16x2 MMA registers of the word is
``rotl(w, r) & 0x81C081C0`` (sign to bf16 bit 15, exponent bits to 8..7, mantissa bit to 6, in
both halves) or, for two of them, a sign and a magnitude part from two rotations
(:data:`WORD_ROTATIONS`, found by exhaustive search: 5 rotations + 6 logic ops per word is the
minimum for this instruction form). The bf16 read from those bits is the E2M1 value x 2^-126
(code 1, 0.5, becomes the bf16 subnormal 2^-127, which the bf16x2 multiply takes exactly).

Scales: one bf16 per 16-block holding ``e4m3 x 2^(126 - ACC_SHIFT)``, so that one bf16x2 multiply
per two weights yields the weight x 2^-ACC_SHIFT as a normal bf16 (exact: an E2M1 x E4M3 product
has at most 6 significant bits, and ACC_SHIFT = 7 keeps 448 x 2^119 finite and 0.5 x 2^-9 x
2^-7 normal); the kernels multiply the fp32 accumulator by scale_2 x 2^ACC_SHIFT. Scales are
tiled like the nibbles, [N/16, K/64, 64] with per-tile order (g, s, row half): lane g's 8 scales
(rows g and g+8, 4 K steps) are 16 contiguous bytes.

Everything here is plain torch (CPU or GPU) and exactly invertible (``unpack_*``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import formats

TILE_ROWS = 16
TILE_K = 64
TILE_BYTES = TILE_ROWS * TILE_K // 2  # 512
TILE_SCALES = TILE_ROWS * TILE_K // formats.NVFP4_BLOCK  # 64
SCALE_BYTES = 2  # one bf16 per block scale (the static model counts the layout's bytes from these)
# bf16 bits of a bit-placed E2M1 code read as value x 2^-E2M1_BF16_EXP_OFFSET.
E2M1_BF16_EXP_OFFSET = 126
# Dequantized bf16 weights carry 2^-ACC_SHIFT; the kernels undo it on the fp32 accumulator.
ACC_SHIFT = 7
ACC_SCALE = float(2**ACC_SHIFT)
# Stored bf16 block scale = e4m3 scale x this (the bit-placed E2M1's 2^-126, less ACC_SHIFT).
_BF16_SCALE_FACTOR = 2.0 ** (E2M1_BF16_EXP_OFFSET - ACC_SHIFT)

SIGN_MASK = 0x80008000
MAG_MASK = 0x01C001C0
BF16X2_E2M1_MASK = SIGN_MASK | MAG_MASK
# (sign rotation, magnitude rotation) of the word's 4 bf16x2 outputs; output o holds rows
# g + 8 * (o % 2) at K offsets 2t + 8 * (o // 2) (low half) and + 1 (high half).
WORD_ROTATIONS = ((0, 0), (1, 3), (2, 12), (6, 6))


@dataclass(frozen=True)
class FP4TileLayout:
    """Shape bookkeeping of one matrix [rows, k] in the kernel-native layout."""

    rows: int
    k: int

    def __post_init__(self) -> None:
        if self.rows % TILE_ROWS:
            raise ValueError(f"FP4TileLayout: rows={self.rows} must be a multiple of {TILE_ROWS}")
        if self.k % formats.NVFP4_BLOCK:
            raise ValueError(f"FP4TileLayout: k={self.k} must be a multiple of {formats.NVFP4_BLOCK}")

    @property
    def row_tiles(self) -> int:
        return self.rows // TILE_ROWS

    @property
    def k_tiles(self) -> int:
        return -(-self.k // TILE_K)

    @property
    def k_padded(self) -> int:
        return self.k_tiles * TILE_K

    @property
    def packed_shape(self) -> tuple[int, int, int]:
        return (self.row_tiles, self.k_tiles, TILE_BYTES)

    @property
    def scale_shape(self) -> tuple[int, int, int]:
        return (self.row_tiles, self.k_tiles, TILE_SCALES)


def _bit_targets() -> torch.Tensor:
    """int64 [8, 4]: word bit of each code bit (mantissa, e0, e1, sign) of the word's element
    e = 4h + 2p + j (row half h, K parity p, K offset 8j)."""
    t = torch.empty(2, 2, 2, 4, dtype=torch.int64)
    for h in range(2):
        for p in range(2):
            for j in range(2):
                rs, rm = WORD_ROTATIONS[2 * j + h]
                base = 16 * p  # bf16 half of the output register
                # rotl(w, r) moves word bit (q - r) mod 32 to bit q.
                t[h, p, j] = torch.tensor([(base + 6 - rm) % 32, (base + 7 - rm) % 32,
                                           (base + 8 - rm) % 32, (base + 15 - rs) % 32])
    return t.reshape(8, 4)


def _word_tables(device) -> torch.Tensor:
    """int64 [8, 16]: the word bits contributed by code c at element position e."""
    codes = torch.arange(16, dtype=torch.int64)
    bits = (codes[:, None] >> torch.arange(4)) & 1  # [16, 4]
    return (bits[None] << _bit_targets()[:, None, :]).sum(-1).to(device)


# Leading (expert) matrices are converted a bounded number of weights at a time: the integer
# temporaries take ~24 bytes per weight, which a whole 56-expert layer could not afford.
_CHUNK_WEIGHTS = {"cpu": 1 << 22, "cuda": 1 << 24}


def _chunks(n_lead: int, per_matrix: int, device: torch.device):
    step = max(1, _CHUNK_WEIGHTS.get(device.type, 1 << 22) // max(per_matrix, 1))
    for lo in range(0, n_lead, step):
        yield lo, min(lo + step, n_lead)


def pack_e2m1_tiles(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt nibbles uint8 [..., rows, k/2] (low nibble = even element) -> kernel layout
    uint8 [..., rows/16, ceil(k/64), 512]. K is zero-padded to a multiple of 64."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed: expected torch.uint8, got {packed.dtype}")
    if packed.dim() < 2:
        raise ValueError(f"packed: expected [..., rows, k/2], got shape {tuple(packed.shape)}")
    *lead, rows, half_k = packed.shape
    lay = FP4TileLayout(rows, 2 * half_k)
    flat = packed.reshape(-1, rows, half_k)
    out = torch.empty(flat.shape[0], *lay.packed_shape, dtype=torch.uint8, device=packed.device)
    table = _word_tables(packed.device)
    for lo, hi in _chunks(flat.shape[0], rows * half_k * 2, packed.device):
        codes = formats.unpack_e2m1(flat[lo:hi])
        if lay.k_padded != lay.k:
            codes = torch.nn.functional.pad(codes, (0, lay.k_padded - lay.k))
        c = codes.reshape(hi - lo, lay.row_tiles, 2, 8, lay.k_tiles, 4, 2, 4, 2)  # n R h g KT s j t p
        c = c.permute(0, 1, 4, 3, 7, 5, 2, 8, 6).reshape(-1, 8).long()  # words x (h p j)
        word = table.gather(1, c.t().contiguous()).sum(0)  # distinct bits: sum == or
        b = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
        out[lo:hi] = b.to(torch.uint8).reshape(hi - lo, *lay.packed_shape)
    return out.reshape(*lead, *lay.packed_shape)


def unpack_e2m1_tiles(tiles: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1_tiles`: uint8 [..., R, KT, 512] -> uint8 [..., 16R, k/2]."""
    if tiles.dtype != torch.uint8 or tiles.dim() < 3 or tiles.shape[-1] != TILE_BYTES:
        raise ValueError(f"tiles: expected uint8 [..., R, KT, {TILE_BYTES}], got {tiles.dtype} {tuple(tiles.shape)}")
    *lead, R, KT, _ = tiles.shape
    lay = FP4TileLayout(R * TILE_ROWS, k)
    if lay.k_tiles != KT:
        raise ValueError(f"tiles: {KT} K tiles do not hold k={k}")
    flat = tiles.reshape(-1, R, KT, TILE_BYTES)
    out = torch.empty(flat.shape[0], lay.rows, k // 2, dtype=torch.uint8, device=tiles.device)
    targets = _bit_targets().to(tiles.device)
    weights = (1 << torch.arange(4, device=tiles.device))
    for lo, hi in _chunks(flat.shape[0], R * KT * TILE_BYTES * 2, tiles.device):
        b = flat[lo:hi].reshape(-1, 4).long()
        word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
        codes = (((word[:, None, None] >> targets) & 1) * weights).sum(-1)  # words x 8
        c = codes.reshape(hi - lo, R, KT, 8, 4, 4, 2, 2, 2)  # n R KT g t s h p j
        c = c.permute(0, 1, 6, 3, 2, 5, 8, 4, 7).reshape(hi - lo, lay.rows, lay.k_padded)[..., :k]
        out[lo:hi] = formats.pack_e2m1(c.to(torch.uint8).contiguous())
    return out.reshape(*lead, lay.rows, k // 2)


def _tile_scales(values: torch.Tensor, lay: FP4TileLayout) -> torch.Tensor:
    """Block-scale values in the kernels' form [..., rows, <= k_padded/16] (zero-padded to
    k_padded) -> bf16 [..., R, KT, 64] in per-tile order (g, s, row half)."""
    pad = lay.k_padded // formats.NVFP4_BLOCK - values.shape[-1]
    if pad:
        values = torch.nn.functional.pad(values, (0, pad))
    lead = values.shape[:-2]
    v = values.reshape(*lead, lay.row_tiles, 2, 8, lay.k_tiles, 4)  # R hh g KT s
    n = len(lead)
    v = v.permute(*range(n), n + 0, n + 3, n + 2, n + 4, n + 1)
    return v.reshape(*lead, *lay.scale_shape).to(torch.bfloat16).contiguous()


def _block_scales(tiles: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of _tile_scales without the 2^(126 - ACC_SHIFT) factor: bf16 [..., R, KT, 64] ->
    float32 block scales [..., 16R, k/16]."""
    if tiles.dtype != torch.bfloat16 or tiles.dim() < 3 or tiles.shape[-1] != TILE_SCALES:
        raise ValueError(f"scale tiles: expected bf16 [..., R, KT, {TILE_SCALES}], got {tiles.dtype} {tuple(tiles.shape)}")
    lay = FP4TileLayout(tiles.shape[-3] * TILE_ROWS, k)
    lead = tiles.shape[:-3]
    v = (tiles.float() / _BF16_SCALE_FACTOR).reshape(*lead, lay.row_tiles, lay.k_tiles, 8, 4, 2)  # R KT g s hh
    n = len(lead)
    v = v.permute(*range(n), n + 0, n + 4, n + 2, n + 1, n + 3)
    return v.reshape(*lead, lay.rows, lay.k_padded // formats.NVFP4_BLOCK)[..., : k // formats.NVFP4_BLOCK]


def pack_e4m3_scale_tiles(scale: torch.Tensor, name: str = "scale") -> torch.Tensor:
    """E4M3 block scales (float8_e4m3fn or its uint8 bits) [..., rows, k/16] -> bf16
    [..., rows/16, ceil(k/64), 64] holding scale x 2^(126 - ACC_SHIFT) (exact). Padding blocks
    are 0. NaN scale patterns are refused; errors name the tensor ``name``."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e4m3fn)
    if scale.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{name}: expected float8_e4m3fn (or uint8 bits), got {scale.dtype}")
    *lead, rows, groups = scale.shape
    lay = FP4TileLayout(rows, groups * formats.NVFP4_BLOCK)
    v = scale.float()
    if torch.isnan(v).any():
        raise ValueError(f"{name}: holds E4M3 NaN patterns (0x7F/0xFF); NVFP4 block scales must be finite")
    return _tile_scales(v * _BF16_SCALE_FACTOR, lay)


def unpack_e4m3_scale_tiles(tiles: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_e4m3_scale_tiles`: bf16 [..., R, KT, 64] -> float8_e4m3fn [..., 16R, k/16]."""
    return _block_scales(tiles, k).to(torch.float8_e4m3fn).contiguous()


def pack_e8m0_scale_tiles(e8m0: torch.Tensor, scale_2_exp: torch.Tensor, name: str = "e8m0") -> torch.Tensor:
    """MXFP4 block exponents uint8 [..., rows, k/32] (value 2^(e - 127), one per 32 elements) and
    the per-matrix exponent m (int, [...] or a scalar) of scale_2 = 2^m -> bf16 scale tiles
    [..., rows/16, ceil(k/64), 64] such that the kernel's weight equals
    e2m1 x 2^(e - 127) exactly: each 16-block gets 2^(e - 127 - m) x 2^(126 - ACC_SHIFT).

    Exact where that power of two is a bf16 (e - 127 - m + 119 in [-133, 127]); refused
    otherwise with the count of blocks out of range. e8m0 = 255 (NaN) is refused; errors name
    the tensor ``name``."""
    if e8m0.dtype != torch.uint8:
        raise TypeError(f"{name}: expected uint8, got {e8m0.dtype}")
    if (e8m0 == formats.E8M0_NAN).any():
        raise ValueError(f"{name}: holds 255 (the E8M0 NaN); MXFP4 block exponents must be finite")
    *lead, rows, blocks32 = e8m0.shape
    m = torch.as_tensor(scale_2_exp, dtype=torch.int64, device=e8m0.device)
    exp = e8m0.to(torch.int64) - formats.E8M0_BIAS - m.reshape(*m.shape, *([1] * 2)) + (E2M1_BF16_EXP_OFFSET - ACC_SHIFT)
    bad = (exp < -133) | (exp > 127)
    if bad.any():
        raise ValueError(f"{name}: {int(bad.sum())} block exponents fall outside bf16 for the given scale_2 exponent")
    v = torch.exp2(exp.double()).repeat_interleave(2, dim=-1)  # two 16-blocks per 32-block
    lay = FP4TileLayout(rows, blocks32 * formats.MXFP4_BLOCK)
    return _tile_scales(v, lay)


def dequantize_tiles(tiles: torch.Tensor, scale_tiles: torch.Tensor, k: int) -> torch.Tensor:
    """Plain-torch value of kernel-layout weights without scale_2: uint8 [..., R, KT, 512] and
    bf16 [..., R, KT, 64] -> float32 [..., 16R, k] = e2m1 x block scale (exact). What the
    kernels multiply, before the fp32 scale_2 x 2^ACC_SHIFT on the accumulator."""
    codes = formats.unpack_e2m1(unpack_e2m1_tiles(tiles, k))
    scale = _block_scales(scale_tiles, k)
    return formats.e2m1_to_float(codes) * scale.repeat_interleave(formats.NVFP4_BLOCK, dim=-1)
