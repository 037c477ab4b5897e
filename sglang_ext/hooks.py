"""HookRegistry hooks on SGLang's ModelOptNvFp4FusedMoEMethod (no sglang file is edited).

Every hook is an AROUND hook that calls SGLang's original through ``original_fn`` and changes
behaviour only for:
- the plugin's backends (backends.py: ``triton_situ``, ``torch_reference``): lift the
  Blackwell-only check (the backend's own device check instead), skip the placeholder swizzled
  scales, hand the loaded layer to the backend's ``prepare_modelopt`` and ``apply`` to its
  ``apply``;
- backend ``marlin`` with activation ``situ``: let ``apply`` past SGLang 0.5.23's activation
  assert (marlin's fused path supports gated SiTU and forwards gemm1_alpha/clamp_limit).
Every other backend and quantization method runs SGLang's code unchanged.
"""

from __future__ import annotations

from typing import Any

from .backends import PluginBackend, plugin_backend, plugin_hook
from .names import BACKEND_NAME

_METHOD = "sglang.srt.layers.quantization.modelopt_quant.ModelOptNvFp4FusedMoEMethod"
# NVFP4: one e4m3 scale per 16 elements along K of both GEMMs.
NVFP4_BLOCK = 16


def _selected_backend(method: Any) -> Any:
    """The backend the method runs with: cached by create_moe_runner, else the global choice."""
    cached = getattr(method, "_moe_runner_backend", None)
    if cached is not None:
        return cached
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    return get_moe_runner_backend()


def check_shard_shapes(hidden_size: int, intermediate_size_per_partition: int, layer: Any, *,
                       block: int = NVFP4_BLOCK, block_name: str = "the NVFP4 block",
                       backend: str = BACKEND_NAME) -> None:  # fmt: skip
    """Clear errors for shapes the checkpoint's scale blocks cannot tile (before any weight is loaded)."""
    tp_size = getattr(layer, "moe_tp_size", 1)
    if intermediate_size_per_partition % block:
        raise ValueError(
            f"--moe-runner-backend {backend}: the MoE intermediate size per rank is "
            f"{intermediate_size_per_partition} (moe_intermediate_size / moe tp size "
            f"{tp_size}); it must be a multiple of {block_name} {block}. Use a smaller --tp-size "
            "or expert parallelism (--ep-size) for this model."
        )
    if hidden_size % block:
        raise ValueError(
            f"--moe-runner-backend {backend}: MoE hidden size {hidden_size} must be a "
            f"multiple of {block_name} {block}"
        )


def _init(backend: PluginBackend, original_fn, self, quant_config, *args, **kwargs):
    """SGLang allows NVFP4 MoE off Blackwell only for marlin; the backend's own device check
    instead (triton_situ: SM80+; torch_reference: anywhere torch runs)."""
    backend.check_device()
    from sglang.srt.runtime_context import get_platform, override_platform

    if get_platform().is_blackwell:
        return original_fn(self, quant_config, *args, **kwargs)
    # SGLang's scoped platform override, held only for the constructor's capability check.
    with override_platform(is_blackwell=True):
        return original_fn(self, quant_config, *args, **kwargs)


def _create_weights(backend: PluginBackend, original_fn, self, layer, num_experts, hidden_size,
                    intermediate_size_per_partition, params_dtype, **extra_weight_attrs):  # fmt: skip
    """Validate the shard and drop SGLang's swizzled-scale placeholders (unused here)."""
    check_shard_shapes(hidden_size, intermediate_size_per_partition, layer, backend=backend.name)
    result = original_fn(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                         **extra_weight_attrs)
    # Kept until process_weights_after_loading they would cost ~1/8 of the expert bytes.
    layer.w13_blockscale_swizzled = None
    layer.w2_blockscale_swizzled = None
    return result


def _process_weights(backend: PluginBackend, original_fn, self, layer):
    """SGLang's NVFP4 post-load processing (scale swizzle, ...) replaced by the backend's."""
    backend.prepare_modelopt(self, layer)
    return None


init_hook = plugin_hook(_init)
create_weights_hook = plugin_hook(_create_weights)
process_weights_hook = plugin_hook(_process_weights, _selected_backend)


def apply_hook(original_fn, self, layer, dispatch_output):
    from k3nvfp4.kernels.activation import ActivationKind

    backend = _selected_backend(self)
    ours = plugin_backend(backend)
    if ours is not None:
        return ours.apply(self, layer, dispatch_output)
    if (
        backend is not None
        and backend.is_marlin()
        and self.moe_runner_config.activation == ActivationKind.SITU
        and not getattr(layer, "_mega_moe_nvfp4", False)
    ):
        # SGLang 0.5.23 asserts the activation before its per-backend dispatch; marlin's own
        # check accepts gated situ. This is SGLang's marlin branch of apply, unchanged.
        quant_info = self.get_marlin_quant_info(layer)
        return self.runner.run(dispatch_output, quant_info)
    return original_fn(self, layer, dispatch_output)


HOOKS = (
    (f"{_METHOD}.__init__", init_hook),
    (f"{_METHOD}.create_weights", create_weights_hook),
    (f"{_METHOD}.process_weights_after_loading", process_weights_hook),
    (f"{_METHOD}.apply", apply_hook),
)
