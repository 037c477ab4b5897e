"""Backend ``torch_reference``: what it does in the hooks of hooks.py / hooks_mxfp4.py.

After loading, a layer keeps the tensors SGLang's loader filled, as they are: ModelOpt NVFP4
(w13/w2 nibbles, linear E4M3 block scales, scale_2 per gate/up) or the MXFP4 release (nibbles,
E8M0 scales). They are wrapped, not copied, in kernels.moe_torch_backend's ModelOptNVFP4Experts /
MXFP4Experts (which check dtypes, shapes and NaN scales once, here), and ``apply`` runs the
TorchReferenceRunnerCore on them. Nothing of the Triton kernels' layout is built.
"""

from __future__ import annotations

import logging
from typing import Any

from .layer_checks import check_modelopt_layer_supported, check_mxfp4_layer_supported
from .names import REFERENCE_BACKEND_NAME

logger = logging.getLogger(__name__)

# Attribute of the FusedMoE layer holding the reference's view of the loaded tensors.
EXPERTS_ATTR = "k3nvfp4_reference_experts"

_logged_active = False


class TorchReferenceBackend:
    """``--moe-runner-backend torch_reference`` (one instance, in backends.BACKENDS)."""

    name = REFERENCE_BACKEND_NAME

    def check_device(self) -> None:
        """Any device torch runs on."""

    def prepare_modelopt(self, method: Any, layer: Any) -> Any:
        return prepare_modelopt_layer_for_reference(layer)

    def prepare_mxfp4(self, method: Any, layer: Any) -> Any:
        return prepare_mxfp4_layer_for_reference(method, layer)

    def apply(self, method: Any, layer: Any, dispatch_output: Any) -> Any:
        return run_torch_reference(method, layer, dispatch_output)


def prepare_modelopt_layer_for_reference(layer: Any) -> Any:
    """Replaces SGLang's NVFP4 post-load processing (no scale swizzle); returns the experts."""
    from k3nvfp4.kernels.moe_torch_backend import ModelOptNVFP4Experts

    check_modelopt_layer_supported(layer, REFERENCE_BACKEND_NAME)
    experts = ModelOptNVFP4Experts(
        layer.w13_weight.data, layer.w13_weight_scale.data, layer.w13_weight_scale_2.data,
        layer.w2_weight.data, layer.w2_weight_scale.data, layer.w2_weight_scale_2.data)
    layer.w13_blockscale_swizzled = None
    layer.w2_blockscale_swizzled = None
    return _store(layer, experts, "ModelOpt NVFP4 (E4M3 scales per 16, scale_2 per gate/up)")


def prepare_mxfp4_layer_for_reference(method: Any, layer: Any) -> Any:
    """Replaces SGLang's MXFP4 post-load processing; returns the experts."""
    from k3nvfp4.kernels.moe_torch_backend import MXFP4Experts

    check_mxfp4_layer_supported(method, layer, REFERENCE_BACKEND_NAME)
    experts = MXFP4Experts(layer.w13_weight.data, layer.w13_weight_scale.data,
                           layer.w2_weight.data, layer.w2_weight_scale.data)
    return _store(layer, experts, "MXFP4 (E8M0 scales per 32, as released)")


def _store(layer: Any, experts: Any, source: str) -> Any:
    global _logged_active
    setattr(layer, EXPERTS_ATTR, experts)
    if not _logged_active:
        _logged_active = True
        config = layer.moe_runner_config
        logger.info(
            "k3nvfp4: MoE runner backend %s active: %d local of %d experts, hidden %d, intermediate/rank %d, "
            "activation %s (beta=%s, linear_beta=%s), weights from %s, dequantized to fp32 per call "
            "(plain torch, no Triton; slow)",
            REFERENCE_BACKEND_NAME, layer.num_local_experts, layer.num_experts, config.hidden_size,
            config.intermediate_size_per_partition, config.activation, config.gemm1_alpha,
            config.gemm1_clamp_limit, source)
    return experts


def run_torch_reference(method: Any, layer: Any, dispatch_output: Any) -> Any:
    """The body of ``apply`` for torch_reference (ModelOpt NVFP4 and MXFP4 methods alike)."""
    from .reference_runner import TorchReferenceMoeQuantInfo

    experts = getattr(layer, EXPERTS_ATTR, None)
    if experts is None:
        raise RuntimeError(
            f"{REFERENCE_BACKEND_NAME}: layer {getattr(layer, 'layer_name', '?')!r} has no reference experts; "
            "process_weights_after_loading did not run")
    return method.runner.run(dispatch_output, TorchReferenceMoeQuantInfo(experts=experts))
