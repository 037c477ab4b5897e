"""The FP4 MMA kernels compile offline (no GPU): for sm100 GEMM1 and GEMM2 of both modes get
Blackwell's block-scaled tcgen05 MMA (nvfp4: kind::mxf4nvf4 block16; mxfp8: kind::mxf8f6f4
block32), with nothing decomposed; for sm90 the same code is decomposed onto wgmma."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _compile(arch: int) -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "k3nvfp4.kernels.moe_fp4_details.compile_fp4", "--arch", str(arch)],
        capture_output=True, text=True, env=env, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["kernel"]: r for r in json.loads(proc.stdout)}


def test_sm100_gemms_use_block_scaled_tcgen05():
    res = _compile(100)
    assert len(res) == 8
    for name, r in res.items():
        assert "error" not in r, r
        kind, block = (("kind::mxf4nvf4", "block_scale.block16") if "_nvfp4_" in name
                       else ("kind::mxf8f6f4", "block_scale.block32"))
        assert r["tcgen05_mma"] > 0, r
        assert r["kinds"] == [kind], r  # every tcgen05 MMA block-scaled: no kind::f16 decomposition
        assert r["block_scale"] == [block], r
        assert r["wgmma"] == 0 and r["mma_sync"] == 0, r
        assert r["local_bytes"] == 0, r  # no register spills


@pytest.mark.parametrize("arch", [90])
def test_sm90_decomposes_onto_wgmma(arch):
    res = _compile(arch)
    for name, r in res.items():
        assert "error" not in r, r
        assert r["wgmma"] > 0 and r["tcgen05_mma"] == 0, r
