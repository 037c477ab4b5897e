"""Lossy fallback of the cast: re-quantize 16-element blocks with their best E4M3 scale.

Used only for the blocks the closed form cannot represent (k_max - k_j > 17). For each
block every positive finite E4M3 code is a candidate scale; the block's values are
rounded to E2M1 (nearest, ties to even, saturating) under each candidate and the one with
the smallest squared error wins (first such code on a tie). Because NVIDIA ModelOpt's
data-derived fallback picks one of these candidates and rounds the same way, this is
never worse than it, block by block.

Plain torch, so it runs on CPU and on CUDA (the Triton path calls it for the few blocks
its kernel flags).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import formats

# Candidate scales: E4M3 codes 1..126 (0x7F is NaN, 0 would zero the block, which code
# 1 already does when every value rounds to 0). Increasing code = increasing value.
_FIRST_CODE = 1
_LAST_CODE = 126
# Chunk of blocks evaluated at once: [chunk, codes, 16] float64 stays ~ tens of MB.
_CHUNK = 2048


@dataclass(frozen=True)
class RequantResult:
    """Re-quantized 16-blocks.

    codes:   uint8 [N, 16] E2M1 codes (signed zero follows the input's sign bit).
    scale:   uint8 [N] E4M3 bit patterns of the chosen block scales.
    exact:   bool [N], True where the block's NVFP4 values equal the input exactly.
    max_abs_err: float64 [N], per block max |nvfp4 - input|.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    exact: torch.Tensor
    max_abs_err: torch.Tensor


def requantize_blocks_e4m3(values: torch.Tensor, scale_2: float) -> RequantResult:
    """Best-E4M3-scale NVFP4 quantization of 16-element blocks under a fixed scale_2.

    values: float64 (or float32) [N, 16], the exact source values; scale_2: the group's
    FP32 per-tensor scale (a power of two here, but any positive float works).
    """
    if values.dim() != 2 or values.shape[-1] != formats.NVFP4_BLOCK:
        raise ValueError(f"values: expected [N, {formats.NVFP4_BLOCK}], got {tuple(values.shape)}")
    x = values.to(torch.float64)
    device = x.device
    n = x.shape[0]
    codes_out = torch.empty((n, formats.NVFP4_BLOCK), dtype=torch.uint8, device=device)
    scale_out = torch.empty((n,), dtype=torch.uint8, device=device)
    exact_out = torch.empty((n,), dtype=torch.bool, device=device)
    err_out = torch.empty((n,), dtype=torch.float64, device=device)
    if n == 0:
        return RequantResult(codes_out, scale_out, exact_out, err_out)

    cand_codes = torch.arange(_FIRST_CODE, _LAST_CODE + 1, dtype=torch.uint8, device=device)
    cand = formats.e4m3_to_float(cand_codes).to(torch.float64) * float(scale_2)  # [C], increasing
    table = formats.e2m1_table(device).to(torch.float64)

    for lo in range(0, n, _CHUNK):
        xb = x[lo : lo + _CHUNK]
        # A scale s >= 4 * amax rounds every value of the block to 0 (|x|/s <= 0.25, a tie
        # that goes to the even code 0), so all larger codes tie with the first such one and
        # cannot win the first-minimum argmin: search only up to it.
        amax = float(xb.abs().max())
        n_cand = int(torch.searchsorted(cand, torch.tensor(4.0 * amax, dtype=torch.float64, device=device))) + 1
        c = cand[: min(n_cand, cand.numel())]
        q = formats.float_to_e2m1(xb.unsqueeze(1) / c.view(1, -1, 1))  # [B, C, 16]
        deq = table[q.long()] * c.view(1, -1, 1)
        err = (deq - xb.unsqueeze(1)).square().sum(-1)  # [B, C]
        best = torch.argmin(err, dim=1)  # first minimum = smallest code
        rows = torch.arange(xb.shape[0], device=device)
        best_deq = deq[rows, best]
        diff = (best_deq - xb).abs()
        codes_out[lo : lo + xb.shape[0]] = q[rows, best]
        scale_out[lo : lo + xb.shape[0]] = cand_codes[best]
        exact_out[lo : lo + xb.shape[0]] = (best_deq == xb).all(-1)
        err_out[lo : lo + xb.shape[0]] = diff.max(-1).values
    return RequantResult(codes_out, scale_out, exact_out, err_out)
