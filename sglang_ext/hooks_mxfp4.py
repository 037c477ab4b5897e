"""HookRegistry hooks on SGLang's Mxfp4MoEMethod: ``triton_situ`` on the MXFP4 release, no cast.

SGLang 0.5.23 gives a compressed-tensors ``mxfp4-pack-quantized`` MoE layer (Kimi-K3's release)
``sglang.srt.layers.quantization.mxfp4.Mxfp4MoEMethod`` on CUDA (compressed_tensors.py picks it
before any scheme). Its ``create_moe_runner`` knows no registered backend, and its
``create_weights`` pads the intermediate size for whichever kernel it expects. For backend
``triton_situ`` these AROUND hooks:

- ``__init__``: the device check of the backend (SM80+, or the Triton interpreter);
- ``create_weights``: the checkpoint's own shapes, unpadded (w13 / w2 nibbles uint8 and their
  E8M0 scales uint8 per 32, the parameters SGLang's MXFP4 loader fills; no bias parameters:
  the release has none);
- ``process_weights_after_loading``: ``NVFP4MoEWeights.from_mxfp4`` (the kernels' tiled layout,
  bit-exact to the cast's NVFP4 values), then the checkpoint-layout tensors are freed;
- ``create_moe_runner`` / ``apply``: the ``triton_situ`` runner core, as for ModelOpt NVFP4.

Backend ``torch_reference`` takes the same hooks, without the device check, and keeps the loaded
MXFP4 tensors as they are (hooks_reference.py). Every other backend (marlin, flashinfer_mxfp4,
triton_kernel, ...) runs SGLang's code unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from .layer_checks import check_mxfp4_layer_supported
from .names import BACKEND_NAME
from .hooks import (
    check_device_supported,
    check_shard_shapes,
    free_checkpoint_params,
    is_plugin_backend,
    is_torch_reference,
    is_triton_situ,
    log_active_once,
    set_kernel_weights,
)

_METHOD = "sglang.srt.layers.quantization.mxfp4.Mxfp4MoEMethod"
MXFP4_BLOCK = 32
# E8M0 127 = 2^0: SGLang's initial value of the scale parameters.
_E8M0_ONE = 127
_MXFP4_PARAMS = ("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale")


def _global_backend() -> Any:
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    return get_moe_runner_backend()


def _backend_is_ours() -> bool:
    """triton_situ or torch_reference (both take the checkpoint's own shapes)."""
    return is_plugin_backend(_global_backend())


def init_hook(original_fn, self, *args, **kwargs):
    if is_triton_situ(_global_backend()):
        check_device_supported()
    return original_fn(self, *args, **kwargs)


def create_weights_hook(
    original_fn,
    self,
    layer,
    num_experts,
    hidden_size,
    intermediate_size_per_partition,
    params_dtype,
    with_bias: bool = False,
    **extra_weight_attrs,
):
    """The checkpoint's shapes, as SGLang's MXFP4 loader fills them, with no kernel padding."""
    if not _backend_is_ours():
        return original_fn(
            self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
            with_bias=with_bias, **extra_weight_attrs,
        )
    from sglang.srt.utils import set_weight_attrs

    if with_bias:
        raise NotImplementedError(f"{BACKEND_NAME}: MXFP4 MoE layers with biases are not supported")
    check_shard_shapes(hidden_size, intermediate_size_per_partition, layer, block=MXFP4_BLOCK,
                       block_name="the MXFP4 block")
    E, H, I = layer.num_local_experts, hidden_size, intermediate_size_per_partition
    # What SGLang's method records for its own apply paths (never reached for triton_situ).
    self.num_experts, self.with_bias = num_experts, False
    self.intermediate_size_per_partition, self.hidden_size = I, H
    shapes = {
        "w13_weight": ((E, 2 * I, H // 2), 0),
        "w13_weight_scale": ((E, 2 * I, H // MXFP4_BLOCK), _E8M0_ONE),
        "w2_weight": ((E, H, I // 2), 0),
        "w2_weight_scale": ((E, H, I // MXFP4_BLOCK), _E8M0_ONE),
    }
    for name, (shape, fill) in shapes.items():
        param = torch.nn.Parameter(torch.full(shape, fill, dtype=torch.uint8), requires_grad=False)
        layer.register_parameter(name, param)
        set_weight_attrs(param, extra_weight_attrs)
        if name.endswith("_scale"):
            param.quant_method = "group"  # FusedMoE's loader: a per-group scale, sharded like its weight
    return None


def layer_mxfp4_tensors(layer: Any) -> Any:
    """The layer's loaded MXFP4 tensors (E2M1 nibbles, E8M0 scales per 32) as MXFP4MoETensors."""
    from k3nvfp4.kernels.moe_details.weights import MXFP4MoETensors

    return MXFP4MoETensors(
        layer.w13_weight.data,
        layer.w13_weight_scale.data,
        layer.w2_weight.data,
        layer.w2_weight_scale.data,
    )


def process_weights_hook(original_fn, self, layer):
    backend = _global_backend()
    if is_torch_reference(backend):
        from .hooks_reference import prepare_mxfp4_layer_for_reference

        prepare_mxfp4_layer_for_reference(self, layer)
        return None
    if not is_triton_situ(backend):
        return original_fn(self, layer)
    check_mxfp4_layer_supported(self, layer)
    weights = set_kernel_weights(layer, layer_mxfp4_tensors(layer))
    free_checkpoint_params(layer, weights, _MXFP4_PARAMS)
    log_active_once(layer, weights, source="MXFP4 (E8M0 scales per 32, read directly)")
    return None


def create_moe_runner_hook(original_fn, self, layer, moe_runner_config):
    if not _backend_is_ours():
        return original_fn(self, layer, moe_runner_config)
    from sglang.srt.layers.moe import MoeRunner
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    self.moe_runner_config = moe_runner_config
    self.runner = MoeRunner(get_moe_runner_backend(), moe_runner_config)
    return None


def apply_hook(original_fn, self, layer, dispatch_output):
    backend = getattr(getattr(self, "runner", None), "runner_backend", None)
    if is_torch_reference(backend):
        from .hooks_reference import run_torch_reference

        return run_torch_reference(self, layer, dispatch_output)
    if not is_triton_situ(backend):
        return original_fn(self, layer, dispatch_output)
    from .hooks import run_triton_situ

    return run_triton_situ(self, layer, dispatch_output)


HOOKS = (
    (f"{_METHOD}.__init__", init_hook),
    (f"{_METHOD}.create_weights", create_weights_hook),
    (f"{_METHOD}.process_weights_after_loading", process_weights_hook),
    (f"{_METHOD}.create_moe_runner", create_moe_runner_hook),
    (f"{_METHOD}.apply", apply_hook),
)
