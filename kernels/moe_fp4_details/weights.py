"""FP4MMAWeights: expert weights in the plain layouts ``tl.dot_scaled`` reads.

Both FP4 modes read the ModelOpt nibbles unchanged (uint8 [E, N, K/2], K contiguous, low nibble =
even element). act_quant="nvfp4" reads the E4M3 block scales per 16 and applies scale_2 to the
fp32 accumulator; act_quant="mxfp8" needs E8M0 scales per 32 (MXFP4 weights, K3's own format),
recovered exactly from the NVFP4 tensors by :func:`recover_e8m0`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import formats
from ..cast import MXFP4Weight, cast_expert
from ..moe_details import layout_host
from ..moe_details.weights import ExpertWeights, ModelOptMoETensors, gate_up_scale_2, validate_modelopt


# H and I of the FP4 modes: whole 64-wide K tiles for tl.dot_scaled (GEMM1 runs K = H, GEMM2 K = I)
# with no masks on the K loop. Stricter than W4A16's NVFP4 block of 16; enforced in from_modelopt.
FP4_SHAPE_MULTIPLE = 64


class E8M0RecoveryError(ValueError):
    """An NVFP4 matrix whose blocks are not exactly MXFP4 (refused for act_quant="mxfp8")."""


def _pow2_exponent(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 values -> (is an exact positive power of two, its exponent as int32)."""
    mant, exp = torch.frexp(v)
    return (v > 0) & (mant == 0.5), (exp - 1).to(torch.int32)


def recover_e8m0(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, name: str, *,
                 use: str = "act_quant='mxfp8'") -> torch.Tensor:
    """E8M0 bytes per 32 of an NVFP4 matrix set that is exactly MXFP4.

    packed uint8 [E, N, K/2]; scale float8_e4m3fn [E, N, K/16]; scale_2 float32 [E, N] (the scale_2
    of each row: gate and up rows of w13 may differ). Per 32-block the two E4M3 scales must be the
    same power of two 2^j (a 16-half that is zero - nibbles all +-0 or scale 0 - may carry any
    scale) and scale_2 must be a power of two 2^m; the byte is j + m + 127, which must lie in
    [1, 254] (0 would be decoded as 0 by Triton 3.8). Blocks that are zero throughout get byte 127.
    Returns uint8 [E, N, K/32]; raises E8M0RecoveryError naming ``name``, the first bad block and
    ``use`` (what needs the MXFP4 weights: act_quant='mxfp8', or another consumer of them).
    """
    E, N, half_k = packed.shape
    K = half_k * 2
    if K % formats.MXFP4_BLOCK:
        raise E8M0RecoveryError(f"{name}: K = {K} is not a multiple of 32 (the MXFP4 block)")
    s2_ok, m = _pow2_exponent(scale_2.float())
    if not bool(s2_ok.all()):
        bad = torch.nonzero(~s2_ok)[0].tolist()
        raise E8M0RecoveryError(
            f"{name}: weight_scale_2 {float(scale_2[tuple(bad)]):.9g} (expert {bad[0]}) is not a power of two, "
            f"so its blocks have no E8M0 scale; {use} needs a checkpoint cast bit-exactly from MXFP4"
        )
    if packed.device.type == "cpu" and scale.device.type == "cpu":
        fast = layout_host.e8m0_from_pow2_e4m3(packed.contiguous().numpy(), scale.contiguous().view(torch.uint8).numpy(),
                                                m.to(torch.int32).contiguous().numpy())
        if fast is not None and fast[1] == 0:
            return torch.from_numpy(fast[0])
        # else: the torch path below finds the first bad block for the message
    # The torch path (CUDA, or the host without numba, or a bad block to name): experts in chunks,
    # so that its float temporaries (~40 bytes per 32-block) stay bounded whatever the layer.
    step = max(1, _RECOVERY_CHUNK_BLOCKS // max(1, N * (K // 32)))
    out, bad_total, first = [], 0, None
    for e0 in range(0, E, step):
        byte, bad, why = _recover_chunk(packed[e0:e0 + step], scale[e0:e0 + step], m[e0:e0 + step])
        out.append(byte)
        if why is not None:
            bad_total += bad
            if first is None:
                first = (why[0] + e0, *why[1:])
    if first is not None:
        e, n, b, why = first
        raise E8M0RecoveryError(
            f"{name}: {bad_total} block(s) are not exact MXFP4; first at expert {e}, row {n}, 32-block {b} "
            f"(elements {32 * b}..{32 * b + 31}): {why}. {use} is refused for this matrix"
        )
    return torch.cat(out) if len(out) > 1 else out[0]


_RECOVERY_CHUNK_BLOCKS = 1 << 22  # 32-blocks per torch-path chunk: ~160 MB of temporaries at most


def _recover_chunk(packed: torch.Tensor, scale: torch.Tensor, m: torch.Tensor
                   ) -> tuple[torch.Tensor, int, tuple | None]:
    """recover_e8m0's rule on experts packed [e, N, K/2], scale [e, N, K/16], m int32 [e, N]:
    (bytes uint8 [e, N, K/32], bad-block count, (expert, row, block, why) of the first or None)."""
    E, N, half_k = packed.shape
    K = half_k * 2
    sf = formats.e4m3_to_float(scale).reshape(E, N, K // 32, 2)
    # [E, N, K/32, 2]: the 16-half has a non-zero value (some nibble is not +-0 and its scale is not 0)
    nz = ((packed.reshape(E, N, K // 32, 2, 8) & 0x77).amax(-1) != 0) & (sf != 0)
    s_ok, j = _pow2_exponent(sf)
    half_bad = nz & ~s_ok
    j_any = torch.where(nz[..., 0], j[..., 0], j[..., 1])
    disagree = nz[..., 0] & nz[..., 1] & (j[..., 0] != j[..., 1])
    byte = j_any + m[:, :, None] + formats.E8M0_BIAS
    used = nz.any(-1)
    out_of_range = used & ((byte < 1) | (byte > 254))
    bad = half_bad.any(-1) | disagree | out_of_range
    first = None
    if bool(bad.any()):
        e, n, b = torch.nonzero(bad)[0].tolist()
        why = ("a block scale that is not a power of two (a re-quantized block)" if bool(half_bad[e, n, b].any())
               else "two 16-block scales that differ" if bool(disagree[e, n, b])
               else f"an exponent outside E8M0 [1, 254] (byte {int(byte[e, n, b])})")
        first = (e, n, b, why)
    out = torch.where(used, byte, torch.full_like(byte, formats.E8M0_BIAS)).to(torch.uint8).contiguous()
    return out, int(bad.sum()), first


FP4_ACT_QUANT_MODES = ("nvfp4", "mxfp8")
FP4_PREPARE_HINT = "FP4MMAWeights.from_modelopt / from_mxfp4(..., act_quant=...)"


@dataclass(frozen=True)
class FP4MMAWeights(ExpertWeights):
    """Routed-expert weights of one layer for the block-scaled MMA kernels, prepared for ONE mode
    (``act_quant``): the mode a call runs is the one its weights were prepared for.

      w13          uint8 [E, 2I, H/2]     gate (w1) rows then up (w3) rows, E2M1 nibbles
      w13_scale    float8_e4m3fn [E, 2I, H/16]   ("nvfp4"; None for "mxfp8")
      w13_scale_2  float32 [E, 2]         (gate, up); all 1 for "mxfp8" (folded into the E8M0 scales)
      w2           uint8 [E, H, I/2]
      w2_scale     float8_e4m3fn [E, H, I/16]    ("nvfp4"; None for "mxfp8")
      w2_scale_2   float32 [E]            all 1 for "mxfp8"
      w13_e8m0     uint8 [E, 2I, H/32]    ("mxfp8"; None for "nvfp4"), scale_2 folded in
      w2_e8m0      uint8 [E, H, I/32]     ("mxfp8"; None for "nvfp4")
      act_quant    "nvfp4" (W4A4: NVFP4 activations) or "mxfp8" (W4A8: MXFP8 activations)
    H and I must be multiples of 64 (whole K tiles for the MMA, no masks on the K loop).
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor | None
    w13_scale_2: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor | None
    w2_scale_2: torch.Tensor
    w13_e8m0: torch.Tensor | None
    w2_e8m0: torch.Tensor | None
    hidden_size: int
    intermediate_size: int
    act_quant: str = "nvfp4"

    def __post_init__(self) -> None:
        if self.act_quant not in FP4_ACT_QUANT_MODES:
            raise ValueError(f"FP4MMAWeights.act_quant: expected one of {FP4_ACT_QUANT_MODES}, got {self.act_quant!r}")
        need = ("w13_scale", "w2_scale") if self.act_quant == "nvfp4" else ("w13_e8m0", "w2_e8m0")
        missing = [n for n in need if getattr(self, n) is None]
        if missing:
            raise ValueError(f"FP4MMAWeights: act_quant={self.act_quant!r} needs {' and '.join(missing)}; prepare "
                             "the weights with FP4MMAWeights.from_modelopt / from_mxfp4(..., act_quant=...)")

    @classmethod
    def from_modelopt(
        cls,
        w13: torch.Tensor,
        w13_scale: torch.Tensor,
        w13_scale_2: torch.Tensor,
        w2: torch.Tensor,
        w2_scale: torch.Tensor,
        w2_scale_2: torch.Tensor,
        *,
        act_quant: str,
    ) -> "FP4MMAWeights":
        """The weights of mode ``act_quant`` from SGLang's ModelOpt NVFP4 MoE tensors (shapes as
        NVFP4MoEWeights.from_modelopt; scales float8_e4m3fn or their uint8 bits, w13_scale_2 [E, 2]
        or [E]); the inputs are not modified. "nvfp4" keeps the tensors as they are; "mxfp8"
        recovers the E8M0 scales per 32 (E8M0RecoveryError when the matrices are not exact MXFP4).
        H and I must be multiples of 64 (FP4_SHAPE_MULTIPLE): ValueError naming the one that is not."""
        _check_mode(act_quant)
        E, I, H = validate_modelopt(w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2)
        _check_fp4_shape(H, I)
        w13_scale = w13_scale.view(torch.float8_e4m3fn) if w13_scale.dtype == torch.uint8 else w13_scale
        w2_scale = w2_scale.view(torch.float8_e4m3fn) if w2_scale.dtype == torch.uint8 else w2_scale
        s13 = gate_up_scale_2(w13_scale_2, E).float()
        s2 = w2_scale_2.reshape(E).float().contiguous()
        if act_quant == "nvfp4":
            return cls(w13.contiguous(), w13_scale.contiguous(), s13, w2.contiguous(), w2_scale.contiguous(), s2,
                       None, None, H, I, act_quant)
        rows13 = torch.cat([s13[:, :1].expand(E, I), s13[:, 1:].expand(E, I)], dim=1)
        e13 = recover_e8m0(w13, w13_scale, rows13, "w13")
        e2 = recover_e8m0(w2, w2_scale, s2[:, None].expand(E, H), "w2")
        return cls._mxfp8(w13, e13, w2, e2, H, I)

    @classmethod
    def from_mxfp4(
        cls,
        w13: torch.Tensor,
        w13_e8m0: torch.Tensor,
        w2: torch.Tensor,
        w2_e8m0: torch.Tensor,
        *,
        act_quant: str,
    ) -> "FP4MMAWeights":
        """The weights of mode ``act_quant`` from the MXFP4 release's tensors (MXFP4MoETensors'
        shapes: E2M1 nibbles uint8, E8M0 bytes uint8 per 32). "mxfp8" takes them as they are (the
        kernels' MXFP4 operands); "nvfp4" runs the closed-form cast (kernels/cast.py, what
        k3nvfp4-cast writes: scale_2 per expert and matrix, E4M3 scales per 16) and keeps its tensors."""
        _check_mode(act_quant)
        _check_mxfp4(w13, w13_e8m0, w2, w2_e8m0)
        E, two_i, half_h = w13.shape
        I, H = two_i // 2, half_h * 2
        _check_fp4_shape(H, I)
        if act_quant == "mxfp8":
            for name, packed, t in (("w13_e8m0", w13, w13_e8m0), ("w2_e8m0", w2, w2_e8m0)):
                used = (packed.reshape(*t.shape, 16) & 0x77).amax(-1) != 0  # blocks with a non-zero value
                bad = int((t == formats.E8M0_NAN).sum()) + int(((t == 0) & used).sum())
                if bad:
                    raise E8M0RecoveryError(f"{name}: {bad} E8M0 byte(s) are 255 (NaN), or 0 on a non-zero block; "
                                            "act_quant='mxfp8' takes E8M0 in [1, 254] (Triton decodes 0 as 0)")
            return cls._mxfp8(w13, w13_e8m0, w2, w2_e8m0, H, I)
        return cls.from_modelopt(*cast_mxfp4_moe(w13, w13_e8m0, w2, w2_e8m0), act_quant="nvfp4")

    @classmethod
    def _mxfp8(cls, w13, e13, w2, e2, H: int, I: int) -> "FP4MMAWeights":
        E, dev = w13.shape[0], w13.device
        ones13 = torch.ones(E, 2, dtype=torch.float32, device=dev)
        ones2 = torch.ones(E, dtype=torch.float32, device=dev)
        return cls(w13.contiguous(), None, ones13, w2.contiguous(), None, ones2, e13.contiguous(), e2.contiguous(),
                   H, I, "mxfp8")

    def to(self, device) -> "FP4MMAWeights":
        import dataclasses

        return dataclasses.replace(self, **{
            f: (getattr(self, f).to(device) if getattr(self, f) is not None else None)
            for f in ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2", "w13_e8m0", "w2_e8m0")
        })


def _check_mode(act_quant: str) -> None:
    if act_quant not in FP4_ACT_QUANT_MODES:
        raise ValueError(f"act_quant: expected one of {FP4_ACT_QUANT_MODES}, got {act_quant!r}")


def _check_fp4_shape(H: int, I: int) -> None:
    sizes = (("hidden size H", H), ("intermediate size I", I))
    bad = [f"{name} = {v}" for name, v in sizes if v % FP4_SHAPE_MULTIPLE]
    if bad:
        raise ValueError(
            f"FP4MMAWeights: {' and '.join(bad)} {'is' if len(bad) == 1 else 'are'} not a multiple of "
            f"{FP4_SHAPE_MULTIPLE}: the FP4 tensor-core "
            f"modes (act_quant 'nvfp4' / 'mxfp8') need H and I multiples of {FP4_SHAPE_MULTIPLE} (whole "
            f"{FP4_SHAPE_MULTIPLE}-wide K tiles of the block-scaled MMA, no masks on the K loop); W4A16 "
            "(act_quant 'none') takes multiples of 16"
        )


def _check_mxfp4(w13, w13_e8m0, w2, w2_e8m0) -> None:
    for name, t in (("w13", w13), ("w13_e8m0", w13_e8m0), ("w2", w2), ("w2_e8m0", w2_e8m0)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 3:
            raise TypeError(f"{name}: expected a uint8 tensor with 3 dims, got "
                            f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    E, two_i, half_h = w13.shape
    I, H = two_i // 2, half_h * 2
    for name, t, shape in (("w13_e8m0", w13_e8m0, (E, 2 * I, H // 32)), ("w2", w2, (E, H, I // 2)),
                           ("w2_e8m0", w2_e8m0, (E, H, I // 32))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def cast_mxfp4_moe(w13: torch.Tensor, w13_e8m0: torch.Tensor, w2: torch.Tensor, w2_e8m0: torch.Tensor,
                   *, backend: str = "auto") -> ModelOptMoETensors:
    """The closed-form cast (kernels.cast.cast_expert, what k3nvfp4-cast writes) of one layer's
    MXFP4 experts (MXFP4MoETensors' shapes) as ModelOpt tensors: w1 and w3 of an expert share
    scale_2 (w13_scale_2 [E, 2] holds it twice), w2 its own."""
    E, two_i, _ = w13.shape
    I = two_i // 2
    casts = [cast_expert(MXFP4Weight(w13[e, :I], w13_e8m0[e, :I], f"expert {e} w1"),
                         MXFP4Weight(w13[e, I:], w13_e8m0[e, I:], f"expert {e} w3"),
                         MXFP4Weight(w2[e], w2_e8m0[e], f"expert {e} w2"), backend=backend)
             for e in range(E)]  # fmt: skip
    return ModelOptMoETensors(
        torch.stack([torch.cat([c[0].packed, c[1].packed]) for c in casts]),
        torch.stack([torch.cat([c[0].scale, c[1].scale]) for c in casts]),
        torch.stack([torch.stack([c[0].scale_2, c[1].scale_2]) for c in casts]).to(torch.float32),
        torch.stack([c[2].packed for c in casts]),
        torch.stack([c[2].scale for c in casts]),
        torch.stack([c[2].scale_2 for c in casts]).reshape(-1).to(torch.float32),
    )
