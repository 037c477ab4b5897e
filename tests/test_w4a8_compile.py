"""The W4A8 expansion compiles for sm90 without a GPU and the GEMM it feeds gets Hopper's FP8 wgmma:
4-bit weights expanded in registers to E4M3 (kernels/moe_details/e4m3_expand.py) as the first
tl.dot operand, FP8 activations from memory (kernels/offline/compile_w4a8.py's probe kernel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_w4a8_probe_compiles_to_e4m3_wgmma_with_weights_from_registers():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-P", "-m", "k3nvfp4.kernels.offline.compile_w4a8", "--block-k", "128"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    assert r["wgmma_forms"] == ["wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"], r["wgmma_forms"]
    assert r["wgmma_e4m3_in_ptx"] >= 4  # 128 K = 4 wgmma of K 32 per iteration
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16" not in proc.stdout  # not decomposed to bf16
    assert r["a_in_registers"], r  # the expanded weights are the register operand, the activations by descriptor
    assert r["loop_mma_per_warp"] >= 1 and r["local_bytes"] == 0, r  # FP8 MMA in the hot loop, no spills
