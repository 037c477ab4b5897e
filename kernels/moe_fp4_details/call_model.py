"""The FP4 tensor-core family's call model: fused_moe_fp4's launches (routing with the activation
quantization, GEMM1, GEMM2 with the top-k sum) mapped onto the generic device model
(k3nvfp4.kernels.perf_model.predict_kernel) with each mode's weight, activation and MMA rates.
FP4MoEConfig.heuristic picks split-K with :func:`fp4_call`; the skeleton's epilogue traffic and
the routing's launches are the W4A16 family's (moe_details/call_model.py).
"""

from __future__ import annotations

from ..moe_details.call_model import routing_launches, skeleton_traffic
from ..moe_details.routing import max_padded_blocks
from ..perf_model import (DEFAULT_ASSUMPTIONS, Assumptions, CallPrediction, Device, KernelPrediction, LoopCost,
                          RoutingEstimate, Shard, expected_routing, predict_kernel)

__all__ = ["FP4_MODE_ACT_BYTES", "FP4_MODE_BYTES_PER_WEIGHT", "FP4_MODE_MMA_SPEEDUP", "fp4_call", "fp4_gemm"]


# HBM bytes per weight of FP4MMAWeights: nibbles + E4M3 per 16 (nvfp4) or E8M0 per 32 (mxfp8).
FP4_MODE_BYTES_PER_WEIGHT = {"nvfp4": 0.5 + 1 / 16, "mxfp8": 0.5 + 1 / 32}
# Bytes per activation / intermediate element as the FP4 modes store them (values + block scales).
FP4_MODE_ACT_BYTES = {"nvfp4": 0.5 + 1 / 16, "mxfp8": 1 + 1 / 32}
# Block-scaled MMA rate relative to the dense bf16 peak (B200 datasheet: FP4 4x, FP8 2x).
FP4_MODE_MMA_SPEEDUP = {"nvfp4": 4.0, "mxfp8": 2.0}


def fp4_gemm(device: Device, shard: Shard, M: int, config, kind: str, cost: LoopCost, routing: RoutingEstimate,
             act_quant: str, assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> KernelPrediction:
    """GEMM1 or GEMM2 of fused_moe_fp4 (act_quant "nvfp4" / "mxfp8") at one FP4MoEConfig."""
    H, I, k = shard.hidden, shard.intermediate, shard.top_k
    bpw, abytes = FP4_MODE_BYTES_PER_WEIGHT[act_quant], FP4_MODE_ACT_BYTES[act_quant]
    gemm1 = kind == "gemm1"
    K = H if gemm1 else I
    block_n, block_k, split = ((config.block_n1, config.block_k1, config.split_k1) if gemm1
                               else (config.block_n2, config.block_k2, config.split_k2))
    rows_tile = 2 * block_n if gemm1 else block_n  # GEMM1: gate and up rows stacked in one operand
    n_tiles = -(-(I if gemm1 else H) // block_n)
    useful_rows = 2 * I if gemm1 else H
    k_steps = -(-K // block_k)
    iters = -(-k_steps // split)
    blocks = routing.blocks
    rows_used = blocks * config.block_m
    # quantized x in and the quantized intermediate out (GEMM1), the intermediate in and the bf16
    # output out (GEMM2)
    other, stores, trips = skeleton_traffic(gemm1, split, config.atomic_reduce, shard, M, routing, rows_used)
    if gemm1:
        other += min(M, routing.local_pairs) * H * abytes + rows_used * I * abytes
        stores += rows_used * I * abytes
    else:
        other += rows_used * I * abytes + M * H * 2
        stores += M * H * 2
    iterations_total = blocks * n_tiles * k_steps
    processed = iterations_total * rows_tile * block_k
    return predict_kernel(
        device, name=f"k3nvfp4 {act_quant} {kind}", config=config.label(), cost=cost,
        programs_launched=max_padded_blocks(M * k, shard.local_experts, config.block_m) * n_tiles * split,
        programs_active=blocks * n_tiles * split, iterations_per_program=iters, iterations_total=iterations_total,
        weights_per_iteration=rows_tile * block_k, useful_weights=routing.active_experts * useful_rows * K,
        useful_passes=blocks * useful_rows * K, weight_bytes=routing.active_experts * useful_rows * K * bpw,
        other_bytes=other, store_bytes=stores, stage_bytes=rows_tile * block_k * bpw, stages=config.num_stages,
        mma_flops=2.0 * processed * config.block_m / FP4_MODE_MMA_SPEEDUP[act_quant],
        dependent_round_trips=trips, assumptions=assumptions,
    )


def fp4_call(device: Device, shard: Shard, M: int, config, costs: dict, act_quant: str,
             assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> CallPrediction:
    """fused_moe_fp4 at one FP4MoEConfig (static NVFP4 intermediate scale, or MXFP8): routing +
    activation quantization (one launch up to 1024 pairs), GEMM1, GEMM2 with the top-k sum.
    costs: {"gemm1": LoopCost, "gemm2": LoopCost} (k3nvfp4.kernels.costs)."""
    routing = expected_routing(shard, M, config.block_m)
    kernels = [fp4_gemm(device, shard, M, config, kind, costs[kind], routing, act_quant, assumptions)
               for kind in ("gemm1", "gemm2")]
    n_routing, routing_s = routing_launches(shard, M, assumptions)
    # The quantization shares the one-program routing's launch; next to the 3-kernel one it is its own.
    launches = n_routing + (0 if n_routing == 1 else 1)
    launches += 1 if config.atomic_reduce else 0  # the memset of the atomic top-k sum
    # Quantization streams x once (read 2 B, write the quantized row) at the copy bandwidth.
    quant_s = M * shard.hidden * (2 + FP4_MODE_ACT_BYTES[act_quant]) / device.hbm_copy_bytes_per_s
    fixed = routing_s + quant_s + launches * assumptions.launch_s
    return CallPrediction(f"k3nvfp4 {act_quant}", device.name, shard.name, M, kernels, routing, fixed, launches)
