"""Measure the W4A16 heuristic's tile table (moe_details/tile_cost_table.py) by compiling every
tile of moe_details.tile_costs.TILES offline (compile_check.measure_gemm; no GPU), and write it.
The table is per Triton version (the loops differ: Triton 3.6, the H200 machine's, lowers the
2-warp mma.sync tiles to loops 1.6x as long as 3.8's); a run rewrites the installed version's
table and keeps the others:

    python -P -m k3nvfp4.kernels.offline.tile_costs --write     # ~25 min on 2 cores, per version

Run it after any change to a kernel, the layout, a tile or the Triton version; bench/sass_report.py
--check reports a table that no longer matches the compiler (bench/README.md).

Each tile is measured for both scale formats of the layout (layout.E5M3_16 for NVFP4 and
E8M0_32 for the MXFP4 release): their scale decodes differ by an instruction or so per word.
Costs are measured with no K tail. GEMM1 is compiled with H = 3584, I = 3072; GEMM2 with
I = 3072 (both are runtime arguments: the loop does not depend on them). Each tile is compiled
with every epilogue it ships with (split-K 1 and 2; for GEMM2 also the fp32-atomic top-k
reduction) and the worst is recorded, field by field: ptxas allocates registers for the whole
kernel, so the split-K or atomic epilogue can cost a CTA per SM.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import pathlib
import sys

from ..moe_details import tile_cost_table
from ..moe_details.layout import E5M3_16, SCALE_FORMATS
from ..moe_details.tile_costs import TILES, Tile
from ..target import triton_release

COMMAND = "python -P -m k3nvfp4.kernels.offline.tile_costs --write"
Row = tuple[int, int, int, int]  # instructions per warp-iteration, registers, shared bytes, local (spill) bytes


def config_for(tile: Tile, atomic_reduce: bool = False, split_k: int = 1):
    """A MoEConfig whose GEMM `tile.kind` has this tile (the other GEMM at defaults)."""
    from ..moe_details.config import MoEConfig

    if tile.kind == "gemm1":
        return MoEConfig(block_m=tile.block_m, swap_ab=tile.swap_ab, block_n1=tile.block_n, block_k1=tile.block_k,
                         split_k1=split_k, num_warps1=tile.num_warps, num_stages1=tile.num_stages)
    return MoEConfig(block_m=tile.block_m, swap_ab=tile.swap_ab, block_n2=tile.block_n, block_k2=tile.block_k,
                     split_k2=split_k, num_warps2=tile.num_warps, num_stages2=tile.num_stages,
                     atomic_reduce=atomic_reduce)


def _variants(tile: Tile) -> tuple[tuple[bool, int], ...]:
    """(atomic_reduce, split_k) of the epilogues a tile ships with: ptxas allocates registers for
    the whole kernel, so each can move the loop's registers, CTAs per SM and count."""
    if tile.kind == "gemm1":
        return ((False, 1), (False, 2))
    return ((False, 1), (False, 2), (True, 1))


def measure_tile(tile: Tile, arch: int, fmt=None) -> Row:
    """One tile's row: the worst of its shipped epilogues, field by field."""
    from .compile_check import measure_gemm

    rows = []
    for atomic, split in _variants(tile):
        m = measure_gemm(tile.kind, config_for(tile, atomic, split), 3584, 3072, 16, arch,
                         scale_fmt=(fmt or E5M3_16).kernel_id)
        rows.append((m["instructions_per_iteration"], m["registers"], m["shared_bytes"], m["local_bytes"]))
    return tuple(max(col) for col in zip(*rows))


def measure(arch: int, fmt=None, progress: bool = True, tiles=TILES) -> dict[str, Row]:
    """Compile every tile for sm<arch> and a layout.ScaleFormat and measure it."""
    fmt = fmt or E5M3_16
    out = {}
    for i, tile in enumerate(tiles):
        out[tile.label()] = measure_tile(tile, arch, fmt)
        if progress:
            print(f"[{i + 1}/{len(tiles)}] sm_{arch} {fmt.name} {tile.label()}: {out[tile.label()]}",
                  file=sys.stderr, flush=True)
    return out


def render(costs: dict, generated: dict[str, str]) -> str:
    """The text of tile_cost_table.py for these tables ({version: {arch: {format: {label: row}}}})."""
    lines = ['"""GENERATED: do not edit. The W4A16 heuristic\'s measured tile costs, read by',
             "moe_details/tile_costs.py (the format of a row and what it measures: offline/tile_costs.py).",
             "",
             f"Command: {COMMAND}",
             "Per Triton version (major.minor), the date it was measured: "
             + ", ".join(f"Triton {v} on {d}" for v, d in sorted(generated.items())) + ".",
             '"""',
             "",
             f'COMMAND = "{COMMAND}"',
             f"GENERATED = {dict(sorted(generated.items()))!r}".replace("'", '"'),
             "# {Triton major.minor: {arch: {ScaleFormat.name: {Tile.label(): (instructions per warp-iteration,",
             "#   registers, shared bytes, local bytes)}}}}",
             "COSTS: dict[str, dict[int, dict[str, dict[str, tuple[int, int, int, int]]]]] = {"]
    for v in sorted(costs):
        lines.append(f'    "{v}": {{')
        for arch in sorted(costs[v]):
            lines.append(f"        {arch}: {{")
            for fmt_name, rows in costs[v][arch].items():
                lines.append(f'            "{fmt_name}": {{')
                lines += [f'                "{k}": {tuple(row)!r},' for k, row in rows.items()]
                lines.append("            },")
            lines.append("        },")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write(costs: dict[int, dict[str, dict[str, Row]]], version: str | None = None) -> pathlib.Path:
    """Replace one Triton version's table (default: the installed one) in tile_cost_table.py,
    keeping the other versions'."""
    from ...common.files import write_text_atomic

    version = version or triton_release()
    tables = {**tile_cost_table.COSTS, version: costs}
    dates = {**tile_cost_table.GENERATED, version: _dt.date.today().isoformat()}
    path = pathlib.Path(tile_cost_table.__file__)
    write_text_atomic(path, render(tables, dates))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -P -m k3nvfp4.kernels.offline.tile_costs",
                                description="Measure the W4A16 heuristic's tile shapes offline (no GPU).")
    p.add_argument("--arch", default="90,100", help="comma list of compute capabilities x10")
    p.add_argument("--write", action="store_true",
                   help="rewrite the installed Triton version's table in tile_cost_table.py (other versions are kept)")
    args = p.parse_args(argv)
    costs = {int(a): {f.name: measure(int(a), f) for f in SCALE_FORMATS} for a in args.arch.split(",")}
    if args.write:
        print(f"wrote {write(costs)}")
    else:
        for arch, tables in costs.items():
            for fmt_name, table in tables.items():
                for k, v in table.items():
                    print(f"sm_{arch} {fmt_name} {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
