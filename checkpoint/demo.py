"""``make demo``: build a small synthetic Kimi-K3 MXFP4 checkpoint, cast it to NVFP4 with
``--verify`` and print the summary. Runs on CPU in well under a minute.

    python -m k3nvfp4.checkpoint.demo --workdir build/demo
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

from .cli import main as cast_main
from .synthetic import write_synthetic_checkpoint

# Small, but every feature of the K3 layout: dense layer 0, KDA + MLA attention, 3 MoE
# layers whose experts straddle shards, zero-exponent (all +-0) blocks, padded A_log.
DEMO_SHAPE = dict(num_layers=4, num_experts=16, hidden_size=256, intermediate_size=128, num_shards=4,
                  zero_exponent_fraction=0.005, out_of_range_fraction=0.0, seed=0)


def build_source(workdir: Path) -> Path:
    """The synthetic MXFP4 checkpoint (reused when a previous demo left it complete)."""
    src = workdir / "k3-mxfp4"
    if (src / "model.safetensors.index.json").is_file():
        print(f"[demo] reusing synthetic MXFP4 checkpoint {src}")
        return src
    t0 = time.perf_counter()
    write_synthetic_checkpoint(src, **DEMO_SHAPE)
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    print(f"[demo] wrote synthetic Kimi-K3 MXFP4 checkpoint {src} ({size / 1e6:.1f} MB, "
          f"{DEMO_SHAPE['num_layers'] - 1} MoE layers x {DEMO_SHAPE['num_experts']} experts) "
          f"in {time.perf_counter() - t0:.1f} s")
    return src


def cast(src: Path, workdir: Path, workers: int = 2) -> Path:
    """Run the cast CLI exactly as a user would (with --verify); returns the NVFP4 checkpoint."""
    out = workdir / "k3-nvfp4"
    argv = ["--source_ckpt", str(src), "--output_ckpt", str(out), "--verify", "--workers", str(workers), "--overwrite"]
    print("[demo] k3nvfp4-cast " + " ".join(argv))
    rc = cast_main(argv)
    if rc != 0:
        raise SystemExit(f"[demo] k3nvfp4-cast failed with exit code {rc}")
    report = json.loads((out / "cast_report.json").read_text())
    if report["stats"]["exact_blocks"] != report["stats"]["blocks"] or report["verify"]["mismatches"]:
        raise SystemExit("[demo] the cast is not bit-exact")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3nvfp4.checkpoint.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("build/demo"))
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = build_source(args.workdir)
    cast(src, args.workdir, args.workers)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
