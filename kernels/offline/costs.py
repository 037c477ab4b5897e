"""Measure the kernel families' tile costs (kernels/cost_table.py, read by kernels/costs.py) by
compiling every tile their heuristics may pick offline (offline/compile.py; no GPU), and write
them. One section per (Triton "major.minor", arch, mode); a run rewrites the sections it
measures, with the installed Triton, and keeps the others (other releases, other families):

    python -P -m k3nvfp4.kernels.offline.costs --write                  # both families
    python -P -m k3nvfp4.kernels.offline.costs --family w4a16 --write   # ~25 min on 2 cores
    python -P -m k3nvfp4.kernels.offline.costs --family fp4 --write     # ~30 s on 2 cores
    python -P -m k3nvfp4.kernels.offline.costs --family w4a8 --write    # ~8 min CPU

Run it after any change to a kernel, the layout, a tile or the Triton version;
bench/sass_report.py --check reports a table that no longer matches the compiler (bench/README.md).

What a row measures (instructions per warp-iteration of the hot K loop, registers, shared bytes
the launch requests, local (spill) bytes), per family:

- **W4A16** (modes "w4a16 e5m3/16" and "w4a16 e8m0/32", sm90 and sm100): every tile of
  moe_details.config.TILES, for both scale formats of the layout (their decodes differ by an
  instruction or so per word), with no K tail: GEMM1 compiled with H = 3584, I = 3072, GEMM2
  with I = 3072 (runtime arguments: the loop does not depend on them). Each tile is compiled
  with every epilogue it ships with (split-K 1 and 2; for GEMM2 also the fp32-atomic top-k
  reduction) and the worst is recorded, field by field: ptxas allocates registers for the whole
  kernel, so the split-K or atomic epilogue can cost a CTA per SM. The loops differ per Triton
  release (3.6, the H200 machine's, lowers the 2-warp mma.sync tiles to loops 1.6x as long as
  3.8's), so each release that ran this keeps its sections.
- **FP4 tensor-core modes** ("w4a4 nvfp4", "w4a8 mxfp8", sm100 only): every tile of
  FP4MoEConfig.candidates at decode and prefill, for H and I divisible by 128 or only by 64, the
  atomic top-k sum as a tile of its own, each compiled with split-K 2 where K allows
  (measure_fp4_gemm: the epilogue that costs the most registers).
- **Hopper W4A8** ("w4a8 e4m3/16", "w4a8 e4m3/32": the weights' block, from ModelOpt NVFP4 or
  MXFP4; each also "... normal": the weights' E4M3 table, W4A8MoEWeights.w13_table; sm90 only):
  every tile of W4A8Config.candidates for I divisible by 128 and by 64 only,
  the atomic top-k sum as a tile of its own, each compiled with split-K 1 and 2 and the worst
  recorded field by field (compile_w4a8.measure_w4a8_gemm) at H = 3584, I = 3072.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import pathlib
import sys
from dataclasses import replace

from .. import cost_table
from ..costs import Row, Tile
from ..target import triton_release

COMMAND = "python -P -m k3nvfp4.kernels.offline.costs --write"
FP4_ARCH = 100
Section = tuple[str, int, str]  # (Triton major.minor, arch, mode)


def _row(m: dict) -> Row:
    """A table row from one measurement (offline/compile*.py's dict)."""
    return (m["instructions_per_iteration"], m["registers"], m["shared_bytes"], m["local_bytes"])


def worst_row(measurements: list[dict]) -> Row:
    """The worst of several compiles of one tile (its shipped epilogues, or the e4m3 mode's two
    E4M3 tables), field by field: ptxas allocates registers for the whole kernel, so any variant
    can cost a CTA per SM. measurements: offline/compile*.py's dicts."""
    return tuple(max(col) for col in zip(*map(_row, measurements)))


# ---------------------------------------------------------------------------------------------- W4A16


def w4a16_config_for(tile: Tile, atomic_reduce: bool = False, split_k: int = 1):
    """A MoEConfig whose GEMM `tile.kind` has this tile (the other GEMM at defaults)."""
    from ..moe_details.config import MoEConfig

    if tile.kind == "gemm1":
        return MoEConfig(block_m=tile.block_m, swap_ab=tile.swap_ab, block_n1=tile.block_n, block_k1=tile.block_k,
                         split_k1=split_k, num_warps1=tile.num_warps, num_stages1=tile.num_stages)
    return MoEConfig(block_m=tile.block_m, swap_ab=tile.swap_ab, block_n2=tile.block_n, block_k2=tile.block_k,
                     split_k2=split_k, num_warps2=tile.num_warps, num_stages2=tile.num_stages,
                     atomic_reduce=atomic_reduce)


def _w4a16_variants(tile: Tile) -> tuple[tuple[bool, int], ...]:
    """(atomic_reduce, split_k) of the epilogues a W4A16 tile ships with."""
    if tile.kind == "gemm1":
        return ((False, 1), (False, 2))
    return ((False, 1), (False, 2), (True, 1))


def measure_w4a16_tile(tile: Tile, arch: int, fmt=None) -> Row:
    """One W4A16 tile's row: the worst of its shipped epilogues, field by field."""
    from ..moe_details.layout import E5M3_16
    from .compile import measure_gemm

    return worst_row([measure_gemm(tile.kind, w4a16_config_for(tile, atomic, split), 3584, 3072, 16, arch,
                                scale_fmt=(fmt or E5M3_16).kernel_id)
                   for atomic, split in _w4a16_variants(tile)])


def measure_w4a16(arch: int, fmt=None, progress: bool = True, tiles=None) -> dict[str, Row]:
    """{Tile.label(): row} of every W4A16 tile (default moe_details.config.TILES) for sm<arch> and a
    layout.ScaleFormat (None: E5M3_16)."""
    from ..moe_details.config import TILES
    from ..moe_details.layout import E5M3_16

    fmt = fmt or E5M3_16
    tiles = TILES if tiles is None else tiles
    out = {}
    for i, tile in enumerate(tiles):
        out[tile.label()] = measure_w4a16_tile(tile, arch, fmt)
        if progress:
            print(f"[{i + 1}/{len(tiles)}] sm_{arch} {fmt.name} {tile.label()}: {out[tile.label()]}",
                  file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------------------------------------- FP4 modes


def fp4_table_configs() -> dict[str, tuple[str, object]]:
    """{Tile.label(): (kind, FP4MoEConfig)} of every tile the FP4 heuristic may need:
    FP4MoEConfig.candidates at decode and prefill, for H and I divisible by 128 or only by 64."""
    from ..moe_fp4_details.config import FP4MoEConfig

    out = {}
    for M in (1, 4096):
        for H in (3584, 3520):
            for I in (384, 192):
                for cfg in FP4MoEConfig.candidates(8, H, I, 16, M):
                    for kind in ("gemm1", "gemm2"):
                        out[cfg.tile(kind).label()] = (kind, cfg)
    return out


def measure_fp4(act_quant: str, progress: bool = True) -> dict[str, Row]:
    """{Tile.label(): row} of one FP4 mode ("nvfp4" / "mxfp8") on sm100, each tile compiled
    without split-K in the config (measure_fp4_gemm adds the split-K 2 epilogue)."""
    from .compile import measure_fp4_gemm

    out = {}
    for label, (kind, cfg) in sorted(fp4_table_configs().items()):
        r = measure_fp4_gemm(kind, act_quant, replace(cfg, split_k1=1, split_k2=1), arch=FP4_ARCH)
        out[label] = _row(r)
        if progress:
            print(f"{act_quant} {label}: {out[label]}", file=sys.stderr, flush=True)
    return out


# ---------------------------------------------------------------------------------------------- W4A8 (e4m3)


def w4a8_table_configs() -> dict[str, tuple[str, object]]:
    """{Tile.label(): (kind, W4A8Config)} of every tile the e4m3 heuristic may need:
    W4A8Config.candidates for I divisible by 128 and by 64 only."""
    from ..moe_w4a8_details.config import W4A8Config

    out = {}
    for I in (3072, 192):
        for cfg in W4A8Config.candidates(3584, I):
            for kind in ("gemm1", "gemm2"):
                out[cfg.tile(kind).label()] = (kind, cfg)
    return out


def _w4a8_job(job: tuple) -> tuple[str, Row]:
    from .compile_w4a8 import measure_w4a8_gemm

    label, kind, cfg, weight_block, table = job
    # Both epilogues a tile ships with: neither is always the larger (the MXFP4 GEMM1 tile bm16
    # bn128 bk64 w4 s3 takes 176 registers at split-K 1 and 168 at split-K 2 with Triton 3.8).
    return label, worst_row([measure_w4a8_gemm(kind, replace(cfg, split_k1=split, split_k2=split), 3584, 3072, 16,
                                            W4A8_ARCH, weight_block, table=table)
                          for split in (1, 2)])


def measure_w4a8(weight_block: int, progress: bool = True, workers: int = 1, table: str = "full") -> dict[str, Row]:
    """{Tile.label(): row} of the e4m3 mode on sm90 for one weight block (16 / 32) and E4M3 table
    ("full" / "normal"), in ``workers`` processes."""
    jobs = [(label, kind, cfg, weight_block, table) for label, (kind, cfg) in sorted(w4a8_table_configs().items())]
    if workers > 1:
        import concurrent.futures as cf
        import multiprocessing as mp

        with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
            results = list(pool.map(_w4a8_job, jobs))
    else:
        results = [_w4a8_job(j) for j in jobs]
    if progress:
        for label, row in results:
            print(f"e4m3/{weight_block} {table} {label}: {row}", file=sys.stderr, flush=True)
    return dict(results)


W4A8_ARCH = 90


def measure_family(family: str, archs=(90, 100), progress: bool = True, workers: int = 1) -> dict[Section, dict[str, Row]]:
    """Every section of one family ("w4a16" on ``archs``, or "fp4" on sm100), measured with the
    installed Triton."""
    version = triton_release()
    if family == "w4a16":
        from ..moe_details.config import MoEConfig
        from ..moe_details.layout import SCALE_FORMATS

        return {(version, arch, MoEConfig.cost_mode(f)): measure_w4a16(arch, f, progress)
                for arch in archs for f in SCALE_FORMATS}
    if family == "fp4":
        from ..moe_fp4_details.config import FP4MoEConfig

        return {(version, FP4_ARCH, FP4MoEConfig.cost_mode(aq)): measure_fp4(aq, progress) for aq in ("nvfp4", "mxfp8")}
    if family == "w4a8":
        from ..moe_w4a8_details.config import W4A8Config

        from ..moe_details.e4m3_expand import E4M3_TABLES

        return {(version, W4A8_ARCH, W4A8Config.cost_mode(wb, t)): measure_w4a8(wb, progress, workers, t)
                for wb in (16, 32) for t in E4M3_TABLES}
    raise ValueError(f"family: expected 'w4a16', 'fp4' or 'w4a8', got {family!r}")


# ---------------------------------------------------------------------------------------------- the table


def render(costs: dict[Section, dict[str, Row]], generated: dict[Section, str]) -> str:
    """The text of cost_table.py for these sections (sorted by release, arch, mode; rows in the
    order given)."""
    dates = sorted({d for d in generated.values()})
    lines = ['"""GENERATED: do not edit. The kernel families\' measured tile costs, read by kernels/costs.py',
             "(the schema and what a row measures: offline/costs.py).",
             "",
             f"Command: {COMMAND}",
             "Sections measured on " + ", ".join(dates) + " (GENERATED gives each section's date).",
             '"""',
             "",
             f'COMMAND = "{COMMAND}"',
             "# {(Triton major.minor, arch, mode): the date the section was measured}",
             "GENERATED: dict[tuple[str, int, str], str] = {"]
    lines += [f"    {k!r}: {generated[k]!r}," for k in sorted(costs, key=_section_key)]
    lines += ["}",
              "# {(Triton major.minor, arch, mode): {Tile.label(): (instructions per warp-iteration, registers,",
              "#   shared bytes, local bytes)}}",
              "COSTS: dict[tuple[str, int, str], dict[str, tuple[int, int, int, int]]] = {"]
    for key in sorted(costs, key=_section_key):
        lines.append(f"    {key!r}: {{")
        lines += [f"        {label!r}: {tuple(row)!r}," for label, row in costs[key].items()]
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _section_key(key: Section) -> tuple:
    version, arch, mode = key
    return tuple(int(x) for x in version.split(".")), arch, mode


def write(sections: dict[Section, dict[str, Row]]) -> pathlib.Path:
    """Replace these sections of cost_table.py (dated today), keeping every other section."""
    from ...common.files import write_text_atomic

    today = _dt.date.today().isoformat()
    costs = {**cost_table.COSTS, **sections}
    generated = {**cost_table.GENERATED, **{k: today for k in sections}}
    path = pathlib.Path(cost_table.__file__)
    write_text_atomic(path, render(costs, generated))
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -P -m k3nvfp4.kernels.offline.costs",
                                description="Measure the kernel families' tile costs offline (no GPU).")
    p.add_argument("--family", choices=("w4a16", "fp4", "w4a8", "all"), default="all", help="which family's sections")
    p.add_argument("--workers", type=int, default=1, help="w4a8: compile processes")
    p.add_argument("--arch", default="90,100", help="W4A16: comma list of compute capabilities x10 (FP4: sm100 only)")
    p.add_argument("--write", action="store_true",
                   help="rewrite the measured sections of kernels/cost_table.py (every other section is kept)")
    args = p.parse_args(argv)
    try:
        archs = tuple(int(a) for a in args.arch.split(","))
    except ValueError:
        p.error(f"--arch: expected comma-separated integers, got {args.arch!r}")
    sections: dict[Section, dict[str, Row]] = {}
    for family in (("w4a16", "fp4", "w4a8") if args.family == "all" else (args.family,)):
        sections |= measure_family(family, archs, workers=args.workers)
    if args.write:
        print(f"wrote {write(sections)}")
    else:
        for key, rows in sections.items():
            for label, row in rows.items():
                print(f"{key} {label}: {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
