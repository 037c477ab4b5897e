"""Launch config of the FP4 tensor-core MoE kernels and its heuristic: tile shapes fixed by the
MMA (tcgen05's block-scaled MMA wants 128 rows on M), split-K per GEMM chosen by the static
performance model (call_model.fp4_call) with the loop costs measured offline on sm100
(kernels/costs.py) and the device's SM count."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ..costs import Tile, loop_costs

# Split-K candidates; a split never leaves a slice without K steps (k_range).
_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16)
# A split must beat the unsplit time by more than this to be taken (the model's noise).
_GAIN = 1.03
# The FP4 tiles are measured on sm100 (the modes' target); the heuristic reads those costs everywhere.
COST_ARCH = 100
# The cost table's mode of each act_quant (kernels/costs.py).
_COST_MODES = {"nvfp4": "w4a4 nvfp4", "mxfp8": "w4a8 mxfp8"}


@dataclass(frozen=True)
class FP4MoEConfig:
    """Launch config of fused_moe_fp4. block_n1: columns of I per GEMM1 program (its MMA has
    2 x block_n1 rows: gate and up stacked); block_n2: columns of H per GEMM2 program. Both powers of
    two >= 32 (a last tile may run past the matrix). block_k1 must divide H and block_k2 I (64 or
    128). split_k1 / split_k2: K slices per GEMM (finished by the last arrival). swap_ab puts the
    weights on the MMA M side (tokens on N), for decode-sized blocks; sm100's block-scaled tcgen05
    MMA then wants 128 weight rows: block_n1 = 64, block_n2 = 128. atomic_reduce: GEMM2 adds its
    rows into an fp32 [M, H] buffer (one memset more, order not fixed) instead of storing fp32
    [split_k2, M k, H] rows summed in slot order: less traffic at prefill sizes."""

    block_m: int = 16
    block_n1: int = 64
    block_n2: int = 128
    block_k1: int = 128
    block_k2: int = 64
    split_k1: int = 1
    split_k2: int = 1
    swap_ab: bool = True
    num_warps: int = 4
    num_stages: int = 3
    atomic_reduce: bool = False

    def label(self) -> str:
        return (f"bm{self.block_m} {'swap' if self.swap_ab else 'noswap'} bn{self.block_n1}/{self.block_n2} "
                f"bk{self.block_k1}/{self.block_k2} sk{self.split_k1}/{self.split_k2} w{self.num_warps} "
                f"s{self.num_stages}" + (" atomic" if self.atomic_reduce else ""))

    def tile(self, kind: str) -> Tile:
        """GEMM1's or GEMM2's tile: its row key in the cost table (GEMM2's atomic top-k sum is a
        tile of its own; split-K is not part of it)."""
        bn, bk = (self.block_n1, self.block_k1) if kind == "gemm1" else (self.block_n2, self.block_k2)
        return Tile(kind, self.block_m, self.swap_ab, bn, bk, self.num_warps, self.num_stages,
                    kind == "gemm2" and self.atomic_reduce)

    @staticmethod
    def cost_mode(act_quant: str) -> str:
        """The cost table's mode of an act_quant: "w4a4 nvfp4" or "w4a8 mxfp8" (kernels/costs.py)."""
        try:
            return _COST_MODES[act_quant]
        except KeyError:
            raise ValueError(f"act_quant: expected one of {sorted(_COST_MODES)}, got {act_quant!r}") from None

    @staticmethod
    def tiles(E: int, H: int, I: int, top_k: int, M: int) -> "FP4MoEConfig":
        """Tile shapes without split-K: 16-token blocks with swap-AB when an expert gets few rows
        (decode: GEMM1's 128 MMA rows are 64 gate + 64 up rows, so I = 192 / 384 need no padding
        row), 128-token blocks else."""
        def pick(n: int) -> int:
            return 128 if n % 128 == 0 else 64

        small = M * top_k <= 32 * E
        return FP4MoEConfig(block_m=16 if small else 128, block_n1=64, block_n2=128,
                            block_k1=pick(H), block_k2=pick(I), swap_ab=small,
                            num_warps=4 if small else 8,  # 4 warps spill at 128 x 128 (sm100)
                            num_stages=3)

    @staticmethod
    def candidates(E: int, H: int, I: int, top_k: int, M: int) -> tuple["FP4MoEConfig", ...]:
        """The tile shapes the heuristic chooses among: tiles(), and at prefill also the atomic top-k
        sum (less traffic, but its epilogue costs GEMM2 registers) and GEMM1 with 128 + 128
        columns on N (fewer programs, twice the bytes in flight) where I allows it."""
        base = FP4MoEConfig.tiles(E, H, I, top_k, M)
        if base.swap_ab:
            return (base,)
        out = [base, replace(base, atomic_reduce=True)]
        if I % 128 == 0:
            out += [replace(c, block_n1=128) for c in out]
        return tuple(out)

    @classmethod
    def heuristic(cls, E: int, H: int, I: int, top_k: int, M: int, *, act_quant: str = "nvfp4",
                  num_global_experts: int | None = None, device_name: str = "B200") -> "FP4MoEConfig":
        """tiles() with the split-K pair the static model predicts fastest on ``device_name``
        (perf_model.DEVICES; its SM count decides how far a split fills the GPU). Cached: the
        model runs once per shape, not per call."""
        return _heuristic(E, H, I, top_k, M, act_quant, num_global_experts, device_name)

    def check(self, H: int, I: int) -> None:
        """Raise a ValueError naming the field this config gets wrong for H, I."""
        for name, b in (("block_n1", self.block_n1), ("block_n2", self.block_n2)):
            if b < 32 or b & (b - 1):
                raise ValueError(f"config.{name} = {b} must be a power of two >= 32")
        for name, n, div in (("block_k1", H, self.block_k1), ("block_k2", I, self.block_k2)):
            if div not in (64, 128) or n % div:
                raise ValueError(f"config.{name} = {div} must be 64 or 128 and divide {n}")
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"config.block_m = {self.block_m} must be a power of two >= 16")
        for name, s, K, bk in (("split_k1", self.split_k1, H, self.block_k1), ("split_k2", self.split_k2, I, self.block_k2)):
            if s < 1 or s > K // bk:
                raise ValueError(f"config.{name} = {s} must be in [1, {K // bk}] (K steps of {bk})")


@functools.lru_cache(maxsize=4096)
def _heuristic(E: int, H: int, I: int, top_k: int, M: int, act_quant: str, num_global_experts: int | None,
               device_name: str) -> FP4MoEConfig:
    from .. import perf_model as pm
    from .call_model import fp4_call

    device = pm.DEVICES.get(device_name, pm.B200)
    shard = pm.Shard("call", E, num_global_experts or E, H, I, top_k)
    best, t_best = FP4MoEConfig.tiles(E, H, I, top_k, M), float("inf")
    for base in FP4MoEConfig.candidates(E, H, I, top_k, M):
        costs = loop_costs({k: base.tile(k) for k in ("gemm1", "gemm2")}, COST_ARCH, FP4MoEConfig.cost_mode(act_quant))
        if costs is None or any(c.local_bytes for c in costs.values()):  # unmeasured, or spills
            continue

        def time(cfg: FP4MoEConfig) -> float:
            return fp4_call(device, shard, M, cfg, costs, act_quant).time_s

        cand_best, cand_t = base, time(base)
        for kind, K, bk in (("split_k1", H, base.block_k1), ("split_k2", I, base.block_k2)):
            steps = -(-K // bk)
            for s in _SPLITS[1:]:
                if (s - 1) * -(-steps // s) >= steps:  # a slice would get no K step
                    continue
                cand = replace(cand_best, **{kind: s})
                t = time(cand)
                if t * _GAIN < cand_t:
                    cand_best, cand_t = cand, t
        if cand_t * _GAIN < t_best:
            best, t_best = cand_best, cand_t
    return best
