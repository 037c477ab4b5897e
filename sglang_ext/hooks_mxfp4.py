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
- ``process_weights_after_loading``: the backend's ``prepare_mxfp4`` (triton_situ:
  ``NVFP4MoEWeights.from_mxfp4``, bit-exact to the cast's NVFP4 values, then the
  checkpoint-layout tensors are freed; torch_reference keeps them as they are);
- ``create_moe_runner`` / ``apply``: the backend's runner core, as for ModelOpt NVFP4.

Backend ``torch_reference`` takes the same hooks (backends.py: one object per backend, its device
check a no-op). Every other backend (marlin, flashinfer_mxfp4, triton_kernel, ...) runs
SGLang's code unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from .backends import PluginBackend, plugin_hook
from .hooks import check_shard_shapes

_METHOD = "sglang.srt.layers.quantization.mxfp4.Mxfp4MoEMethod"
MXFP4_BLOCK = 32
# E8M0 127 = 2^0: SGLang's initial value of the scale parameters.
_E8M0_ONE = 127


def _runner_backend(method: Any) -> Any:
    """The backend of the runner create_moe_runner made (None before it ran)."""
    return getattr(getattr(method, "runner", None), "runner_backend", None)


def _init(backend: PluginBackend, original_fn, self, *args, **kwargs):
    backend.check_device()
    return original_fn(self, *args, **kwargs)


def _create_weights(backend: PluginBackend, original_fn, self, layer, num_experts, hidden_size,
                    intermediate_size_per_partition, params_dtype, with_bias: bool = False,
                    **extra_weight_attrs):  # fmt: skip
    """The checkpoint's shapes, as SGLang's MXFP4 loader fills them, with no kernel padding."""
    from sglang.srt.utils import set_weight_attrs

    if with_bias:
        raise NotImplementedError(f"{backend.name}: MXFP4 MoE layers with biases are not supported")
    check_shard_shapes(hidden_size, intermediate_size_per_partition, layer, block=MXFP4_BLOCK,
                       block_name="the MXFP4 block", backend=backend.name)
    E, H, I = layer.num_local_experts, hidden_size, intermediate_size_per_partition
    # What SGLang's method records for its own apply paths (never reached for the plugin's backends).
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


def _process_weights(backend: PluginBackend, original_fn, self, layer):
    backend.prepare_mxfp4(self, layer)
    return None


def _create_moe_runner(backend: PluginBackend, original_fn, self, layer, moe_runner_config):
    """Mxfp4MoEMethod's own create_moe_runner knows no registered backend: the plugin's runner."""
    from sglang.srt.layers.moe import MoeRunner
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    self.moe_runner_config = moe_runner_config
    self.runner = MoeRunner(get_moe_runner_backend(), moe_runner_config)
    return None


def _apply(backend: PluginBackend, original_fn, self, layer, dispatch_output):
    return backend.apply(self, layer, dispatch_output)


init_hook = plugin_hook(_init)
create_weights_hook = plugin_hook(_create_weights)
process_weights_hook = plugin_hook(_process_weights)
create_moe_runner_hook = plugin_hook(_create_moe_runner)
apply_hook = plugin_hook(_apply, _runner_backend)


HOOKS = (
    (f"{_METHOD}.__init__", init_hook),
    (f"{_METHOD}.create_weights", create_weights_hook),
    (f"{_METHOD}.process_weights_after_loading", process_weights_hook),
    (f"{_METHOD}.create_moe_runner", create_moe_runner_hook),
    (f"{_METHOD}.apply", apply_hook),
)
