"""Measure the FP4 modes' tile table (moe_fp4_details/cost_table.py) by compiling every tile the
heuristic may pick offline for sm100 (compile_fp4.measure_fp4_gemm; no GPU), and write it.
Measured with the installed Triton (SGLang pins 3.8; the table records which):

    python -P -m k3nvfp4.kernels.offline.fp4_costs --write     # ~30 s on 2 cores

Run it after any change to an FP4 kernel, FP4MoEConfig's tiles or the Triton version;
bench/sass_report.py --check reports a table that no longer matches the compiler.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import pathlib
import sys
from dataclasses import replace

from ..moe_fp4_details.costs import ARCH, tile_key
from ..target import triton_release

COMMAND = "python -P -m k3nvfp4.kernels.offline.fp4_costs --write"


def table_configs():
    """Every (kind, act_quant, config) whose loop the heuristic may need: FP4MoEConfig.candidates
    at decode and prefill, for H and I divisible by 128 or only by 64."""
    from ..moe_fp4_details.config import FP4MoEConfig

    out = {}
    for M in (1, 4096):
        for H in (3584, 3520):
            for I in (384, 192):
                for cfg in FP4MoEConfig.candidates(8, H, I, 16, M):
                    for kind in ("gemm1", "gemm2"):
                        for aq in ("nvfp4", "mxfp8"):
                            out[tile_key(kind, aq, cfg)] = (kind, aq, cfg)
    return out


def measure(progress: bool = True) -> dict[str, tuple[int, int, int, int]]:
    """{tile_key: (instructions per warp-iteration, registers, shared bytes, local bytes)}, each
    tile compiled without split-K."""
    from .compile_fp4 import measure_fp4_gemm

    out = {}
    for key, (kind, aq, cfg) in sorted(table_configs().items()):
        r = measure_fp4_gemm(kind, aq, replace(cfg, split_k1=1, split_k2=1), arch=ARCH)
        out[key] = (r["instructions_per_iteration"], r["registers"], r["shared_bytes"], r["local_bytes"])
        if progress:
            print(f"{key}: {out[key]}", flush=True)
    return out


def render(costs: dict, version: str, date: str) -> str:
    """The text of cost_table.py for this table."""
    body = "".join(f"    {k!r}: {tuple(v)!r},\n" for k, v in sorted(costs.items()))
    return ('"""GENERATED: do not edit. The FP4 modes\' measured tile costs on sm100, read by\n'
            "moe_fp4_details/costs.py (how they are measured: offline/fp4_costs.py).\n\n"
            f"Command: {COMMAND}\nMeasured with Triton {version} on {date}.\n" + '"""\n\n'
            f'COMMAND = "{COMMAND}"\nTRITON = "{version}"\nGENERATED = "{date}"\n'
            "# {tile_key: (instructions per warp-iteration, registers, shared bytes, local bytes)}\n"
            f"COSTS: dict[str, tuple[int, int, int, int]] = {{\n{body}}}\n")


def write(costs: dict) -> pathlib.Path:
    from ...common.files import write_text_atomic
    from ..moe_fp4_details import cost_table

    path = pathlib.Path(cost_table.__file__)
    write_text_atomic(path, render(costs, triton_release(), _dt.date.today().isoformat()))
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -P -m k3nvfp4.kernels.offline.fp4_costs",
                                 description="Measure the FP4 modes' tile shapes offline (no GPU).")
    ap.add_argument("--write", action="store_true", help="rewrite moe_fp4_details/cost_table.py")
    args = ap.parse_args(argv)
    costs = measure()
    if args.write:
        print(f"wrote {write(costs)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
