"""The top-k combine of the plain-torch same-quantization references (moe_fp4_reference,
moe_w4a8_reference): the per-slot outputs summed in slot order, as the combine kernel does."""

from __future__ import annotations

import torch


def combine_slots(ys: torch.Tensor, routed_scaling_factor: float | None, dtype: torch.dtype,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """ys float32 [M, k, H] (a dropped slot's row all zero) -> (sum over slots in slot order) x
    routed_scaling_factor, cast to ``dtype`` [M, H]; written into ``out`` when given."""
    acc = torch.zeros(ys.shape[0], ys.shape[2], dtype=torch.float32, device=ys.device)
    for j in range(ys.shape[1]):  # slot order, as the combine kernel; dropped slots add nothing
        acc = acc + ys[:, j]
    if routed_scaling_factor is not None:
        acc = acc * float(routed_scaling_factor)
    result = acc.to(dtype)
    if out is not None:
        out.copy_(result)
        return out
    return result
