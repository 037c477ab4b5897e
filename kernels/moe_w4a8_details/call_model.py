"""The Hopper W4A8 ("e4m3") mode's call model: fused_moe_w4a8's launches (routing with the tokens'
quantization, GEMM1 with the activation and the intermediate's quantization, GEMM2 with the top-k
sum) mapped onto the generic device model (k3nvfp4.kernels.perf_model.predict_kernel):

- weight bytes: the nibbles, one int8 exponent offset per weight block (16 from ModelOpt NVFP4,
  32 from MXFP4) and one fp32 row factor per row (W4A8MoEWeights);
- activation bytes: E4M3 tokens and intermediate with one fp32 scale per token per 128 columns;
- the MMA at the device's dense FP8 rate (FP8 wgmma, twice the bf16 rate on H100 / H200), the
  tokens on its N side (swap-AB, always: block_m tokens per MMA);
- the skeleton's epilogue traffic and the routing's launches are the W4A16 family's
  (moe_details/call_model.py).

W4A8Config.heuristic picks its config with :func:`w4a8_call`; bench/sass_report.py predicts the
mode's rows with it.
"""

from __future__ import annotations

from ..moe_details.call_model import routing_launches, skeleton_traffic
from ..moe_details.routing import max_padded_blocks
from ..perf_model import (DEFAULT_ASSUMPTIONS, Assumptions, CallPrediction, Device, KernelPrediction, LoopCost,
                          RoutingEstimate, Shard, expected_routing, predict_kernel)

__all__ = ["ACT_BYTES", "w4a8_bytes_per_weight", "w4a8_call", "w4a8_gemm"]

# Bytes per E4M3 activation / intermediate element with its fp32 scale per 128 columns.
ACT_BYTES = 1 + 4 / 128


def w4a8_bytes_per_weight(weight_block: int, K: int) -> float:
    """HBM bytes per weight of W4A8MoEWeights: 0.5 B of nibbles, one int8 offset per
    ``weight_block`` weights (16: NVFP4, 32: MXFP4), one fp32 row factor per K weights of a row."""
    return 0.5 + 1 / weight_block + 4 / K


def w4a8_gemm(device: Device, shard: Shard, M: int, config, kind: str, cost: LoopCost, routing: RoutingEstimate,
              weight_block: int = 32, assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> KernelPrediction:
    """GEMM1 or GEMM2 of fused_moe_w4a8 at one W4A8Config under the model."""
    H, I, k = shard.hidden, shard.intermediate, shard.top_k
    gemm1 = kind == "gemm1"
    K = H if gemm1 else I
    bpw = w4a8_bytes_per_weight(weight_block, K)
    block_n, block_k, split = ((config.block_n1, config.block_k1, config.split_k1) if gemm1
                               else (config.block_n2, config.block_k2, config.split_k2))
    rows_tile = 2 * block_n if gemm1 else block_n  # GEMM1: gate and up rows stacked in one operand
    n_tiles = -(-(I if gemm1 else H) // block_n)
    useful_rows = 2 * I if gemm1 else H
    k_steps = -(-K // block_k)
    iters = -(-k_steps // split)
    blocks = routing.blocks
    rows_used = blocks * config.block_m
    other, stores, trips = skeleton_traffic(gemm1, split, config.atomic_reduce, shard, M, routing, rows_used)
    if gemm1:  # the E4M3 tokens in, the E4M3 intermediate (every padded row) out
        other += min(M, routing.local_pairs) * H * ACT_BYTES + rows_used * I * ACT_BYTES
        stores += rows_used * I * ACT_BYTES
    else:  # the intermediate in, the output out (bf16)
        other += rows_used * I * ACT_BYTES + M * H * 2
        stores += M * H * 2
    iterations_total = blocks * n_tiles * k_steps
    processed = iterations_total * rows_tile * block_k
    return predict_kernel(
        device, name=f"k3nvfp4 e4m3 {kind}", config=config.label(), cost=cost,
        programs_launched=max_padded_blocks(M * k, shard.local_experts, config.block_m) * n_tiles * split,
        programs_active=blocks * n_tiles * split, iterations_per_program=iters, iterations_total=iterations_total,
        weights_per_iteration=rows_tile * block_k, useful_weights=routing.active_experts * useful_rows * K,
        useful_passes=blocks * useful_rows * K, weight_bytes=routing.active_experts * useful_rows * K * bpw,
        other_bytes=other, store_bytes=stores, stage_bytes=rows_tile * block_k * bpw, stages=config.num_stages,
        mma_flops=2.0 * processed * config.block_m, dependent_round_trips=trips, assumptions=assumptions,
        mma_peak_flops=device.mma_fp8_flops or device.mma_bf16_flops,
    )


def w4a8_call(device: Device, shard: Shard, M: int, config, costs: dict, weight_block: int = 32,
              assumptions: Assumptions = DEFAULT_ASSUMPTIONS) -> CallPrediction:
    """fused_moe_w4a8 at one W4A8Config: routing + the tokens' quantization (one launch up to 1024
    pairs, else the routing's 3 kernels + memset and the quantization apart), GEMM1, GEMM2 with the
    top-k sum (+ its memset when atomic). costs: {"gemm1": LoopCost, "gemm2": LoopCost}
    (k3nvfp4.kernels.costs); weight_block: the weights' block (16 NVFP4, 32 MXFP4)."""
    routing = expected_routing(shard, M, config.block_m)
    kernels = [w4a8_gemm(device, shard, M, config, kind, costs[kind], routing, weight_block, assumptions)
               for kind in ("gemm1", "gemm2")]
    n_routing, routing_s = routing_launches(shard, M, assumptions)
    launches = n_routing + (0 if n_routing == 1 else 1)  # the quantization shares the one-program routing's launch
    launches += 1 if config.atomic_reduce else 0
    # The quantization streams x once (read 2 B, write E4M3 + scales) at the copy bandwidth.
    quant_s = M * shard.hidden * (2 + ACT_BYTES) / device.hbm_copy_bytes_per_s
    fixed = routing_s + quant_s + launches * assumptions.launch_s
    name = "k3nvfp4 e4m3" + (" mxfp4" if weight_block == 32 else "")
    return CallPrediction(name, device.name, shard.name, M, kernels, routing, fixed, launches)
