"""Fused NVFP4 / MXFP4-weight gated MoE for Hopper, W4A8 ("e4m3"): 4-bit weights expanded exactly to
E4M3 in registers, FP8 activations, E4M3 x E4M3 ``tl.dot`` (FP8 wgmma on sm90).

The numerics (docs/w4a8.md, moe_w4a8_details/kernels.py): weights as W4A8MoEWeights prepared at
load (E2M1 nibbles, one exponent offset per block, one fp32 factor per row: exact inside each
row's 14-binade window, out-of-window blocks re-encoded and counted); each token quantized once
(for all its experts) to E4M3 with one fp32 scale amax / 448 per 128 columns; GEMM1's fp32
accumulator promoted once per 128 K with the tokens' scales, SiTU / SiLU in fp32, the
intermediate quantized the same way per 128 output columns in GEMM1's epilogue; GEMM2 likewise,
then the routing weight, the top-k sum and the cast.

One call on the MoE skeleton shared with the other families (moe_details/skeleton.py): up to
1024 (token, slot) pairs ONE first launch aligns the routing in its program 0 and quantizes the
tokens in the others; then GEMM1 (+ activation + intermediate quantization) and GEMM2 (+ top-k sum
by each token's last arrival). 3 launches; above 1024 pairs the routing takes 3 kernels + a
memset and the quantization one launch. No host synchronisation (CUDA-graph capturable).

Where it runs: sm89 / sm90 and newer (FP8 ``tl.dot``; on sm90 ``wgmma ... e4m3.e4m3``,
the static report's e4m3 rows, tests/test_launch_configs.py), or Triton's interpreter. On a GPU the weights are
expanded by moe_details/e4m3_expand.py's per-block table + PRMT lookup (inline PTX on weights
stored in wgmma's fragment order, about 2 thread instructions per weight in GEMM1's sm90 loop), in
the interpreter by its plain-Triton twin (the same bits). No GPU
speed is measured, so this mode is selectable, not the default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .activation import K3_SITU, GatedActivation
from .interpreter import interpret_requested
from .moe_details.routing import SMALL_NUM_WARPS, AlignedRouting, align_routing_triton, max_padded_blocks, small_routing_launch
from .moe_details.skeleton import arrival_counters, split_k_partials, top_k_buffer
from .moe_details.validate import validate_moe_inputs
from .moe_w4a8_details import kernels as _k
from .moe_w4a8_details.config import ACT_GROUP, W4A8Config, get_w4a8_config
from .moe_w4a8_details.weights import W4A8_PREPARE_HINT, W4A8MoEWeights
from .target import capability

__all__ = ["W4A8Config", "W4A8MoEWeights", "W4A8Run", "check_w4a8_supported", "fused_moe_w4a8", "run_w4a8"]


def check_w4a8_supported(device: torch.device) -> None:
    """Raise a clear error where the W4A8 kernels cannot run on ``device``: a CUDA GPU with FP8
    ``tl.dot`` (sm89 or newer), or the CPU with TRITON_INTERPRET=1 set before triton's import."""
    if device.type != "cuda":
        if not interpret_requested() or type(_k.w4a8_gemm1_kernel).__name__ != "InterpretedFunction":
            raise RuntimeError(
                f"fused_moe_w4a8: tensors are on {device}; the Triton kernels need a CUDA device, or "
                "TRITON_INTERPRET=1 set before triton is imported. fused_moe_w4a8_reference is the plain-torch version."
            )
        return
    major, minor = capability(device)
    if (major, minor) < (8, 9):
        raise RuntimeError(f"fused_moe_w4a8: the W4A8 mode (act_quant='e4m3') needs FP8 MMA (sm89 / sm90 or "
                           f"newer), got sm{major}{minor}; use act_quant='none' (W4A16)")


@dataclass(frozen=True)
class W4A8Run:
    """One call's output and what it computed on the way (for tests and diagnostics):
    out [M, H]; the tokens' E4M3 [M, H] and fp32 scales [M, cdiv(H, 128)]; the intermediate's
    E4M3 [max_padded, I] and fp32 scales [max_padded, cdiv(I, 128)] in the routing's sorted order
    (routing.sorted_pair_ids: row -> pair token x k + slot; rows of padding hold token 0's values;
    row block b = rows b x config.block_m .. belongs to expert routing.block_expert_ids[b])."""

    out: torch.Tensor
    act_q: torch.Tensor
    act_scales: torch.Tensor
    inter_q: torch.Tensor
    inter_scales: torch.Tensor
    routing: AlignedRouting | None  # None for M = 0
    config: W4A8Config | None  # the launch config used (None for M = 0)


def fused_moe_w4a8(
    hidden_states: torch.Tensor,
    weights: W4A8MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: GatedActivation = K3_SITU,
    routed_scaling_factor: float | None = None,
    out: torch.Tensor | None = None,
    config: W4A8Config | None = None,
    num_global_experts: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Routed experts of one MoE layer in the W4A8 mode (same contract as fused_moe_nvfp4).

    hidden_states [M, H] bfloat16 / float16 / float32 (last dim contiguous); weights:
    W4A8MoEWeights (H and I multiples of 64); topk_weights float32 [M, k]; topk_ids int32/int64
    [M, k], ids outside [0, E) contribute nothing; activation: a GatedActivation; out: optional
    [M, H] in hidden_states' dtype; config: overrides W4A8Config.heuristic; num_global_experts:
    the experts topk_ids range over under expert parallelism (sizes the tiles); deterministic:
    the top-k sum in slot order whatever the config. Returns [M, H] in hidden_states' dtype.
    """
    return run_w4a8(hidden_states, weights, topk_weights, topk_ids, activation=activation,
                    routed_scaling_factor=routed_scaling_factor, out=out, config=config,
                    num_global_experts=num_global_experts, deterministic=deterministic).out


def run_w4a8(
    hidden_states: torch.Tensor,
    weights: W4A8MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: GatedActivation = K3_SITU,
    routed_scaling_factor: float | None = None,
    out: torch.Tensor | None = None,
    config: W4A8Config | None = None,
    num_global_experts: int | None = None,
    deterministic: bool = False,
) -> W4A8Run:
    """fused_moe_w4a8, returning its quantized tokens and intermediate too (W4A8Run)."""
    validate_moe_inputs(hidden_states, weights, topk_weights, topk_ids, activation, out, weights_type=W4A8MoEWeights,
                        prepare_hint=W4A8_PREPARE_HINT, unit_stride=True)
    device = hidden_states.device
    check_w4a8_supported(device)
    M, H = hidden_states.shape
    k = topk_ids.shape[1]
    E, I = weights.num_experts, weights.intermediate_size
    if num_global_experts is not None and num_global_experts < E:
        raise ValueError(f"fused_moe_w4a8: num_global_experts={num_global_experts} is below the weights' "
                         f"{E} local experts")
    if out is None:
        out = torch.empty(M, H, dtype=hidden_states.dtype, device=device)
    if M == 0:
        empty = torch.empty(0, dtype=torch.float8_e4m3fn, device=device)
        return W4A8Run(out, empty, empty.float(), empty, empty.float(), None, None)
    cfg = config or get_w4a8_config(E, H, I, k, M, num_global_experts=num_global_experts,
                                    weight_block=weights.block, tables=(weights.w13_table, weights.w2_table))
    cfg.check(H, I)
    ng_h, ng_i = -(-H // ACT_GROUP), -(-I // ACT_GROUP)
    aq = torch.empty(M, H, dtype=torch.float8_e4m3fn, device=device)
    asc = torch.empty(M, ng_h, dtype=torch.float32, device=device)
    tiles1, tiles2 = triton.cdiv(I, cfg.block_n1), triton.cdiv(H, cfg.block_n2)
    num_pairs = M * k
    max_blocks = max_padded_blocks(num_pairs, E, cfg.block_m)
    tickets, tickets1, tickets2 = arrival_counters(max_blocks, tiles1, cfg.split_k1, M, tiles2, device)

    # 1. Routing alignment + each token quantized once (reused by all its k experts).
    small = small_routing_launch(topk_ids, E, cfg.block_m, tickets)
    if small is not None:  # one launch: program 0 routes, programs 1 .. M quantize
        routing, args, consts = small
        _k.route_quant_kernel[(1 + M,)](*args, hidden_states, hidden_states.stride(0), aq, asc, H, **consts,
                                        num_warps=SMALL_NUM_WARPS)
    else:
        routing = align_routing_triton(topk_ids, E, cfg.block_m, tickets)
        _k.quant_rows_kernel[(M,)](hidden_states, hidden_states.stride(0), aq, asc, H, num_warps=4)
    P = routing.max_padded
    iq = torch.empty(P, I, dtype=torch.float8_e4m3fn, device=device)
    isc = torch.empty(P, ng_i, dtype=torch.float32, device=device)

    # 2. GEMM1 + activation + the intermediate's quantization per 128 columns.
    part = split_k_partials(cfg.split_k1, P, I, iq)
    beta, linear_beta = activation.kernel_args()
    _k.w4a8_gemm1_kernel[(max_blocks, tiles1, cfg.split_k1)](
        aq, asc, weights.w13, weights.w13_offsets, weights.w13_row_scale, iq, isc, part, tickets1,
        routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        num_pairs, k, H, I, beta, linear_beta,
        ACT=activation.kernel_id, HAS_LINEAR_BETA=activation.has_linear_beta, WB=weights.block,
        NORMAL=weights.w13_table == "normal",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1, SPLIT_K=cfg.split_k1,
        num_warps=cfg.num_warps1, num_stages=cfg.num_stages,
    )

    # 3. GEMM2 x row factors x routing weight, the top-k sum by each token's last arrival, the cast.
    atomic = cfg.atomic_reduce and not deterministic
    buf = top_k_buffer(atomic, cfg.split_k2, M, num_pairs, H, device)
    _k.w4a8_gemm2_kernel[(max_blocks, tiles2, cfg.split_k2)](
        iq, isc, weights.w2, weights.w2_offsets, weights.w2_row_scale,
        topk_weights.contiguous(), topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        buf, out, out.stride(0), out.stride(1), tickets2,
        routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        num_pairs, k, E, H, I, 1.0 if routed_scaling_factor is None else float(routed_scaling_factor),
        WB=weights.block, NORMAL=weights.w2_table == "normal", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2,
        BLOCK_K=cfg.block_k2,
        SPLIT_K=cfg.split_k2, ATOMIC=atomic, num_warps=cfg.num_warps2, num_stages=cfg.num_stages,
    )
    return W4A8Run(out, aq, asc, iq, isc, routing, cfg)
