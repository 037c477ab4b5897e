"""Weight preparation of the Hopper W4A8 mode, plain torch, no file I/O: from MXFP4 (E2M1 nibbles +
E8M0 per 32) or power-of-two NVFP4 (E2M1 + E4M3 block scales that are exact powers of two, and
scale_2), the exponents the kernel needs to expand the nibbles EXACTLY into E4M3 operands.

The rule (docs/w4a8.md derives it): E2M1 x 2^j is an E4M3 value for every code iff j in [-8, 6].
Per output row (the weights sit on the MMA's M side, so a row factor is one fp32 multiply of the
accumulator row in the epilogue):
  k_b   block exponent (MXFP4: E8M0 byte - 127; NVFP4: log2 of the E4M3 block scale),
  r     row reference exponent = max(k_max - 6, -126), k_max over the row's blocks that hold a
        nonzero code (-126 keeps the fp32 factor 2^r normal; a row of zeros gets -126),
  j_b   = k_b - r, the offset the kernel adds to the E4M3 exponent field (moe_details/e4m3_expand.py).
Every block within 14 binades below its row's largest (j_b >= -8) expands exactly. A block further
below (its nonzero codes' exponent j_b < -8) is "out of window"; with out_of_window="round" (the
default) it is re-encoded at j = -8, its codes E2M1_RNE(v x 2^(j_b + 8)) (lossy, counted in
`rounded` when a value changes, with a warning naming the tensor), and with "refuse" a block that
would change raises ValueError naming the tensor. Such a block is at most 2^-15 of the row's largest
block scale, so its rounding error stays below 2^-17 of that scale per element. All-zero blocks
(any exponent) are exact; their offset is clipped into [-5, 6].

The table (W4A8Weights.table): the kernel builds each block's 8-byte E4M3 table from j_b. When
every block that holds a nonzero code has j_b >= -5 (within 11 binades of its row's largest) the
table is linear in j_b, two multiply-adds ("normal", e4m3_expand.E4M3_NORMAL_TABLE_PTX); one
block at -6 .. -8 (or re-encoded at -8) makes the matrix take the 11-instruction "full" table.
Each matrix chooses for itself; both tables give the same bytes wherever the normal one applies.

NVFP4 block scales must be exact powers of two (E4M3 normals with mantissa 0, or the subnormals
2^-9, 2^-8, 2^-7) or zero (the block is zero: its nibbles are cleared); anything else cannot be
expanded exactly and is refused with a ValueError naming the tensor (no lossy path is offered).
scale_2 stays an fp32 factor of the row (`row_scale` = 2^r x scale_2 per row).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .. import formats
from ..moe_details.e4m3_expand import (E4M3_EXPAND_MAX_OFFSET, E4M3_EXPAND_MIN_OFFSET, E4M3_NORMAL_MIN_OFFSET,
                                       expand_e2m1_to_e4m3_reference)

OUT_OF_WINDOW_MODES = ("round", "refuse")
FP32_MIN_NORMAL_EXP = -126


@dataclass(frozen=True)
class W4A8Weights:
    """One prepared weight tensor [..., N, K] (leading dims: experts).

    packed       uint8 [..., N, K/2]: E2M1 nibbles (low nibble = even element), out-of-window
                 blocks re-encoded (the input tensor itself when nothing changed)
    offsets      int8 [..., N, K/block]: j_b in [-8, 6], added to the E4M3 exponent field
    row_exponent int32 [..., N]: r, the row's power of two (epilogue)
    row_scale    float32 [..., N]: 2^r x scale_2 (NVFP4) or 2^r (MXFP4), the epilogue factor
    block        32 (MXFP4) or 16 (NVFP4)
    out_of_window  blocks with a nonzero code below the window
    rounded      those of them whose values changed (0 under "refuse")
    table        "normal" when every block with a nonzero code has offset >= -5, else "full"
                 (module docstring: the kernel's per-block table)
    """

    name: str
    packed: torch.Tensor
    offsets: torch.Tensor
    row_exponent: torch.Tensor
    row_scale: torch.Tensor
    block: int
    out_of_window: int
    rounded: int
    table: str

    def expand_e4m3(self) -> torch.Tensor:
        """uint8 [..., N, K]: the E4M3 bytes the kernel builds in registers (torch reference)."""
        codes = formats.unpack_e2m1(self.packed)
        off = self.offsets.to(torch.int32).repeat_interleave(self.block, dim=-1)
        return expand_e2m1_to_e4m3_reference(codes, off)

    def dequantize(self) -> torch.Tensor:
        """float64 [..., N, K] = e4m3 x row_scale, the values the W4A8 GEMM multiplies."""
        v = self.expand_e4m3().view(torch.float8_e4m3fn).double()
        return v * self.row_scale.double()[..., None]


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        raise TypeError(f"{name}: expected a {dtype} tensor, got {getattr(t, 'dtype', type(t).__name__)}")


def _prepare(name: str, packed: torch.Tensor, k: torch.Tensor, block: int, scale_2: torch.Tensor | None,
             out_of_window: str) -> W4A8Weights:
    """packed uint8 [..., N, K/2], k int32 [..., N, K/block] (block exponents, any value where the
    block is zero) -> W4A8Weights (module docstring)."""
    if out_of_window not in OUT_OF_WINDOW_MODES:
        raise ValueError(f"out_of_window: expected one of {OUT_OF_WINDOW_MODES}, got {out_of_window!r}")
    codes = formats.unpack_e2m1(packed)
    cb = codes.reshape(*k.shape, block)
    nonzero = (cb & 7).amax(dim=-1) > 0
    low = torch.iinfo(torch.int32).min // 2
    kmax = torch.where(nonzero, k, torch.full_like(k, low)).amax(dim=-1)
    r = torch.clamp(kmax - E4M3_EXPAND_MAX_OFFSET, min=FP32_MIN_NORMAL_EXP).to(torch.int32)
    j = k - r[..., None]
    outside = (j < E4M3_EXPAND_MIN_OFFSET) & nonzero
    n_out = int(outside.sum())
    n_rounded = 0
    if n_out:
        sel = cb[outside]  # [n_out, block]
        shift = (j[outside] - E4M3_EXPAND_MIN_OFFSET).to(torch.float64)  # <= -1
        want = formats.e2m1_to_float(sel).double() * torch.exp2(shift)[:, None]
        new = formats.float_to_e2m1(want)  # RNE, |want| <= 3: no saturation; tiny values -> +-0
        changed = (formats.e2m1_to_float(new).double() != want).any(dim=-1)
        n_rounded = int(changed.sum())
        if n_rounded and out_of_window == "refuse":
            worst = int((E4M3_EXPAND_MAX_OFFSET - j[outside][changed]).max())  # binades below the window's top
            raise ValueError(f"{name}: {n_rounded} E2M1 blocks lie more than 14 binades below their row's largest "
                             f"(up to {worst}) and cannot be expanded to E4M3 exactly; prepare with "
                             "out_of_window='round' to re-encode them (lossy, counted)")
        cb = cb.clone()
        cb[outside] = new
        packed = formats.pack_e2m1(cb.reshape(codes.shape))
        if n_rounded:
            warnings.warn(f"{name}: {n_rounded} of {k.numel()} E2M1 blocks lie more than 14 binades below their "
                          "row's largest; re-encoded at the bottom of the E4M3 window (lossy, < 2^-17 of the "
                          "row's largest block scale per element)", stacklevel=3)
    offsets = torch.clamp(j, E4M3_EXPAND_MIN_OFFSET, E4M3_EXPAND_MAX_OFFSET)
    # A block of zeros (also one that re-encoding emptied) is zero under any offset: keep it out of
    # the way of the normal table.
    holds_code = (cb & 7).amax(dim=-1) > 0 if n_out else nonzero
    offsets = torch.where(holds_code, offsets, torch.clamp(offsets, min=E4M3_NORMAL_MIN_OFFSET)).to(torch.int8)
    table = "normal" if offsets.numel() == 0 or int(offsets.min()) >= E4M3_NORMAL_MIN_OFFSET else "full"
    row_scale = torch.exp2(r.double())
    if scale_2 is not None:
        row_scale = row_scale * torch.as_tensor(scale_2, dtype=torch.float64, device=r.device).expand(r.shape)
    return W4A8Weights(name, packed, offsets, r, row_scale.float(), block, n_out, n_rounded, table)


def prepare_w4a8_from_mxfp4(packed: torch.Tensor, e8m0: torch.Tensor, name: str = "weight",
                            out_of_window: str = "round") -> W4A8Weights:
    """MXFP4 -> W4A8Weights. packed uint8 [..., N, K/2], e8m0 uint8 [..., N, K/32] (byte 255 = NaN is
    refused, naming `name`). out_of_window: "round" (lossy, counted, warned) or "refuse"."""
    _check(packed, torch.uint8, f"{name} (packed E2M1)")
    _check(e8m0, torch.uint8, f"{name} (E8M0 scales)")
    if tuple(e8m0.shape) != (*packed.shape[:-1], packed.shape[-1] * 2 // formats.MXFP4_BLOCK) or packed.shape[-1] % 16:
        raise ValueError(f"{name}: E8M0 scales {tuple(e8m0.shape)} do not match 32-element blocks of the packed "
                         f"weight {tuple(packed.shape)}")
    k = formats.e8m0_to_exponent(e8m0, f"{name} (E8M0 scales)")
    return _prepare(name, packed, k, formats.MXFP4_BLOCK, None, out_of_window)


def e4m3_pow2_exponents(scale: torch.Tensor, name: str = "weight_scale") -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn block scales [...] -> (int32 exponents k with scale = 2^k, bool zero mask).
    Refuses, naming `name`, any scale that is not +0/-0 or a positive power of two (NaN included)."""
    _check(scale, torch.float8_e4m3fn, name)
    s = scale.float()
    mant, exp = torch.frexp(s)
    zero = s == 0
    bad = ~zero & ~(mant == 0.5)  # negative, NaN or not a power of two
    if bad.any():
        idx = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"{name}: {int(bad.sum())} E4M3 block scales are not powers of two (first at {idx}: "
                         f"{float(s[idx])}); W4A8 expands only power-of-two NVFP4 scales exactly (as the MXFP4 -> "
                         "NVFP4 cast writes them); use W4A16 for this checkpoint")
    return torch.where(zero, torch.zeros_like(exp), exp - 1).to(torch.int32), zero


def prepare_w4a8_from_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor | float = 1.0,
                            name: str = "weight", out_of_window: str = "round") -> W4A8Weights:
    """Power-of-two NVFP4 -> W4A8Weights. packed uint8 [..., N, K/2], scale float8_e4m3fn
    [..., N, K/16] (powers of two or zero, else ValueError naming `name`), scale_2 float32
    broadcastable to [..., N] (per matrix: shape [..., 1]; for a fused w13 [E, 2I, H] pass the
    [E, 2] gate/up values repeated per row, s2.repeat_interleave(I, dim=1)). Blocks with a zero
    scale are zero (their nibbles are cleared)."""
    _check(packed, torch.uint8, f"{name} (packed E2M1)")
    if tuple(scale.shape) != (*packed.shape[:-1], packed.shape[-1] * 2 // formats.NVFP4_BLOCK) or packed.shape[-1] % 8:
        raise ValueError(f"{name}: E4M3 block scales {tuple(scale.shape)} do not match 16-element blocks of the "
                         f"packed weight {tuple(packed.shape)}")
    k, zero = e4m3_pow2_exponents(scale, f"{name} (E4M3 block scales)")
    s2 = torch.as_tensor(scale_2, dtype=torch.float32, device=packed.device)
    if not torch.isfinite(s2).all() or (s2 <= 0).any():
        raise ValueError(f"{name}: scale_2 must be finite and positive")
    if zero.any():
        byte_zero = zero.repeat_interleave(formats.NVFP4_BLOCK // 2, dim=-1)
        packed = torch.where(byte_zero, torch.zeros_like(packed), packed)
    return _prepare(name, packed, k, formats.NVFP4_BLOCK, s2, out_of_window)
