"""The ``torch_reference`` MoE runner core: SGLang's dispatch output -> the plain-torch MoE of
k3nvfp4.kernels.moe_torch_backend, on the checkpoint's tensors as SGLang loaded them.

Same contract as the ``triton_situ`` core (runner.py): the standard dispatcher's hidden states
and top-k ids/weights as served (local ids, -1 for other ranks' experts under EP), this rank's
shard of the intermediate dimension under TP, SGLang's own reduction after combine, and the
same mapping of MoeRunnerConfig to the activation. Only the math differs: no Triton, no kernel
layout, its own decode (see kernels/moe_torch_backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.layers.moe.moe_runner.base import DispatchMoeRunnerCore, MoeQuantInfo, MoeRunnerConfig
from sglang.srt.layers.moe.utils import MoeRunnerBackendLike, resolve_moe_runner_backend

from .names import REFERENCE_BACKEND_NAME
from .runner import activation_from_config, check_dispatch, check_runner_config, routed_scaling_factor_for_runner


@dataclass
class TorchReferenceMoeQuantInfo(MoeQuantInfo):
    """The layer's experts as loaded: kernels.moe_torch_backend.ModelOptNVFP4Experts or MXFP4Experts."""

    experts: Any


class TorchReferenceRunnerCore(DispatchMoeRunnerCore):
    """Runs one MoE layer with kernels.moe_torch_backend.moe_forward_reference (slow, exact)."""

    def __init__(self, config: MoeRunnerConfig):
        super().__init__(config)
        self.activation = check_runner_config(config, REFERENCE_BACKEND_NAME)  # fail at construction

    @property
    def runner_backend(self) -> MoeRunnerBackendLike:
        return resolve_moe_runner_backend(REFERENCE_BACKEND_NAME)

    def run_from_dispatch(self, dispatch_output: Any, quant_info: TorchReferenceMoeQuantInfo,
                          runner_config: MoeRunnerConfig, hooks: Any = None) -> Any:  # fmt: skip
        from sglang.srt.layers.moe.token_dispatcher.standard import StandardCombineInput

        from k3nvfp4.kernels.moe_torch_backend import moe_forward_reference

        topk_output = check_dispatch(dispatch_output, quant_info, TorchReferenceMoeQuantInfo, hooks,
                                     REFERENCE_BACKEND_NAME)
        activation = activation_from_config(runner_config, REFERENCE_BACKEND_NAME)
        out = moe_forward_reference(
            dispatch_output.hidden_states, quant_info.experts, topk_output.topk_weights, topk_output.topk_ids,
            activation=activation,
            routed_scaling_factor=routed_scaling_factor_for_runner(runner_config))
        return StandardCombineInput(hidden_states=out)


def make_reference_runner_core(config: MoeRunnerConfig) -> TorchReferenceRunnerCore:
    """Factory given to ``register_moe_runner_core``: ModelOpt NVFP4 and MXFP4 MoE layers only."""
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod

    layer = config.layer
    method = getattr(layer, "quant_method", None)
    if layer is not None and not isinstance(method, (ModelOptNvFp4FusedMoEMethod, Mxfp4MoEMethod)):
        raise ValueError(
            f"--moe-runner-backend {REFERENCE_BACKEND_NAME} serves ModelOpt NVFP4 and MXFP4 MoE layers only; "
            f"layer {getattr(layer, 'layer_name', '?')!r} uses {type(method).__name__}")
    return TorchReferenceRunnerCore(config)
