"""Activation quantizers of the FP4 tensor-core MoE modes, in plain torch (the references of the
Triton quantizers in moe_fp4_details/quant.py, which produce the same bits).

NVFP4 (act_quant="nvfp4"), per row r of x [R, K], K a multiple of 16:
  row scale   s_r = amax_r / (6 * 448)  (fp32; dynamic), or a given static scale (the W4A4
              checkpoint's input_scale, or the SiTU bound for the intermediate). A row whose
              s_r is 0 (all-zero row, or amax so small that the division underflows) gets
              s_r = 1 and quantizes to zeros.
  block scale b = e4m3_rne(min(amax_blk / (s_r * 6), 448)) per 16 elements. With the dynamic
              row scale the row's largest block maps to exactly 448. Overflow (only possible
              with a static scale): saturated at 448, the block's values then saturate at +-6.
              Underflow: b rounds to 0 when amax_blk / (s_r * 6) < 2^-10 (half E4M3's
              smallest subnormal 2^-9); the block is FLUSHED to +0 codes.
  values      e2m1_rne(x / (b * s_r)) saturating at +-6 (ties to even, the sign of -0 kept).
  value = e2m1 * b * s_r; the kernels apply s_r to the fp32 accumulator.
MXFP8 (act_quant="mxfp8"), per 32 elements (OCP MX, E8M0 shared exponent):
  scale 2^k with k = ceil(log2(amax_blk / 448)) (the smallest power of two that keeps every value
  within E4M3's 448, so nothing saturates), computed exactly from amax's bits; the E8M0 byte
  k + 127 is clamped to [1, 254]: byte 0 (2^-127) is avoided because Triton 3.8 decodes it as 0
  (docs/facts.md#triton); an all-zero block gets byte 1.
  values e4m3_rne(x / 2^k) (exact division by a power of two, then one rounding).
All divisions are IEEE fp32 (the kernels use div_rn), so kernel and reference agree bit for bit.
"""

from __future__ import annotations

import torch

from . import formats

NVFP4_ROW_RANGE = formats.E2M1_MAX * formats.E4M3_MAX  # 2688: the row max maps to 448 x 6
E8M0_MIN_BYTE = 1  # not 0: Triton 3.8 decodes E8M0 0 as 0 instead of 2^-127
E8M0_MAX_BYTE = 254


def nvfp4_dynamic_row_scale(x: torch.Tensor) -> torch.Tensor:
    """x: float [R, K] -> float32 [R] row scales amax / 2688 (1 where that is 0)."""
    s = x.float().abs().amax(dim=1) / torch.tensor(NVFP4_ROW_RANGE, dtype=torch.float32)
    return torch.where(s > 0, s, torch.ones_like(s))


def quantize_nvfp4_rows(
    x: torch.Tensor, static_scale: float | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NVFP4-quantize the rows of x (module docstring).

    x: float [R, K], K % 16 == 0; static_scale: None (dynamic per-row scale) or one fp32 scale for
    every row (a python float is rounded to fp32 first, as a kernel argument is).
    Returns (packed uint8 [R, K/2] low nibble = even element, block scales float8_e4m3fn [R, K/16],
    row scales float32 [R]).
    """
    if x.dim() != 2 or x.shape[1] % formats.NVFP4_BLOCK:
        raise ValueError(f"x: expected [R, K] with K a multiple of 16, got shape {tuple(x.shape)}")
    x = x.float()
    R, K = x.shape
    if static_scale is None:
        rs = nvfp4_dynamic_row_scale(x)
    else:
        s = torch.as_tensor(static_scale, dtype=torch.float32, device=x.device).reshape(())
        if not bool(s > 0) or not bool(torch.isfinite(s)):
            raise ValueError(f"static_scale: must be a finite positive scale, got {float(s)}")
        rs = s.expand(R).clone()
    xb = x.reshape(R, K // 16, 16)
    amax = xb.abs().amax(dim=2)
    bf = torch.clamp(amax / (rs[:, None] * 6.0), max=formats.E4M3_MAX)
    bs = bf.to(torch.float8_e4m3fn)
    denom = bs.float() * rs[:, None]
    ok = denom > 0
    y = torch.where(ok[:, :, None], xb / torch.where(ok, denom, 1.0)[:, :, None], 0.0)
    codes = formats.float_to_e2m1(y.reshape(R, K))
    return formats.pack_e2m1(codes), bs, rs


def dequantize_nvfp4_rows(packed: torch.Tensor, scales: torch.Tensor, row_scale: torch.Tensor | None) -> torch.Tensor:
    """(packed [R, K/2], e4m3 [R, K/16], fp32 [R] or None) -> float32 [R, K]: e2m1 x b (x s_r)."""
    v = formats.dequantize_nvfp4(packed, scales, 1.0)
    return v if row_scale is None else v * row_scale[:, None]


def mxfp8_block_exponent_bytes(amax: torch.Tensor) -> torch.Tensor:
    """Block amax (float32 >= 0) -> E8M0 bytes (uint8) of 2^ceil(log2(amax / 448)), clamped [1, 254].

    448 = 1.75 x 2^8, so for amax = (1 + f) 2^e: k = e - 8, plus 1 when 1 + f > 1.75."""
    bits = amax.float().contiguous().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    byte = biased - 8 + (mant > 0x600000).to(torch.int32)
    return byte.clamp(E8M0_MIN_BYTE, E8M0_MAX_BYTE).to(torch.uint8)


def quantize_mxfp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8-quantize the rows of x (module docstring).

    x: float [R, K], K % 32 == 0. Returns (values float8_e4m3fn [R, K], E8M0 bytes uint8 [R, K/32]).
    """
    if x.dim() != 2 or x.shape[1] % formats.MXFP4_BLOCK:
        raise ValueError(f"x: expected [R, K] with K a multiple of 32, got shape {tuple(x.shape)}")
    x = x.float()
    R, K = x.shape
    xb = x.reshape(R, K // 32, 32)
    e8 = mxfp8_block_exponent_bytes(xb.abs().amax(dim=2))
    scale = (e8.to(torch.int32) << 23).view(torch.float32)
    y = torch.clamp(xb / scale[:, :, None], -formats.E4M3_MAX, formats.E4M3_MAX)
    return y.reshape(R, K).to(torch.float8_e4m3fn), e8


def dequantize_mxfp8_rows(values: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """(e4m3 [R, K], E8M0 bytes [R, K/32]) -> float32 [R, K]."""
    R, K = values.shape
    v = values.float().reshape(R, K // 32, 32) * formats.e8m0_to_float(e8m0)[:, :, None]
    return v.reshape(R, K)


E4M3_GROUP = 128  # the Hopper W4A8 mode's activation scale group (columns)


def quantize_e4m3_groups(x: torch.Tensor, group: int = E4M3_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """The W4A8 ("e4m3") mode's activation rule: x float [R, K] -> (float8_e4m3fn [R, K], float32
    scales [R, cdiv(K, group)]). Per row per ``group`` columns (a row's last group may be shorter):
    s = fp32(amax / 448), 1 where that is 0; values e4m3_rne(clamp(fp32(x / s), -448, 448)) (the
    clamp: an fp32 division can land one ulp above 448). IEEE fp32 divisions, as the kernels."""
    xf = x.float()
    R, K = xf.shape
    n = -(-K // group)
    pad = torch.zeros(R, n * group, dtype=torch.float32, device=x.device)
    pad[:, :K] = xf
    xb = pad.reshape(R, n, group)
    s = xb.abs().amax(dim=2) / torch.tensor(formats.E4M3_MAX, dtype=torch.float32)
    s = torch.where(s > 0, s, torch.ones_like(s))
    y = (xb / s[:, :, None]).clamp(-formats.E4M3_MAX, formats.E4M3_MAX)
    return y.to(torch.float8_e4m3fn).reshape(R, n * group)[:, :K].contiguous(), s


def dequantize_e4m3_groups(values: torch.Tensor, scales: torch.Tensor, group: int = E4M3_GROUP) -> torch.Tensor:
    """float8_e4m3fn [R, K], float32 [R, cdiv(K, group)] -> float32 [R, K] = value x its group's scale."""
    K = values.shape[1]
    return values.float() * scales.repeat_interleave(group, dim=1)[:, :K]
