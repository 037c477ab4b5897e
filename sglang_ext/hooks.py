"""HookRegistry hooks on SGLang's ModelOptNvFp4FusedMoEMethod (no sglang file is edited).

Every hook is an AROUND hook that calls SGLang's original through ``original_fn`` and changes
behaviour only for:
- backend ``triton_situ``: lift the Blackwell-only check (SM80+), skip the placeholder
  swizzled scales, keep the checkpoint's linear block scales and build ``NVFP4MoEWeights``
  once after loading, route ``apply`` to the runner core;
- backend ``torch_reference``: the same, on any device, except that after loading the layer
  keeps SGLang's ModelOpt tensors as loaded (no kernel layout; hooks_reference.py);
- backend ``marlin`` with activation ``situ``: let ``apply`` past SGLang 0.5.23's activation
  assert (marlin's fused path supports gated SiTU and forwards gemm1_alpha/clamp_limit).
Every other backend and quantization method runs SGLang's code unchanged.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .layer_checks import check_modelopt_layer_supported
from .names import BACKEND_NAME, REFERENCE_BACKEND_NAME

logger = logging.getLogger(__name__)

_METHOD = "sglang.srt.layers.quantization.modelopt_quant.ModelOptNvFp4FusedMoEMethod"
# Attribute of the FusedMoE layer holding the kernels' weights after loading.
WEIGHTS_ATTR = "k3nvfp4_moe_weights"
# NVFP4: one e4m3 scale per 16 elements along K of both GEMMs.
NVFP4_BLOCK = 16
# ModelOpt parameter names the kernels read (gate/up scale_2 kept as [E, 2]).
_MODELOPT_PARAMS = (
    "w13_weight",
    "w13_weight_scale",
    "w13_weight_scale_2",
    "w2_weight",
    "w2_weight_scale",
    "w2_weight_scale_2",
)

_logged_active = False


def is_triton_situ(backend: Any) -> bool:
    """Whether a MoeRunnerBackend(-like) value or name is this plugin's backend."""
    return backend is not None and getattr(backend, "value", backend) == BACKEND_NAME


def is_torch_reference(backend: Any) -> bool:
    """Whether a MoeRunnerBackend(-like) value or name is the plugin's torch_reference backend."""
    return backend is not None and getattr(backend, "value", backend) == REFERENCE_BACKEND_NAME


def is_plugin_backend(backend: Any) -> bool:
    """triton_situ or torch_reference: a backend whose layers this plugin prepares and runs."""
    return is_triton_situ(backend) or is_torch_reference(backend)


def _selected_backend(method: Any) -> Any:
    """The backend the method runs with: cached by create_moe_runner, else the global choice."""
    cached = getattr(method, "_moe_runner_backend", None)
    if cached is not None:
        return cached
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    return get_moe_runner_backend()


def check_device_supported() -> None:
    """triton_situ needs SM80+ (bf16 tensor cores); without CUDA only the Triton interpreter."""
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
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


# --- __init__ ---------------------------------------------------------------------------


def init_hook(original_fn, self, quant_config, *args, **kwargs):
    """SGLang allows NVFP4 MoE off Blackwell only for marlin; triton_situ runs on SM80+,
    torch_reference anywhere torch does."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    backend = get_moe_runner_backend()
    if not is_plugin_backend(backend):
        return original_fn(self, quant_config, *args, **kwargs)
    if is_triton_situ(backend):
        check_device_supported()
    from sglang.srt.runtime_context import get_platform, override_platform

    if get_platform().is_blackwell:
        return original_fn(self, quant_config, *args, **kwargs)
    # SGLang's scoped platform override, held only for the constructor's capability check.
    with override_platform(is_blackwell=True):
        return original_fn(self, quant_config, *args, **kwargs)


# --- create_weights ---------------------------------------------------------------------


def check_shard_shapes(hidden_size: int, intermediate_size_per_partition: int, layer: Any, *,
                       block: int = NVFP4_BLOCK, block_name: str = "the NVFP4 block") -> None:  # fmt: skip
    """Clear errors for shapes the checkpoint's scale blocks cannot tile (before any weight is loaded)."""
    tp_size = getattr(layer, "moe_tp_size", 1)
    if intermediate_size_per_partition % block:
        raise ValueError(
            f"--moe-runner-backend {BACKEND_NAME}: the MoE intermediate size per rank is "
            f"{intermediate_size_per_partition} (moe_intermediate_size / moe tp size "
            f"{tp_size}); it must be a multiple of {block_name} {block}. Use a smaller --tp-size "
            "or expert parallelism (--ep-size) for this model."
        )
    if hidden_size % block:
        raise ValueError(
            f"--moe-runner-backend {BACKEND_NAME}: MoE hidden size {hidden_size} must be a "
            f"multiple of {block_name} {block}"
        )


def create_weights_hook(
    original_fn,
    self,
    layer,
    num_experts,
    hidden_size,
    intermediate_size_per_partition,
    params_dtype,
    **extra_weight_attrs,
):
    """Validate the shard and drop SGLang's swizzled-scale placeholders (unused here)."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    if not is_plugin_backend(get_moe_runner_backend()):
        return original_fn(
            self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
            **extra_weight_attrs,
        )
    check_shard_shapes(hidden_size, intermediate_size_per_partition, layer)
    result = original_fn(
        self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
        **extra_weight_attrs,
    )
    # Kept until process_weights_after_loading they would cost ~1/8 of the expert bytes.
    layer.w13_blockscale_swizzled = None
    layer.w2_blockscale_swizzled = None
    return result


# --- process_weights_after_loading ------------------------------------------------------


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


def layer_modelopt_tensors(layer: Any) -> Any:
    """The layer's six loaded ModelOpt tensors (linear block scales) as ModelOptMoETensors."""
    from k3nvfp4.kernels.moe_details.weights import ModelOptMoETensors

    return ModelOptMoETensors(layer.w13_weight.data, layer.w13_weight_scale.data, layer.w13_weight_scale_2.data,
            layer.w2_weight.data, layer.w2_weight_scale.data, layer.w2_weight_scale_2.data)


def prepare_layer_for_triton_situ(layer: Any) -> Any:
    """Replaces SGLang's NVFP4 post-load processing for triton_situ; returns the weights. The
    W4A16 layout is built only for act_quant none; the FP4 modes take the ModelOpt tensors as
    they are (set_kernel_weights)."""
    check_modelopt_layer_supported(layer)
    weights = set_kernel_weights(layer, layer_modelopt_tensors(layer))
    layer.w13_blockscale_swizzled = None
    layer.w2_blockscale_swizzled = None
    free_checkpoint_params(layer, weights, _MODELOPT_PARAMS)
    log_active_once(layer, weights, source="ModelOpt NVFP4 (E4M3 scales per 16)")
    return weights


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


def free_checkpoint_params(layer: Any, weights: Any, names: tuple[str, ...]) -> None:
    """Empty the checkpoint-layout parameters ``names`` that ``weights`` does not share storage
    with: the kernels read their own tiled copy, the originals would be dead weight."""
    kept = _storages(weights)
    for name in names:
        param = getattr(layer, name, None)
        if isinstance(param, torch.Tensor) and param.numel():
            if param.untyped_storage().data_ptr() not in kept:
                param.data = param.data.new_empty((0,) * param.dim())


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
        "kernel-native FP4 tiles (bit-placed e2m1, bf16 block-16 scales)" if act_quant == "none"
        else "e2m1 + block scales for tl.dot_scaled",
        weights.w13.device,
        act_quant,
        "dynamic" if input_scale is None else f"static {input_scale:g} from the checkpoint",
        where_it_runs(act_quant),
    )


def process_weights_hook(original_fn, self, layer):
    backend = _selected_backend(self)
    if is_torch_reference(backend):
        from .hooks_reference import prepare_modelopt_layer_for_reference

        prepare_modelopt_layer_for_reference(layer)
        return None
    if not is_triton_situ(backend):
        return original_fn(self, layer)
    prepare_layer_for_triton_situ(layer)
    return None


# --- apply ------------------------------------------------------------------------------


def apply_hook(original_fn, self, layer, dispatch_output):
    from k3nvfp4.kernels.activation import ActivationKind

    backend = _selected_backend(self)
    activation = self.moe_runner_config.activation
    if is_triton_situ(backend):
        return run_triton_situ(self, layer, dispatch_output)
    if is_torch_reference(backend):
        from .hooks_reference import run_torch_reference

        return run_torch_reference(self, layer, dispatch_output)
    if (
        backend is not None
        and backend.is_marlin()
        and activation == ActivationKind.SITU
        and not getattr(layer, "_mega_moe_nvfp4", False)
    ):
        # SGLang 0.5.23 asserts the activation before its per-backend dispatch; marlin's own
        # check accepts gated situ. This is SGLang's marlin branch of apply, unchanged.
        quant_info = self.get_marlin_quant_info(layer)
        return self.runner.run(dispatch_output, quant_info)
    return original_fn(self, layer, dispatch_output)


def run_triton_situ(method: Any, layer: Any, dispatch_output: Any) -> Any:
    """The body of ``apply`` for triton_situ (ModelOpt NVFP4 and MXFP4 methods alike)."""
    from k3nvfp4.kernels.activation import activation_kind

    from .runner import TritonSituMoeQuantInfo

    activation_kind(method.moe_runner_config.activation, f"{BACKEND_NAME}: activation")
    weights = getattr(layer, WEIGHTS_ATTR, None)
    if weights is None:
        raise RuntimeError(
            f"{BACKEND_NAME}: layer {getattr(layer, 'layer_name', '?')!r} has no kernel weights; "
            "process_weights_after_loading did not run"
        )
    from .act_quant import INPUT_SCALE_ATTR

    info = TritonSituMoeQuantInfo(weights=weights, input_scale=getattr(layer, INPUT_SCALE_ATTR, None))
    return method.runner.run(dispatch_output, info)


HOOKS = (
    (f"{_METHOD}.__init__", init_hook),
    (f"{_METHOD}.create_weights", create_weights_hook),
    (f"{_METHOD}.process_weights_after_loading", process_weights_hook),
    (f"{_METHOD}.apply", apply_hook),
)
