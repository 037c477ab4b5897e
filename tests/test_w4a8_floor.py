"""bench/w4a8_rows.floor_us (the least time an e4m3 call can take: bytes at the copy bandwidth,
useful MACs at the FP8 rate) against hand-computed cases, and targets() marking a bound the floor
alone exceeds as out of reach."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import w4a8_rows  # noqa: E402
from k3nvfp4.kernels import perf_model as pm  # noqa: E402

# 1 TB/s, 1 PFLOP/s FP8 at half efficiency: round figures for the hand computation.
DEVICE = SimpleNamespace(hbm_copy_bytes_per_s=1e12, mma_fp8_flops=1e15)
HALF = SimpleNamespace(mma_efficiency=0.5)


def test_bytes_bound_call_by_hand():
    # 4 local of 4 experts, top-4: every expert active, 4 M pairs. H = 256, I = 128, blocks of 32.
    shard = pm.Shard("t", 4, 4, 256, 128, 4)
    f = w4a8_rows.floor_us(shard, 64, 32, DEVICE, HALF)
    # GEMM1: 4 x 256 x 256 weights at 0.5 + 1/32 + 4/256 B; 64 tokens x 256 and 256 pairs x 128
    # intermediate at 1 + 4/128 B. MMA 2 x 256 x 256 x 256 at 0.5 PFLOP/s = 67.1 ns < bytes.
    g1 = (4 * 256 * 256 * 0.546875 + 64 * 256 * 1.03125 + 256 * 128 * 1.03125) / 1e12
    # GEMM2: 4 x 256 x 128 weights at 0.5 + 1/32 + 4/128 B, the intermediate, the top-k sum:
    # zeroed 64 x 256 x 4, 256 x 256 fp32 atomics, read 64 x 256 x 4, bf16 out 64 x 256 x 2.
    g2 = (4 * 256 * 128 * 0.5625 + 256 * 128 * 1.03125 + 64 * 256 * (4 + 4 + 2) + 256 * 256 * 4) / 1e12
    quant = 64 * 256 * 3.03125 / 1e12
    assert f["gemm1_us"] == pytest.approx(g1 * 1e6)
    assert f["gemm2_us"] == pytest.approx(g2 * 1e6)
    assert f["us"] == pytest.approx((g1 + g2 + quant) * 1e6)
    assert f["topk_sum_us"] == pytest.approx(64 * 256 * 10 / 1e12 * 1e6 + 256 * 256 * 4 / 1e12 * 1e6)


def test_mma_bound_call_and_expert_parallel_share_by_hand():
    # 2 of 8 experts local, top-2 of 8: local pairs M x 2 x 2 / 8 = M / 2; at M = 65536 every local
    # expert has tokens (1 - 0.75^65536 = 1). H = 4096, I = 2048: the MMA dominates GEMM1.
    shard = pm.Shard("t", 2, 8, 4096, 2048, 2)
    M = 65536
    f = w4a8_rows.floor_us(shard, M, 16, DEVICE, HALF)
    pairs = 32768
    mma1 = 2 * pairs * 2 * 2048 * 4096 / 0.5e15
    bytes1 = (2 * 4096 * 4096 * (0.5 + 1 / 16 + 4 / 4096) + pairs * 4096 * 1.03125 + pairs * 2048 * 1.03125) / 1e12
    assert mma1 > bytes1
    assert f["gemm1_us"] == pytest.approx(mma1 * 1e6)


def test_targets_mark_a_bound_below_the_floor_out_of_reach():
    shard = pm.K3_SHARDS["tp16"]
    floor = w4a8_rows.floor_us(shard, 16384, 16)["us"]
    row = {"checkpoint": "nvfp4", "shard": "tp16", "M": 16384, "w4a16_ratio": 0.9, "marlin_ratio": 0.9}
    (t,) = w4a8_rows.targets({"e4m3": {"rows": [dict(row, w4a16_time_us=floor / 0.59)]}})
    assert t["floor_over_w4a16"] == pytest.approx(0.59, abs=1e-4) and t["reachable"] and not t["met"]
    (t,) = w4a8_rows.targets({"e4m3": {"rows": [dict(row, w4a16_time_us=floor / 0.61)]}})
    assert not t["reachable"]
    (t,) = w4a8_rows.targets({"e4m3": {"rows": [row]}})  # no W4A16 time: no floor ratio
    assert t["floor_over_w4a16"] is None and t["reachable"] is None
