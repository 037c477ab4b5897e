"""The measured static costs of the kernel families' GEMM tiles, read by their heuristics: the hot
K loop's instructions per warp and iteration, registers, shared memory and spill bytes of each
tile, per Triton release, architecture and mode. The heuristics feed them to the static device
model (perf_model) through their family's call model instead of compiling at run time.

The numbers are data in one schema, generated offline into cost_table.py (its docstring names
the command, and GENERATED the date of each section) by ``python -P -m
k3nvfp4.kernels.offline.costs --write``, which says how each tile is measured. This module only
reads them: runtime code never imports the compilers that produced them (tests/test_imports.py).

A section is keyed (Triton "major.minor", arch, mode). Modes: "w4a16 <ScaleFormat.name>" (the
W4A16 family, one per weight scale format: "w4a16 e5m3/16", "w4a16 e8m0/32"), "w4a4 nvfp4" and
"w4a8 mxfp8" (the FP4 tensor-core family); each family's config class names its own
(``MoEConfig.cost_mode``, ``FP4MoEConfig.cost_mode``). Architectures are 90 (Hopper) and 100
(Blackwell: every sm >= 100 reads it).
"""

from __future__ import annotations

from dataclasses import dataclass

from .cost_table import COSTS
from .perf_model import LoopCost
from .target import triton_release

__all__ = ["Row", "Tile", "loop_costs", "table", "tile_cost"]

Row = tuple[int, int, int, int]  # instructions per warp-iteration, registers, shared bytes, local (spill) bytes


@dataclass(frozen=True)
class Tile:
    """One GEMM tile shape: the config knobs that shape its compiled loop. atomic_reduce: GEMM2's
    fp32-atomic top-k sum as a tile of its own (the FP4 family measures it apart; a W4A16 row is
    the worse of both reductions, so its tiles leave it False)."""

    kind: str  # "gemm1" | "gemm2"
    block_m: int
    swap_ab: bool
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    atomic_reduce: bool = False

    def label(self) -> str:
        """The tile's row key in a cost-table section."""
        return (f"{self.kind} bm{self.block_m} {'swap' if self.swap_ab else 'noswap'} bn{self.block_n} "
                f"bk{self.block_k} w{self.num_warps} s{self.num_stages}" + (" atomic" if self.atomic_reduce else ""))


def _release_key(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def table(arch: int, mode: str, version: str | None = None) -> dict[str, Row]:
    """The rows of one mode on sm<arch> for a Triton release (None: the installed one): its own
    section if measured, else the newest release's (the loops of one Triton release are not
    another's: Triton 3.6 lowers the 2-warp tiles to a costlier loop than 3.8 does); {} when no
    release measured the mode on that architecture."""
    arch = 100 if arch >= 100 else 90
    version = version or triton_release()
    measured = [v for (v, a, m) in COSTS if a == arch and m == mode]
    if not measured:
        return {}
    return COSTS[(version if version in measured else max(measured, key=_release_key), arch, mode)]


def tile_cost(tile: Tile, arch: int, mode: str, version: str | None = None) -> LoopCost | None:
    """The measured cost of a tile on sm<arch> in a mode with the installed Triton (or
    ``version``), None if unmeasured."""
    row = table(arch, mode, version).get(tile.label())
    if row is None:
        return None
    instr, regs, shared, local = row
    return LoopCost(instr, tile.num_warps, regs, shared, local)


def loop_costs(tiles: dict[str, Tile], arch: int, mode: str, version: str | None = None) -> dict[str, LoopCost] | None:
    """{"gemm1": LoopCost, "gemm2": LoopCost} of a call's tiles (a config's ``tile(kind)``), or None
    if the table lacks one."""
    out = {}
    for kind, tile in tiles.items():
        cost = tile_cost(tile, arch, mode, version)
        if cost is None:
            return None
        out[kind] = cost
    return out
