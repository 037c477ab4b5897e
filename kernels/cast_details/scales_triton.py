"""Closed-form E8M0 -> E4M3 block scales as a Triton kernel (CUDA, or TRITON_INTERPRET=1).

Same contract as ``scales_torch.e8m0_to_e4m3_torch``: scales in, scales out (each
source scale written to both 16-blocks), plus device-side counts of out-of-range and
zero-exponent blocks. E4M3 bits are built with integer ops: 2^d is (d + 7) << 3 for
d >= -6 (normal) and the subnormal 1 << (d + 9) for d in [-9, -7].
Only basic tl ops are used so it runs on Triton 3.6 and 3.8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .scales_torch import ScaleCast

_BLOCK = 1024


@triton.jit
def _e8m0_to_e4m3_kernel(src_ptr, dst_ptr, counts_ptr, n, e8m0_max, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    s = tl.load(src_ptr + offs, mask=mask, other=0).to(tl.int32)
    d = s - e8m0_max + 8  # exponent of the block scale relative to scale_2
    in_range = d >= -9
    normal = (d + 7) << 3
    subnormal = 1 << tl.maximum(d + 9, 0)
    bits = tl.where(d >= -6, normal, subnormal)
    bits = tl.where(in_range, bits, 0).to(tl.uint8)
    tl.store(dst_ptr + 2 * offs, bits, mask=mask)
    tl.store(dst_ptr + 2 * offs + 1, bits, mask=mask)
    n_oor = tl.sum((mask & (d < -9)).to(tl.int32), axis=0)
    n_zero = tl.sum((mask & (s == 0)).to(tl.int32), axis=0)
    tl.atomic_add(counts_ptr, n_oor)
    tl.atomic_add(counts_ptr + 1, n_zero)


def e8m0_to_e4m3_triton(scale_e8m0: torch.Tensor, e8m0_max: int) -> ScaleCast:
    """scale_e8m0: uint8 [out, nb] on CUDA (or CPU under TRITON_INTERPRET=1) -> ScaleCast."""
    s = scale_e8m0.contiguous()
    out = torch.empty((s.shape[0], 2 * s.shape[1]), dtype=torch.uint8, device=s.device)
    counts = torch.zeros(2, dtype=torch.int32, device=s.device)
    n = s.numel()
    if n:
        grid = (triton.cdiv(n, _BLOCK),)
        _e8m0_to_e4m3_kernel[grid](s, out, counts, n, int(e8m0_max), BLOCK=_BLOCK, num_warps=4)
    n_oor, n_zero = (int(c) for c in counts.tolist())
    return ScaleCast(out, n_oor, n_zero)
