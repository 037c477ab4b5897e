"""Static costs of the FP4 GEMM tiles FP4MoEConfig.candidates picks, on sm100 (B200): the hot K
loop's instructions per warp and iteration, registers, shared memory and spill bytes. The
heuristic feeds them to the static performance model (call_model.fp4_call) to choose split-K,
without compiling at run time.

The numbers are data, generated offline into cost_table.py (its docstring names the command,
the Triton version and the date) by ``python -P -m k3nvfp4.kernels.offline.fp4_costs --write``.
This module only reads them: runtime code never imports the compilers (tests/test_imports.py).
"""

from __future__ import annotations

from ..perf_model import LoopCost
from .cost_table import COSTS

ARCH = 100


def tile_key(kind: str, act_quant: str, config) -> str:
    """The fields of a config that shape one GEMM's compiled loop, as a table key."""
    bn, bk = (config.block_n1, config.block_k1) if kind == "gemm1" else (config.block_n2, config.block_k2)
    atomic = " atomic" if kind == "gemm2" and config.atomic_reduce else ""
    return (f"{kind} {act_quant} bm{config.block_m} {'swap' if config.swap_ab else 'noswap'} bn{bn} bk{bk} "
            f"w{config.num_warps} s{config.num_stages}{atomic}")


def fp4_loop_costs(act_quant: str, config) -> dict[str, LoopCost] | None:
    """{"gemm1": LoopCost, "gemm2": LoopCost} of a config's tiles, or None if the table lacks one."""
    out = {}
    for kind in ("gemm1", "gemm2"):
        row = COSTS.get(tile_key(kind, act_quant, config))
        if row is None:
            return None
        instr, regs, shared, local = row
        out[kind] = LoopCost(instr, config.num_warps, regs, shared, local)
    return out
