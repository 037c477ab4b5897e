"""The W4A16 heuristic's tile shapes and their measured static costs, per architecture: the hot K
loop's instructions per warp and iteration, registers, shared memory and spill bytes of each GEMM
tile. The heuristic feeds them to the static performance model (k3nvfp4.kernels.perf_model)
instead of compiling at run time.

The numbers are data, generated offline into tile_cost_table.py (per Triton version; its
docstring names the command and dates) by ``python -P -m k3nvfp4.kernels.offline.tile_costs
--write``, which says how each tile is measured. This module only reads them: runtime code never
imports the compilers that produced them (tests/test_imports.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..perf_model import LoopCost
from ..target import triton_release
from .layout import E5M3_16
from .tile_cost_table import COSTS


@dataclass(frozen=True)
class Tile:
    """One GEMM tile shape: the MoEConfig knobs that shape its compiled loop."""

    kind: str  # "gemm1" | "gemm2"
    block_m: int
    swap_ab: bool
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    def label(self) -> str:
        return (f"{self.kind} bm{self.block_m} {'swap' if self.swap_ab else 'noswap'} bn{self.block_n} "
                f"bk{self.block_k} w{self.num_warps} s{self.num_stages}")


def _tiles() -> tuple[Tile, ...]:
    # (block_m, block_n, block_k, warps). Fewer than 4 warps is no warpgroup: mma.sync with the
    # weights from registers, on sm90 and on sm100 alike (4+ warps use wgmma / tcgen05).
    g1 = [(16, 32, 256, 2), (16, 64, 256, 4), (16, 128, 256, 8), (16, 64, 128, 4), (16, 64, 128, 2),
          (32, 32, 256, 2), (32, 64, 256, 4), (32, 128, 256, 8), (32, 64, 128, 2),
          (64, 64, 128, 4), (64, 128, 128, 8), (64, 32, 256, 2)]
    # (16, 512, 64, 4): 32 words per lane at bk64 halves the per-iteration overhead of K = I = 192 or 384
    # (TP16, TP8), whose 16-word bk64 tiles issue 0.091-0.094 per weight.
    g2 = [(16, 256, 32, 2), (16, 256, 64, 4), (16, 512, 64, 4), (16, 256, 128, 4), (16, 256, 128, 8), (16, 256, 256, 8),
          (16, 128, 64, 4), (16, 128, 128, 4), (16, 256, 64, 2), (16, 256, 128, 2), (16, 128, 128, 2),
          (16, 128, 64, 2),
          (32, 256, 32, 4), (32, 256, 64, 4), (32, 256, 128, 8), (32, 256, 256, 8), (32, 128, 64, 4),
          (32, 128, 128, 4), (32, 128, 64, 2), (32, 64, 256, 2),
          (64, 256, 32, 8), (64, 256, 64, 8), (64, 256, 128, 8), (64, 128, 128, 8), (64, 128, 64, 2)]
    out = [Tile("gemm1", bm, True, bn, bk, w, 3) for bm, bn, bk, w in g1]
    # 128 tokens: weights as the MMA's B operand (no swap); 2 stages keep 64 x 256 under 227 KiB.
    out += [Tile("gemm1", 128, False, 64, 256, 8, 2), Tile("gemm1", 128, False, 64, 128, 8, 3)]
    out += [Tile("gemm2", bm, True, bn, bk, w, 3) for bm, bn, bk, w in g2]
    out += [Tile("gemm2", 128, False, 256, 128, 8, 3), Tile("gemm2", 128, False, 128, 128, 8, 3)]
    return tuple(out)


TILES = _tiles()


def _table(arch: int, version: str | None = None, fmt=None) -> dict[str, tuple[int, int, int, int]]:
    """The cost table of sm<arch> for a Triton version: its own if measured, else the newest one
    measured (the loops of one Triton version are not another's: Triton 3.6 lowers the 2-warp
    tiles to a costlier loop than 3.8 does)."""
    version = version or triton_release()
    key = version if version in COSTS else max(COSTS, key=lambda v: tuple(int(x) for x in v.split(".")))
    return COSTS.get(key, {}).get(100 if arch >= 100 else 90, {}).get((fmt or E5M3_16).name, {})


def tile_cost(tile: Tile, arch: int, version: str | None = None, fmt=None) -> LoopCost | None:
    """The measured cost of a tile on sm<arch> (90 for Hopper, 100 for Blackwell) with the
    installed Triton (or ``version``) for weights in a layout.ScaleFormat (None: E5M3_16, NVFP4),
    None if unmeasured."""
    row = _table(arch, version, fmt).get(tile.label())
    if row is None:
        return None
    instr, regs, shared, local = row
    return LoopCost(instr, tile.num_warps, regs, shared, local)
