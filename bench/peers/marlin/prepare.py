"""NVFP4 MoE weights -> marlin's layout, as SGLang 0.5.23's NVFP4 marlin MoE path prepares them.

SGLang (``ModelOptNvFp4FusedMoEMethod.process_weights_after_loading`` with the marlin backend,
then ``marlin_utils_fp4.prepare_moe_nvfp4_layer_for_marlin``) does, per expert matrix
W [N, K] (w13: N = 2I gate then up rows, K = H; w2: N = H, K = I):

  nibbles  uint8 [N, K/2] viewed as int32 [N, K/8], transposed to [K/8, N], then repacked by
           the gptq_marlin_repack CUDA kernel to int32 [K/16, 2N]   -> run here through
           libk3marlin on the GPU (``MarlinLib.repack_fp4``);
  scales   e4m3 [N, K/16] transposed to [K/16, N], cast to the activation dtype (bf16), each
           row's groups of 64 permuted by marlin's scale permutation, then cast to fp16, each
           group of 4 reordered (0, 2, 1, 3), multiplied by 2^7 and re-encoded as the high byte
           of (fp16 bits << 1) -> e4m3-typed bytes [K/16, N]           -> reimplemented below in
           torch (CPU or GPU), checked bit for bit against SGLang's own functions on CPU;
  scale_2  w13: the gate column only (marlin has one global scale per matrix; SGLang warns when
           gate != up), cast to bf16 and multiplied by 2^(2^7 - 2 - 7) = 2^119        -> same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The fp16 exponent-bias trick of marlin's NVFP4 dequant: fp4's exponent bias (1) differs from
# bf16's (127) by 126; the kernel's scale decode contributes 2^7 (see the 2^7 on the block scales).
GLOBAL_SCALE_FACTOR = 2.0 ** (2**7 - 2**1 - 7)
BLOCK_SCALE_FACTOR = 2.0**7


def marlin_scale_perm() -> torch.Tensor:
    """Marlin's permutation of each 64 consecutive scales (group size < K): position 8 i + j holds
    scale i + 8 j, i.e. an 8 x 8 transpose."""
    return torch.arange(64).reshape(8, 8).t().reshape(64)


def process_block_scales(scale: torch.Tensor, act_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """ModelOpt block scales e4m3 [E, N, K/16] -> marlin's scale tensor, e4m3-typed bytes [E, K/16, N]."""
    if scale.dim() != 3:
        raise ValueError(f"scale: expected [E, N, K/16], got shape {tuple(scale.shape)}")
    if scale.dtype != torch.float8_e4m3fn:
        raise ValueError(f"scale: expected float8_e4m3fn, got {scale.dtype}")
    E, N, G = scale.shape
    if N % 64:
        raise ValueError(f"scale: N = {N} must be a multiple of 64 (marlin's scale permutation)")
    s = scale.transpose(1, 2).to(act_dtype)  # [E, K/16, N], exact (e4m3 values are bf16 values)
    s = s.reshape(E, -1, 64)[:, :, marlin_scale_perm().to(s.device)].reshape(E, G, N)
    h = s.to(torch.float16)  # exact: e4m3 magnitudes 2^-9 .. 448 are fp16 values
    h = h.reshape(E, -1, 4)[:, :, [0, 2, 1, 3]].reshape(E, G, N)
    bits = (h * BLOCK_SCALE_FACTOR).view(torch.int16).to(torch.int32)  # x 2^7: exact, <= 57344
    # high byte of the 16-bit pattern shifted left by one (sign dropped: scales are >= 0)
    byte = ((bits << 1) >> 8) & 0xFF
    return byte.to(torch.uint8).view(torch.float8_e4m3fn).contiguous()


def process_global_scale(scale_2: torch.Tensor, act_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Per-matrix fp32 scale_2 [E] -> marlin's global scale [E] in the activation dtype."""
    if act_dtype != torch.bfloat16:
        raise ValueError("only bf16 activations are prepared here (the exponent offset is dtype specific)")
    return (scale_2.to(act_dtype) * GLOBAL_SCALE_FACTOR).reshape(-1).contiguous()


def transpose_nibbles(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt uint8 [E, N, K/2] -> int32 [E, K/8, N] (each expert's W viewed as int32 and transposed)."""
    if w.dtype != torch.uint8 or w.dim() != 3 or w.shape[2] % 4:
        raise ValueError(f"weight: expected uint8 [E, N, K/2] with K a multiple of 8, got {w.dtype} {tuple(w.shape)}")
    return w.contiguous().view(torch.int32).transpose(1, 2).contiguous()


@dataclass
class MarlinMoEWeights:
    """One layer's experts in marlin's layout (SGLang's w13_weight / w2_weight / ..._scale / ..._scale_2
    after prepare_moe_nvfp4_layer_for_marlin)."""

    w13: torch.Tensor  # int32 [E, H/16, 4I]
    w13_scale: torch.Tensor  # e4m3-typed [E, H/16, 2I]
    w13_global_scale: torch.Tensor  # bf16 [E]
    w2: torch.Tensor  # int32 [E, I/16, 2H]
    w2_scale: torch.Tensor  # e4m3-typed [E, I/16, H]
    w2_global_scale: torch.Tensor  # bf16 [E]
    hidden_size: int
    intermediate_size: int
    gate_up_scale_2_equal: bool  # False: marlin uses the gate scale_2 for the up half too (as SGLang)

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]


def prepare_marlin_weights(weights, lib, chunk: int = 128) -> MarlinMoEWeights:
    """k3nvfp4 NVFP4MoEWeights (on a CUDA device) -> MarlinMoEWeights, through SGLang's repack kernel
    (``lib``: a MarlinLib) and the scale processing above. ``chunk`` experts are transposed at a time."""
    w13q, w13s, w13s2, w2q, w2s, w2s2 = weights.to_modelopt()
    E, H, I = weights.num_experts, weights.hidden_size, weights.intermediate_size
    dev = w13q.device

    def repack(w: torch.Tensor, size_k: int, size_n: int) -> torch.Tensor:
        out = torch.empty(E, size_k // 16, 2 * size_n, dtype=torch.int32, device=dev)
        for lo in range(0, E, chunk):
            hi = min(E, lo + chunk)
            lib.repack_fp4(transpose_nibbles(w[lo:hi]), out[lo:hi], size_k, size_n)
        return out

    return MarlinMoEWeights(
        w13=repack(w13q, H, 2 * I),
        w13_scale=process_block_scales(w13s),
        w13_global_scale=process_global_scale(w13s2[:, 0]),
        w2=repack(w2q, I, H),
        w2_scale=process_block_scales(w2s),
        w2_global_scale=process_global_scale(w2s2),
        hidden_size=H,
        intermediate_size=I,
        gate_up_scale_2_equal=bool(torch.equal(w13s2[:, 0], w13s2[:, 1])),
    )
