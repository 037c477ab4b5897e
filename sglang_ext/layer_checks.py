"""What both plugin backends (triton_situ, torch_reference) refuse in a MoE layer, after loading
and before preparing it: one module that backend_triton.py and backend_reference.py both import,
so neither imports the other for it. ``backend`` names the backend in the errors."""

from __future__ import annotations

from typing import Any

from .names import BACKEND_NAME


def check_modelopt_layer_supported(layer: Any, backend: str = BACKEND_NAME) -> None:
    """What both plugin backends refuse in a ModelOpt NVFP4 layer (``backend`` names it)."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    if getattr(layer, "inference_moe_w13_interleaved", False):
        raise NotImplementedError(
            f"{backend}: interleaved w13 checkpoints are not supported (gate rows, then up rows)"
        )
    if get_moe_a2a_backend().is_megamoe():
        raise NotImplementedError(f"{backend} does not run under the MegaMoE a2a backend")
    if not layer.moe_runner_config.is_gated:
        raise NotImplementedError(f"{backend} runs gated MoE only")


def check_mxfp4_layer_supported(method: Any, layer: Any, backend: str = BACKEND_NAME) -> None:
    """What both plugin backends refuse in an MXFP4 layer (``backend`` names it)."""
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    if getattr(method, "moe_runner_config", None) is not None and not method.moe_runner_config.is_gated:
        raise NotImplementedError(f"{backend} runs gated MoE only")
    if getattr(layer.moe_runner_config, "gate_up_interleaved", False):
        raise NotImplementedError(
            f"{backend}: interleaved w13 (gate/up alternating rows) is not supported; Kimi-K3 "
            "loads w1 rows then w3 rows"
        )
    if get_moe_a2a_backend().is_megamoe():
        raise NotImplementedError(f"{backend} does not run under the MegaMoE a2a backend")
