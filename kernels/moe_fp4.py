"""Fused NVFP4-weight gated MoE on the block-scaled FP4 tensor cores (``tl.dot_scaled``).

Two activation-quantization modes of one kernel family (moe_fp4_details/kernels.py):
- act_quant="nvfp4" (W4A4): activations NVFP4 (E2M1, E4M3 per 16, one fp32 scale per token row,
  applied to the fp32 accumulator), dynamic by default (kernels/act_quant.py gives the exact rule)
  or with a static scale (the W4A4 checkpoint's input_scale). The SiTU intermediate is quantized
  to NVFP4 for GEMM2: with situ and linear_beta set, every SiTU output lies in (-beta *
  linear_beta, beta * linear_beta) = (-100, 100) for K3, so GEMM1's epilogue quantizes it with
  the static row scale beta * linear_beta / 2688 (no block can overflow E4M3; blocks below
  2^-10 x 6 x that scale flush to zero); silu and uncapped situ have no bound, so GEMM1 stores
  the fp32 intermediate and a row kernel quantizes it with a dynamic per-row scale (one more
  launch). intermediate_scale="dynamic" picks that path for bounded SiTU too.
- act_quant="mxfp8" (W4A8, Kimi-K3's native numerics): activations and intermediate MXFP8 (E4M3,
  E8M0 per 32, quantized per 32-block, fused into GEMM1's epilogue for the intermediate) against
  MXFP4 weights, whose E8M0 scales are recovered exactly from the NVFP4 tensors (FP4MMAWeights).
One call on the MoE skeleton shared with the W4A16 kernels (moe_details/skeleton.py): up to 1024
(token, slot) pairs ONE first launch aligns the routing in its program 0 and quantizes each token
once (for all its k experts) in the others; GEMM1 (+ activation + intermediate quantization,
split over K when the static model says it fills the GPU better), [row quantization of a dynamic
NVFP4 intermediate], GEMM2 (x routing weight, split over K, the top-k sum by each token's last
arrival - in slot order, or at prefill sizes by fp32 atomics and one memset - and the cast to the
output). 3 launches (4 with the dynamic NVFP4 intermediate); above 1024 pairs the routing takes 3
kernels + a memset and the quantization one launch. No host synchronisation, so a call can be captured in a CUDA graph.

On sm100/sm103 ``tl.dot_scaled`` lowers to tcgen05 block-scaled MMA (kind::mxf4nvf4 block16 /
kind::mxf8f6f4 block32, tests/test_moe_fp4_compile.py); on other GPUs Triton decomposes it (wgmma
on sm90) when the installed Triton can (else a clear error); in the interpreter "mxfp8" runs
``tl.dot_scaled`` (Triton >= 3.8) and "nvfp4" the kernels' own decomposition, because Triton 3.8's
interpreter decodes E4M3 scales as E8M0.
"""

from __future__ import annotations

import torch
import triton

from .activation import K3_SITU, GatedActivation
from .interpreter import interpret_requested
from .moe_details.routing import SMALL_NUM_WARPS, align_routing_triton, max_padded_blocks, small_routing_launch
from .moe_details.skeleton import arrival_counters, split_k_partials, top_k_buffer
from .moe_fp4_details import kernels as _k
from .moe_fp4_details.config import FP4MoEConfig
from .moe_details.validate import validate_moe_inputs
from .moe_fp4_details.validate import ACT_QUANT_MODES, input_scale_value, intermediate_is_static
from .moe_fp4_details.weights import FP4_PREPARE_HINT, E8M0RecoveryError, FP4MMAWeights
from .target import capability, model_device_name, triton_version

__all__ = ["ACT_QUANT_MODES", "E8M0RecoveryError", "FP4MMAWeights", "FP4MoEConfig", "check_fp4_mode_supported",
           "fused_moe_fp4"]

_MODE = {"nvfp4": _k.MODE_NVFP4, "mxfp8": _k.MODE_MXFP8}
# First Triton release whose dot_scaled decomposition (non-Blackwell GPUs) takes E4M3 block
# scales per 16 (NVFP4, triton PR 9772; 3.6 predates it, docs/facts.md#triton).
_NVFP4_DECOMPOSED_MIN_TRITON = (3, 7)
_INTERPRETER_MIN_TRITON = (3, 8)  # tl.dot_scaled in the interpreter


def check_fp4_mode_supported(act_quant: str, device: torch.device) -> bool:
    """Raise a clear error where this Triton / device cannot run the mode; returns EMULATE (True
    only in the interpreter for "nvfp4", module docstring)."""
    if act_quant not in ACT_QUANT_MODES:
        raise ValueError(f"act_quant: expected one of {ACT_QUANT_MODES}, got {act_quant!r}")
    version = triton_version()
    if device.type != "cuda":
        if not interpret_requested() or type(_k.fp4_gemm1_kernel).__name__ != "InterpretedFunction":
            raise RuntimeError(
                f"fused_moe_fp4: tensors are on {device}; the Triton kernels need a CUDA device, or "
                "TRITON_INTERPRET=1 set before triton is imported. fused_moe_fp4_reference is the plain-torch version."
            )
        if version < _INTERPRETER_MIN_TRITON:
            raise RuntimeError(f"fused_moe_fp4: act_quant={act_quant!r} needs Triton >= 3.8 in the interpreter "
                               f"(tl.dot_scaled), installed {triton.__version__}")
        return act_quant == "nvfp4"
    major, _ = capability(device)
    if major < 8:
        raise RuntimeError(f"fused_moe_fp4: act_quant={act_quant!r} needs sm80 or newer, got sm{major}x")
    if major != 10 and act_quant == "nvfp4" and version < _NVFP4_DECOMPOSED_MIN_TRITON:
        raise RuntimeError(
            f"fused_moe_fp4: act_quant='nvfp4' on sm{major}x needs Triton's decomposed NVFP4 dot_scaled "
            f"(E4M3 scales per 16, Triton >= 3.7); installed Triton {triton.__version__} cannot. "
            "Use act_quant='mxfp8', or the W4A16 path (act_quant='none')."
        )
    return False


def fused_moe_fp4(
    hidden_states: torch.Tensor,
    weights: FP4MMAWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: GatedActivation = K3_SITU,
    routed_scaling_factor: float | None = None,
    input_scale: float | torch.Tensor | None = None,
    intermediate_scale: str = "auto",
    out: torch.Tensor | None = None,
    config: FP4MoEConfig | None = None,
    num_global_experts: int | None = None,
    deterministic: bool = False,
) -> torch.Tensor:
    """Routed experts of one MoE layer on the FP4 tensor cores (same contract as fused_moe_nvfp4).

    hidden_states: [M, H] bfloat16 / float16 / float32; weights: FP4MMAWeights prepared at load
    for one mode (FP4MMAWeights.from_modelopt / from_mxfp4(..., act_quant=...)), which is the
    mode this call runs: weights.act_quant "nvfp4" (W4A4) or "mxfp8" (W4A8); H and I must be
    multiples of 64 (whole K tiles for the MMA; W4A16 needs only multiples of 16);
    topk_weights float32 [M, k]; topk_ids int32/int64 [M, k], ids outside [0, E) contribute
    nothing.
    input_scale: static fp32 NVFP4 scale of the GEMM1 activations ("nvfp4" only; e.g. the W4A4
    checkpoint's w13 input_scale, max over experts); None = dynamic per token row.
    intermediate_scale: "auto" (static for situ with linear_beta, else dynamic), "static" or
    "dynamic" ("nvfp4" only; see the module docstring). activation: a GatedActivation. out: optional [M, H] in hidden_states'
    dtype. config: overrides FP4MoEConfig.heuristic (whose split-K the static model picks for
    this GPU's SM count; num_global_experts, under expert parallelism, sizes it for the local
    share of the pairs). deterministic: the top-k sum in slot order whatever the config (the
    heuristic's prefill configs add atomically). Returns [M, H] in hidden_states' dtype.
    """
    validate_moe_inputs(hidden_states, weights, topk_weights, topk_ids, activation, out, weights_type=FP4MMAWeights,
                        prepare_hint=FP4_PREPARE_HINT, unit_stride=True)
    act_quant = weights.act_quant
    device = hidden_states.device
    emulate = check_fp4_mode_supported(act_quant, device)
    mode = _MODE[act_quant]
    M, H = hidden_states.shape
    k = topk_ids.shape[1]
    E, I = weights.num_experts, weights.intermediate_size
    dtype = hidden_states.dtype
    if num_global_experts is not None and num_global_experts < E:
        raise ValueError(f"fused_moe_fp4: num_global_experts={num_global_experts} is below the weights' "
                         f"{E} local experts")
    if out is None:
        out = torch.empty(M, H, dtype=dtype, device=device)
    if M == 0:
        return out
    static_inter = intermediate_is_static(act_quant, intermediate_scale, activation)
    inter_s = activation.nvfp4_static_scale if static_inter else 1.0
    in_s = input_scale_value(input_scale, act_quant)
    cfg = config or FP4MoEConfig.heuristic(E, H, I, k, M, act_quant=act_quant, num_global_experts=num_global_experts,
                                           device_name=model_device_name(device))
    cfg.check(H, I)
    launch = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    tiles1, tiles2 = triton.cdiv(I, cfg.block_n1), triton.cdiv(H, cfg.block_n2)
    num_pairs = M * k

    max_blocks = max_padded_blocks(num_pairs, E, cfg.block_m)
    tickets, tickets1, tickets2 = arrival_counters(max_blocks, tiles1, cfg.split_k1, M, tiles2, device)

    # 1. Routing alignment + each token quantized once (reused by all its k experts).
    aq, asc, ars = _quant_buffers(mode, M, H, device)
    quant_args = (hidden_states, hidden_states.stride(0), aq, asc, ars)
    quant_consts = dict(MODE=mode, STATIC=in_s is not None, BLOCK_K=_row_block(H))
    scale_in = in_s if in_s is not None else 1.0
    small = small_routing_launch(topk_ids, E, cfg.block_m, tickets)
    if small is not None:  # one launch: program 0 routes, programs 1 .. M quantize
        routing, args, consts = small
        _k.route_quant_kernel[(1 + M,)](*args, *quant_args, H, scale_in, **consts, **quant_consts,
                                        num_warps=SMALL_NUM_WARPS)
    else:
        routing = align_routing_triton(topk_ids, E, cfg.block_m, tickets)
        _k.quant_rows_kernel[(M,)](*quant_args, ars, H, scale_in, HAS_NUM_ROWS=False, **quant_consts, num_warps=4)
    P = routing.max_padded

    # 2. GEMM1 + activation + intermediate quantization.
    iq, isc, irs = _quant_buffers(mode, P, I, device)
    out_f32 = mode == _k.MODE_NVFP4 and not static_inter
    inter_f32 = torch.empty(P, I, dtype=torch.float32, device=device) if out_f32 else iq
    part = split_k_partials(cfg.split_k1, P, I, inter_f32)
    w13_s = weights.w13_scale if mode == _k.MODE_NVFP4 else weights.w13_e8m0
    beta, linear_beta = activation.kernel_args()
    _k.fp4_gemm1_kernel[(max_blocks, tiles1, cfg.split_k1)](
        aq, asc, ars, weights.w13, w13_s, weights.w13_scale_2, iq, isc, inter_f32, part, tickets1,
        routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        num_pairs, k, H, I, beta, linear_beta, inter_s,
        MODE=mode, OUT_F32=out_f32, ACT=activation.kernel_id, HAS_LINEAR_BETA=activation.has_linear_beta,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n1, BLOCK_K=cfg.block_k1, SPLIT_K=cfg.split_k1,
        SWAP_AB=cfg.swap_ab, EMULATE=emulate, **launch,
    )
    if out_f32:  # dynamic per-row NVFP4 scale of the intermediate: needs the whole row
        _k.quant_rows_kernel[(P,)](
            inter_f32, I, iq, isc, irs, routing.num_padded, I, 1.0,
            MODE=mode, STATIC=False, HAS_NUM_ROWS=True, BLOCK_K=_row_block(I), num_warps=4,
        )

    # 3. GEMM2 x routing weight, the top-k sum by each token's last arrival, the cast: out.
    atomic = cfg.atomic_reduce and not deterministic
    buf = top_k_buffer(atomic, cfg.split_k2, M, num_pairs, H, device)
    w2_s = weights.w2_scale if mode == _k.MODE_NVFP4 else weights.w2_e8m0
    _k.fp4_gemm2_kernel[(max_blocks, tiles2, cfg.split_k2)](
        iq, isc, irs, weights.w2, w2_s, weights.w2_scale_2,
        topk_weights.contiguous(), topk_ids, topk_ids.stride(0), topk_ids.stride(1),
        buf, out, out.stride(0), out.stride(1), tickets2,
        routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded,
        num_pairs, k, E, H, I, inter_s, 1.0 if routed_scaling_factor is None else float(routed_scaling_factor),
        MODE=mode, INTER_STATIC=static_inter,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, SPLIT_K=cfg.split_k2,
        SWAP_AB=cfg.swap_ab, EMULATE=emulate, ATOMIC=atomic, **launch,
    )
    return out




def _row_block(K: int) -> int:
    """Largest power of two <= 1024 dividing K (K % 64 == 0)."""
    b = 1024
    while K % b:
        b //= 2
    return b


def _quant_buffers(mode: int, R: int, K: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantized rows: NVFP4 (packed [R, K/2], E4M3 [R, K/16], fp32 [R]) or MXFP8 (E4M3 [R, K],
    E8M0 [R, K/32], an unused placeholder)."""
    if mode == _k.MODE_NVFP4:
        return (torch.empty(R, K // 2, dtype=torch.uint8, device=device),
                torch.empty(R, K // 16, dtype=torch.float8_e4m3fn, device=device),
                torch.empty(R, dtype=torch.float32, device=device))
    return (torch.empty(R, K, dtype=torch.float8_e4m3fn, device=device),
            torch.empty(R, K // 32, dtype=torch.uint8, device=device),
            torch.empty(1, dtype=torch.float32, device=device))
