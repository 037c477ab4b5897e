"""Launch config of the Hopper W4A8 MoE kernels (moe_w4a8_details/kernels.py) and its heuristic.

The tile shapes follow from the mode's numerics: weights on the MMA M side (swap-AB, always),
GEMM1's column tile a multiple of 128 so that each 128-column group of the intermediate (one
fp32 scale per token per group) is quantized inside one program, K steps of 64 or 128 inside one
activation group. The heuristic predicts every candidate (:meth:`W4A8Config.candidates`, each
GEMM's split-K) with the mode's call model (call_model.w4a8_call) from the tile costs measured
offline on sm90 (kernels/costs.py, sections "w4a8 e4m3/16" and "w4a8 e4m3/32": one per weight
block, each also with the normal E4M3 table, "... normal", for the GEMMs whose weights chose it),
and never picks a tile that spills or cannot launch; where no section is measured it falls back to
a shape rule (:func:`shape_rule`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, replace

from ..costs import Tile, tile_cost
from ..moe_details.e4m3_expand import E4M3_TABLES, is_normal_table
from ..moe_details.config import config_file_name, config_from_dict, load_tuned_configs, nearest_tuned
from ..target import current_device_name

# The activations' and the intermediate's scale group (docs/w4a8.md: one fp32 scale amax / 448 per
# token per 128 columns).
ACT_GROUP = 128
# The mode's tiles are measured on sm90 (its target: FP8 wgmma); the heuristic reads those costs.
COST_ARCH = 90
# The cost table's mode of each weight block (16: from ModelOpt NVFP4, 32: from MXFP4); a GEMM whose
# weights take the normal E4M3 table (W4A8MoEWeights.w13_table / w2_table) has a section of its own.
_COST_MODES = {16: "w4a8 e4m3/16", 32: "w4a8 e4m3/32"}
_NORMAL_SUFFIX = " normal"
FULL_TABLES = ("full", "full")
# (block_m, GEMM1's num_warps) of the candidates: GEMM1's 256-row operand (2 x block_n1 = 128 columns)
# with block_m tokens needs 8 warps at 64 tokens (its accumulators), 4 below; block_m 128 would spill.
TOKEN_TILES = ((16, 4), (32, 4), (64, 8))
# GEMM2's num_warps per block_m. Its operand has block_n2 <= 128 rows, so one warpgroup holds its
# accumulators at every token tile; at 64 tokens 4 warps cost fewer instructions per weight than 8
# (sm90, Triton 3.8: 0.095 against 0.121 at bn128 bk128 from NVFP4) and fit two CTAs per SM, i.e.
# twice the weights in flight. 8 stays a candidate there (the cost table decides).
GEMM2_WARPS = {16: (4,), 32: (4,), 64: (4, 8)}
# GEMM2's column tiles (power of two >= 64).
GEMM2_BLOCK_N = (64, 128)
# Split-K candidates; a split never leaves a slice without K steps. Powers of two only: SPLIT_K is a
# constexpr, so each value is a compile of its own (at first use, and in the static report's and the
# test suite's shared compile), and the model rarely prefers 3 / 6 / 12 by more than its noise.
_SPLITS = (1, 2, 4, 8, 16)
# A split or another tile must beat the best time so far by more than this to be taken (the model's noise).
_GAIN = 1.03


@dataclass(frozen=True)
class W4A8Config:
    """Launch config of fused_moe_w4a8. block_m: tokens per program (the MMA N side, a power of two
    >= 16); block_n1: columns of I per GEMM1 program (its MMA has 2 x block_n1 rows, gate and up
    stacked; a multiple of 128); block_n2: columns of H per GEMM2 program (a power of two >= 64);
    block_k1 / block_k2: 64 or 128, dividing H / I; split_k1 / split_k2: K slices per GEMM
    (finished by the last arrival); num_warps1 / num_warps2: each GEMM's warps (4 or 8; GEMM1
    needs 8 at 64 tokens, GEMM2 fits one warpgroup at every tile); num_stages: both GEMMs'
    pipeline depth; atomic_reduce: GEMM2's top-k sum by fp32 atomics (order not
    fixed) instead of rows summed in slot order. The weights are always on the MMA M side."""

    block_m: int = 16
    block_n1: int = 128
    block_n2: int = 64
    block_k1: int = 64
    block_k2: int = 128
    split_k1: int = 1
    split_k2: int = 1
    num_warps1: int = 4
    num_warps2: int = 4
    num_stages: int = 3
    atomic_reduce: bool = False

    def label(self) -> str:
        return (f"bm{self.block_m} swap bn{self.block_n1}/{self.block_n2} bk{self.block_k1}/{self.block_k2} "
                f"sk{self.split_k1}/{self.split_k2} w{self.num_warps1}/{self.num_warps2} s{self.num_stages}"
                + (" atomic" if self.atomic_reduce else ""))

    def warps(self, kind: str) -> int:
        """The warps of GEMM1 (kind "gemm1") or GEMM2 ("gemm2")."""
        return self.num_warps1 if kind == "gemm1" else self.num_warps2

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "W4A8Config":
        """The config of one tuned-file entry; unknown keys are refused by name. A file written
        before GEMM2 had warps of its own (2026-12-07) has one "num_warps" for both GEMMs; it is
        read as both."""
        if "num_warps" in d:
            d = {k: v for k, v in d.items() if k != "num_warps"} | {"num_warps1": d["num_warps"],
                                                                    "num_warps2": d["num_warps"]}
        return config_from_dict(cls, d)

    @staticmethod
    def tuned_dtype(weight_block: int) -> str:
        """The dtype field of this mode's tuned-config file names (moe_details.config.config_file_name):
        "w4a8_e4m3_b16" (weights from ModelOpt NVFP4) or "w4a8_e4m3_b32" (from MXFP4); the two
        have their own tile costs, so they are tuned apart."""
        W4A8Config.cost_mode(weight_block)  # refuses another block by name
        return f"w4a8_e4m3_b{weight_block}"

    def tile(self, kind: str) -> Tile:
        """GEMM1's or GEMM2's tile: its row key in the cost table (swap-AB always; GEMM2's atomic
        top-k sum is a tile of its own; split-K is not part of it)."""
        bn, bk = (self.block_n1, self.block_k1) if kind == "gemm1" else (self.block_n2, self.block_k2)
        return Tile(kind, self.block_m, True, bn, bk, self.warps(kind), self.num_stages,
                    kind == "gemm2" and self.atomic_reduce)

    @staticmethod
    def cost_mode(weight_block: int, table: str = "full") -> str:
        """The cost table's mode of the weights' block and E4M3 table: "w4a8 e4m3/16" (ModelOpt
        NVFP4) or "w4a8 e4m3/32" (MXFP4), + " normal" for the normal table (kernels/costs.py)."""
        try:
            mode = _COST_MODES[weight_block]
        except KeyError:
            raise ValueError(f"weight_block: expected one of {sorted(_COST_MODES)}, got {weight_block!r}") from None
        return mode + (_NORMAL_SUFFIX if is_normal_table(table) else "")

    @staticmethod
    def cost_modes() -> tuple[str, ...]:
        """Every section of the cost table this mode reads (both weight blocks x both tables)."""
        return tuple(W4A8Config.cost_mode(b, t) for b in sorted(_COST_MODES) for t in E4M3_TABLES)

    def costs(self, weight_block: int, tables: tuple[str, str] = FULL_TABLES) -> dict | None:
        """{"gemm1": LoopCost, "gemm2": LoopCost} of this config's tiles from the cost table (sm90),
        each GEMM under its weights' table (tables: GEMM1's, GEMM2's), or None if one is missing."""
        out = {}
        for kind, table in zip(("gemm1", "gemm2"), tables):
            cost = tile_cost(self.tile(kind), COST_ARCH, W4A8Config.cost_mode(weight_block, table))
            if cost is None:
                return None
            out[kind] = cost
        return out

    @staticmethod
    def candidates(H: int, I: int) -> tuple["W4A8Config", ...]:
        """The tile shapes the heuristic chooses among for H, I (multiples of 64), without split-K:
        GEMM1 128 columns of I (256 MMA rows) at K step 64, and 128 where H allows (one fp32
        promotion per activation group instead of two; with the weights in the fragment order it
        fits the registers at 16 and 64 tokens, the cost table says which tiles spill and the
        heuristic skips those); every (block_m, GEMM1's warps) of TOKEN_TILES with each of GEMM2's
        warps (GEMM2_WARPS); GEMM2 64 or 128 columns
        of H at K step 128 where I allows, else 64; each with GEMM2's top-k sum by last arrival and
        by fp32 atomics (the atomic sum moves 2 x fewer bytes per (pair, column) than the slot rows
        stored and summed: what decides TP prefill, where GEMM2 is byte-bound, docs/w4a8.md)."""
        out = []
        for bm, warps in TOKEN_TILES:
            for bk1 in ((64, 128) if H % 128 == 0 else (64,)):
                for bn2 in GEMM2_BLOCK_N:
                    for warps2 in GEMM2_WARPS[bm]:
                        base = W4A8Config(block_m=bm, block_n1=128, block_n2=bn2, block_k1=bk1,
                                          block_k2=128 if I % 128 == 0 else 64, num_warps1=warps,
                                          num_warps2=warps2)
                        out += [base, replace(base, atomic_reduce=True)]
        return tuple(out)

    @classmethod
    def heuristic(cls, E: int, H: int, I: int, top_k: int, M: int, *, num_global_experts: int | None = None,
                  weight_block: int = 32, tables: tuple[str, str] = FULL_TABLES,
                  device_name: str = "H200") -> "W4A8Config":
        """The candidate (:meth:`candidates`) and split-K pair the static model predicts fastest on
        ``device_name`` (perf_model.DEVICES; H200 where unknown) with the tile costs measured for
        the weights' block (``weight_block`` 16 or 32) and each GEMM's E4M3 table (``tables``:
        GEMM1's and GEMM2's, "full" or "normal", W4A8MoEWeights.w13_table / w2_table;
        :meth:`costs`); tiles that spill or cannot launch are never chosen. Without a measured
        section, :func:`shape_rule`. Cached per shape: the model runs once per shape, not per call."""
        return _heuristic(E, H, I, top_k, M, num_global_experts, weight_block, tuple(tables), device_name)

    def check(self, H: int, I: int) -> None:
        """Raise a ValueError naming the field this config gets wrong for H, I."""
        if self.block_m < 16 or self.block_m & (self.block_m - 1):
            raise ValueError(f"config.block_m = {self.block_m} must be a power of two >= 16")
        if self.block_n1 < ACT_GROUP or self.block_n1 % ACT_GROUP or self.block_n1 & (self.block_n1 - 1):
            raise ValueError(f"config.block_n1 = {self.block_n1} must be a power of two multiple of {ACT_GROUP} "
                             "(each 128-column group of the intermediate is quantized in one program)")
        if self.block_n2 < 64 or self.block_n2 & (self.block_n2 - 1):
            raise ValueError(f"config.block_n2 = {self.block_n2} must be a power of two >= 64")
        for name in ("num_warps1", "num_warps2"):
            if getattr(self, name) not in (4, 8):
                raise ValueError(f"config.{name} = {getattr(self, name)} must be 4 or 8 (the mode's tiles: one "
                                 "or two warpgroups of Hopper's FP8 wgmma)")
        for name, K, bk, s in (("1", H, self.block_k1, self.split_k1), ("2", I, self.block_k2, self.split_k2)):
            if bk not in (64, 128) or K % bk:
                raise ValueError(f"config.block_k{name} = {bk} must be 64 or 128 and divide {K}")
            if s < 1 or s > K // bk:
                raise ValueError(f"config.split_k{name} = {s} must be in [1, {K // bk}] (K steps of {bk})")


def get_w4a8_config(E: int, H: int, I: int, top_k: int, M: int, *, weight_block: int,
                    tables: tuple[str, str] = FULL_TABLES, num_global_experts: int | None = None,
                    device_name: str | None = None, directory=None) -> W4A8Config:
    """Config for one call of the W4A8 mode: the tuned config of the nearest batch size when
    ``k3nvfp4-tune --mode e4m3`` wrote a file for (E, H, I, device, weight block) (looked up like
    W4A16's: moe_details.config.config_dirs; tuned with the tables the tuner's weights chose, and
    used for either), else :meth:`W4A8Config.heuristic` (the static model on the H200, with the
    GEMMs' E4M3 ``tables``). device_name: the file's device (None: this process's CUDA device,
    "cpu" without one)."""
    name = config_file_name(E, H, I, device_name or current_device_name(), W4A8Config.tuned_dtype(weight_block))
    tuned = nearest_tuned(load_tuned_configs(name, W4A8Config, directory), M)
    if tuned is not None:
        return tuned
    return W4A8Config.heuristic(E, H, I, top_k, M, num_global_experts=num_global_experts, weight_block=weight_block,
                                tables=tables)


def _split(programs: int, steps: int, num_sms: int) -> int:
    s = 1
    while s < 8 and programs * s < num_sms and steps // (2 * s) >= 2:
        s *= 2
    return s


@functools.lru_cache(maxsize=4096)
def _heuristic(E: int, H: int, I: int, top_k: int, M: int, num_global_experts: int | None, weight_block: int,
               tables: tuple[str, str], device_name: str) -> W4A8Config:
    from .. import perf_model as pm
    from .call_model import w4a8_call

    device = pm.DEVICES.get(device_name, pm.H200)
    shard = pm.Shard("call", E, num_global_experts or E, H, I, top_k)
    best, t_best = None, float("inf")
    for base in W4A8Config.candidates(H, I):
        costs = base.costs(weight_block, tables)
        if costs is None or any(c.local_bytes for c in costs.values()):  # unmeasured, or spills
            continue
        if not all(pm.occupancy(device, c.registers, 32 * c.num_warps, c.shared_bytes)[0] for c in costs.values()):
            continue  # cannot launch

        def time(cfg: W4A8Config) -> float:
            return w4a8_call(device, shard, M, cfg, costs, weight_block).time_s

        cand_best, cand_t = base, time(base)
        for kind, K, bk in (("split_k1", H, base.block_k1), ("split_k2", I, base.block_k2)):
            steps = K // bk
            unsplit_t = cand_t
            for s in _SPLITS[1:]:
                if s > steps or (s - 1) * -(-steps // s) >= steps:  # a slice would get no K step
                    continue
                cand = replace(cand_best, **{kind: s})
                t = time(cand)
                # A split must beat the unsplit GEMM by the noise margin; among those, the fastest
                # (a margin between splits would stop at 2 where 4 is 3 % faster still).
                if t * _GAIN < unsplit_t and t < cand_t:
                    cand_best, cand_t = cand, t
        if cand_t * _GAIN < t_best:
            best, t_best = cand_best, cand_t
    return best if best is not None else shape_rule(E, H, I, top_k, M, num_global_experts, device.sms)


def shape_rule(E: int, H: int, I: int, top_k: int, M: int, num_global_experts: int | None = None,
               num_sms: int = 132) -> W4A8Config:
    """The heuristic without measured costs (a Triton whose section is missing): block_m the power
    of two in [16, 64] nearest above the mean rows per local expert (~M k E / E_global / E); GEMM1's
    K step 64, GEMM2's 128 where I allows, else 64; GEMM1 8 warps at block_m 64 (its accumulators),
    GEMM2 4;
    each GEMM split over K (at most 8 slices, each with >= 2 K steps) while its programs fill fewer
    than ``num_sms``."""
    local_pairs = M * top_k * E / max(E, num_global_experts or E)
    per_expert = local_pairs / max(1, E)
    bm = 16
    while bm < 64 and bm < per_expert:
        bm *= 2
    bk1 = 64
    bk2 = 128 if I % 128 == 0 else 64
    blocks = min(E, max(1, int(local_pairs))) + int(local_pairs) // bm  # used row blocks, roughly
    tiles1, tiles2 = -(-I // 128), -(-H // 64)
    return W4A8Config(block_m=bm, block_k1=bk1, block_k2=bk2, num_warps1=8 if bm >= 64 else 4, num_warps2=4,
                      split_k1=_split(blocks * tiles1, H // bk1, num_sms),
                      split_k2=_split(blocks * tiles2, I // bk2, num_sms))
