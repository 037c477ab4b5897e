"""Closed-form, bit-exact MXFP4 -> NVFP4 cast (tensor level).

For a group of matrices that share one ``scale_2`` (w1 and w3 of an expert, which a fused
GEMM1 and marlin read with one scale; or a single w2):

    k_j     = e8m0_j - 127                   per 32-element source block
    k_max   = max_j k_j                      over the whole group
    m       = k_max - 8,   scale_2 = 2^m     (FP32)
    scale   = 2^(k_j - m)  for both 16-element halves of block j (E4M3)
    nibbles copied verbatim                  (the packed bytes are returned as is)

so e4m3(scale) * scale_2 == 2^k_j exactly whenever k_max - k_j <= 17 (E4M3 holds 2^-9..2^8).
Blocks outside that window ("out of range") are re-quantized per 16-block with the E4M3
scale that minimises the squared error (``cast_details.requant``) and reported.

Zero-exponent blocks (e8m0 == 0, what MXFP4 quantizers emit for all-zero blocks) are
ordinary blocks with k = -127: they never raise k_max while any other block exists, and
are exact when inside the window. When EVERY block of a group has e8m0 == 0, k_max = -127,
m = -135 and scale_2 = 2^-135 (an FP32 subnormal): every block stays bit-exact.
An out-of-range block whose 32 nibbles are all +-0 (the usual zero-exponent block) is exact
under any finite scale: it keeps its bytes, gets E4M3 code 1 (2^-9, what the search would
pick) and skips the search; it still counts as out of range (and exact).

Statistics are exact and counted in 32-element source blocks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import torch

from . import formats
from .interpreter import interpret_requested
from .cast_details.requant import requantize_blocks_e4m3
from .cast_details.scales_torch import (
    ScaleCast,
    count_true,
    e8m0_to_e4m3_torch,
    indices_below,
    out_of_range_threshold,
)

BACKENDS = ("auto", "torch", "triton")
# E4M3 scale byte given to out-of-range blocks whose nibbles are all +-0 (see _finish).
ZERO_BLOCK_SCALE_E4M3 = 0x01
_E2M1_MAGNITUDE_BITS_64 = 0x7777_7777_7777_7777  # 8 packed bytes (16 nibbles) without sign bits


@dataclass(frozen=True)
class MXFP4Weight:
    """One MXFP4 matrix. packed: uint8 [out, in/2] (low nibble = even element);
    scale: uint8 E8M0 [out, in/32]; name: used in error messages (checkpoint tensor name)."""

    packed: torch.Tensor
    scale: torch.Tensor
    name: str = "weight"


@dataclass(frozen=True)
class NVFP4Weight:
    """One NVFP4 matrix. packed: uint8 [out, in/2] (the source tensor itself when every
    block is exact); scale: float8_e4m3fn [out, in/16]; scale_2: float32 0-dim tensor."""

    packed: torch.Tensor
    scale: torch.Tensor
    scale_2: torch.Tensor


@dataclass
class CastStats:
    """Exact statistics of a cast, counted in 32-element SOURCE blocks.

    blocks: all blocks; exact_blocks: blocks whose 32 NVFP4 values equal the MXFP4 values;
    zero_exponent_blocks: blocks with e8m0 == 0; out_of_range_blocks: blocks re-quantized
    (k_max - k_j > 17; such a block still counts as exact if re-quantization reproduced it);
    max_abs_err: max |nvfp4 - mxfp4| over all elements (float64).
    """

    blocks: int = 0
    exact_blocks: int = 0
    zero_exponent_blocks: int = 0
    out_of_range_blocks: int = 0
    max_abs_err: float = 0.0

    def merge(self, other: "CastStats") -> "CastStats":
        """Statistics of both casts together (counts add, max_abs_err is the max)."""
        return CastStats(
            blocks=self.blocks + other.blocks,
            exact_blocks=self.exact_blocks + other.exact_blocks,
            zero_exponent_blocks=self.zero_exponent_blocks + other.zero_exponent_blocks,
            out_of_range_blocks=self.out_of_range_blocks + other.out_of_range_blocks,
            max_abs_err=max(self.max_abs_err, other.max_abs_err),
        )

    def __add__(self, other: "CastStats") -> "CastStats":
        if not isinstance(other, CastStats):
            return NotImplemented
        return self.merge(other)

    @property
    def all_exact(self) -> bool:
        return self.exact_blocks == self.blocks

    def to_dict(self) -> dict:
        return asdict(self)


def cast_mxfp4_to_nvfp4(
    weights: Sequence[MXFP4Weight], *, backend: str = "auto"
) -> tuple[list[NVFP4Weight], CastStats]:
    """Cast matrices that share ONE scale_2 (w1 and w3 of an expert; or a single w2).

    weights: MXFP4Weight each with packed uint8 [out, in/2] and scale uint8 [out, in/32],
    all on one device. backend: "torch", "triton" (CUDA, or CPU with TRITON_INTERPRET=1)
    or "auto" (Triton for CUDA tensors, torch otherwise).
    Returns one NVFP4Weight per input (same order; scale float8_e4m3fn [out, in/16], the
    shared scale_2 float32 0-dim) and the statistics of the group.
    """
    if not weights:
        raise ValueError("cast_mxfp4_to_nvfp4: no weights given")
    for w in weights:
        _validate(w)
    device = weights[0].packed.device
    for w in weights[1:]:
        if w.packed.device != device:
            raise ValueError(f"{w.name}: on {w.packed.device}, but {weights[0].name} is on {device}")
    scale_fn = _scale_backend(backend, device)

    # One max per matrix gives k_max AND the NaN check (255 is the largest byte).
    e8m0_max = 0
    for w in weights:
        hi = int(w.scale.max()) if w.scale.numel() else 0
        if hi == formats.E8M0_NAN:
            n = int((w.scale == formats.E8M0_NAN).sum())
            raise ValueError(f"{w.name}: {n} E8M0 scale byte(s) are 255 (NaN); the checkpoint is corrupt")
        e8m0_max = max(e8m0_max, hi)
    m = e8m0_max - formats.E8M0_BIAS - formats.E4M3_MAX_EXP2
    scale_2 = 2.0**m  # exact in FP32 for every m in [-135, 119] (subnormal below -126)

    outs: list[NVFP4Weight] = []
    stats = CastStats()
    for w in weights:
        sc = scale_fn(w.scale, e8m0_max)
        packed, scale_e4m3, st = _finish(w, sc, e8m0_max, scale_2)
        # a scale_2 tensor per matrix: safetensors refuses to save tensors sharing memory
        s2 = torch.tensor(scale_2, dtype=torch.float32, device=device)
        outs.append(NVFP4Weight(packed, scale_e4m3.view(torch.float8_e4m3fn), s2))
        stats = stats + st
    return outs, stats


def cast_expert(
    w1: MXFP4Weight, w3: MXFP4Weight, w2: MXFP4Weight, *, backend: str = "auto"
) -> tuple[NVFP4Weight, NVFP4Weight, NVFP4Weight, CastStats]:
    """Cast one expert: w1 (gate) and w3 (up) share scale_2, w2 (down) has its own.

    w1, w3: [I, H/2] packed + [I, H/32] scales; w2: [H, I/2] + [H, I/32].
    Returns (w1n, w3n, w2n, stats of all three).
    """
    for w in (w1, w3, w2):
        _validate(w)
    if w1.packed.shape != w3.packed.shape:
        raise ValueError(
            f"{w3.name}: shape {tuple(w3.packed.shape)} differs from {w1.name} {tuple(w1.packed.shape)}; "
            "w1 and w3 of one expert must have the same shape"
        )
    inter, hidden = w1.packed.shape[0], 2 * w1.packed.shape[1]
    if tuple(w2.packed.shape) != (hidden, inter // 2):
        raise ValueError(
            f"{w2.name}: packed shape {tuple(w2.packed.shape)} does not fit {w1.name} "
            f"[{inter}, {hidden}] (expected [{hidden}, {inter // 2}] for w2 = down projection)"
        )
    (w1n, w3n), st13 = cast_mxfp4_to_nvfp4([w1, w3], backend=backend)
    (w2n,), st2 = cast_mxfp4_to_nvfp4([w2], backend=backend)
    return w1n, w3n, w2n, st13 + st2


def _validate(w: MXFP4Weight) -> None:
    name = w.name
    for t, what in ((w.packed, "packed"), (w.scale, "scale")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.uint8:
            raise TypeError(f"{name}: {what} must be uint8, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name}: {what} must be 2-D, got shape {tuple(t.shape)}")
    rows, half = w.packed.shape
    in_dim = 2 * half
    if in_dim % formats.MXFP4_BLOCK:
        raise ValueError(
            f"{name}: in-dim {in_dim} (packed {tuple(w.packed.shape)}) is not a multiple of "
            f"{formats.MXFP4_BLOCK}"
        )
    expected = (rows, in_dim // formats.MXFP4_BLOCK)
    if tuple(w.scale.shape) != expected:
        raise ValueError(
            f"{name}: scale shape {tuple(w.scale.shape)} does not match packed {tuple(w.packed.shape)} "
            f"(expected {expected})"
        )
    if w.scale.device != w.packed.device:
        raise ValueError(f"{name}: scale on {w.scale.device} but packed on {w.packed.device}")


def _scale_backend(backend: str, device: torch.device):
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    if backend == "torch":
        return e8m0_to_e4m3_torch
    if device.type != "cuda" and not interpret_requested():
        raise ValueError(
            f"backend='triton' needs CUDA tensors (got {device}) or TRITON_INTERPRET=1 for CPU tensors"
        )
    from .cast_details.scales_triton import e8m0_to_e4m3_triton  # imports triton only when used

    return e8m0_to_e4m3_triton



def _finish(
    w: MXFP4Weight, sc: ScaleCast, e8m0_max: int, scale_2: float
) -> tuple[torch.Tensor, torch.Tensor, CastStats]:
    """Statistics of one matrix, re-quantizing its out-of-range blocks if it has any.

    Out-of-range blocks whose 32 nibbles are all +-0 (every zero-exponent block an MXFP4
    quantizer writes) are exact under ANY finite scale: they keep their bytes and get the
    E4M3 scale ``ZERO_BLOCK_SCALE_E4M3`` (code 1 = 2^-9, the smallest positive E4M3 value;
    the code the E4M3 search itself picks for an all-zero 16-block, so the output bytes are
    those of re-quantizing them). They still count as out of range (and as exact), as
    before. The packed tensor is copied only when some out-of-range block has a nonzero
    nibble, so a matrix whose only out-of-range blocks are zero blocks stays on the hot path.
    """
    n_blocks = w.scale.numel()
    stats = CastStats(
        blocks=n_blocks,
        exact_blocks=n_blocks - sc.out_of_range_blocks,
        zero_exponent_blocks=sc.zero_exponent_blocks,
        out_of_range_blocks=sc.out_of_range_blocks,
    )
    if sc.out_of_range_blocks == 0:
        return w.packed, sc.scale_e4m3, stats  # hot path: nibbles untouched

    thr = out_of_range_threshold(e8m0_max)
    e8m0 = w.scale.contiguous().reshape(-1)
    idx = indices_below(e8m0, thr)  # 32-block indices, row-major
    src_blocks = w.packed.contiguous().view(-1, formats.MXFP4_BLOCK // 2)  # 16 bytes = one 32-block
    sel = src_blocks[idx]  # [n_oor, 16], a small gather
    # all 32 nibbles +-0: both 8-byte halves free of magnitude bits
    zero = ((sel.view(torch.int64) & _E2M1_MAGNITUDE_BITS_64) == 0).all(1)
    scale_e4m3 = sc.scale_e4m3  # a fresh buffer from either backend
    pairs = scale_e4m3.view(-1, 2)
    n_zero = count_true(zero)
    if n_zero:
        pairs[idx[zero]] = ZERO_BLOCK_SCALE_E4M3
        stats.exact_blocks += n_zero
    if n_zero == idx.numel():
        return w.packed, scale_e4m3, stats  # only +-0 blocks out of range: nibbles untouched

    keep = ~zero
    idx, sel = idx[keep], sel[keep]
    values = formats.e2m1_to_float(formats.unpack_e2m1(sel)).to(torch.float64)
    values = values * torch.exp2(e8m0[idx].to(torch.float64) - formats.E8M0_BIAS).unsqueeze(1)
    res = requantize_blocks_e4m3(values.reshape(-1, formats.NVFP4_BLOCK), scale_2)

    packed = _copy(w.packed)
    packed.view(-1, formats.MXFP4_BLOCK // 2)[idx] = formats.pack_e2m1(res.codes.reshape(-1, formats.MXFP4_BLOCK))
    pairs[idx] = res.scale.view(-1, 2)
    stats.exact_blocks += int(res.exact.view(-1, 2).all(1).sum())
    stats.max_abs_err = float(res.max_abs_err.max())
    return packed, scale_e4m3, stats


def _copy(t: torch.Tensor) -> torch.Tensor:
    """Contiguous copy (numpy's copy is several times faster than torch's clone on CPU)."""
    if t.device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(t.numpy()).copy())
    return t.contiguous().clone()
