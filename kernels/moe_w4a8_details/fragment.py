"""The W4A8 weights' storage order: wgmma's 8-bit A fragment (docs/w4a8.md, "A pre-permuted weight
layout"). Plain torch, no file I/O.

The FP8 wgmma (m64nNk32) gives lane 4g + t of each warp rows g and g + 8 of its 16-row slice, at
K 4t .. 4t + 3 and 16 + 4t .. 16 + 4t + 3 of each 32-K step: two rows x 2 registers of 4 bytes.
Storing each (row, lane, 32-K step)'s 8 nibbles in one int32 word makes the expansion's two
lookups (moe_details/e4m3_expand.py) two fragment registers, so the expanded tile reaches the MMA
without a shared-memory trip. Per 16-row block r and 64-K step q of a [N, K] matrix:

- words int32 [N/16, K/64, 128]: word ((g x 4 + t) x 2 + s) x 2 + h holds row 16r + 8h + g, its
  nibble n (bits 4n .. 4n + 3) element K = 64q + 32s + 4t + n for n < 4 and 64q + 32s + 16 + 4t +
  (n - 4) for n >= 4. Lane 4g + t reads its 4 words (s, h) as 16 contiguous bytes.
- offsets int8 [N/16, K/64, 1024/block]: blocks of 32: offset (g x 2 + s) x 2 + h is the block of
  (row 16r + 8h + g, K 64q + 32s ..); blocks of 16: offset ((g x 2 + s) x 2 + h) x 2 + half, K
  64q + 32s + 16 half .. (half 0: a word's nibbles 0..3, half 1: 4..7).

Same bytes as the logical layout (0.5 B of nibbles + one int8 per block), only their order differs.
"""

from __future__ import annotations

import torch

__all__ = ["from_fragment_order", "to_fragment_order"]


def _check(packed: torch.Tensor, offsets: torch.Tensor, block: int) -> tuple[int, int]:
    if packed.dtype != torch.uint8 or offsets.dtype != torch.int8:
        raise TypeError(f"expected uint8 nibbles and int8 offsets, got {packed.dtype} and {offsets.dtype}")
    if block not in (16, 32):
        raise ValueError(f"block: expected 16 or 32, got {block}")
    N, K = packed.shape[-2], packed.shape[-1] * 2
    if N % 16 or K % 64 or tuple(offsets.shape[-2:]) != (N, K // block):
        raise ValueError(f"expected N % 16 == 0, K % 64 == 0 and offsets [..., {N}, {K // block}]; got nibbles "
                         f"{tuple(packed.shape)}, offsets {tuple(offsets.shape)}")
    return N, K


def to_fragment_order(packed: torch.Tensor, offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical weights -> the fragment order (module docstring).

    packed uint8 [..., N, K/2] (E2M1 nibbles, low = even element), offsets int8 [..., N, K/block]
    -> (words int32 [..., N/16, K/64, 128], offsets int8 [..., N/16, K/64, 1024/block])."""
    N, K = _check(packed, offsets, block)
    lead = packed.shape[:-2]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*lead, N, K)
    # codes[..., r, h, g, q, s, half, t, i]: row 16r + 8h + g, K 64q + 32s + 16half + 4t + i
    c = codes.reshape(*lead, N // 16, 2, 8, K // 64, 2, 2, 4, 4)
    n = len(lead)
    # -> [..., r, q, g, t, s, h, half, i]: the word order, then nibble n = 4 half + i
    c = c.permute(*range(n), n, n + 3, n + 2, n + 6, n + 4, n + 1, n + 5, n + 7)
    c = c.reshape(*lead, N // 16, K // 64, 128, 8).to(torch.int64)
    words = (c << (4 * torch.arange(8, device=packed.device))).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    nb = 32 // block  # blocks per (row, 32-K step)
    o = offsets.reshape(*lead, N // 16, 2, 8, K // 64, 2, nb)  # r h g q s half
    o = o.permute(*range(n), n, n + 3, n + 2, n + 4, n + 1, n + 5).reshape(*lead, N // 16, K // 64, 32 * nb)
    return words.contiguous(), o.contiguous()


def from_fragment_order(words: torch.Tensor, offsets: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`to_fragment_order`: (words int32 [..., N/16, K/64, 128], offsets int8
    [..., N/16, K/64, 1024/block]) -> (packed uint8 [..., N, K/2], offsets int8 [..., N, K/block])."""
    if words.dtype != torch.int32 or words.shape[-1] != 128 or offsets.dtype != torch.int8:
        raise TypeError(f"expected int32 words [..., 128] and int8 offsets, got {words.dtype} "
                        f"{tuple(words.shape)} and {offsets.dtype}")
    lead = words.shape[:-3]
    R, Q = words.shape[-3], words.shape[-2]
    n = len(lead)
    w = words.to(torch.int64) & 0xFFFFFFFF
    c = (w[..., None] >> (4 * torch.arange(8, device=words.device))) & 0xF  # [..., r, q, 128, 8]
    c = c.reshape(*lead, R, Q, 8, 4, 2, 2, 2, 4)  # r q g t s h half i
    c = c.permute(*range(n), n, n + 5, n + 2, n + 1, n + 4, n + 6, n + 3, n + 7)  # r h g q s half t i
    codes = c.reshape(*lead, 16 * R, 64 * Q).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    nb = 32 // block
    o = offsets.reshape(*lead, R, Q, 8, 2, 2, nb)  # r q g s h half
    o = o.permute(*range(n), n, n + 4, n + 2, n + 1, n + 3, n + 5).reshape(*lead, 16 * R, 2 * Q * nb)
    return packed.contiguous(), o.contiguous()
