"""NVFP4MoEWeights: the expert weights of one MoE layer in the layout the kernels read."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


@dataclass(frozen=True)
class NVFP4MoEWeights:
    """Routed-expert weights of one layer, NVFP4 (E2M1 nibbles, E4M3 16-block scales, fp32 scale_2).

    Layout (what the Triton kernels read; the ModelOpt layout made contiguous, scales kept as
    raw E4M3 bytes so the kernels decode them with integer ops):
      w13        uint8 [E, 2I, H/2]   gate (w1) rows 0..I-1, then up (w3) rows I..2I-1; K-major,
                                       low nibble = even element.
      w13_scale  uint8 [E, 2I, H/16]  E4M3 bit patterns, one per 16 elements of a row.
      w13_scale_2 float32 [E, 2]      (gate, up) per-tensor scales.
      w2         uint8 [E, H, I/2]
      w2_scale   uint8 [E, H, I/16]
      w2_scale_2 float32 [E]
    value = e2m1(nibble) * e4m3(scale) * scale_2. ``to_modelopt()`` returns the canonical tensors
    (scales as float8_e4m3fn).
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_scale_2: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_scale_2: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.w13.device

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
        H and I must be multiples of 16.
        """
        scale_dtypes = (torch.float8_e4m3fn, torch.uint8)
        _check(w13, "w13", (torch.uint8,), 3)
        _check(w2, "w2", (torch.uint8,), 3)
        _check(w13_scale, "w13_scale", scale_dtypes, 3)
        _check(w2_scale, "w2_scale", scale_dtypes, 3)
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
        _shape(w13_scale, "w13_scale", (E, 2 * I, H // 16))
        _shape(w2, "w2", (E, H, I // 2))
        _shape(w2_scale, "w2_scale", (E, H, I // 16))
        if w13_scale_2.dim() == 1:
            _shape(w13_scale_2, "w13_scale_2", (E,))
            w13_scale_2 = w13_scale_2[:, None].expand(E, 2)
        else:
            _shape(w13_scale_2, "w13_scale_2", (E, 2))
        _shape(w2_scale_2.reshape(-1) if w2_scale_2.dim() == 2 and w2_scale_2.shape[1] == 1 else w2_scale_2,
               "w2_scale_2", (E,))
        devices = {t.device for t in (w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)}
        if len(devices) != 1:
            raise ValueError(f"NVFP4MoEWeights: all six tensors must be on one device, got {sorted(map(str, devices))}")

        def raw(t: torch.Tensor) -> torch.Tensor:
            return t.contiguous().view(torch.uint8)

        return cls(
            w13=w13.contiguous(),
            w13_scale=raw(w13_scale),
            w13_scale_2=w13_scale_2.contiguous(),
            w2=w2.contiguous(),
            w2_scale=raw(w2_scale),
            w2_scale_2=w2_scale_2.reshape(E).contiguous(),
        )

    def to_modelopt(self) -> tuple[torch.Tensor, ...]:
        """(w13, w13_scale e4m3, w13_scale_2 [E, 2], w2, w2_scale e4m3, w2_scale_2 [E]) - canonical."""
        return (
            self.w13,
            self.w13_scale.view(torch.float8_e4m3fn),
            self.w13_scale_2,
            self.w2,
            self.w2_scale.view(torch.float8_e4m3fn),
            self.w2_scale_2,
        )

    def to(self, device) -> "NVFP4MoEWeights":
        return NVFP4MoEWeights(*(getattr(self, f).to(device) for f in (
            "w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2")))
