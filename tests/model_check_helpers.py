"""Shared by the model-class tests: the synthetic Kimi-K3 shape, the cast, and the self-check
run as a user runs it (a fresh ``python -P`` process with the Triton interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from k3nvfp4.checkpoint.cli import main as cast_main

# 4 layers: 0 dense + KDA, 1-2 MoE + KDA, 3 MoE + MLA (q_a/kv_a fused); experts straddle shards.
SHAPE = dict(num_layers=4, num_experts=8, hidden_size=64, intermediate_size=64, top_k=4, num_shards=4, seed=11)
MOE_LAYERS = (1, 2, 3)
RSF = 2.5  # the self-check's default routed_scaling_factor override (checkpoint: 1.0)


def cast_checkpoint(src: Path, out: Path, *extra: str) -> Path:
    assert cast_main(["--source_ckpt", str(src), "--output_ckpt", str(out), "--workers", "1", "--no-progress", *extra]) == 0
    return out


def run_python(tmp: Path, argv: list[str], extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONSAFEPATH": "1", **(extra_env or {})}
    env.pop("SGLANG_PLUGINS", None)
    proc = subprocess.run([sys.executable, "-P", *argv], capture_output=True, text=True, timeout=900, env=env, cwd=tmp)
    print(proc.stdout[-6000:])
    return proc


def run_selfcheck(tmp: Path, name: str, *args: str, extra_env: dict[str, str] | None = None) -> dict:
    out = tmp / f"{name}.json"
    proc = run_python(tmp, ["-m", "k3nvfp4.sglang_ext.selfcheck", *args, "--json", str(out)], extra_env)
    assert proc.returncode == 0, (proc.stdout[-6000:], proc.stderr[-6000:])
    assert "model-class self-check: PASSED" in proc.stdout
    report = json.loads(out.read_text())
    report["log"] = proc.stdout + proc.stderr
    return report


def index_names(ckpt: Path) -> list[str]:
    return sorted(json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"])
