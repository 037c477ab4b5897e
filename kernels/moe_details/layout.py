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

Scales: one byte per block scale, as in the checkpoint (0.5625 B per weight for NVFP4, 0.53125
for the MXFP4 release), turned by the kernel into the bf16 ``scale x 2^(126 - ACC_SHIFT)`` its
bf16x2 multiply needs (one bf16x2 multiply per two weights gives the weight x 2^-ACC_SHIFT as a
normal bf16, exact: an E2M1 x E4M3 product has at most 6 significant bits, and ACC_SHIFT = 7 keeps
448 x 2^119 finite and 0.5 x 2^-9 x 2^-7 normal; the kernels multiply the fp32 accumulator by
scale_2 x 2^ACC_SHIFT). A :class:`ScaleFormat` says how:

- ``E5M3_16`` (NVFP4, one scale per 16): each E4M3 scale is re-encoded once, at preparation, as
  the unsigned byte u = ((e + 22) << 3) | m of its normalised value 2^e (1 + m / 8) (E4M3
  subnormals normalise too: e in [-9, 8]), so that the bf16 bits are ``(u << 4) | 0x7000``.
  Zero and negative scales have no such byte: a zero scale's nibbles keep only their signs
  (u = 0), a negative scale's nibbles change sign (u of |scale|); both values are exact, and the
  blocks' original bytes are kept aside (:class:`BlockExceptions`) for ``to_modelopt``.
- ``E8M0_32`` (the MXFP4 release, one scale per 32, not expanded): the byte is the bf16 exponent
  field of 2^(k - m) x 2^119 (m the scale_2 exponent), the bf16 bits ``f << 7``.

Scale words: per tile, lane g reads its scales (rows g and g + 8 at its K steps) as 32-bit words
of 4 bytes. A word holds two bf16x2 pairs (row g low, row g + 8 high): one in place (bytes at bits
SH..SH+7 and SH+16..SH+23, SH = 4 or 7) and one rotated right by 8 bits, so the kernel gets each
pair with one LOP3 (``& mask | fill``) and the second after one rotation. E5M3_16: 2 words per lane
and tile (word i: steps 2i in place, 2i + 1 rotated), [rows/16, K/64, 16] int32; E8M0_32: 1 word
(32-block 0 in place, 1 rotated), [rows/16, K/64, 8] int32.

Everything here is plain torch (CPU or GPU) and exactly invertible (``unpack_*``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .. import formats
from . import layout_host

TILE_ROWS = 16
TILE_K = 64
TILE_BYTES = TILE_ROWS * TILE_K // 2  # 512
# bf16 bits of a bit-placed E2M1 code read as value x 2^-E2M1_BF16_EXP_OFFSET.
E2M1_BF16_EXP_OFFSET = 126
# Dequantized bf16 weights carry 2^-ACC_SHIFT; the kernels undo it on the fp32 accumulator.
ACC_SHIFT = 7
ACC_SCALE = float(2**ACC_SHIFT)
# Stored bf16 block scale = e4m3 scale x this (the bit-placed E2M1's 2^-126, less ACC_SHIFT).
_BF16_SCALE_FACTOR = 2.0 ** (E2M1_BF16_EXP_OFFSET - ACC_SHIFT)



@dataclass(frozen=True)
class ScaleFormat:
    """How the kernel layout stores block scales (one byte each) and the kernel decodes them:
    bf16x2 pair = ``(rotl(word, 0 or 8) & mask) | fill``."""

    name: str
    block: int  # weights per scale
    kernel_id: int  # the kernels' SCALE_FMT constexpr
    shift: int  # bit of the byte's LSB in the bf16 half
    fill: int  # constant bf16x2 bits OR-ed in (the exponent's fixed high bits)

    @property
    def mask(self) -> int:
        return (0xFF << self.shift) | (0xFF << (self.shift + 16))

    @property
    def words_per_lane(self) -> int:
        """Scale words per lane and tile (each holds 2 pairs = 2 K steps' or 32-blocks' scales)."""
        return TILE_K // self.block // 2

    @property
    def words_per_tile(self) -> int:
        return 8 * self.words_per_lane

    @property
    def bytes_per_weight(self) -> float:
        """Bytes the kernel streams per weight: the nibble and the scale byte's share."""
        return 0.5 + 1.0 / self.block


E5M3_16 = ScaleFormat("e5m3/16", formats.NVFP4_BLOCK, 0, 4, 0x70007000)
E8M0_32 = ScaleFormat("e8m0/32", formats.MXFP4_BLOCK, 1, 7, 0)
SCALE_FORMATS = (E5M3_16, E8M0_32)
# E5M3_16's byte: u = (bf16 bits of scale x 2^119) >> 4, less the fixed exponent bits (0x7000 >> 4).
_E5M3_FILL_BYTE = 0x700
_E5M3_ZERO = 0  # u of zero scales (no non-zero scale has u < 104)

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

    def scale_shape(self, fmt: ScaleFormat) -> tuple[int, int, int]:
        return (self.row_tiles, self.k_tiles, fmt.words_per_tile)


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


def word_bit_tables(device=None) -> torch.Tensor:
    """int64 [8, 16]: the word bits contributed by code c at element position e = 4h + 2p + j."""
    codes = torch.arange(16, dtype=torch.int64)
    bits = (codes[:, None] >> torch.arange(4)) & 1  # [16, 4]
    return (bits[None] << _bit_targets()[:, None, :]).sum(-1).to(device)


@functools.lru_cache(maxsize=1)
def _host_tables() -> tuple:
    return layout_host.pair_tables(word_bit_tables().numpy().tobytes())


def _on_host(t: torch.Tensor) -> bool:
    return t.device.type == "cpu"


def _tile_units(packed: torch.Tensor, lay: "FP4TileLayout") -> torch.Tensor:
    """[..., rows, k/2] -> [row tiles of all matrices, 16, k/2] (a view when contiguous)."""
    return packed.contiguous().reshape(-1, TILE_ROWS, lay.k // 2)


def pack_e2m1_tiles(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt nibbles uint8 [..., rows, k/2] (low nibble = even element) -> kernel layout
    uint8 [..., rows/16, ceil(k/64), 512]. K is zero-padded to a multiple of 64. One pass over
    the bytes: numpy on the host (layout_host.py), a Triton kernel on CUDA (layout_kernels.py);
    temporaries of a few hundred KiB, whatever the size."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed: expected torch.uint8, got {packed.dtype}")
    if packed.dim() < 2:
        raise ValueError(f"packed: expected [..., rows, k/2], got shape {tuple(packed.shape)}")
    *lead, rows, half_k = packed.shape
    lay = FP4TileLayout(rows, 2 * half_k)
    src = _tile_units(packed, lay)
    out = torch.empty(src.shape[0], lay.k_tiles, TILE_BYTES, dtype=torch.uint8, device=packed.device)
    if src.shape[0]:
        if _on_host(packed):
            layout_host.pack_nibbles(src.numpy(), lay.k_tiles, _host_tables(), out=out.numpy())
        else:
            from . import layout_kernels

            layout_kernels.pack_nibbles(src, out, word_bit_tables())
    return out.reshape(*lead, *lay.packed_shape)


def unpack_e2m1_tiles(tiles: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of :func:`pack_e2m1_tiles`: uint8 [..., R, KT, 512] -> uint8 [..., 16R, k/2]."""
    if tiles.dtype != torch.uint8 or tiles.dim() < 3 or tiles.shape[-1] != TILE_BYTES:
        raise ValueError(f"tiles: expected uint8 [..., R, KT, {TILE_BYTES}], got {tiles.dtype} {tuple(tiles.shape)}")
    *lead, R, KT, _ = tiles.shape
    lay = FP4TileLayout(R * TILE_ROWS, k)
    if lay.k_tiles != KT:
        raise ValueError(f"tiles: {KT} K tiles do not hold k={k}")
    src = tiles.contiguous().reshape(-1, KT, TILE_BYTES)
    out = torch.empty(src.shape[0], TILE_ROWS, k // 2, dtype=torch.uint8, device=tiles.device)
    if src.shape[0]:
        if _on_host(tiles):
            layout_host.unpack_nibbles(src.numpy(), k // 2, _host_tables(), out=out.numpy())
        else:
            from . import layout_kernels

            layout_kernels.unpack_nibbles(src, out, word_bit_tables())
    return out.reshape(*lead, lay.rows, k // 2)


def _tile_scale_bytes(codes: torch.Tensor, lay: FP4TileLayout, fmt: ScaleFormat,
                      luts: torch.Tensor | None = None) -> torch.Tensor:
    """Scale bytes (uint8, or any integer dtype holding 0..255) [..., rows, <= k_padded / block]
    (zero-padded to k_padded) -> scale words int32 [..., R, KT, fmt.words_per_tile] (module
    docstring). ``luts`` uint8 [256] (one table) or [M, 256] (one per matrix of the M = prod(...)
    leading matrices) maps each byte first. One pass: numba / numpy on the host, a Triton kernel
    on CUDA; no temporaries of the tensor's size."""
    if codes.dtype != torch.uint8:
        codes = codes.to(torch.uint8)
    lead, groups = codes.shape[:-2], codes.shape[-1]
    units = codes.contiguous().reshape(-1, TILE_ROWS, groups)
    per_lut = units.shape[0]
    if luts is not None:
        luts = luts.reshape(-1, 256)
        per_lut = lay.row_tiles if luts.shape[0] > 1 else max(1, units.shape[0])
    if _on_host(codes):
        words = torch.from_numpy(layout_host.tile_scale_bytes(
            units.numpy(), lay.k_tiles, fmt.words_per_lane, fmt.shift, None if luts is None else luts.numpy(), per_lut))
    else:
        from . import layout_kernels

        words = layout_kernels.tile_scale_bytes(units, lay.k_tiles, fmt.words_per_lane, fmt.shift,
                                                None if luts is None else luts.to(codes.device), per_lut)
    return words.reshape(*lead, *lay.scale_shape(fmt))


def _untile_scale_bytes(words: torch.Tensor, k: int, fmt: ScaleFormat) -> torch.Tensor:
    """Inverse of _tile_scale_bytes: int32 [..., R, KT, words_per_tile] -> uint8 scale bytes
    [..., 16R, k / block]."""
    if words.dtype != torch.int32 or words.dim() < 3 or words.shape[-1] != fmt.words_per_tile:
        raise ValueError(f"scale words: expected int32 [..., R, KT, {fmt.words_per_tile}] for {fmt.name}, "
                         f"got {words.dtype} {tuple(words.shape)}")
    lay = FP4TileLayout(words.shape[-3] * TILE_ROWS, k)
    lead = words.shape[:-3]
    units = words.contiguous().reshape(-1, lay.k_tiles, fmt.words_per_tile)
    groups = k // fmt.block
    if _on_host(words):
        codes = torch.from_numpy(layout_host.untile_scale_bytes(units.numpy(), groups, fmt.words_per_lane, fmt.shift))
    else:
        from . import layout_kernels

        codes = layout_kernels.untile_scale_bytes(units, groups, fmt.words_per_lane, fmt.shift)
    return codes.reshape(*lead, lay.rows, groups)


def _apply_lut(lut: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """lut uint8 [256] applied to uint8 ``codes`` (any shape): a new uint8 tensor."""
    if _on_host(codes):
        return torch.from_numpy(layout_host.apply_lut(lut.numpy(), codes.contiguous().numpy()))
    return lut.to(codes.device)[codes.long()]


def _scale_values(codes: torch.Tensor, fmt: ScaleFormat) -> torch.Tensor:
    """Scale bytes (uint8) -> float32 block scales: the bf16 the kernel's LOP3 makes of them,
    ``(byte << shift) | fill``, without the 2^(126 - ACC_SHIFT)."""
    bits = (codes.to(torch.int32) << fmt.shift) | (fmt.fill & 0xFFFF)
    return (bits.to(torch.int32) << 16).view(torch.float32) / _BF16_SCALE_FACTOR


def decode_scale_words(words: torch.Tensor, k: int, fmt: ScaleFormat) -> torch.Tensor:
    """What the kernel multiplies by, without the 2^(126 - ACC_SHIFT): scale words int32
    [..., R, KT, words_per_tile] -> float32 block scales [..., 16R, k / fmt.block]."""
    return _scale_values(_untile_scale_bytes(words, k, fmt), fmt)


@dataclass(frozen=True)
class BlockExceptions:
    """The original bytes of NVFP4 blocks whose scale has no E5M3_16 byte (zero or negative
    scales whose nibbles the layout changed; see the module docstring), for ``to_modelopt``.
    index int64 [n] into the flattened [..., rows, k/16] scale tensor; scale uint8 [n] (E4M3
    bits); nibbles uint8 [n, 8]. Empty for checkpoints from ModelOpt or the cast."""

    index: torch.Tensor
    scale: torch.Tensor
    nibbles: torch.Tensor

    def __len__(self) -> int:
        return int(self.index.numel())

    @staticmethod
    def empty(device=None) -> "BlockExceptions":
        return BlockExceptions(torch.zeros(0, dtype=torch.int64, device=device),
                               torch.zeros(0, dtype=torch.uint8, device=device),
                               torch.zeros(0, 8, dtype=torch.uint8, device=device))

    def to(self, device) -> "BlockExceptions":
        return BlockExceptions(self.index.to(device), self.scale.to(device), self.nibbles.to(device))


def _e4m3_bits(scale: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
    """(the uint8 bits of E4M3 block scales, whether some are negative or +-0); NaN patterns
    are refused naming ``name``."""
    if scale.dtype == torch.float8_e4m3fn:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise TypeError(f"{name}: expected float8_e4m3fn (or uint8 bits), got {scale.dtype}")
    if _on_host(scale):
        nan, special = layout_host.e4m3_flags(scale.contiguous().numpy())
    else:
        magnitude = scale & 0x7F
        nan = bool((magnitude == 0x7F).any())
        special = bool(scale.numel()) and (int(scale.max()) >= 0x80 or int(magnitude.min()) == 0)
    if nan:
        raise ValueError(f"{name}: holds E4M3 NaN patterns (0x7F/0xFF); NVFP4 block scales must be finite")
    return scale, special


def pack_nvfp4_scales(packed: torch.Tensor, scale: torch.Tensor, name: str = "scale"
                      ) -> tuple[torch.Tensor, torch.Tensor, BlockExceptions]:
    """NVFP4 nibbles uint8 [..., rows, k/2] and E4M3 block scales (float8_e4m3fn or its uint8
    bits) [..., rows, k/16] -> (nibbles uint8 [..., rows, k/2] to tile, E5M3_16 scale words int32
    [..., rows/16, ceil(k/64), 16], BlockExceptions). The nibbles are the input itself unless a
    block has a zero or negative scale (then a changed copy: the input is never modified).
    NaN scale patterns are refused; errors name the tensor ``name``."""
    bits, special = _e4m3_bits(scale, name)
    *lead, rows, groups = bits.shape
    lay = FP4TileLayout(rows, groups * formats.NVFP4_BLOCK)
    lut = _e5m3_lut(bits.device)
    exceptions = BlockExceptions.empty(bits.device)
    if special:  # some scale is zero or negative (never in ModelOpt's or the cast's checkpoints)
        negative = bits >= 0x80
        zero = (bits & 0x7F) == 0
        blocks = packed.reshape(*lead, rows, groups, formats.NVFP4_BLOCK // 2)
        kept_magnitude = (blocks & 0x77).amax(-1) != 0
        exc = negative | (zero & kept_magnitude)
        idx = torch.nonzero(exc.flatten()).flatten()
        exceptions = BlockExceptions(idx, bits.flatten()[idx].contiguous(),
                                     blocks.reshape(-1, formats.NVFP4_BLOCK // 2)[idx].contiguous())
        flip = torch.where(negative, 0x88, 0).to(torch.uint8)[..., None]
        keep = torch.where(zero, 0x88, 0xFF).to(torch.uint8)[..., None]
        packed = ((blocks & keep) ^ flip).reshape(packed.shape)
    return packed, _tile_scale_bytes(bits, lay, E5M3_16, luts=lut), exceptions


@functools.lru_cache(maxsize=None)
def _e5m3_lut(device) -> torch.Tensor:
    """uint8 [256]: E4M3 bits -> the E5M3_16 byte u of |scale| (module docstring); 0 for +-0."""
    bits = torch.arange(256, dtype=torch.int32)
    magnitude = (bits & 0x7F).to(torch.uint8).view(torch.float8_e4m3fn).float()
    u = ((magnitude * _BF16_SCALE_FACTOR).to(torch.bfloat16).view(torch.int16).to(torch.int32) >> 4) - _E5M3_FILL_BYTE
    u = torch.where((bits & 0x7F) == 0, _E5M3_ZERO, u)
    u = torch.where((bits & 0x7F) == 0x7F, 0, u)  # NaN patterns: refused before any lookup
    return u.to(torch.uint8).to(device)


@functools.lru_cache(maxsize=None)
def _e5m3_inverse_lut(device) -> torch.Tensor:
    """uint8 [256]: E5M3_16 byte u -> E4M3 bits of the positive scale (0 for u = 0; bytes no
    E4M3 scale maps to stay 0)."""
    inv = torch.zeros(256, dtype=torch.uint8)
    lut = _e5m3_lut("cpu")
    for b in range(1, 0x7F):
        inv[int(lut[b])] = b
    return inv.to(device)


def unpack_nvfp4_scales(packed: torch.Tensor, words: torch.Tensor, exceptions: BlockExceptions, k: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_nvfp4_scales`: nibbles uint8 [..., rows, k/2] (unpacked from the
    tiles) and E5M3_16 words -> (the original nibbles, float8_e4m3fn scales [..., rows, k/16])."""
    u = _untile_scale_bytes(words, k, E5M3_16)
    scale = _apply_lut(_e5m3_inverse_lut(u.device), u)
    if len(exceptions):
        shape = packed.shape
        blocks = packed.reshape(-1, formats.NVFP4_BLOCK // 2).clone()
        blocks[exceptions.index] = exceptions.nibbles
        packed = blocks.reshape(shape)
        scale = scale.flatten().clone()
        scale[exceptions.index] = exceptions.scale
        scale = scale.reshape(u.shape)
    return packed, scale.view(torch.float8_e4m3fn).contiguous()


def pack_e8m0_scale_tiles(e8m0: torch.Tensor, scale_2_exp: torch.Tensor, name: str = "e8m0") -> torch.Tensor:
    """MXFP4 block exponents uint8 [..., rows, k/32] (value 2^(e - 127), one per 32 elements) and
    the per-matrix exponent m (int, [...] or a scalar) of scale_2 = 2^m -> E8M0_32 scale words
    int32 [..., rows/16, ceil(k/64), 8] such that the kernel's weight equals e2m1 x 2^(e - 127)
    exactly: each 32-block's byte is the bf16 exponent field of 2^(e - 127 - m) x 2^(126 - ACC_SHIFT).

    Exact where that field is in [1, 254]; field 0 (a block 254 binades below its matrix's
    largest) is a zero scale, whose products the bf16 multiply would flush anyway. Refused
    otherwise with the count of blocks out of range. e8m0 = 255 (NaN) is refused; errors name
    the tensor ``name``."""
    if e8m0.dtype != torch.uint8:
        raise TypeError(f"{name}: expected uint8, got {e8m0.dtype}")
    *lead, rows, blocks32 = e8m0.shape
    lay = FP4TileLayout(rows, blocks32 * formats.MXFP4_BLOCK)
    if not e8m0.numel():
        return _tile_scale_bytes(e8m0, lay, E8M0_32)
    m = torch.as_tensor(scale_2_exp, dtype=torch.int64, device=e8m0.device)
    per_matrix = e8m0.reshape(-1, rows * blocks32)
    hi, lo = per_matrix.amax(1).to(torch.int64), per_matrix.amin(1).to(torch.int64)  # reductions, no copies
    if int(hi.max()) == formats.E8M0_NAN:
        raise ValueError(f"{name}: holds 255 (the E8M0 NaN); MXFP4 block exponents must be finite")
    # field = e8m0 + offset (per matrix): the bf16 exponent of 2^(e - 127 - m) x 2^(126 - ACC_SHIFT)
    offset = ((E2M1_BF16_EXP_OFFSET - ACC_SHIFT - formats.E8M0_BIAS + 127) - m).reshape(-1)
    offset = offset.expand(per_matrix.shape[0]) if offset.numel() == 1 else offset
    if bool(((lo + offset) < 0).any()) or bool(((hi + offset) > 254).any()):
        field = e8m0.to(torch.int16) + offset.to(torch.int16).reshape(*lead, 1, 1)  # lead () : one offset
        bad = int(((field < 0) | (field > 254)).sum())
        raise ValueError(f"{name}: {bad} block exponents fall outside bf16 for the given scale_2 exponent")
    # One 256-byte table per matrix (byte -> byte + offset) turns the bytes into fields in the
    # tiling pass itself.
    luts = ((torch.arange(256, device=e8m0.device)[None, :] + offset[:, None]) & 0xFF).to(torch.uint8)
    return _tile_scale_bytes(e8m0, lay, E8M0_32, luts=luts)


def dequantize_tiles(tiles: torch.Tensor, scale_words: torch.Tensor, k: int, fmt: ScaleFormat) -> torch.Tensor:
    """Plain-torch value of kernel-layout weights without scale_2: uint8 [..., R, KT, 512] and
    scale words int32 [..., R, KT, fmt.words_per_tile] -> float32 [..., 16R, k] = e2m1 x block
    scale (exact). What the kernels multiply, before the fp32 scale_2 x 2^ACC_SHIFT on the
    accumulator."""
    codes = formats.unpack_e2m1(unpack_e2m1_tiles(tiles, k))
    scale = decode_scale_words(scale_words, k, fmt)
    return formats.e2m1_to_float(codes) * scale.repeat_interleave(fmt.block, dim=-1)
