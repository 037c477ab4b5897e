"""The FP4 MMA kernels compile offline (no GPU): for sm100 GEMM1 and GEMM2 of both modes get
Blackwell's block-scaled tcgen05 MMA (nvfp4: kind::mxf4nvf4 block16; mxfp8: kind::mxf8f6f4
block32), with nothing decomposed; for sm90 the same code is decomposed onto wgmma.

The sm100 GEMMs are the static report's (its ``fp4_modes`` rows: the same compile_all_fp4(100),
made once per test session, tests/shared_compiles.py); the sm90 GEMMs and both architectures'
first launch compile in one subprocess for this module."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# One process for every compile of this module that the static report does not make:
# compile_all_fp4(90), and the route + quantize launch of both modes for sm90 and sm100
# (spill bytes from cuobjdump -res-usage).
_SCRIPT = """
import json
from k3nvfp4.kernels.offline import sass
from k3nvfp4.kernels.offline.compile import compile_all_fp4, compile_route_quant
spills = {str(a): [sass.resource_usage(compile_route_quant(m, a).asm["cubin"])["route_quant_kernel"].local_bytes
                   for m in ("nvfp4", "mxfp8")] for a in (90, 100)}
print(json.dumps({"sm90": compile_all_fp4(90), "route_quant_spills": spills}))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-P", "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sm100_gemms_use_block_scaled_tcgen05(static_report):
    assert static_report.result is not None, static_report.stderr_tail
    res = {r["kernel"]: r for r in static_report.result["fp4_modes"]}
    assert len(res) == 8 and all(r["arch"] == 100 for r in res.values()), sorted(res)
    for name, r in res.items():
        assert "error" not in r, r
        kind, block = (("kind::mxf4nvf4", "block_scale.block16") if "_nvfp4_" in name
                       else ("kind::mxf8f6f4", "block_scale.block32"))
        assert r["tcgen05_mma"] > 0, r
        assert r["kinds"] == [kind], r  # every tcgen05 MMA block-scaled: no kind::f16 decomposition
        assert r["block_scale"] == [block], r
        assert r["wgmma"] == 0 and r["mma_sync"] == 0, r
        assert r["local_bytes"] == 0, r  # no register spills


def test_sm90_decomposes_onto_wgmma(compiled):
    res = {r["kernel"]: r for r in compiled["sm90"]}
    assert len(res) == 8 and all(r["arch"] == 90 for r in res.values()), sorted(res)
    for name, r in res.items():
        assert "error" not in r, r
        assert r["wgmma"] > 0 and r["tcgen05_mma"] == 0, r


def test_cost_table_tiles_launch_and_the_heuristic_picks_no_spill():
    """Every FP4 tile of kernels/cost_table.py (the heuristic's model input) launches on B200,
    and what the heuristic picks at the K3 shapes never spills and fills the GPU at M = 1 (GEMM1
    split over K). That the table is what the kernels compile to today is a change detector:
    bench/sass_report.py --check re-measures it."""
    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels import costs
    from k3nvfp4.kernels.moe_fp4_details.config import COST_ARCH, FP4MoEConfig

    for mode in ("nvfp4", "mxfp8"):
        rows = costs.table(COST_ARCH, FP4MoEConfig.cost_mode(mode))
        assert len(rows) == 12, (mode, sorted(rows))
        for key, (_instr, regs, shared, _local) in rows.items():
            warps = int(key.split(" w")[1].split()[0])
            assert pm.occupancy(pm.B200, regs, 32 * warps, shared)[0] >= 1, (mode, key)
    for name in ("tp8", "tp16"):
        s = pm.K3_SHARDS[name]
        for mode in ("nvfp4", "mxfp8"):
            for M in (1, 8, 64, 128, 1024, 4096):
                cfg = FP4MoEConfig.heuristic(s.local_experts, s.hidden, s.intermediate, s.top_k, M, act_quant=mode)
                picked = costs.loop_costs({k: cfg.tile(k) for k in ("gemm1", "gemm2")}, COST_ARCH,
                                          FP4MoEConfig.cost_mode(mode))
                assert picked is not None and all(c.local_bytes == 0 for c in picked.values()), (name, mode, M, cfg)
            one = FP4MoEConfig.heuristic(s.local_experts, s.hidden, s.intermediate, s.top_k, 1, act_quant=mode)
            tiles1 = -(-s.intermediate // one.block_n1)
            assert s.top_k * tiles1 * one.split_k1 >= pm.B200.sms, (name, mode, one)  # >= one program per SM


@pytest.mark.parametrize("arch", [90, 100])
def test_fused_routing_and_quantization_launch_compiles(compiled, arch):
    """The FP4 modes' first launch (align_small in program 0, quant_row in the others) compiles
    for Hopper and Blackwell without spilling (nvfp4, mxfp8)."""
    assert compiled["route_quant_spills"][str(arch)] == [0, 0]
