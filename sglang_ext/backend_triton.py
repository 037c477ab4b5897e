"""Backend ``triton_situ``: the Triton kernels, prepared at load from the layer's ModelOpt NVFP4 or
MXFP4 tensors and run by the runner core (runner.py) per call.

- :meth:`TritonSituBackend.check_device`: SM80+ (bf16 tensor cores), or the Triton interpreter;
- :meth:`TritonSituBackend.prepare_modelopt` / :meth:`TritonSituBackend.prepare_mxfp4`: what the
  kernels take in the ``K3NVFP4_ACT_QUANT`` mode (act_quant.kernel_weights_for_mode), stored on
  the layer under ``WEIGHTS_ATTR``; the checkpoint-layout tensors the kernels do not share are
  freed;
- :meth:`TritonSituBackend.apply`: the runner with ``TritonSituMoeQuantInfo``.

backends.py holds the one instance; hooks.py / hooks_mxfp4.py call it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .layer_checks import check_modelopt_layer_supported, check_mxfp4_layer_supported
from .names import BACKEND_NAME

logger = logging.getLogger(__name__)

# Attribute of the FusedMoE layer holding the kernels' weights after loading.
WEIGHTS_ATTR = "k3nvfp4_moe_weights"
# ModelOpt parameter names the kernels read (gate/up scale_2 kept as [E, 2]).
MODELOPT_PARAMS = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale",
                   "w2_weight_scale_2")
MXFP4_PARAMS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")

_logged_active = False


class TritonSituBackend:
    """``--moe-runner-backend triton_situ`` (one instance, in backends.BACKENDS)."""

    name = BACKEND_NAME

    def check_device(self) -> None:
        """SM80+ (bf16 tensor cores); without CUDA only the Triton interpreter."""
        check_device_supported()

    def prepare_modelopt(self, method: Any, layer: Any) -> Any:
        """Replaces SGLang's NVFP4 post-load processing; returns the weights. The W4A16 layout is
        built only for act_quant none; the FP4 modes take the ModelOpt tensors as they are."""
        check_modelopt_layer_supported(layer)
        weights = set_kernel_weights(layer, layer_modelopt_tensors(layer))
        layer.w13_blockscale_swizzled = None
        layer.w2_blockscale_swizzled = None
        free_checkpoint_params(layer, weights, MODELOPT_PARAMS)
        log_active_once(layer, weights, source="ModelOpt NVFP4 (E4M3 scales per 16)")
        return weights

    def prepare_mxfp4(self, method: Any, layer: Any) -> Any:
        """Replaces SGLang's MXFP4 post-load processing: the mode prepares its weights from the
        layer's MXFP4 tensors (W4A16: bit-exact to the cast's NVFP4 values, no cast written);
        returns the weights."""
        check_mxfp4_layer_supported(method, layer)
        weights = set_kernel_weights(layer, layer_mxfp4_tensors(layer))
        free_checkpoint_params(layer, weights, MXFP4_PARAMS)
        log_active_once(layer, weights, source="MXFP4 (E8M0 scales per 32, read directly)")
        return weights

    def apply(self, method: Any, layer: Any, dispatch_output: Any) -> Any:
        """The body of ``apply`` (ModelOpt NVFP4 and MXFP4 methods alike)."""
        from k3nvfp4.kernels.activation import activation_kind

        from .act_quant import INPUT_SCALE_ATTR
        from .runner import TritonSituMoeQuantInfo

        activation_kind(method.moe_runner_config.activation, f"{BACKEND_NAME}: activation")
        weights = getattr(layer, WEIGHTS_ATTR, None)
        if weights is None:
            raise RuntimeError(
                f"{BACKEND_NAME}: layer {getattr(layer, 'layer_name', '?')!r} has no kernel weights; "
                "process_weights_after_loading did not run"
            )
        info = TritonSituMoeQuantInfo(weights=weights, input_scale=getattr(layer, INPUT_SCALE_ATTR, None))
        return method.runner.run(dispatch_output, info)


def check_device_supported() -> None:
    """triton_situ needs SM80+ (bf16 tensor cores); without CUDA only the Triton interpreter."""
    if torch.cuda.is_available():
        from ..kernels import target  # lazy: registration stays light

        capability = target.capability()
        if capability < (8, 0):
            raise ValueError(
                f"--moe-runner-backend {BACKEND_NAME} needs an SM80+ GPU "
                f"(Ampere, Hopper, Blackwell); this GPU is sm{capability[0]}{capability[1]}"
            )
    else:
        from ..kernels.interpreter import interpret_requested  # lazy: registration stays light

        if interpret_requested():
            return
        raise ValueError(
            f"--moe-runner-backend {BACKEND_NAME} needs a CUDA GPU "
            "(or TRITON_INTERPRET=1 to run the kernels on CPU for testing)"
        )


def layer_modelopt_tensors(layer: Any) -> Any:
    """The layer's six loaded ModelOpt tensors (linear block scales) as ModelOptMoETensors."""
    from k3nvfp4.kernels.moe_details.weights import ModelOptMoETensors

    return ModelOptMoETensors(layer.w13_weight.data, layer.w13_weight_scale.data, layer.w13_weight_scale_2.data,
            layer.w2_weight.data, layer.w2_weight_scale.data, layer.w2_weight_scale_2.data)


def layer_mxfp4_tensors(layer: Any) -> Any:
    """The layer's loaded MXFP4 tensors (E2M1 nibbles, E8M0 scales per 32) as MXFP4MoETensors."""
    from k3nvfp4.kernels.moe_details.weights import MXFP4MoETensors

    return MXFP4MoETensors(
        layer.w13_weight.data,
        layer.w13_weight_scale.data,
        layer.w2_weight.data,
        layer.w2_weight_scale.data,
    )


def set_kernel_weights(layer: Any, tensors: Any) -> Any:
    """Prepare from the layer's checkpoint tensors (ModelOptMoETensors or MXFP4MoETensors) what
    the kernels take in the K3NVFP4_ACT_QUANT mode and store it on the layer (with the static
    NVFP4 input scale, if asked for); returns the weights stored."""
    from .act_quant import INPUT_SCALE_ATTR, kernel_weights_for_mode, selected_act_quant, static_input_scale

    act_quant = selected_act_quant()
    weights = kernel_weights_for_mode(tensors, act_quant, getattr(layer, "layer_name", "?"))
    setattr(layer, WEIGHTS_ATTR, weights)
    setattr(layer, INPUT_SCALE_ATTR, static_input_scale(layer, act_quant))
    return weights


def _storages(obj: Any) -> set[int]:
    """Data pointers of every tensor reachable from a (dataclass-like) weights object."""
    tensors = []
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
    elif hasattr(obj, "__dict__"):
        for value in vars(obj).values():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
            elif isinstance(value, (list, tuple)):
                tensors.extend(v for v in value if isinstance(v, torch.Tensor))
    return {t.untyped_storage().data_ptr() for t in tensors if t.numel()}


def free_checkpoint_params(layer: Any, weights: Any, names: tuple[str, ...]) -> None:
    """Empty the checkpoint-layout parameters ``names`` that ``weights`` does not share storage
    with: the kernels read their own tiled copy, the originals would be dead weight."""
    kept = _storages(weights)
    for name in names:
        param = getattr(layer, name, None)
        if isinstance(param, torch.Tensor) and param.numel():
            if param.untyped_storage().data_ptr() not in kept:
                param.data = param.data.new_empty((0,) * param.dim())


def _scale_format_name(weights: Any) -> str:
    """``e5m3/16`` or ``e8m0/32``: the block-scale format of NVFP4MoEWeights' tiles."""
    fmt = getattr(weights, "scale_format", None)
    return getattr(fmt, "name", "unknown")


def log_active_once(layer: Any, weights: Any, source: str) -> None:
    """One INFO line per process at load: the backend is active, with shapes and layout."""
    global _logged_active
    if _logged_active:
        return
    _logged_active = True
    from .act_quant import INPUT_SCALE_ATTR, selected_act_quant, where_it_runs

    config = layer.moe_runner_config
    act_quant = selected_act_quant()
    input_scale = getattr(layer, INPUT_SCALE_ATTR, None)
    logger.info(
        "k3nvfp4: MoE runner backend %s active: %d local of %d experts, hidden %d, "
        "intermediate/rank %d, moe tp %d/ep %d, activation %s (beta=%s, linear_beta=%s), "
        "weights from %s, layout %s w13 %s + w2 %s %s, gate/up scale_2 separate, on %s; "
        "activation quantization %s (K3NVFP4_ACT_QUANT, input scale %s) on %s",
        BACKEND_NAME,
        layer.num_local_experts,
        layer.num_experts,
        config.hidden_size,
        config.intermediate_size_per_partition,
        getattr(layer, "moe_tp_size", 1),
        getattr(layer, "moe_ep_size", 1),
        config.activation,
        config.gemm1_alpha,
        config.gemm1_clamp_limit,
        source,
        type(weights).__name__,
        list(weights.w13.shape),
        list(weights.w2.shape),
        # The scale format the tiles hold: e5m3/16 for ModelOpt NVFP4, e8m0/32 for the MXFP4 release
        # (a fixed "block-16" here misdescribed the release's 32-blocks).
        {"none": f"kernel-native FP4 tiles (bit-placed e2m1, {_scale_format_name(weights)} block scales)",
         "e4m3": "e2m1 + int8 exponent offsets per block (exact E4M3 expansion) + fp32 row factors"}.get(
            act_quant, "e2m1 + block scales for tl.dot_scaled"),
        weights.w13.device,
        act_quant,
        "dynamic" if input_scale is None else f"static {input_scale:g} from the checkpoint",
        where_it_runs(act_quant),
    )
