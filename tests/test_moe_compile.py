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
        [sys.executable, "-P", "-m", "k3nvfp4.kernels.offline.compile", "--family", "w4a16", "--arch", "90"],
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


def test_offline_compiles_use_the_bundled_ptxas(monkeypatch):
    """The tile tables are measured with Triton's bundled ptxas; an environment that points Triton
    at another one (FlashInfer's triton package sets TRITON_PTXAS_BLACKWELL_PATH on import) must
    not reach the compile, and is restored after it."""
    import triton

    from k3nvfp4.kernels.offline import compile as offline_compile
    from k3nvfp4.kernels.moe_details.config import MoEConfig

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_PTXAS_BLACKWELL_PATH", "/opt/other/ptxas")
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/other/ptxas")
    seen = {}

    def fake_compile(src, target=None, options=None):
        seen.update({k: os.environ.get(k) for k in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")})
        return "compiled"

    monkeypatch.setattr(triton, "compile", fake_compile)
    assert offline_compile.compile_gemm("gemm1", MoEConfig(), 256, 128, 2, arch=100) == "compiled"
    assert seen == {"TRITON_PTXAS_PATH": None, "TRITON_PTXAS_BLACKWELL_PATH": None}
    assert os.environ["TRITON_PTXAS_BLACKWELL_PATH"] == os.environ["TRITON_PTXAS_PATH"] == "/opt/other/ptxas"
