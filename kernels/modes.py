"""The kernel modes of the fused MoE, one small object each: how one K step's operands are
prepared, which prepared weights the mode takes (and how they are prepared at load from the
checkpoint's tensors), its launch-config class and its cost table.

  mode    weights (prepared once, at load)     one K step of GEMM1 / GEMM2
  none    NVFP4MoEWeights (moe_details/)       W4A16: FP4 weight tile dequantized in registers
                                                (e2m1 x block scale -> bf16), bf16 x bf16 MMA
  nvfp4   FP4MMAWeights(act_quant="nvfp4")     W4A4: activations quantized to NVFP4 once per
                                                token, e2m1 x e2m1 block-scaled MMA (E4M3 per 16)
  mxfp8   FP4MMAWeights(act_quant="mxfp8")     W4A8: activations MXFP8, e4m3 x e2m1 block-scaled
                                                MMA (E8M0 per 32)
  e4m3    W4A8MoEWeights (moe_w4a8_details/)   W4A8 on Hopper: weights expanded exactly to E4M3 in
                                                registers, activations E4M3 (fp32 scale per 128),
                                                e4m3 x e4m3 MMA (FP8 wgmma), fp32 promotion per 128 K

The prepared weights choose the kernels: ``k3nvfp4.kernels.fused_moe_nvfp4`` runs the mode its
weights were prepared for (:func:`mode_of`), and no call converts one mode's prepared layout
into another's. A new mode is one more entry here, its weights class with ``from_modelopt`` /
``from_mxfp4``, its kernels on the shared skeleton (moe_details/skeleton.py) and one dispatch
branch in kernels/moe.py; "e4m3" (FP8 activations on Hopper) was added that way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .moe_details.config import MoEConfig
from .moe_details.layout import E5M3_16, E8M0_32
from .moe_details.weights import ModelOptMoETensors, MXFP4MoETensors, NVFP4MoEWeights
from .moe_fp4_details.config import FP4MoEConfig
from .moe_fp4_details.weights import FP4MMAWeights
from .moe_w4a8_details.config import W4A8Config
from .moe_w4a8_details.weights import W4A8MoEWeights

CheckpointTensors = ModelOptMoETensors | MXFP4MoETensors


@dataclass(frozen=True)
class KernelMode:
    """One mode of the fused MoE (module docstring).

    name: the K3NVFP4_ACT_QUANT value ("none", "nvfp4", "mxfp8", "e4m3"); label: "W4A16" / "W4A4" /
    "W4A8" (mxfp8 and e4m3 are both W4A8: MXFP8 on Blackwell's block-scaled MMA, E4M3 on Hopper);
    operands: how one K step's operands are prepared (for docs, logs and reports);
    weights_type: the prepared weights this mode takes; config_type: its launch config;
    cost_modes: its sections of the measured tile-cost table (kernels/cost_table.py, read by
    the config class's heuristic through kernels/costs.py); () for a mode not measured yet;
    from_modelopt / from_mxfp4: prepare the weights from the ModelOpt NVFP4 / MXFP4 tensors.
    """

    name: str
    label: str
    operands: str
    weights_type: type
    config_type: type
    cost_modes: tuple[str, ...]
    from_modelopt: Callable[..., Any]
    from_mxfp4: Callable[..., Any]

    def prepare(self, tensors: CheckpointTensors) -> Any:
        """This mode's weights from one layer's checkpoint tensors (ModelOptMoETensors or
        MXFP4MoETensors), on their device."""
        if isinstance(tensors, ModelOptMoETensors):
            return self.from_modelopt(*tensors)
        if isinstance(tensors, MXFP4MoETensors):
            return self.from_mxfp4(*tensors)
        raise TypeError(f"tensors: expected ModelOptMoETensors or MXFP4MoETensors, got {type(tensors).__name__}")

    def takes(self, weights: Any) -> bool:
        """True where ``weights`` were prepared for this mode."""
        return isinstance(weights, self.weights_type) and getattr(weights, "act_quant", "none") == self.name


def _fp4(act_quant: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    return (lambda *t: FP4MMAWeights.from_modelopt(*t, act_quant=act_quant),
            lambda *t: FP4MMAWeights.from_mxfp4(*t, act_quant=act_quant))


W4A16 = KernelMode(
    "none", "W4A16", "FP4 weight tile dequantized in registers to bf16, bf16 x bf16 MMA (wgmma / mma)",
    NVFP4MoEWeights, MoEConfig, tuple(MoEConfig.cost_mode(f) for f in (E5M3_16, E8M0_32)),  # both scale formats
    lambda *t: NVFP4MoEWeights.from_modelopt(*t), lambda *t: NVFP4MoEWeights.from_mxfp4(*t),
)
W4A4_NVFP4 = KernelMode(
    "nvfp4", "W4A4", "activations NVFP4 (E4M3 per 16, fp32 per row) x NVFP4 weights, tl.dot_scaled e2m1 x e2m1",
    FP4MMAWeights, FP4MoEConfig, (FP4MoEConfig.cost_mode("nvfp4"),), *_fp4("nvfp4"),
)
W4A8_MXFP8 = KernelMode(
    "mxfp8", "W4A8", "activations MXFP8 (E8M0 per 32) x MXFP4 weights, tl.dot_scaled e4m3 x e2m1",
    FP4MMAWeights, FP4MoEConfig, (FP4MoEConfig.cost_mode("mxfp8"),), *_fp4("mxfp8"),
)

W4A8_E4M3 = KernelMode(
    "e4m3", "W4A8",
    "E2M1 weights expanded exactly to E4M3 in registers (x 2^r x scale_2 per row), activations E4M3 "
    "(fp32 scale per token per 128), tl.dot e4m3 x e4m3 (FP8 wgmma on sm90), fp32 promotion per 128 K",
    W4A8MoEWeights, W4A8Config, W4A8Config.cost_modes(),  # both weight blocks x both E4M3 tables
    lambda *t: W4A8MoEWeights.from_modelopt(*t), lambda *t: W4A8MoEWeights.from_mxfp4(*t),
)

MODES: dict[str, KernelMode] = {m.name: m for m in (W4A16, W4A4_NVFP4, W4A8_MXFP8, W4A8_E4M3)}
MODE_NAMES = tuple(MODES)


def kernel_mode(name: str, what: str = "act_quant") -> KernelMode:
    """The mode called ``name``; ValueError naming ``what`` and the known modes otherwise."""
    try:
        return MODES[name]
    except (KeyError, TypeError):
        raise ValueError(f"{what}: expected one of {', '.join(MODE_NAMES)}, got {name!r}") from None


def mode_of(weights: Any) -> KernelMode:
    """The mode ``weights`` were prepared for; TypeError naming ``weights`` for anything else."""
    for mode in MODES.values():
        if mode.takes(weights):
            return mode
    raise TypeError(f"weights: expected prepared MoE weights (NVFP4MoEWeights for W4A16, FP4MMAWeights for the FP4 "
                    f"modes, W4A8MoEWeights for e4m3: k3nvfp4.kernels.modes.MODES[mode].prepare(checkpoint tensors)), got {type(weights).__name__}")
