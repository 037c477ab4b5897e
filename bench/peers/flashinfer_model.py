"""FlashInfer 0.7.2's SM90 CUTLASS W4A16 MoE (MXFP4 weights x bf16, SiTU) under the project's static
performance model.

One ``cutlass_fused_moe(..., use_w4_group_scaling=True)`` call is 11 launches (flashinfer_sass:
3 sort kernels, permute, strides, a work-tile map and the grouped GEMM per GEMM, the activation,
finalize). Each grouped GEMM runs FlashInfer's untuned default tactic, the 64x16x128 pingpong
tile (flashinfer_sass.TILES[0]) with the weights on the 64-row side and tokens on the 16 side:
an expert with X local pairs is ceil(rows / 64) x ceil(X / 16) tiles of K / 128 loop passes,
on a persistent grid (one 205 KiB CTA per SM). Bytes: nibbles + one E8M0 per 32 (0.53125 per
weight). The nine small kernels are charged a launch, an HBM latency and their bytes.

Not modelled: the pingpong overlap of two consumer warpgroups (counted as one program per tile),
the autotuner's choice of another tile, the first and last K tile outside the SASS loop.
"""

from __future__ import annotations

from typing import Any

from k3nvfp4.kernels import perf_model as pm


def _gemm(device: pm.Device, statics: dict[str, Any], shard: pm.Shard, gemm: str, M: int,
          routing: pm.RoutingEstimate, a: pm.Assumptions) -> pm.KernelPrediction:
    H, I = shard.hidden, shard.intermediate
    tile = statics["tile"]
    rows, K = (2 * I, H) if gemm == "gemm1" else (H, I)
    row_tiles = -(-rows // tile["M"])
    passes = -(-K // tile["K"])
    tiles = row_tiles * routing.blocks  # routing at block_m = tile N (16 tokens)
    warps = statics["num_warps"]
    # All loop warps' instructions of one pass (4 consumer + 1 producer), spread over the CTA's
    # warps so that LoopCost's instructions x warps is the pass's total.
    per_pass = statics["warp_instr_per_weight"] * statics["weights_per_iteration"]
    cost = pm.LoopCost(per_pass / warps, warps, statics["registers"], statics["shared_bytes"], statics["local_bytes"])
    bpw = statics["bytes_per_weight"]
    useful = routing.active_experts * rows * K
    tokens = routing.local_pairs
    other = (M * H * 2 + tokens * 2 * I * 2) if gemm == "gemm1" else (tokens * I * 2 + tokens * H * 2)
    return pm.predict_kernel(
        device, name=f"flashinfer {gemm}", config=f"{tile['M']}x{tile['N']}x{tile['K']} {tile['schedule']}", cost=cost,
        programs_launched=device.sms, programs_active=tiles, iterations_per_program=passes,
        iterations_total=tiles * passes, weights_per_iteration=tile["M"] * tile["K"], useful_weights=useful,
        useful_passes=routing.blocks * rows * K, weight_bytes=useful * bpw, other_bytes=other,
        stage_bytes=tile["M"] * tile["K"] * bpw, stages=tile["stages"],
        mma_flops=2.0 * tiles * passes * tile["M"] * tile["K"] * tile["N"], assumptions=a,
    )


def flashinfer_call(device: pm.Device, statics: list[dict[str, Any]], shard: pm.Shard, M: int,
                    a: pm.Assumptions = pm.DEFAULT_ASSUMPTIONS) -> pm.CallPrediction:
    """One cutlass_fused_moe call under the model (statics: flashinfer_sass.flashinfer_rows()).
    Raises RuntimeError where FlashInfer cannot run the shard (H and I must be multiples of 128)."""
    if shard.hidden % 128 or shard.intermediate % 128:
        raise RuntimeError(f"needs H % 128 == 0 and I % 128 == 0 (isProfileShapeSupported); "
                           f"this shard has H = {shard.hidden}, I = {shard.intermediate}")
    default = statics[0]  # the untuned default tactic
    routing = pm.expected_routing(shard, M, default["tile"]["N"])
    kernels = [_gemm(device, default, shard, g, M, routing, a) for g in ("gemm1", "gemm2")]
    launches = default["launches_per_call"] - 2
    pairs = routing.local_pairs
    small_bytes = (2 * pairs * shard.hidden * 2  # permute: rows gathered in, expanded out
                   + pairs * 2 * shard.intermediate * 2 + pairs * shard.intermediate * 2  # activation
                   + pairs * shard.hidden * 2 + M * shard.hidden * 2)  # finalize
    fixed = launches * (a.launch_s + a.hbm_latency_s) + small_bytes / device.hbm_copy_bytes_per_s
    return pm.CallPrediction("flashinfer", device.name, shard.name, M, kernels, routing, fixed, launches,
                             notes=[f"tile {default['tile']}"])
