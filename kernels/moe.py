"""Fused NVFP4 gated MoE (SiTU / SiLU) in Triton: W4A16, FP4 weights dequantized in registers.

One call = 3 launches up to 1024 (token, slot) pairs (K3 decode: M <= 64 at top-16), no memset,
no host sync: routing alignment in one program, GEMM1 with the gated activation fused in its
epilogue, GEMM2 with scale_2, routing weight, the top-k sum, routed_scaling_factor and the cast
to the output. Above 1024 pairs the routing takes 3 kernels + a memset; atomic_reduce adds a
memset of its fp32 accumulator. Every buffer is sized by the worst case, nothing reads device
values on the host, so the whole call can be captured in a CUDA graph.

fused_moe_nvfp4 is the one public entry point of every mode (kernels/modes.py): the prepared
weights choose the kernels. NVFP4MoEWeights run the W4A16 kernels of this module;
FP4MMAWeights prepared for act_quant="nvfp4" / "mxfp8" run the FP4 tensor-core kernels of
moe_fp4.py (Blackwell's block-scaled MMA); W4A8MoEWeights (act_quant="e4m3") run the Hopper W4A8
kernels of moe_w4a8.py (FP8 wgmma). No call converts one mode's weights into another's.

Kernel design (moe_details/kernels.py):
- tokens of one expert are grouped into block_m-row blocks (routing.py); program (b, n, s)
  computes a block x column tile x K slice. Blocks past the used rows exit immediately.
- GEMM1 computes gate rows n and up rows I + n of the same expert in one program, applies the
  per-half scale_2 to the fp32 accumulators, then SiTU/SiLU, and stores the intermediate in the
  activation dtype (bf16 for bf16 inputs) - the "intermediate rounded to the activation dtype".
- swap_ab: accumulator is W x X^T, i.e. weight rows on the MMA M side and tokens on N: at decode
  a block has 1-16 real tokens, and Hopper's wgmma wants M >= 64.
- arrival counters instead of extra launches: a program stores its fp32 result, then counts
  itself on an int32 counter (barrier + acq_rel atomic; the counters are zeroed by the routing
  launch, earlier on the stream). The program that arrives last finishes the work, reading the
  others' results in a FIXED order; nobody waits, so programs need not be co-resident.
  GEMM1 split over K: the last K slice of a (block, column tile) sums the slices in slice order
  and applies the activation. GEMM2: the last arrival for a (token, column tile) sums the
  token's per-(slice, slot) fp32 rows in slot order, scales, casts and writes the output.
- reduction over top-k: deterministic by default (fp32 [split_k2, M*k, H] rows, summed in a
  fixed order, bitwise reproducible whatever the order programs run in); MoEConfig.atomic_reduce
  adds straight into fp32 [M, H] (less traffic at large M; order not fixed).
  ``deterministic=True`` forces the store path whatever the config.
"""

from __future__ import annotations

import dataclasses

import torch
import triton.language as tl

from .activation import K3_SITU, GatedActivation
from .interpreter import kernels_interpreted
from .moe_details import kernels as _k
from .moe_details.config import MoEConfig, get_moe_config
from .moe_details.routing import align_routing_triton, max_padded_blocks
from .moe_details.skeleton import arrival_counters, split_k_partials, top_k_buffer
from .moe_details.validate import validate_moe_inputs
from .moe_details.weights import NVFP4MoEWeights
from .moe_fp4 import FP4MMAWeights, fused_moe_fp4
from .moe_reference import fused_moe_nvfp4_reference
from .moe_w4a8 import W4A8MoEWeights, fused_moe_w4a8
from .modes import W4A8_E4M3, W4A16, mode_of

__all__ = ["FP4MMAWeights", "MoEConfig", "NVFP4MoEWeights", "W4A8MoEWeights", "fused_moe_nvfp4",
           "fused_moe_nvfp4_reference"]

_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def fused_moe_nvfp4(
    hidden_states: torch.Tensor,
    weights: NVFP4MoEWeights | FP4MMAWeights | W4A8MoEWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: GatedActivation = K3_SITU,
    routed_scaling_factor: float | None = None,
    out: torch.Tensor | None = None,
    config=None,
    deterministic: bool = False,
    input_scale: float | torch.Tensor | None = None,
    num_global_experts: int | None = None,
) -> torch.Tensor:
    """Routed experts of one MoE layer, in the mode its weights were prepared for.

    hidden_states: [M, H] bfloat16 / float16 (float32 accepted, computed with fp32 dots);
    weights: the prepared weights of one mode (E experts, H, I; kernels/modes.py):
    NVFP4MoEWeights (W4A16, this module's kernels) or FP4MMAWeights with act_quant "nvfp4"
    (W4A4: NVFP4 activations and intermediate) or "mxfp8" (W4A8: MXFP8 activations against
    MXFP4 weights), which :func:`k3nvfp4.kernels.moe_fp4.fused_moe_fp4` runs, or W4A8MoEWeights
    (act_quant "e4m3": Hopper W4A8, :func:`k3nvfp4.kernels.moe_w4a8.fused_moe_w4a8`); topk_weights: float32 [M, k];
    topk_ids: int32/int64 [M, k], ids outside [0, E) (-1: expert on another rank) contribute
    nothing. activation: a GatedActivation (SiTU with its beta and linear cap, or SiLU; default
    Kimi-K3's situ(4, 25)). The weighted sum over k is multiplied by routed_scaling_factor (None = 1), as SGLang
    does after its moe_sum. out: optional [M, H] destination in hidden_states' dtype.
    config: launch config overriding the tuned/heuristic lookup (the tuner passes it): the
    mode's config class (MoEConfig for W4A16, FP4MoEConfig for the FP4 modes, W4A8Config for e4m3).
    input_scale: the static NVFP4 activation scale (W4A4 only; None = dynamic per token).
    deterministic: the top-k sum in a fixed order whatever the config.
    num_global_experts: the experts topk_ids range over, when this rank holds E of them (expert
    parallelism; None = E). Only the launch-config choice uses it (both paths): ~E /
    num_global_experts of the pairs are local, and the tiles are sized for those.
    Returns [M, H] in hidden_states' dtype.
    """
    mode = mode_of(weights)
    if config is not None and not isinstance(config, mode.config_type):
        raise TypeError(f"config: the {mode.label} weights (act_quant={mode.name!r}) take a {mode.config_type.__name__}, "
                        f"got {type(config).__name__}")
    if mode is W4A8_E4M3:
        if input_scale is not None:
            raise ValueError("fused_moe_nvfp4: input_scale is the NVFP4 activation scale of the W4A4 weights; the "
                             "e4m3 (W4A8) weights quantize activations per token per 128 columns")
        return fused_moe_w4a8(hidden_states, weights, topk_weights, topk_ids, activation=activation,
                              routed_scaling_factor=routed_scaling_factor, out=out, config=config,
                              num_global_experts=num_global_experts, deterministic=deterministic)
    if mode is not W4A16:
        return fused_moe_fp4(hidden_states, weights, topk_weights, topk_ids, activation=activation,
                             routed_scaling_factor=routed_scaling_factor, input_scale=input_scale, out=out,
                             config=config, num_global_experts=num_global_experts, deterministic=deterministic)
    if input_scale is not None:
        raise ValueError("fused_moe_nvfp4: input_scale is the NVFP4 activation scale of the W4A4 weights "
                         "(FP4MMAWeights, act_quant='nvfp4'); W4A16 weights take unquantized activations")
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
    if num_global_experts is not None and num_global_experts < E:
        raise ValueError(f"fused_moe_nvfp4: num_global_experts={num_global_experts} is below the weights' "
                         f"{E} local experts")
    if M == 0:
        return out if out is not None else torch.empty(0, H, dtype=dtype, device=device)

    if config is None:
        config = get_moe_config(E, H, I, k, M, num_global_experts=num_global_experts,
                                scale_format=weights.scale_format)
    if deterministic and config.atomic_reduce:
        config = dataclasses.replace(config, atomic_reduce=False)

    # The interpreter's tl.dot on 16-bit operands is wrong (docs/facts.md#triton): fp32 dots there. fp32
    # inputs get IEEE fp32 dots (no TF32) so that the exact tests mean something on a GPU.
    dot_f32 = interp or dtype == torch.float32
    dot_dtype = tl.float32 if dot_f32 else _TL_DTYPE[dtype]
    precision = "ieee" if dot_f32 else None
    beta, lb = activation.kernel_args()
    scale = 1.0 if routed_scaling_factor is None else float(routed_scaling_factor)

    num_pairs = M * k
    tiles1, tiles2 = _cdiv(I, config.block_n1), _cdiv(H, config.block_n2)
    max_blocks = max_padded_blocks(num_pairs, E, config.block_m)
    tickets, tickets1, tickets2 = arrival_counters(max_blocks, tiles1, config.split_k1, M, tiles2, device)

    routing = align_routing_triton(topk_ids, E, config.block_m, tickets)
    max_padded = routing.max_padded
    tw = topk_weights.contiguous()

    # GEMM1 (+ activation) -> intermediate [max_padded, I] in the activation dtype.
    inter = torch.empty(max_padded, I, dtype=dtype, device=device)
    part = split_k_partials(config.split_k1, max_padded, I, inter)
    _k.gemm1_gated_kernel[(max_blocks, tiles1, config.split_k1)](
        hidden_states, hidden_states.stride(0), hidden_states.stride(1),
        weights.w13, weights.w13_scale, weights.w13_scale_2, weights.w13_k_tiles,
        inter, part, tickets1,
        routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        num_pairs, k, H, I,
        beta, lb,
        ACT=activation.kernel_id, HAS_LINEAR_BETA=activation.has_linear_beta,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n1, BLOCK_K=config.block_k1, SPLIT_K=config.split_k1,
        SWAP_AB=config.swap_ab, DOT_DTYPE=dot_dtype, PRECISION=precision, USE_ASM=not interp,
        EVEN_K=H % config.block_k1 == 0, SCALE_FMT=weights.scale_format.kernel_id,
        PER_WORD=_k.per_word_scales(config.num_warps1),
        num_warps=config.num_warps1, num_stages=config.num_stages1,
    )

    # GEMM2 x scale_2 x routing weight, summed over top-k, x routed_scaling_factor, cast: out.
    buf = top_k_buffer(config.atomic_reduce, config.split_k2, M, num_pairs, H, device)
    if out is None:
        out = torch.empty(M, H, dtype=dtype, device=device)
    _k.gemm2_combine_kernel[(max_blocks, tiles2, config.split_k2)](
        inter,
        weights.w2, weights.w2_scale, weights.w2_scale_2, weights.w2_k_tiles,
        tw, topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        buf, out, out.stride(0), out.stride(1), tickets2,
        routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        num_pairs, k, E, H, I, scale,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n2, BLOCK_K=config.block_k2, SPLIT_K=config.split_k2,
        SWAP_AB=config.swap_ab, DOT_DTYPE=dot_dtype, PRECISION=precision, USE_ASM=not interp,
        EVEN_K=I % config.block_k2 == 0, ATOMIC=config.atomic_reduce, SCALE_FMT=weights.scale_format.kernel_id,
        PER_WORD=_k.per_word_scales(config.num_warps2),
        num_warps=config.num_warps2, num_stages=config.num_stages2,
    )
    return out


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
