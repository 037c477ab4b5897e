"""The MoE kernels compile for sm90 (H100/H200) on a machine without a GPU, and the GEMMs get
Hopper's wgmma and cp.async-pipelined loads (a regression here costs most of the H200 speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_kernels_compile_for_sm90_with_wgmma_and_pipelining():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "k3nvfp4.kernels.moe_details.compile_check", "--arch", "90"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = {r["kernel"]: r for r in json.loads(proc.stdout)}
    assert len(res) == 9
    for name, r in res.items():
        if name.startswith("gemm"):
            assert r["wgmma"] > 0, r  # Hopper MMA, not the mma.sync fallback
            assert r["async_copy"] > 0, r  # loads pipelined through shared memory
            assert r["shared_bytes"] <= 227 * 1024, r
