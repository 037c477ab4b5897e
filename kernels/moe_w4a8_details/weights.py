"""W4A8MoEWeights: the routed experts of one layer prepared for the Hopper W4A8 mode ("e4m3"):
E2M1 nibbles as the checkpoint stores them (out-of-window blocks re-encoded), one int8 exponent
offset per block (expanded exactly to E4M3 in registers, moe_details/e4m3_expand.py) and one fp32
factor per weight row (2^r x scale_2, applied to the accumulator row in the epilogue), nibbles and
offsets stored in wgmma's A-fragment order (fragment.py). The rule and its window are prep.py's
(docs/w4a8.md derives them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..moe_details.e4m3_expand import E4M3_NORMAL_MIN_OFFSET, is_normal_table
from ..moe_details.weights import ExpertWeights, gate_up_scale_2, validate_modelopt
from .fragment import from_fragment_order, to_fragment_order
from .prep import W4A8Weights, prepare_w4a8_from_mxfp4, prepare_w4a8_from_nvfp4

# H and I of the mode: whole 64-wide K steps (GEMM1 runs K = H, GEMM2 K = I) with no masks on the
# K loop; the activation groups are 128 columns, the last one of a row 64 when K % 128 == 64.
W4A8_SHAPE_MULTIPLE = 64
W4A8_PREPARE_HINT = "W4A8MoEWeights.from_modelopt / from_mxfp4 (kernels.modes.MODES['e4m3'].prepare)"
W4A8_ACT_QUANT = "e4m3"


@dataclass(frozen=True)
class W4A8MoEWeights(ExpertWeights):
    """Routed-expert weights of one layer for the W4A8 kernels (moe_w4a8_details/kernels.py).

      w13            int32 [E, 2I/16, H/64, 128]   gate (w1) rows then up (w3) rows, E2M1 nibbles
      w13_offsets    int8 [E, 2I/16, H/64, 1024/block]  per block j_b in [-8, 6]: E4M3 = E2M1 x 2^j_b
      w13_row_scale  float32 [E, 2I]      2^r x scale_2 of each row (gate rows the gate's scale_2)
      w2             int32 [E, H/16, I/64, 128]
      w2_offsets     int8 [E, H/16, I/64, 1024/block]
      w2_row_scale   float32 [E, H]
    (nibbles and offsets in the fragment order of fragment.py: the bytes of the logical
    uint8 [E, N, K/2] nibbles and int8 [E, N, K/block] offsets, reordered; matrices() gives those)
      block          32 (from MXFP4: one E8M0 per 32) or 16 (from power-of-two NVFP4)
      out_of_window  blocks below their row's 14-binade window, re-encoded (w13 + w2)
      rounded        those of them whose values changed (lossy; warned at preparation)
      w13_table, w2_table  the per-block E4M3 table each GEMM's kernel builds: "normal" (two
                     multiply-adds; every offset of the matrix >= -5) or "full" (11 instructions,
                     any offset in [-8, 6]); chosen by the preparation (prep.py), checked here
    value = E4M3(E2M1 x 2^offset) x row_scale. H and I must be multiples of 64.
    """

    w13: torch.Tensor
    w13_offsets: torch.Tensor
    w13_row_scale: torch.Tensor
    w2: torch.Tensor
    w2_offsets: torch.Tensor
    w2_row_scale: torch.Tensor
    hidden_size: int
    intermediate_size: int
    block: int
    out_of_window: int = 0
    rounded: int = 0
    w13_table: str = "full"  # "full" is exact for every offset the mode stores
    w2_table: str = "full"
    act_quant: str = W4A8_ACT_QUANT  # the mode these weights are for (kernels/modes.py: KernelMode.takes)

    def __post_init__(self):
        # The normal table gives wrong bytes below offset -5: refuse weights that claim it wrongly
        # (the kernels trust the flag). Runs at every construction -- the preparation, .to() and
        # dataclasses.replace -- one min() per matrix (a host sync on a GPU): cheap beside the
        # preparation itself, and never on the forward path.
        for name, table, offsets in (("w13", self.w13_table, self.w13_offsets), ("w2", self.w2_table, self.w2_offsets)):
            normal = is_normal_table(table, f"{name}_table")
            if normal and offsets.numel() and int(offsets.min()) < E4M3_NORMAL_MIN_OFFSET:
                raise ValueError(f"{name}_table = 'normal' but {name}_offsets go down to {int(offsets.min())}; "
                                 f"the normal E4M3 table is exact only for offsets >= {E4M3_NORMAL_MIN_OFFSET} "
                                 "(use 'full')")

    @classmethod
    def from_modelopt(cls, w13: torch.Tensor, w13_scale: torch.Tensor, w13_scale_2: torch.Tensor,
                      w2: torch.Tensor, w2_scale: torch.Tensor, w2_scale_2: torch.Tensor,
                      *, out_of_window: str = "round") -> "W4A8MoEWeights":
        """From SGLang's ModelOpt NVFP4 MoE tensors (shapes as NVFP4MoEWeights.from_modelopt; block
        scales float8_e4m3fn or their uint8 bits, w13_scale_2 [E, 2] or [E]). Every nonzero block
        scale must be an exact power of two (as k3nvfp4-cast writes them): ValueError naming
        w13 / w2 otherwise (no lossy path: serve such a checkpoint with W4A16). out_of_window:
        "round" (default; counted, warned) or "refuse" (prep.py). The inputs are not modified."""
        E, I, H = validate_modelopt(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
        _check_shape(H, I)
        w13_scale = w13_scale.view(torch.float8_e4m3fn) if w13_scale.dtype == torch.uint8 else w13_scale
        w2_scale = w2_scale.view(torch.float8_e4m3fn) if w2_scale.dtype == torch.uint8 else w2_scale
        s13 = gate_up_scale_2(w13_scale_2, E).float()
        rows13 = s13.repeat_interleave(I, dim=1)  # [E, 2I]: gate rows the gate's scale_2, up rows the up's
        rows2 = w2_scale_2.reshape(E, 1).float().expand(E, H)
        p13 = prepare_w4a8_from_nvfp4(w13, w13_scale, rows13, name="w13", out_of_window=out_of_window)
        p2 = prepare_w4a8_from_nvfp4(w2, w2_scale, rows2, name="w2", out_of_window=out_of_window)
        return cls._of(p13, p2, H, I)

    @classmethod
    def from_mxfp4(cls, w13: torch.Tensor, w13_e8m0: torch.Tensor, w2: torch.Tensor, w2_e8m0: torch.Tensor,
                   *, out_of_window: str = "round") -> "W4A8MoEWeights":
        """From the MXFP4 release's tensors (MXFP4MoETensors' shapes: E2M1 nibbles uint8, E8M0 bytes
        uint8 per 32; byte 255 = NaN is refused naming the tensor). No cast in between: the E8M0
        exponents become the offsets and the row exponent directly."""
        for name, t in (("w13", w13), ("w13_e8m0", w13_e8m0), ("w2", w2), ("w2_e8m0", w2_e8m0)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 3:
                raise TypeError(f"{name}: expected a uint8 tensor with 3 dims, got "
                                f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        E, two_i, half_h = w13.shape
        I, H = two_i // 2, half_h * 2
        if tuple(w2.shape) != (E, H, I // 2):
            raise ValueError(f"w2: expected shape {(E, H, I // 2)}, got {tuple(w2.shape)}")
        _check_shape(H, I)
        p13 = prepare_w4a8_from_mxfp4(w13, w13_e8m0, name="w13", out_of_window=out_of_window)
        p2 = prepare_w4a8_from_mxfp4(w2, w2_e8m0, name="w2", out_of_window=out_of_window)
        return cls._of(p13, p2, H, I)

    @classmethod
    def _of(cls, p13: W4A8Weights, p2: W4A8Weights, H: int, I: int) -> "W4A8MoEWeights":
        w13, o13 = to_fragment_order(p13.packed, p13.offsets, p13.block)
        w2, o2 = to_fragment_order(p2.packed, p2.offsets, p2.block)
        return cls(w13, o13, p13.row_scale.contiguous(), w2, o2, p2.row_scale.contiguous(), H, I, p13.block,
                   p13.out_of_window + p2.out_of_window, p13.rounded + p2.rounded, p13.table, p2.table)

    def matrices(self) -> tuple[W4A8Weights, W4A8Weights]:
        """(w13, w2) as prep.W4A8Weights in the logical layout (nibbles uint8 [E, N, K/2], offsets int8
        [E, N, K/block]; for the torch reference: expand_e4m3, dequantize)."""
        r13 = torch.zeros(self.w13_row_scale.shape, dtype=torch.int32, device=self.device)  # row exponent folded
        r2 = torch.zeros(self.w2_row_scale.shape, dtype=torch.int32, device=self.device)
        p13, o13 = from_fragment_order(self.w13, self.w13_offsets, self.block)
        p2, o2 = from_fragment_order(self.w2, self.w2_offsets, self.block)
        return (W4A8Weights("w13", p13, o13, r13, self.w13_row_scale, self.block, 0, 0, self.w13_table),
                W4A8Weights("w2", p2, o2, r2, self.w2_row_scale, self.block, 0, 0, self.w2_table))

    def to(self, device) -> "W4A8MoEWeights":
        return dataclasses.replace(self, **{f: getattr(self, f).to(device) for f in (
            "w13", "w13_offsets", "w13_row_scale", "w2", "w2_offsets", "w2_row_scale")})


def _check_shape(H: int, I: int) -> None:
    bad = [f"{name} = {v}" for name, v in (("hidden size H", H), ("intermediate size I", I))
           if v % W4A8_SHAPE_MULTIPLE]
    if bad:
        raise ValueError(f"W4A8MoEWeights: {' and '.join(bad)} not a multiple of {W4A8_SHAPE_MULTIPLE} (the W4A8 "
                         f"mode's K steps are 64 or 128 wide, unmasked); W4A16 (act_quant 'none') takes multiples "
                         "of 16")
