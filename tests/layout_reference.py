"""The kernel layout's first implementation (kernels/moe_details/layout.py before issue 28: int64
gathers over index tensors, 0.03 GB/s), kept verbatim as the test reference of the fast one:
tests/test_layout.py asserts bit-for-bit equality of both on every format and shape class. Test
helper, never product code; the hand-derived checks in test_layout.py and the PTX emulator of
test_fp4_ptx.py prove the placement itself independently of both."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from k3nvfp4.kernels import formats

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


def _rotr8(x: torch.Tensor) -> torch.Tensor:
    return ((x >> 8) | (x << 24)) & 0xFFFFFFFF


def _tile_scale_bytes(codes: torch.Tensor, lay: FP4TileLayout, fmt: ScaleFormat) -> torch.Tensor:
    """Scale bytes int64 [..., rows, <= k_padded / block] (zero-padded to k_padded) -> scale words
    int32 [..., R, KT, fmt.words_per_tile] (module docstring)."""
    pad = lay.k_padded // fmt.block - codes.shape[-1]
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    lead = codes.shape[:-2]
    n = len(lead)
    c = codes.reshape(*lead, lay.row_tiles, 2, 8, lay.k_tiles, fmt.words_per_lane, 2)  # R hh g KT i par
    c = c.permute(*range(n), n + 0, n + 3, n + 2, n + 4, n + 1, n + 5)  # R KT g i hh par
    direct = (c[..., 0, 0] << fmt.shift) | (c[..., 1, 0] << (fmt.shift + 16))
    rotated = (c[..., 0, 1] << fmt.shift) | (c[..., 1, 1] << (fmt.shift + 16))
    words = direct | _rotr8(rotated)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)  # the int32 of the same bits
    return words.to(torch.int32).reshape(*lead, *lay.scale_shape(fmt)).contiguous()


def _untile_scale_bytes(words: torch.Tensor, k: int, fmt: ScaleFormat) -> torch.Tensor:
    """Inverse of _tile_scale_bytes: int32 [..., R, KT, words_per_tile] -> int64 scale bytes
    [..., 16R, k / block]."""
    if words.dtype != torch.int32 or words.dim() < 3 or words.shape[-1] != fmt.words_per_tile:
        raise ValueError(f"scale words: expected int32 [..., R, KT, {fmt.words_per_tile}] for {fmt.name}, "
                         f"got {words.dtype} {tuple(words.shape)}")
    lay = FP4TileLayout(words.shape[-3] * TILE_ROWS, k)
    lead = words.shape[:-3]
    n = len(lead)
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = w.reshape(*lead, lay.row_tiles, lay.k_tiles, 8, fmt.words_per_lane)  # R KT g i
    rot = ((w << 8) | (w >> 24)) & 0xFFFFFFFF
    byte = lambda x, hh: (x >> (fmt.shift + 16 * hh)) & 0xFF  # noqa: E731
    c = torch.stack([torch.stack([byte(w, hh), byte(rot, hh)], -1) for hh in range(2)], -2)  # R KT g i hh par
    c = c.permute(*range(n), n + 0, n + 4, n + 2, n + 1, n + 3, n + 5)  # R hh g KT i par
    return c.reshape(*lead, lay.rows, lay.k_padded // fmt.block)[..., : k // fmt.block]


def _scale_values(codes: torch.Tensor, fmt: ScaleFormat) -> torch.Tensor:
    """Scale bytes (int64) -> float32 block scales: the bf16 the kernel's LOP3 makes of them,
    ``(byte << shift) | fill``, without the 2^(126 - ACC_SHIFT)."""
    bits = (codes << fmt.shift) | (fmt.fill & 0xFFFF)
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


def _e4m3_bits(scale: torch.Tensor, name: str) -> torch.Tensor:
    if scale.dtype == torch.float8_e4m3fn:
        scale = scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise TypeError(f"{name}: expected float8_e4m3fn (or uint8 bits), got {scale.dtype}")
    if ((scale & 0x7F) == 0x7F).any():
        raise ValueError(f"{name}: holds E4M3 NaN patterns (0x7F/0xFF); NVFP4 block scales must be finite")
    return scale


def pack_nvfp4_scales(packed: torch.Tensor, scale: torch.Tensor, name: str = "scale"
                      ) -> tuple[torch.Tensor, torch.Tensor, BlockExceptions]:
    """NVFP4 nibbles uint8 [..., rows, k/2] and E4M3 block scales (float8_e4m3fn or its uint8
    bits) [..., rows, k/16] -> (nibbles uint8 [..., rows, k/2] to tile, E5M3_16 scale words int32
    [..., rows/16, ceil(k/64), 16], BlockExceptions). The nibbles are the input itself unless a
    block has a zero or negative scale (then a changed copy: the input is never modified).
    NaN scale patterns are refused; errors name the tensor ``name``."""
    bits = _e4m3_bits(scale, name)
    *lead, rows, groups = bits.shape
    lay = FP4TileLayout(rows, groups * formats.NVFP4_BLOCK)
    negative = bits >= 0x80
    zero = (bits & 0x7F) == 0
    special = negative | zero
    magnitude = (bits & 0x7F).view(torch.float8_e4m3fn).float()
    u = ((magnitude * _BF16_SCALE_FACTOR).to(torch.bfloat16).view(torch.int16).to(torch.int64) >> 4) - _E5M3_FILL_BYTE
    u = torch.where(zero, torch.full_like(u, _E5M3_ZERO), u)
    exceptions = BlockExceptions.empty(bits.device)
    if bool(special.any()):
        blocks = packed.reshape(*lead, rows, groups, formats.NVFP4_BLOCK // 2)
        kept_magnitude = (blocks & 0x77).amax(-1) != 0
        exc = negative | (zero & kept_magnitude)
        idx = torch.nonzero(exc.flatten()).flatten()
        exceptions = BlockExceptions(idx, bits.flatten()[idx].contiguous(),
                                     blocks.reshape(-1, formats.NVFP4_BLOCK // 2)[idx].contiguous())
        flip = torch.where(negative, 0x88, 0).to(torch.uint8)[..., None]
        keep = torch.where(zero, 0x88, 0xFF).to(torch.uint8)[..., None]
        packed = ((blocks & keep) ^ flip).reshape(packed.shape)
    return packed, _tile_scale_bytes(u, lay, E5M3_16), exceptions


def unpack_nvfp4_scales(packed: torch.Tensor, words: torch.Tensor, exceptions: BlockExceptions, k: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_nvfp4_scales`: nibbles uint8 [..., rows, k/2] (unpacked from the
    tiles) and E5M3_16 words -> (the original nibbles, float8_e4m3fn scales [..., rows, k/16])."""
    u = _untile_scale_bytes(words, k, E5M3_16)
    scale = _scale_values(u, E5M3_16).to(torch.float8_e4m3fn)
    scale = torch.where(u == _E5M3_ZERO, torch.zeros_like(scale.view(torch.uint8)), scale.view(torch.uint8))
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
    if (e8m0 == formats.E8M0_NAN).any():
        raise ValueError(f"{name}: holds 255 (the E8M0 NaN); MXFP4 block exponents must be finite")
    *lead, rows, blocks32 = e8m0.shape
    m = torch.as_tensor(scale_2_exp, dtype=torch.int64, device=e8m0.device)
    field = e8m0.to(torch.int64) - m.reshape(*m.shape, *([1] * 2)) + (E2M1_BF16_EXP_OFFSET - ACC_SHIFT - formats.E8M0_BIAS + 127)
    bad = (field < 0) | (field > 254)
    if bad.any():
        raise ValueError(f"{name}: {int(bad.sum())} block exponents fall outside bf16 for the given scale_2 exponent")
    lay = FP4TileLayout(rows, blocks32 * formats.MXFP4_BLOCK)
    return _tile_scale_bytes(field, lay, E8M0_32)


def dequantize_tiles(tiles: torch.Tensor, scale_words: torch.Tensor, k: int, fmt: ScaleFormat) -> torch.Tensor:
    """Plain-torch value of kernel-layout weights without scale_2: uint8 [..., R, KT, 512] and
    scale words int32 [..., R, KT, fmt.words_per_tile] -> float32 [..., 16R, k] = e2m1 x block
    scale (exact). What the kernels multiply, before the fp32 scale_2 x 2^ACC_SHIFT on the
    accumulator."""
    codes = formats.unpack_e2m1(unpack_e2m1_tiles(tiles, k))
    scale = decode_scale_words(scale_words, k, fmt)
    return formats.e2m1_to_float(codes) * scale.repeat_interleave(fmt.block, dim=-1)
