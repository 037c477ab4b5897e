"""Launch config of the Hopper W4A8 MoE kernels (moe_w4a8_details/kernels.py) and its heuristic.

The tile shapes follow from the mode's numerics: weights on the MMA M side (swap-AB, always),
GEMM1's column tile a multiple of 128 so that each 128-column group of the intermediate (one
fp32 scale per token per group) is quantized inside one program, K steps of 64 or 128 inside one
activation group. No cost table is measured for this mode yet (KernelMode.cost_modes is ()): the
heuristic is a shape rule (below), not the static model the other modes' heuristics run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

# The activations' and the intermediate's scale group (docs/w4a8.md: one fp32 scale amax / 448 per
# token per 128 columns).
ACT_GROUP = 128


@dataclass(frozen=True)
class W4A8Config:
    """Launch config of fused_moe_w4a8. block_m: tokens per program (the MMA N side, a power of two
    >= 16); block_n1: columns of I per GEMM1 program (its MMA has 2 x block_n1 rows, gate and up
    stacked; a multiple of 128); block_n2: columns of H per GEMM2 program (a power of two >= 64);
    block_k1 / block_k2: 64 or 128, dividing H / I; split_k1 / split_k2: K slices per GEMM
    (finished by the last arrival); atomic_reduce: GEMM2's top-k sum by fp32 atomics (order not
    fixed) instead of rows summed in slot order. The weights are always on the MMA M side."""

    block_m: int = 16
    block_n1: int = 128
    block_n2: int = 64
    block_k1: int = 64
    block_k2: int = 128
    split_k1: int = 1
    split_k2: int = 1
    num_warps: int = 4
    num_stages: int = 3
    atomic_reduce: bool = False

    def label(self) -> str:
        return (f"bm{self.block_m} swap bn{self.block_n1}/{self.block_n2} bk{self.block_k1}/{self.block_k2} "
                f"sk{self.split_k1}/{self.split_k2} w{self.num_warps} s{self.num_stages}"
                + (" atomic" if self.atomic_reduce else ""))

    @classmethod
    def heuristic(cls, E: int, H: int, I: int, top_k: int, M: int, *,
                  num_global_experts: int | None = None, num_sms: int = 132) -> "W4A8Config":
        """A shape rule (no measured costs yet): block_m the power of two in [16, 64] nearest above
        the mean rows per local expert (~M k E / E_global / E); GEMM1's K step 64 (its operand is
        2 x 128 weight rows: at 128 it uses every register on sm90 and spills at block_m 64,
        Triton 3.8: kernels/offline/compile_w4a8.py --mode), GEMM2's 128 where I allows, else 64; 8 warps at
        block_m 64 (GEMM1's accumulators); each GEMM split over K (at most 8 slices, each with
        >= 2 K steps) while its programs fill fewer than ``num_sms`` (H100 / H200: 132). Cached
        per shape."""
        return _heuristic(E, H, I, top_k, M, num_global_experts, num_sms)

    def check(self, H: int, I: int) -> None:
        """Raise a ValueError naming the field this config gets wrong for H, I."""
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"config.block_m = {self.block_m} must be a power of two >= 16")
        if self.block_n1 < ACT_GROUP or self.block_n1 % ACT_GROUP or self.block_n1 & (self.block_n1 - 1):
            raise ValueError(f"config.block_n1 = {self.block_n1} must be a power of two multiple of {ACT_GROUP} "
                             "(each 128-column group of the intermediate is quantized in one program)")
        if self.block_n2 < 64 or self.block_n2 & (self.block_n2 - 1):
            raise ValueError(f"config.block_n2 = {self.block_n2} must be a power of two >= 64")
        for name, K, bk, s in (("1", H, self.block_k1, self.split_k1), ("2", I, self.block_k2, self.split_k2)):
            if bk not in (64, 128) or K % bk:
                raise ValueError(f"config.block_k{name} = {bk} must be 64 or 128 and divide {K}")
            if s < 1 or s > K // bk:
                raise ValueError(f"config.split_k{name} = {s} must be in [1, {K // bk}] (K steps of {bk})")


def _split(programs: int, steps: int, num_sms: int) -> int:
    s = 1
    while s < 8 and programs * s < num_sms and steps // (2 * s) >= 2:
        s *= 2
    return s


@functools.lru_cache(maxsize=4096)
def _heuristic(E: int, H: int, I: int, top_k: int, M: int, num_global_experts: int | None,
               num_sms: int) -> W4A8Config:
    local_pairs = M * top_k * E / max(E, num_global_experts or E)
    per_expert = local_pairs / max(1, E)
    bm = 16
    while bm < 64 and bm < per_expert:
        bm *= 2
    bk1 = 64
    bk2 = 128 if I % 128 == 0 else 64
    blocks = min(E, max(1, int(local_pairs))) + int(local_pairs) // bm  # used row blocks, roughly
    tiles1, tiles2 = -(-I // 128), -(-H // 64)
    return W4A8Config(block_m=bm, block_k1=bk1, block_k2=bk2, num_warps=8 if bm >= 64 else 4,
                      split_k1=_split(blocks * tiles1, H // bk1, num_sms),
                      split_k2=_split(blocks * tiles2, I // bk2, num_sms))
