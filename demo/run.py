"""``make demo`` (``python -P -m k3nvfp4.demo``): the main job on a small built-in example.

1. build a small synthetic Kimi-K3 MXFP4 checkpoint (exact K3 layout and naming);
2. cast it to NVFP4 with ``k3nvfp4-cast --verify`` and print the summary;
3. run one MoE layer of the cast checkpoint through the fused Triton kernels (triton_situ)
   and the plain-torch reference (and SGLang's marlin where it can run) with
   ``k3nvfp4-ab layer``, in bf16 and in fp32 (the exactness check), and print the error tables.

Runs on CPU in about a minute (the Triton kernels in the interpreter). It sits above both
``k3nvfp4.checkpoint`` (steps 1-2) and ``k3nvfp4.sglang_ext`` (step 3), so neither of those
depends on the other.

    python -P -m k3nvfp4.demo --workdir build/demo
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Sequence

from ..checkpoint.cli import main as cast_main
from ..checkpoint.layout import INDEX_FILE, REPORT_FILE
from ..checkpoint.synthetic import write_synthetic_checkpoint
from ..kernels.interpreter import rerun_with_interpreter
from ..sglang_ext.ab.cli import main as ab_main

# Small, but every feature of the K3 layout: dense layer 0, KDA + MLA attention, 3 MoE
# layers whose experts straddle shards, zero-exponent (all +-0) blocks, padded A_log.
DEMO_SHAPE = dict(num_layers=4, num_experts=16, hidden_size=256, intermediate_size=128, num_shards=4,
                  zero_exponent_fraction=0.005, out_of_range_fraction=0.0, seed=0)


def build_source(workdir: Path) -> Path:
    """The synthetic MXFP4 checkpoint (reused when a previous demo left it complete)."""
    src = workdir / "k3-mxfp4"
    if (src / INDEX_FILE).is_file():
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
    argv = ["--source-ckpt", str(src), "--output-ckpt", str(out), "--verify", "--workers", str(workers), "--overwrite"]
    print("[demo] k3nvfp4-cast " + " ".join(argv))
    rc = cast_main(argv)
    if rc != 0:
        raise SystemExit(f"[demo] k3nvfp4-cast failed with exit code {rc}")
    report = json.loads((out / REPORT_FILE).read_text())
    if report["stats"]["exact_blocks"] != report["stats"]["blocks"] or report["verify"]["mismatches"]:
        raise SystemExit("[demo] the cast is not bit-exact")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3nvfp4.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("build/demo"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="tokens routed through the layer A/B")
    args = ap.parse_args(argv)
    if argv is None:  # without CUDA the layer A/B runs the kernels in the interpreter
        rerun_with_interpreter("k3nvfp4.demo.run")
    args.workdir.mkdir(parents=True, exist_ok=True)
    src = build_source(args.workdir)
    nvfp4 = cast(src, args.workdir, args.workers)
    layer_ab(nvfp4, args.workdir, args.tokens)
    return 0


def layer_ab(nvfp4: Path, workdir: Path, tokens: int) -> None:
    """One MoE layer of the cast checkpoint: fused Triton kernels vs the plain-torch reference
    (and marlin where it runs), in bf16 as served, then in fp32 as an exactness check."""
    common = ["layer", "--ckpt", str(nvfp4), "--layer", "1", "--tokens", str(tokens)]
    runs = (
        ["--out", str(workdir / "ab-layer1-bf16")],
        ["--dtype", "float32", "--arms", "reference,triton_situ", "--out", str(workdir / "ab-layer1-fp32")],
    )
    for extra in runs:
        argv = common + extra
        print("\n[demo] k3nvfp4-ab " + " ".join(argv))
        rc = ab_main(argv)
        if rc != 0:
            raise SystemExit(f"[demo] k3nvfp4-ab layer failed with exit code {rc}")

