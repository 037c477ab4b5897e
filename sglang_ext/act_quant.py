"""Which activation quantization ``triton_situ`` runs: ``K3NVFP4_ACT_QUANT`` (and its input scale).

- ``none`` (default everywhere): W4A16, FP4 weights dequantized in registers, bf16 MMA. The
  default on Blackwell too: it has the numerics of the deployed marlin W4A16 path, and the FP4
  modes' accuracy cost on the real model is not measured yet (``k3nvfp4-ab layer --arms
  reference,triton_situ,triton_situ:nvfp4,triton_situ:mxfp8`` measures it on a layer).
- ``mxfp8``: W4A8, MXFP8 activations against MXFP4 weights (Kimi-K3's native numerics; the
  E8M0 weight scales are recovered exactly from the NVFP4 tensors, or the load stops naming the
  matrix that has none); Blackwell's ``kind::mxf8f6f4`` MMA.
- ``e4m3``: W4A8 on Hopper: the 4-bit weights expanded exactly to E4M3 in registers (prepared at
  load: one exponent offset per block, one fp32 factor per row; the NVFP4 block scales must be
  powers of two, as k3nvfp4-cast writes them, else the load stops naming the layer and matrix),
  E4M3 activations with one fp32 scale per token per 128 columns, FP8 wgmma (docs/w4a8.md).
  Selectable, not the default: no GPU speed or real-model accuracy is measured yet.
- ``nvfp4``: W4A4, NVFP4 activations (dynamic per-token scale); Blackwell's ``kind::mxf4nvf4``.
  ``K3NVFP4_NVFP4_INPUT_SCALE=checkpoint`` uses a W4A4 checkpoint's ``input_scale`` instead
  (the max over the layer's experts of w1/w3's, one static scale; default ``dynamic``).

Off Blackwell the FP4 modes run decomposed (correct, not fast; the load log says so). The modes
are kernels/modes.py's MODES: a mode added there is selectable here.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from .names import BACKEND_NAME

logger = logging.getLogger(__name__)

ENV_ACT_QUANT = "K3NVFP4_ACT_QUANT"
ENV_INPUT_SCALE = "K3NVFP4_NVFP4_INPUT_SCALE"
DEFAULT_ACT_QUANT = "none"
INPUT_SCALE_MODES = ("dynamic", "checkpoint")
# Layer attribute: the static NVFP4 input scale (a float) when the checkpoint's is used.
INPUT_SCALE_ATTR = "k3nvfp4_input_scale"


def act_quant_modes() -> tuple[str, ...]:
    """The selectable modes: kernels/modes.py's MODE_NAMES (imported here, not at module import)."""
    from k3nvfp4.kernels.modes import MODE_NAMES

    return MODE_NAMES


def selected_act_quant() -> str:
    """The mode K3NVFP4_ACT_QUANT asks for (default none); a bad value names the variable."""
    raw = os.environ.get(ENV_ACT_QUANT, DEFAULT_ACT_QUANT).strip().lower() or DEFAULT_ACT_QUANT
    modes = act_quant_modes()
    if raw not in modes:
        raise ValueError(f"{ENV_ACT_QUANT}={os.environ[ENV_ACT_QUANT]!r}: expected one of {', '.join(modes)}")
    return raw


def selected_input_scale() -> str:
    raw = os.environ.get(ENV_INPUT_SCALE, "dynamic").strip().lower() or "dynamic"
    if raw not in INPUT_SCALE_MODES:
        raise ValueError(f"{ENV_INPUT_SCALE}={os.environ[ENV_INPUT_SCALE]!r}: expected one of {', '.join(INPUT_SCALE_MODES)}")
    return raw


def where_it_runs(act_quant: str) -> str:
    """For the load log: native block-scaled MMA, decomposed, or the interpreter."""
    if act_quant == "none":
        return "bf16 MMA (W4A16)"
    if act_quant == "e4m3":
        if not torch.cuda.is_available():
            return "Triton interpreter (E4M3 x E4M3 tl.dot)"
        from k3nvfp4.kernels import target

        major, minor = target.capability()
        return (f"sm{major}{minor}: FP8 tl.dot e4m3 x e4m3 (wgmma on sm90), weights expanded to E4M3 in registers "
                "(a per-block byte table and PRMT, exact)")
    if not torch.cuda.is_available():
        return "Triton interpreter (tl.dot_scaled decomposed)"
    from k3nvfp4.kernels import target

    major, minor = target.capability()
    if major == 10:
        return f"sm{major}{minor}: native tcgen05 block-scaled MMA"
    return f"sm{major}{minor}: tl.dot_scaled decomposed (correct, not the Blackwell fast path)"


def kernel_weights_for_mode(tensors: Any, act_quant: str, layer_name: str) -> Any:
    """The weights the kernels take in this mode, prepared once, at load, from the layer's
    checkpoint tensors (``tensors``: ModelOptMoETensors or MXFP4MoETensors) by the mode itself
    (kernels/modes.py): NVFP4MoEWeights for none, FP4MMAWeights for nvfp4 / mxfp8,
    W4A8MoEWeights for e4m3. No mode's layout is built on the way to another's."""
    from k3nvfp4.kernels.modes import kernel_mode

    mode = kernel_mode(act_quant, ENV_ACT_QUANT)
    if mode.name == "none":
        return mode.prepare(tensors)
    if mode.name == "e4m3":
        return _prepare_e4m3(mode, tensors, layer_name)
    from k3nvfp4.kernels.moe_fp4 import E8M0RecoveryError, check_fp4_mode_supported

    check_fp4_mode_supported(act_quant, tensors[0].device)  # a clear error at load, not at the first forward
    try:
        return mode.prepare(tensors)
    except E8M0RecoveryError as err:
        raise ValueError(
            f"{BACKEND_NAME} with {ENV_ACT_QUANT}=mxfp8: layer {layer_name!r}: {err}. Use "
            f"{ENV_ACT_QUANT}=nvfp4 or none for this checkpoint."
        ) from None


def _prepare_e4m3(mode: Any, tensors: Any, layer_name: str) -> Any:
    """The e4m3 (W4A8) weights: the device checked at load; a refused matrix (a non-power-of-two
    NVFP4 block scale, an E8M0 NaN) stops the load naming the layer; re-encoded out-of-window
    blocks, and each matrix that takes the slower full E4M3 table, are logged with the layer's name."""
    import warnings

    from k3nvfp4.kernels.moe_w4a8 import check_w4a8_supported

    check_w4a8_supported(tensors[0].device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            weights = mode.prepare(tensors)
        except ValueError as err:
            raise ValueError(f"{BACKEND_NAME} with {ENV_ACT_QUANT}=e4m3: layer {layer_name!r}: {err}") from None
    for w in caught:
        logger.warning("%s with %s=e4m3: layer %r: %s", BACKEND_NAME, ENV_ACT_QUANT, layer_name, w.message)
    full = [name for name, table in (("w13", weights.w13_table), ("w2", weights.w2_table)) if table == "full"]
    if full:
        logger.info("%s with %s=e4m3: layer %r: %s take(s) the full E4M3 table (a block 12 or more binades below "
                    "its row's largest; docs/w4a8.md)", BACKEND_NAME, ENV_ACT_QUANT, layer_name, " and ".join(full))
    return weights


def static_input_scale(layer: Any, act_quant: str) -> float | None:
    """The W4A4 checkpoint's GEMM1 input scale (max over the layer's w13 input_scale) when
    K3NVFP4_NVFP4_INPUT_SCALE=checkpoint and the mode is nvfp4; else None (dynamic)."""
    if act_quant != "nvfp4" or selected_input_scale() != "checkpoint":
        return None
    scale = getattr(layer, "w13_input_scale", None)
    if not isinstance(scale, torch.Tensor) or not scale.numel():
        raise ValueError(
            f"{ENV_INPUT_SCALE}=checkpoint: layer {getattr(layer, 'layer_name', '?')!r} has no w13_input_scale "
            "(a W4A16 checkpoint); unset it for dynamic scales"
        )
    value = float(scale.detach().float().max())
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{ENV_INPUT_SCALE}=checkpoint: layer w13_input_scale max is {value}; expected a finite value > 0")
    return value
