"""Fused NVFP4 gated MoE (SiTU / SiLU) in Triton: W4A16, FP4 weights dequantized in registers.

One call = routing alignment (3 small Triton kernels + a memset, no host sync) + GEMM1 with the gated activation fused in
its epilogue (+ a small activation kernel when GEMM1 is split over K) + GEMM2 with scale_2,
routing weight and the top-k reduction. Every buffer is sized by the worst case, nothing reads
device values on the host, so the whole call can be captured in a CUDA graph.

Kernel design (moe_details/kernels.py):
- tokens of one expert are grouped into block_m-row blocks (routing.py); program (b, n, s)
  computes a block x column tile x K slice. Blocks past the used rows exit immediately.
- GEMM1 computes gate rows n and up rows I + n of the same expert in one program, applies the
  per-half scale_2 to the fp32 accumulators, then SiTU/SiLU, and stores the intermediate in the
  activation dtype (bf16 for bf16 inputs) - the "intermediate rounded to the activation dtype".
- swap_ab: accumulator is W x X^T, i.e. weight rows on the MMA M side and tokens on N: at decode
  a block has 1-16 real tokens, and Hopper's wgmma wants M >= 64.
- split-K: GEMM1 writes fp32 partials and a second kernel sums them in a fixed order before the
  activation (nonlinear, so it must come after the sum); GEMM2 adds with fp32 atomics.
- reduction over top-k: deterministic by default (fp32 [M*k, H] rows, summed over k in a fixed
  order); MoEConfig.atomic_reduce adds straight into fp32 [M, H] (less traffic; order not fixed).
  ``deterministic=True`` forces split_k2 = 1 and the store path whatever the config.
"""

from __future__ import annotations

import dataclasses

import torch
import triton.language as tl

from .interpreter import kernels_interpreted
from .moe_details import kernels as _k
from .moe_details.config import MoEConfig, get_moe_config
from .moe_details.routing import align_routing_triton
from .moe_details.validate import validate_moe_inputs
from .moe_details.weights import NVFP4MoEWeights
from .moe_reference import fused_moe_nvfp4_reference

__all__ = ["MoEConfig", "NVFP4MoEWeights", "fused_moe_nvfp4", "fused_moe_nvfp4_reference"]

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def fused_moe_nvfp4(
    hidden_states: torch.Tensor,
    weights: NVFP4MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "situ",
    situ_beta: float = 4.0,
    situ_linear_beta: float | None = 25.0,
    routed_scaling_factor: float | None = None,
    out: torch.Tensor | None = None,
    config: MoEConfig | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Routed experts of one MoE layer.

    hidden_states: [M, H] bfloat16 / float16 (float32 accepted, computed with fp32 dots);
    weights: NVFP4MoEWeights (E experts, H, I); topk_weights: float32 [M, k];
    topk_ids: int32/int64 [M, k], ids outside [0, E) (-1: expert on another rank) contribute
    nothing. activation: "situ" (beta=situ_beta, linear cap situ_linear_beta, None = no cap) or
    "silu". The weighted sum over k is multiplied by routed_scaling_factor (None = 1), as SGLang
    does after its moe_sum. out: optional [M, H] destination in hidden_states' dtype.
    config: launch config overriding the tuned/heuristic lookup (the tuner passes it).
    Returns [M, H] in hidden_states' dtype.
    """
    validate_moe_inputs(hidden_states, weights, topk_weights, topk_ids, activation, out)
    device = hidden_states.device
    interp = kernels_interpreted()
    if device.type != "cuda" and not interp:
        raise RuntimeError(
            f"fused_moe_nvfp4: tensors are on {device}; the Triton kernels need a CUDA device, or "
            "TRITON_INTERPRET=1 (set before triton is imported) to run on CPU. "
            "fused_moe_nvfp4_reference is the plain-torch version."
        )
    M, H = hidden_states.shape
    k = topk_ids.shape[1]
    E, I = weights.num_experts, weights.intermediate_size
    dtype = hidden_states.dtype
    if M == 0:
        return out if out is not None else torch.empty(0, H, dtype=dtype, device=device)

    if config is None:
        config = get_moe_config(E, H, I, k, M)
    if deterministic and (config.split_k2 > 1 or config.atomic_reduce):
        config = dataclasses.replace(config, split_k2=1, atomic_reduce=False)

    # The interpreter's tl.dot on 16-bit operands is wrong (FACTS.md): fp32 dots there. fp32
    # inputs get IEEE fp32 dots (no TF32) so that the exact tests mean something on a GPU.
    dot_f32 = interp or dtype == torch.float32
    dot_dtype = tl.float32 if dot_f32 else _TL_DTYPE[dtype]
    precision = "ieee" if dot_f32 else None
    act = _k.ACT_SITU if activation == "situ" else _k.ACT_SILU
    has_lb = activation == "situ" and situ_linear_beta is not None
    beta = float(situ_beta)
    lb = float(situ_linear_beta) if has_lb else 1.0

    routing = align_routing_triton(topk_ids, E, config.block_m)
    num_pairs = M * k
    max_blocks, max_padded = routing.max_blocks, routing.max_padded
    tw = topk_weights.contiguous()

    # GEMM1 (+ activation) -> intermediate [max_padded, I] in the activation dtype.
    inter = torch.empty(max_padded, I, dtype=dtype, device=device)
    grid1 = (max_blocks, _cdiv(I, config.block_n1), config.split_k1)
    if config.split_k1 > 1:
        part = torch.empty(config.split_k1, max_padded, 2 * I, dtype=torch.float32, device=device)
        target1 = part
    else:
        target1 = inter
    _k.gemm1_gated_kernel[grid1](
        hidden_states, hidden_states.stride(0), hidden_states.stride(1),
        weights.w13, weights.w13_scale, weights.w13_scale_2, weights.w13_k_tiles,
        target1,
        routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        num_pairs, k, H, I,
        beta, lb,
        ACT=act, HAS_LINEAR_BETA=has_lb,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n1, BLOCK_K=config.block_k1, SPLIT_K=config.split_k1,
        SWAP_AB=config.swap_ab, DOT_DTYPE=dot_dtype, PRECISION=precision, USE_ASM=not interp,
        EVEN_K=H % config.block_k1 == 0,
        num_warps=config.num_warps1, num_stages=config.num_stages1,
    )
    if config.split_k1 > 1:
        act_bn = min(64, _next_pow2(I))
        _k.gated_activation_kernel[(max_blocks, _cdiv(I, act_bn))](
            part, inter, routing.num_padded, I, max_padded,
            beta, lb,
            ACT=act, HAS_LINEAR_BETA=has_lb, SPLIT_K=config.split_k1,
            BLOCK_M=config.block_m, BLOCK_N=act_bn,
            num_warps=4,
        )

    # GEMM2 x scale_2 x routing weight, reduced over top-k.
    row_is_token = config.atomic_reduce
    use_atomic = row_is_token or config.split_k2 > 1
    if row_is_token:
        acc = torch.zeros(M, H, dtype=torch.float32, device=device)
    elif use_atomic:  # split-K adds into per-pair rows; rows of dropped pairs stay unread
        acc = torch.zeros(num_pairs, H, dtype=torch.float32, device=device)
    else:  # plain stores; rows of dropped pairs are skipped by the combine kernel
        acc = torch.empty(num_pairs, H, dtype=torch.float32, device=device)
    grid2 = (max_blocks, _cdiv(H, config.block_n2), config.split_k2)
    _k.gemm2_combine_kernel[grid2](
        inter,
        weights.w2, weights.w2_scale, weights.w2_scale_2, weights.w2_k_tiles,
        tw, acc,
        routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        num_pairs, k, H, I, 1.0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n2, BLOCK_K=config.block_k2, SPLIT_K=config.split_k2,
        SWAP_AB=config.swap_ab, DOT_DTYPE=dot_dtype, PRECISION=precision, USE_ASM=not interp,
        EVEN_K=I % config.block_k2 == 0, USE_ATOMIC=use_atomic, ROW_IS_TOKEN=row_is_token,
        num_warps=config.num_warps2, num_stages=config.num_stages2,
    )
    scale = 1.0 if routed_scaling_factor is None else float(routed_scaling_factor)
    if out is None:
        out = torch.empty(M, H, dtype=dtype, device=device)
    if row_is_token:
        # SGLang multiplies the summed output by routed_scaling_factor (moe_sum then mul).
        out.copy_(acc * scale if routed_scaling_factor is not None else acc)
        return out
    block_h = min(1024, _next_pow2(H))
    _k.combine_topk_kernel[(M, _cdiv(H, block_h))](
        acc, topk_ids, topk_ids.stride(0), topk_ids.stride(1), out, out.stride(0), out.stride(1),
        k, H, E, scale,
        BLOCK_H=block_h, num_warps=4,
    )
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()
