"""Closed-form E8M0 -> E4M3 block scales in plain torch (the reference of ``scales_triton``).

For a group whose largest E8M0 byte is ``e8m0_max`` (m = e8m0_max - 127 - 8), a block with
byte ``b`` gets the E4M3 scale 2^(b - e8m0_max + 8), exact iff b >= e8m0_max - 17. Each
32-block scale is written twice (two 16-blocks). Hot path of the checkpoint tool: one
min/max pass and one 256-entry table gather; the nibbles are never touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .. import formats

# Width of E4M3's exact power-of-two window: 2^-9 .. 2^8 is 18 binades.
EXACT_WINDOW = formats.E4M3_MAX_EXP2 - formats.E4M3_MIN_EXP2  # 17


@dataclass(frozen=True)
class ScaleCast:
    """E4M3 block scales of one matrix from its E8M0 scales.

    scale_e4m3: uint8 [out, 2 * in/32], E4M3 bit patterns, each source scale twice; 0 at
        out-of-range blocks (the caller re-quantizes those).
    out_of_range_blocks / zero_exponent_blocks: counts of 32-element source blocks.
    """

    scale_e4m3: torch.Tensor
    out_of_range_blocks: int
    zero_exponent_blocks: int


def out_of_range_threshold(e8m0_max: int) -> int:
    """Blocks with an E8M0 byte below this value are out of E4M3's exact window."""
    return e8m0_max - EXACT_WINDOW


@lru_cache(maxsize=256)
def _pair_table(e8m0_max: int) -> np.ndarray:
    """256-entry uint16 table: E8M0 byte -> its E4M3 scale byte in BOTH halves (so a
    gather followed by a uint8 view writes the two 16-block scales at once)."""
    e8m0 = torch.arange(256, dtype=torch.int32)
    d = e8m0 - e8m0_max + formats.E4M3_MAX_EXP2
    ok = (d >= formats.E4M3_MIN_EXP2) & (d <= formats.E4M3_MAX_EXP2)
    bits = torch.zeros(256, dtype=torch.int32)
    bits[ok] = formats.exp2_to_e4m3(d[ok]).view(torch.uint8).to(torch.int32)
    return (bits | (bits << 8)).numpy().astype(np.uint16)


def e8m0_to_e4m3_torch(scale_e8m0: torch.Tensor, e8m0_max: int) -> ScaleCast:
    """scale_e8m0: uint8 [out, nb] (no 255 byte; ``e8m0_max`` >= its max) -> ScaleCast."""
    s = scale_e8m0.contiguous()
    table = _pair_table(int(e8m0_max))
    if s.device.type == "cpu":
        # numpy gathers with a uint8 index directly; torch would need an int64 copy first.
        pair = torch.from_numpy(np.take(table, s.numpy()))
    else:
        pair = torch.from_numpy(table.view(np.int16)).to(s.device)[s.long()]
    scale_e4m3 = pair.view(torch.uint8).reshape(s.shape[0], 2 * s.shape[1])

    n_oor = n_zero = 0
    if s.numel():
        lo = int(s.min())
        thr = out_of_range_threshold(int(e8m0_max))
        if lo < thr:
            n_oor = count_below(s, thr)
        if lo == 0:
            n_zero = count_below(s, 1)
    return ScaleCast(scale_e4m3, n_oor, n_zero)


# On CPU the masks are built with numpy: its uint8 compares are ~10x faster than torch's
# single-threaded ones, and these passes are on the cast's per-matrix path.


def count_below(t: torch.Tensor, bound: int) -> int:
    """Number of entries of ``t`` (uint8) below ``bound``."""
    if bound <= 0:  # (a negative bound must not wrap around to a uint8)
        return 0
    if t.device.type == "cpu":
        return int(np.count_nonzero(t.contiguous().numpy() < bound))
    return int(torch.count_nonzero(t < bound))


def indices_below(t: torch.Tensor, bound: int) -> torch.Tensor:
    """int64 indices, in the flattened (row-major) ``t``, of its entries below ``bound``."""
    if bound <= 0:
        return torch.zeros(0, dtype=torch.int64, device=t.device)
    if t.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(t.contiguous().numpy() < bound))
    return torch.nonzero(t.reshape(-1) < bound).squeeze(1)


def count_true(mask: torch.Tensor) -> int:
    """Number of True entries (numpy on CPU: several times faster than torch's sum there)."""
    if mask.device.type == "cpu":
        return int(np.count_nonzero(mask.numpy()))
    return int(torch.count_nonzero(mask))
