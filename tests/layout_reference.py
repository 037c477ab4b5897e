"""The kernel layout's first implementation (kernels/moe_details/layout.py before issue 28: int64
gathers over index tensors, 0.03 GB/s), kept as the test reference of the fast one:
tests/test_layout.py asserts bit-for-bit equality of both on every format and shape class. Test
helper, never product code.

Only the permutation code is its own (the old nibble gather, the old scale-word tiling and
E5M3 byte arithmetic); the shape bookkeeping (FP4TileLayout), the scale formats, the block
exceptions and the bit placement's definition (_bit_targets, WORD_ROTATIONS) are layout.py's,
which the hand-derived checks in test_layout.py and the PTX emulator of test_fp4_ptx.py prove
independently of both implementations."""

from __future__ import annotations

import torch

from k3nvfp4.kernels import formats
from k3nvfp4.kernels.moe_details.layout import (  # noqa: F401  (E8M0_32, E5M3_16: used by the tests as ref.*)
    _BF16_SCALE_FACTOR,
    _E5M3_FILL_BYTE,
    _E5M3_ZERO,
    ACC_SHIFT,
    E2M1_BF16_EXP_OFFSET,
    E5M3_16,
    E8M0_32,
    TILE_BYTES,
    TILE_ROWS,
    BlockExceptions,
    FP4TileLayout,
    ScaleFormat,
    _bit_targets,
)


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
