"""The static performance model on hand-computed cases: occupancy limits, routing expectations
under expert parallelism, and one kernel's predicted time term by term."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from k3nvfp4.kernels import perf_model as pm
from k3nvfp4.kernels.moe_details.layout import E8M0_32

TOY = pm.Device("toy", 90, sms=2, clock_hz=1e9, hbm_bytes_per_s=2e12, hbm_copy_bytes_per_s=1e12, mma_bf16_flops=1e15)
A = pm.Assumptions(hbm_latency_s=1e-6, l2_round_trip_s=0.5e-6, launch_s=1e-6, mma_efficiency=1.0)


def test_occupancy_limits():
    # 238 registers x 256 threads: 240 x 32 = 7680 per warp x 8 warps = 61440 of 65536 -> 1 CTA
    assert pm.occupancy(pm.H200, 238, 256, 106496) == (1, "registers")
    # 234 registers x 128 threads: 2 CTAs (the TP16 GEMM1 of the issue: 2 per SM at 4 warps)
    assert pm.occupancy(pm.H200, 234, 128, 65536) == (2, "registers")
    assert pm.occupancy(pm.H200, 96, 64, 36864) == (6, "shared memory")  # 233472 // (36864 + 1024)
    ctas, why = pm.occupancy(pm.H200, 211, 256, 270336)  # GEMM1 bm128 noswap bn64 bk256 s3
    assert ctas == 0 and why == "shared memory 270336 B > 232448 B per block"
    assert pm.occupancy(pm.H200, 256, 128, 0)[0] == 0  # over 255 registers per thread


def test_expected_routing_hand_computed():
    shard = pm.Shard("toy", local_experts=2, global_experts=4, hidden=16, intermediate=16, top_k=2)
    # p = 2/4 per expert; X ~ Binomial(2, 1/2): P = 1/4, 1/2, 1/4 for 0, 1, 2 tokens
    r1 = pm.expected_routing(shard, 2, 1)
    assert r1.local_pairs == pytest.approx(2.0)  # 2 tokens x 2 slots x 2/4 local
    assert r1.active_experts == pytest.approx(2 * 0.75)
    assert r1.blocks == pytest.approx(2 * 1.0)  # E[X] per expert with block 1
    assert pm.expected_routing(shard, 2, 2).blocks == pytest.approx(2 * 0.75)  # E[ceil(X / 2)]
    # K3 EP16 at M = 1024: 56 of 896 experts -> 1024 local pairs, ~18.3 per local expert
    ep16 = pm.expected_routing(pm.K3_SHARDS["ep16"], 1024, 32)
    assert ep16.local_pairs == pytest.approx(1024 * 16 * 56 / 896)
    assert 56 * 0.99 < ep16.active_experts <= 56
    assert 56 <= ep16.blocks < 56 * 1.2  # ceil(18 / 32) is 1 for almost every expert


def test_predict_kernel_hand_computed():
    cost = pm.LoopCost(instructions_per_iteration=100, num_warps=4, registers=128, shared_bytes=32768)
    k = pm.predict_kernel(
        TOY, name="toy", config="c", cost=cost, programs_launched=10, programs_active=8, iterations_per_program=10,
        iterations_total=80, weights_per_iteration=1000, useful_weights=64000, useful_passes=64000,
        weight_bytes=40000, other_bytes=0, stage_bytes=500, stages=3, mma_flops=0, dependent_round_trips=2,
        assumptions=A,
    )  # fmt: skip
    # registers: 128 x 32 = 4096 per warp, 4 warps -> 65536 / 16384 = 4 CTAs per SM (shared: 6)
    assert (k.ctas_per_sm, k.occupancy_limit) == (4, "registers")
    assert k.waves == pytest.approx(1.0) and k.tail == 0
    assert k.warp_instructions == 80 * 100 * 4 and k.warp_instr_per_useful_weight == pytest.approx(0.5)
    # issue: 4 programs on the busiest SM x 4000 warp-instr / 4 schedulers / 1 GHz = 4 us
    assert k.t_issue == pytest.approx(4e-6)
    # bytes: 8 resident CTAs x 2 stages x 500 B in flight / 1 us = 8 GB/s -> 40 kB in 5 us
    assert k.bytes_in_flight_per_sm == 4 * 1000
    assert k.t_bytes == pytest.approx(5e-6)
    assert k.bound == "bytes" and k.t_exposed_latency == pytest.approx(2e-6)  # 1 us + 2 x 0.5 us
    assert k.time_s == pytest.approx(1e-6 + 2e-6 + 5e-6)
    assert k.bytes_per_useful_weight == pytest.approx(40000 / 64000)
    assert k.bytes_in_flight_needed_per_sm == pytest.approx(1e12 * 1e-6 / 2)


def test_our_gemm_counts_padding_as_processed_not_useful():
    """K3 TP16 GEMM1 with 128-wide column tiles computes 256 gate + 256 up rows for I = 192: a
    quarter of the loop's weights are padding; 64-wide tiles have none."""
    from k3nvfp4.kernels.moe_details.call_model import our_gemm
    from k3nvfp4.kernels.moe_details.config import MoEConfig

    shard = pm.K3_SHARDS["tp16"]
    routing = pm.expected_routing(shard, 1, 16)
    cost = pm.LoopCost(683, 8, 237, 106496)
    wide = our_gemm(pm.H200, shard, 1, MoEConfig(block_n1=128, block_k1=256, num_warps1=8).gemm("gemm1"),
                       cost, routing)
    exact = our_gemm(pm.H200, shard, 1, MoEConfig(block_n1=64, block_k1=256, num_warps1=8).gemm("gemm1"),
                        pm.LoopCost(683 / 2, 8, 237, 65536), routing)
    per_weight = 683 * 8 / (256 * 256)  # 0.0834 per processed weight
    assert wide.warp_instr_per_useful_weight == pytest.approx(per_weight * 256 / 192)
    assert exact.warp_instr_per_useful_weight == pytest.approx(per_weight)
    assert wide.useful_weights == exact.useful_weights == pytest.approx(16 * 2 * 192 * 3584)
    assert math.isclose(wide.bytes_per_useful_weight, 0.5625) and math.isclose(exact.bytes_per_useful_weight, 0.5625)
    mx = our_gemm(pm.H200, shard, 1, MoEConfig(block_n1=64, block_k1=256, num_warps1=8).gemm("gemm1"),
                     pm.LoopCost(683 / 2, 8, 237, 65536), routing, fmt=E8M0_32)
    assert math.isclose(mx.bytes_per_useful_weight, 0.53125)  # one E8M0 byte per 32, not expanded


def test_mma_at_the_kernels_own_peak_and_the_e4m3_call_at_fp8_rate():
    """predict_kernel's MMA term at mma_peak_flops (default the bf16 peak); the e4m3 call model
    runs its GEMMs at the device's FP8 peak (H200: 1979 TFLOP/s, twice its bf16 989), with the
    weights' bytes of W4A8MoEWeights (0.5 + 1/block + 4/K per weight)."""
    from k3nvfp4.kernels.moe_w4a8_details.call_model import w4a8_bytes_per_weight, w4a8_call
    from k3nvfp4.kernels.moe_w4a8_details.config import W4A8Config

    cost = pm.LoopCost(instructions_per_iteration=1, num_warps=4, registers=64, shared_bytes=1024)
    kw = dict(name="toy", config="c", cost=cost, programs_launched=2, programs_active=2, iterations_per_program=1,
              iterations_total=2, weights_per_iteration=1, useful_weights=2, useful_passes=2, weight_bytes=0,
              other_bytes=0, stage_bytes=1, stages=2, mma_flops=1e9, assumptions=A)
    assert pm.predict_kernel(TOY, **kw).t_mma == pytest.approx(1e-6)  # 1e9 / 1e15
    assert pm.predict_kernel(TOY, **kw, mma_peak_flops=2e15).t_mma == pytest.approx(0.5e-6)
    assert pm.H200.mma_fp8_flops == 2 * 989.5e12
    assert w4a8_bytes_per_weight(32, 3584) == pytest.approx(0.5 + 1 / 32 + 4 / 3584)
    shard, cfg = pm.K3_SHARDS["ep16"], W4A8Config(block_m=64, num_warps1=8)
    costs = {k: pm.LoopCost(1, 8, 128, 32768) for k in ("gemm1", "gemm2")}  # loops too cheap to bind
    call = w4a8_call(pm.H200, shard, 16384, cfg, costs, 32)
    g1 = call.kernels[0]
    # GEMM1 processes every token block's 256 rows x H at 64 tokens per MMA: 2 x rows x K x 64 flops
    r = call.routing
    flops = 2.0 * r.blocks * (shard.intermediate // 128) * (shard.hidden // 64) * 256 * 64 * 64
    assert g1.t_mma == pytest.approx(flops / (0.7 * 1979e12))


def test_stores_count_against_the_in_flight_limit_or_only_the_copy_bandwidth():
    """predict_kernel's store_bytes (the part of other_bytes a kernel writes) under both readings of
    Assumptions.stores_in_flight, by hand on TOY (copy 1 TB/s, latency 1 us): 2 resident programs
    with one 1000 B stage in flight each stream at 2000 B / 1 us = 2 GB/s."""
    cost = pm.LoopCost(instructions_per_iteration=1, num_warps=4, registers=64, shared_bytes=1024)
    kw = dict(name="toy", config="c", cost=cost, programs_launched=2, programs_active=2, iterations_per_program=1,
              iterations_total=2, weights_per_iteration=1, useful_weights=2, useful_passes=2, weight_bytes=1000,
              other_bytes=3000, store_bytes=2000, stage_bytes=1000, stages=2, mma_flops=0)
    loads_only = replace(A, stores_in_flight=False)
    assert A.stores_in_flight and pm.DEFAULT_ASSUMPTIONS.stores_in_flight  # the report's reading
    assert pm.predict_kernel(TOY, **kw, assumptions=A).t_bytes == pytest.approx(4000 / 2e9)
    assert pm.predict_kernel(TOY, **kw, assumptions=loads_only).t_bytes == pytest.approx(2000 / 2e9)
    # stores enough to fill the copy bandwidth: then they bind, in flight or not
    big = dict(kw, other_bytes=1000 + 5e6, store_bytes=5e6)
    assert pm.predict_kernel(TOY, **big, assumptions=loads_only).t_bytes == pytest.approx((2000 + 5e6) / 1e12)
    with pytest.raises(ValueError, match=r"toy: store_bytes 4000 must lie in \[0, other_bytes = 3000\]"):
        pm.predict_kernel(TOY, **dict(kw, store_bytes=4000), assumptions=A)


def test_skeleton_traffic_names_its_stores_by_hand():
    """moe_details.call_model.skeleton_traffic: (bytes, of which stores, round trips) of GEMM1's
    split-K partials and GEMM2's two top-k sums."""
    from k3nvfp4.kernels.moe_details.call_model import skeleton_traffic

    shard = pm.Shard("t", 4, 4, 256, 128, 4)  # H = 256, I = 128
    routing = pm.RoutingEstimate(tokens=64, local_pairs=256, active_experts=4, blocks=8, block_m=32)
    assert skeleton_traffic(True, 1, False, shard, 64, routing, 256) == (0.0, 0.0, 0)
    partials = 2 * 256 * 256 * 4  # 2 slices x 256 rows x 2I fp32, stored, then read back
    assert skeleton_traffic(True, 2, False, shard, 64, routing, 256) == (2 * partials, partials, 2)
    # atomics: the [M, H] memset and one fp32 add per (pair, column) are stores, the final read a load
    assert skeleton_traffic(False, 1, True, shard, 64, routing, 256) == (
        64 * 256 * 4 * 2 + 256 * 256 * 4, 64 * 256 * 4 + 256 * 256 * 4, 2)
    rows = 2 * 256 * 256 * 4  # by last arrival, 2 slices: fp32 rows stored, then summed
    assert skeleton_traffic(False, 2, False, shard, 64, routing, 256) == (2 * rows, rows, 2)
