"""The ``triton_situ`` MoE runner core: SGLang's dispatch output -> k3nvfp4.kernels.fused_moe_nvfp4.

A ``DispatchMoeRunnerCore`` receives the standard dispatcher's output directly (hidden states
plus top-k ids/weights). Under expert parallelism SGLang's StandardDispatcher has already mapped
global expert ids to this rank's local ids, with -1 for experts on other ranks - the convention
``fused_moe_nvfp4`` takes. Under tensor parallelism the weights are this rank's shard of the
intermediate dimension; the partial sums are reduced by SGLang after combine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.moe.moe_runner.base import (
    DispatchMoeRunnerCore,
    MoeQuantInfo,
    MoeRunnerConfig,
)
from sglang.srt.layers.moe.utils import MoeRunnerBackendLike, resolve_moe_runner_backend

from k3nvfp4.kernels.activation import ActivationKind, GatedActivation, activation_kind

from .names import BACKEND_NAME


@dataclass
class TritonSituMoeQuantInfo(MoeQuantInfo):
    """What the runner needs from the layer: its NVFP4 expert weights (this rank's shard)."""

    weights: Any  # the mode's prepared weights: k3nvfp4.kernels.NVFP4MoEWeights, or FP4MMAWeights (FP4 modes)
    input_scale: float | None = None  # static NVFP4 activation scale (K3NVFP4_NVFP4_INPUT_SCALE=checkpoint)


def activation_from_config(config: MoeRunnerConfig, backend: str = BACKEND_NAME) -> GatedActivation:
    """The GatedActivation of a MoeRunnerConfig (gemm1_alpha = beta, unset: SGLang's 4.0;
    gemm1_clamp_limit = linear_beta, unset: no cap); ``backend`` names the backend in the errors."""
    if not config.is_gated:
        raise NotImplementedError(f"{backend} runs gated MoE only (got is_gated=False)")
    kind = activation_kind(config.activation, f"{backend}: activation")
    if config.gemm1_beta is not None or config.swiglu_limit is not None:
        raise NotImplementedError(
            f"{backend} does not implement gemm1_beta/swiglu_limit "
            f"(got {config.gemm1_beta=}, {config.swiglu_limit=})"
        )
    if kind is ActivationKind.SILU:
        if config.gemm1_alpha is not None or config.gemm1_clamp_limit is not None:
            # SGLang treats silu + alpha/limit as the GPT-OSS SwiGLU variant.
            raise NotImplementedError(
                f"{backend} implements plain SiLU-and-mul; SwiGLU with gemm1_alpha/"
                "gemm1_clamp_limit is not supported"
            )
        return GatedActivation.silu()
    return GatedActivation.parse(kind.value, config.gemm1_alpha, config.gemm1_clamp_limit)


def routed_scaling_factor_for_runner(config: MoeRunnerConfig) -> float | None:
    """The factor the runner must apply itself: None when TopK already folded it in.

    SGLang folds routed_scaling_factor into the top-k weights for ModelOpt NVFP4 layers on
    every non-marlin runner (``FusedMoE.should_fuse_routed_scaling_factor_in_topk``).
    """
    factor = config.routed_scaling_factor
    if factor is None:
        return None
    layer = config.layer
    if layer is not None and getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False):
        return None
    return float(factor)


def check_runner_config(config: MoeRunnerConfig, backend: str = BACKEND_NAME) -> GatedActivation:
    """What the plugin's runner cores (triton_situ, torch_reference) refuse in a MoeRunnerConfig;
    returns its activation. ``backend`` names the backend in the errors."""
    if config.apply_router_weight_on_input:
        raise NotImplementedError(f"{backend} does not support apply_router_weight_on_input")
    if config.no_combine:
        raise NotImplementedError(f"{backend} does not support no_combine")
    return activation_from_config(config, backend)


def check_dispatch(dispatch_output: Any, quant_info: Any, info_type: type, hooks: Any,
                   backend: str = BACKEND_NAME) -> Any:
    """What the plugin's runner cores refuse in one call (LoRA hooks, another quant info, FP4
    dispatch, a non-standard top-k output); returns the top-k output."""
    if hooks is not None:
        raise NotImplementedError(f"{backend} does not support MoE LoRA hooks")
    if not isinstance(quant_info, info_type):
        raise TypeError(f"{backend} expects {info_type.__name__}, got {type(quant_info).__name__}")
    if getattr(dispatch_output, "hidden_states_scale", None) is not None:
        raise NotImplementedError(f"{backend} takes unquantized activations (no FP4 dispatch)")
    topk_output = dispatch_output.topk_output
    if not hasattr(topk_output, "topk_ids"):
        raise NotImplementedError(f"{backend} needs the standard top-k output, got {type(topk_output).__name__}")
    return topk_output


class TritonSituRunnerCore(DispatchMoeRunnerCore):
    """Runs one MoE layer with the fused NVFP4 Triton kernels (W4A16)."""

    def __init__(self, config: MoeRunnerConfig):
        super().__init__(config)
        # Fail at model construction, not at the first forward.
        self.activation = check_runner_config(config)

    @property
    def runner_backend(self) -> MoeRunnerBackendLike:
        return resolve_moe_runner_backend(BACKEND_NAME)

    def run_from_dispatch(
        self,
        dispatch_output: Any,
        quant_info: TritonSituMoeQuantInfo,
        runner_config: MoeRunnerConfig,
        hooks: Any = None,
    ) -> Any:
        from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

        from k3nvfp4.kernels import fused_moe_nvfp4

        topk_output = check_dispatch(dispatch_output, quant_info, TritonSituMoeQuantInfo, hooks)
        hidden_states = dispatch_output.hidden_states
        activation = activation_from_config(runner_config)
        out = fused_moe_nvfp4(
            hidden_states,
            quant_info.weights,
            topk_output.topk_weights.to(torch.float32),
            topk_output.topk_ids,
            activation=activation,
            routed_scaling_factor=routed_scaling_factor_for_runner(runner_config),
            # Under EP the ids range over all experts: the launch config is sized for the local pairs.
            num_global_experts=runner_config.num_experts,
            # The weights, prepared at load for the K3NVFP4_ACT_QUANT mode, choose the kernels.
            input_scale=quant_info.input_scale,
        )
        return StandardCombineInput(hidden_states=out)


def make_runner_core(config: MoeRunnerConfig) -> TritonSituRunnerCore:
    """Factory given to ``register_moe_runner_core``.

    Only ModelOpt NVFP4 MoE layers (the cast checkpoint) and MXFP4 MoE layers (the release,
    read directly) can feed this runner; a layer of another quantization method that follows
    the global backend choice is refused here, at model construction.
    """
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod

    layer = config.layer
    method = getattr(layer, "quant_method", None)
    if layer is not None and not isinstance(method, (ModelOptNvFp4FusedMoEMethod, Mxfp4MoEMethod)):
        raise ValueError(
            f"--moe-runner-backend {BACKEND_NAME} serves ModelOpt NVFP4 and MXFP4 MoE layers only; "
            f"layer {getattr(layer, 'layer_name', '?')!r} uses {type(method).__name__}"
        )
    return TritonSituRunnerCore(config)
