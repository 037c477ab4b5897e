"""NVFP4MoEWeights: the expert weights of one MoE layer in the layout the kernels read."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from typing import NamedTuple

import torch

from .. import formats
from . import layout


class ModelOptMoETensors(NamedTuple):
    """SGLang's ModelOpt NVFP4 MoE tensors of one layer (canonical layout, scales as e4m3)."""

    w13: torch.Tensor  # uint8 [E, 2I, H/2]
    w13_scale: torch.Tensor  # float8_e4m3fn [E, 2I, H/16]
    w13_scale_2: torch.Tensor  # float32 [E, 2]
    w2: torch.Tensor  # uint8 [E, H, I/2]
    w2_scale: torch.Tensor  # float8_e4m3fn [E, H, I/16]
    w2_scale_2: torch.Tensor  # float32 [E]


class MXFP4MoETensors(NamedTuple):
    """The MXFP4 release's MoE tensors of one layer (compressed-tensors, as SGLang loads them)."""

    w13: torch.Tensor  # uint8 [E, 2I, H/2] E2M1 nibbles, w1 rows then w3 rows, low nibble = even element
    w13_e8m0: torch.Tensor  # uint8 [E, 2I, H/32] E8M0 scale per 32
    w2: torch.Tensor  # uint8 [E, H, I/2]
    w2_e8m0: torch.Tensor  # uint8 [E, H, I/32]


def _check(t: torch.Tensor, name: str, dtypes: tuple[torch.dtype, ...], ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(t.shape)}")


def _shape(t: torch.Tensor, name: str, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name}: expected shape {tuple(expected)}, got {tuple(t.shape)}")


def validate_modelopt(w13: torch.Tensor, w13_scale: torch.Tensor, w13_scale_2: torch.Tensor, w2: torch.Tensor,
                      w2_scale: torch.Tensor, w2_scale_2: torch.Tensor) -> tuple[int, int, int]:
    """Check SGLang's six ModelOpt NVFP4 MoE tensors (dtypes, ranks, shapes, one device; a
    ValueError names the tensor) and return (E, I, H). Shapes as NVFP4MoEWeights.from_modelopt."""
    scale_dtypes = (torch.float8_e4m3fn, torch.uint8)
    _check(w13, "w13", (torch.uint8,), 3)
    _check(w2, "w2", (torch.uint8,), 3)
    _check(w13_scale, "w13_scale", scale_dtypes, 3)
    _check(w2_scale, "w2_scale", scale_dtypes, 3)
    E, I, H = _check_shapes(w13, w2, w13_scale_2, w2_scale_2)
    _shape(w13_scale, "w13_scale", (E, 2 * I, H // 16))
    _shape(w2_scale, "w2_scale", (E, H, I // 16))
    _same_device(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
    return E, I, H


class ExpertWeights:
    """What every routed-expert weight set of one layer answers, whatever its layout: a w13
    tensor with the experts on its first dimension."""

    w13: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def device(self) -> torch.device:
        return self.w13.device


@dataclass(frozen=True)
class NVFP4MoEWeights(ExpertWeights):
    """Routed-expert weights of one layer, NVFP4, in the kernel-native layout (layout.py).

      w13         uint8 [E, 2I/16, ceil(H/64), 512]  gate (w1) rows 0..I-1, then up (w3) rows
                                                     I..2I-1, bit-placed E2M1 nibbles in MMA tiles
      w13_scale   int32 [E, 2I/16, ceil(H/64), W]    block scale words, one byte per scale
                                                     (W = 16: E5M3_16, W = 8: E8M0_32)
      w13_scale_2 float32 [E, 2]                     (gate, up) per-tensor scales
      w2          uint8 [E, H/16, ceil(I/64), 512]
      w2_scale    int32 [E, H/16, ceil(I/64), W]
      w2_scale_2  float32 [E]
      scale_format  layout.E5M3_16 (NVFP4) or layout.E8M0_32 (the MXFP4 release)
      w13_exceptions, w2_exceptions  layout.BlockExceptions: original bytes of zero- or
                                     negative-scale blocks the layout changed (usually empty)
    value = e2m1(nibble) x block scale x scale_2, as in ModelOpt. Built by :meth:`from_modelopt`
    (SGLang's NVFP4 MoE tensors) or :meth:`from_mxfp4`; :meth:`to_modelopt` gives the canonical
    tensors back (bit for bit from ModelOpt). The layout holds the checkpoint's bytes, K padded
    to 64: 0.5625 B per weight for NVFP4, 0.53125 for MXFP4 (layout.py).
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_scale_2: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_scale_2: torch.Tensor
    hidden_size: int
    intermediate_size: int
    scale_format: layout.ScaleFormat = layout.E5M3_16
    w13_exceptions: layout.BlockExceptions | None = None
    w2_exceptions: layout.BlockExceptions | None = None

    @property
    def w13_k_tiles(self) -> int:
        return self.w13.shape[2]

    @property
    def w2_k_tiles(self) -> int:
        return self.w2.shape[2]

    @classmethod
    def from_modelopt(
        cls,
        w13: torch.Tensor,
        w13_scale: torch.Tensor,
        w13_scale_2: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
        w2_scale_2: torch.Tensor,
    ) -> "NVFP4MoEWeights":
        """Validate SGLang's ModelOpt NVFP4 MoE tensors and build the kernel layout.

        w13 uint8 [E, 2I, H/2]; w13_scale float8_e4m3fn (or its uint8 bits) [E, 2I, H/16];
        w13_scale_2 float32 [E, 2] (gate, up) or [E] (one scale for both halves);
        w2 uint8 [E, H, I/2]; w2_scale float8_e4m3fn [E, H, I/16]; w2_scale_2 float32 [E].
        H and I must be multiples of 16. The inputs are not modified.
        """
        E, I, H = validate_modelopt(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
        n13, s13, x13 = layout.pack_nvfp4_scales(w13, w13_scale, "w13_scale")
        n2, s2, x2 = layout.pack_nvfp4_scales(w2, w2_scale, "w2_scale")
        return cls(
            w13=layout.pack_e2m1_tiles(n13),
            w13_scale=s13,
            w13_scale_2=gate_up_scale_2(w13_scale_2, E),
            w2=layout.pack_e2m1_tiles(n2),
            w2_scale=s2,
            w2_scale_2=w2_scale_2.reshape(E).contiguous(),
            hidden_size=H,
            intermediate_size=I,
            scale_format=layout.E5M3_16,
            w13_exceptions=x13,
            w2_exceptions=x2,
        )

    @classmethod
    def from_mxfp4(
        cls,
        w13: torch.Tensor,
        w13_e8m0: torch.Tensor,
        w2: torch.Tensor,
        w2_e8m0: torch.Tensor,
    ) -> "NVFP4MoEWeights":
        """The same layout from MXFP4 expert tensors (E2M1 nibbles, E8M0 exponents per 32).

        w13 uint8 [E, 2I, H/2] (w1 rows then w3 rows), w13_e8m0 uint8 [E, 2I, H/32], w2 uint8
        [E, H, I/2], w2_e8m0 uint8 [E, H, I/32]. Like the closed-form cast, scale_2 = 2^m with
        m = k_max - 8 (k_max over all blocks of the expert's w1 and w3 together), so every
        block whose exponent lies within 17 binades of k_max dequantizes to exactly the cast's
        NVFP4 value (the same tensors, bit for bit). Blocks further below, where the cast had to
        re-quantize, keep their exact MXFP4 value: every finite E8M0 exponent fits the bf16 block
        scale for this scale_2, and the kernel's bf16 product e2m1 x scale is exact and normal
        for every block within 126 binades of k_max. Only blocks more than 126 binades below
        their matrix's largest give subnormal bf16 products (exact to 133 binades where the GPU
        keeps bf16 subnormals, flushed below); no trained matrix spans that, and a warning names
        the tensor and the count if one does. e8m0 = 255 (NaN) is refused.
        """
        _check(w13, "w13", (torch.uint8,), 3)
        _check(w2, "w2", (torch.uint8,), 3)
        _check(w13_e8m0, "w13_e8m0", (torch.uint8,), 3)
        _check(w2_e8m0, "w2_e8m0", (torch.uint8,), 3)
        E, two_i, half_h = w13.shape
        I, H = two_i // 2, half_h * 2
        if H % 32 or I % 32:
            raise ValueError(f"from_mxfp4: H = {H} and I = {I} must be multiples of 32 (the MXFP4 block)")
        _shape(w13_e8m0, "w13_e8m0", (E, 2 * I, H // 32))
        _shape(w2, "w2", (E, H, I // 2))
        _shape(w2_e8m0, "w2_e8m0", (E, H, I // 32))
        _same_device(w13, w13_e8m0, w2, w2_e8m0)
        m13 = _mxfp4_scale_2_exp(w13_e8m0)
        m2 = _mxfp4_scale_2_exp(w2_e8m0)
        s13 = layout.pack_e8m0_scale_tiles(w13_e8m0, m13, "w13_e8m0")  # refuses NaN exponents
        s2 = layout.pack_e8m0_scale_tiles(w2_e8m0, m2, "w2_e8m0")
        _warn_deep_blocks(w13, w13_e8m0, m13, "w13_e8m0")
        _warn_deep_blocks(w2, w2_e8m0, m2, "w2_e8m0")
        return cls(
            w13=layout.pack_e2m1_tiles(w13),
            w13_scale=s13,
            w13_scale_2=torch.exp2(m13.float())[:, None].expand(E, 2).contiguous(),
            w2=layout.pack_e2m1_tiles(w2),
            w2_scale=s2,
            w2_scale_2=torch.exp2(m2.float()).contiguous(),
            hidden_size=H,
            intermediate_size=I,
            scale_format=layout.E8M0_32,
        )

    def to_modelopt(self) -> ModelOptMoETensors:
        """The canonical ModelOpt tensors (new tensors, unpacked from the kernel layout). Bit for
        bit what from_modelopt took; from MXFP4, the cast's tensors where it is exact."""
        H, I = self.hidden_size, self.intermediate_size
        w13, s13 = self._unpack(self.w13, self.w13_scale, self.w13_exceptions, H)
        w2, s2 = self._unpack(self.w2, self.w2_scale, self.w2_exceptions, I)
        return ModelOptMoETensors(w13, s13, self.w13_scale_2, w2, s2, self.w2_scale_2)

    def _unpack(self, tiles, words, exceptions, k):
        nibbles = layout.unpack_e2m1_tiles(tiles, k)
        if self.scale_format == layout.E5M3_16:
            return layout.unpack_nvfp4_scales(nibbles, words, layout.BlockExceptions.empty() if exceptions is None else exceptions, k)
        scale = layout.decode_scale_words(words, k, self.scale_format).repeat_interleave(2, dim=-1)
        return nibbles, scale.to(torch.float8_e4m3fn).contiguous()

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 values e2m1 x block scale (no scale_2) of w13 [E, 2I, H] and w2 [E, H, I],
        computed from the kernel layout as the kernels multiply them (tests, accuracy checks)."""
        H, I, f = self.hidden_size, self.intermediate_size, self.scale_format
        return layout.dequantize_tiles(self.w13, self.w13_scale, H, f), layout.dequantize_tiles(self.w2, self.w2_scale, I, f)

    def to(self, device) -> "NVFP4MoEWeights":
        moved = {f: getattr(self, f).to(device) for f in _TENSORS}
        moved.update({f: getattr(self, f).to(device) for f in ("w13_exceptions", "w2_exceptions") if getattr(self, f) is not None})
        return dataclasses.replace(self, **moved)


_TENSORS = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")


def _check_shapes(w13, w2, w13_scale_2, w2_scale_2) -> tuple[int, int, int]:
    if not isinstance(w13_scale_2, torch.Tensor) or not isinstance(w2_scale_2, torch.Tensor):
        raise TypeError("w13_scale_2 and w2_scale_2 must be torch.Tensor")
    if w13_scale_2.dtype != torch.float32:
        raise TypeError(f"w13_scale_2: expected dtype torch.float32, got {w13_scale_2.dtype}")
    if w2_scale_2.dtype != torch.float32:
        raise TypeError(f"w2_scale_2: expected dtype torch.float32, got {w2_scale_2.dtype}")
    E, two_i, half_h = w13.shape
    if two_i % 2:
        raise ValueError(f"w13: dim 1 ({two_i}) must be 2*I (gate rows then up rows)")
    I, H = two_i // 2, half_h * 2
    if H % 16:
        raise ValueError(f"w13: hidden size H = 2 * {half_h} = {H} is not a multiple of 16")
    if I % 16:
        raise ValueError(f"w13: intermediate size I = {I} is not a multiple of 16")
    _shape(w2, "w2", (E, H, I // 2))
    if w13_scale_2.dim() == 1:
        _shape(w13_scale_2, "w13_scale_2", (E,))
    else:
        _shape(w13_scale_2, "w13_scale_2", (E, 2))
    _shape(w2_scale_2.reshape(-1) if w2_scale_2.dim() == 2 and w2_scale_2.shape[1] == 1 else w2_scale_2,
           "w2_scale_2", (E,))
    return E, I, H


def gate_up_scale_2(w13_scale_2: torch.Tensor, E: int) -> torch.Tensor:
    """w13's scale_2 as [E, 2] (gate, up): a [E] tensor (one scale for both halves) expanded."""
    if w13_scale_2.dim() == 1:
        w13_scale_2 = w13_scale_2[:, None].expand(E, 2)
    return w13_scale_2.contiguous()


def _same_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"NVFP4MoEWeights: all tensors must be on one device, got {sorted(map(str, devices))}")


# A block this many binades below its matrix's largest gives subnormal bf16 products in the
# kernel (smallest product 0.5 x 2^(e - k_max + 1), see from_mxfp4).
_BF16_NORMAL_SPAN = 126


def _warn_deep_blocks(packed: torch.Tensor, e8m0: torch.Tensor, scale_2_exp: torch.Tensor, name: str) -> None:
    """Warn about non-zero blocks far below their matrix's largest (all-zero blocks, which
    MXFP4 quantizers store with E8M0 0, are exact whatever their scale). scale_2_exp: the
    per-expert m of _mxfp4_scale_2_exp, which fixes the largest E8M0 byte."""
    k_max = scale_2_exp + formats.E4M3_MAX_EXP2 + formats.E8M0_BIAS  # the biased byte, per expert
    # Per-expert minima first (a reduction, no copy): the elementwise check only where one is deep.
    if not bool((e8m0.flatten(1).amin(1).to(torch.int64) < k_max - _BF16_NORMAL_SPAN).any()):
        return
    deep = e8m0.to(torch.int64) < (k_max - _BF16_NORMAL_SPAN).reshape(-1, 1, 1)
    nonzero = (packed.reshape(*e8m0.shape, formats.MXFP4_BLOCK // 2) & 0x77).amax(-1) != 0
    n = int((deep & nonzero).sum())
    if n:
        warnings.warn(
            f"from_mxfp4: {name}: {n} non-zero MXFP4 blocks lie more than {_BF16_NORMAL_SPAN} binades "
            "below their matrix's largest block; their bf16 products in the kernel are subnormal "
            "(exact to 133 binades where the GPU keeps bf16 subnormals, flushed to zero below)",
            stacklevel=3,
        )


def _mxfp4_scale_2_exp(e8m0: torch.Tensor) -> torch.Tensor:
    """Per expert m = k_max - 8, k_max over all its blocks (the closed-form cast's choice,
    kernels/cast.py), int64 [E]."""
    k_max = e8m0.flatten(1).amax(1).to(torch.int64) - formats.E8M0_BIAS
    return k_max - formats.E4M3_MAX_EXP2
