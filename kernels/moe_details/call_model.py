"""The W4A16 family's call model: fused_moe_nvfp4's launches (routing, GEMM1, GEMM2 with the top-k
sum) mapped onto the generic device model (k3nvfp4.kernels.perf_model.predict_kernel) with the
kernel layout's bytes and the routing's blocks. The heuristic (MoEConfig.heuristic) and
bench/sass_report.py predict a call with :func:`our_call`. The skeleton's epilogue traffic and the
routing's launches (:func:`skeleton_traffic`, :func:`routing_launches`) are the same for the FP4
family, whose call model (moe_fp4_details/call_model.py) takes them from here.
"""

from __future__ import annotations

from ..perf_model import (DEFAULT_ASSUMPTIONS, Assumptions, CallPrediction, Device, KernelPrediction, LoopCost,
                          RoutingEstimate, Shard, expected_routing, predict_kernel)
from .layout import E5M3_16, TILE_K
from .routing import max_padded_blocks
from .routing_kernels import small_routing

__all__ = ["layout_bytes_per_weight", "our_call", "our_gemm", "padded_k", "routing_launches", "skeleton_traffic"]


def layout_bytes_per_weight(fmt=None) -> float:
    """HBM bytes per FP4 weight of the kernel-native layout (nibbles + one byte per block scale)
    for a layout.ScaleFormat (None: E5M3_16, NVFP4): 0.5625, or 0.53125 for E8M0_32 (MXFP4)."""
    return (fmt or E5M3_16).bytes_per_weight


def padded_k(k: int) -> int:
    """K rounded up to whole K tiles of the layout (what the weights store)."""
    return -(-k // TILE_K) * TILE_K


def skeleton_traffic(gemm1: bool, split: int, atomic: bool, shard: Shard, M: int, routing: RoutingEstimate,
                      rows_used: float) -> tuple[float, float, int]:
    """(bytes, of which stores, dependent L2 round trips) of the MoE skeleton's epilogues
    (moe_details/skeleton.py), the same for every kernel family: GEMM1's split-K partials over its
    rows_used (padded) rows, GEMM2's top-k sum."""
    H, I = shard.hidden, shard.intermediate
    if gemm1:
        if split == 1:
            return 0.0, 0.0, 0
        partials = split * rows_used * 2 * I * 4
        return 2 * partials, partials, 2  # fp32 partials, stored and read back
    if atomic:  # the memset and the atomics are stores, the final read a load
        return 2 * M * H * 4 + routing.local_pairs * H * 4, M * H * 4 + routing.local_pairs * H * 4, 2
    rows = split * routing.local_pairs * H * 4
    return 2 * rows, rows, 2  # fp32 rows, stored and summed; counter, then rows


def routing_launches(shard: Shard, M: int, assumptions: Assumptions) -> tuple[int, float]:
    """(launches, seconds) of the routing alignment: one program up to routing_kernels'
    SMALL_MAX_PAIRS pairs, else 3 kernels + a memset."""
    if small_routing(M * shard.top_k, shard.local_experts):
        return 1, assumptions.routing_small_s
    return 4, assumptions.routing_large_s


def our_gemm(device: Device, shard: Shard, M: int, launch, cost: LoopCost, routing: RoutingEstimate,
             assumptions: Assumptions = DEFAULT_ASSUMPTIONS, fmt=None) -> KernelPrediction:
    """GEMM1 or GEMM2 of fused_moe_nvfp4 under the model. launch: a GemmLaunch (MoEConfig.gemm);
    fmt: the weights' layout.ScaleFormat (None: E5M3_16)."""
    H, I, k = shard.hidden, shard.intermediate, shard.top_k
    bpw = layout_bytes_per_weight(fmt)
    gemm1 = launch.kind == "gemm1"
    K = H if gemm1 else I
    rows_tile = 2 * launch.block_n if gemm1 else launch.block_n
    n_tiles = -(-(I if gemm1 else H) // launch.block_n)
    useful_rows = 2 * I if gemm1 else H
    k_steps = -(-K // launch.block_k)
    iters = -(-k_steps // launch.split_k)
    blocks = routing.blocks
    active = blocks * n_tiles * launch.split_k
    launched = max_padded_blocks(M * k, shard.local_experts, launch.block_m) * n_tiles * launch.split_k
    useful = routing.active_experts * useful_rows * K
    passes = blocks * useful_rows * K
    weight_bytes = routing.active_experts * useful_rows * padded_k(K) * bpw
    rows_used = blocks * launch.block_m
    # x in and the intermediate out (GEMM1), the intermediate in and the output out (GEMM2): bf16
    other, stores, trips = skeleton_traffic(gemm1, launch.split_k, launch.atomic_reduce, shard, M, routing, rows_used)
    other += (min(M, routing.local_pairs) * H + rows_used * I) * 2 if gemm1 else (rows_used * I + M * H) * 2
    stores += rows_used * I * 2 if gemm1 else M * H * 2
    tokens_mma = launch.block_m if launch.swap_ab else max(launch.block_m, 64)
    iterations_total = blocks * n_tiles * k_steps
    processed = iterations_total * rows_tile * launch.block_k
    return predict_kernel(
        device, name=f"k3nvfp4 {launch.kind}", config=launch.label(), cost=cost, programs_launched=launched,
        programs_active=active, iterations_per_program=iters, iterations_total=iterations_total,
        weights_per_iteration=rows_tile * launch.block_k, useful_weights=useful, useful_passes=passes,
        weight_bytes=weight_bytes, other_bytes=other, store_bytes=stores,
        stage_bytes=rows_tile * launch.block_k * bpw, stages=launch.num_stages,
        mma_flops=2.0 * processed * tokens_mma, dependent_round_trips=trips, assumptions=assumptions,
    )


def our_call(device: Device, shard: Shard, M: int, config, costs: dict, assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
             fmt=None) -> CallPrediction:
    """fused_moe_nvfp4 at one MoEConfig: routing + GEMM1 + GEMM2. costs: {"gemm1": LoopCost, "gemm2": LoopCost};
    fmt: the weights' layout.ScaleFormat (None: E5M3_16)."""
    routing = expected_routing(shard, M, config.block_m)
    kernels = [our_gemm(device, shard, M, config.gemm(kind), costs[kind], routing, assumptions, fmt)
               for kind in ("gemm1", "gemm2")]
    n_routing, routing_s = routing_launches(shard, M, assumptions)
    launches = n_routing + (1 if config.atomic_reduce else 0)
    fixed = routing_s + launches * assumptions.launch_s
    name = "k3nvfp4" if fmt is None or fmt.block == 16 else "k3nvfp4 mxfp4"
    return CallPrediction(name, device.name, shard.name, M, kernels, routing, fixed, launches)
