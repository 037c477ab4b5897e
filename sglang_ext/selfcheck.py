"""Does this process see the plugin? ``python -m k3nvfp4.sglang_ext.selfcheck`` prints it as JSON.

Runs SGLang's own ``load_plugins()`` (entry points, SGLANG_PLUGINS filter, hook application),
exactly as SGLang's launcher and scheduler processes do, then reports what it registered.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from . import BACKEND_NAME


def plugin_status() -> dict[str, Any]:
    """Load SGLang's plugins in this process and report the triton_situ registrations."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.srt.layers.moe.moe_runner.runner import _CUSTOM_RUNNER_CORE_FACTORIES
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptNvFp4FusedMoEMethod
    from sglang.srt.model_executor.model_runner_components import load_model_utils
    from sglang.srt.server_args import MOE_RUNNER_BACKEND_CHOICES

    from .hooks import HOOKS

    hooked = {}
    for target, hook in HOOKS:
        attr = target.rsplit(".", 1)[1]
        fn = ModelOptNvFp4FusedMoEMethod.__dict__.get(attr)
        # HookRegistry's AROUND wrapper keeps the original in __wrapped__ and calls our hook.
        hooked[attr] = fn is not None and hasattr(fn, "__wrapped__") and hook in _closure_cells(fn)
    return {
        "backend_choice": BACKEND_NAME in MOE_RUNNER_BACKEND_CHOICES,
        "runner_core": BACKEND_NAME in _CUSTOM_RUNNER_CORE_FACTORIES,
        "hooks": hooked,
        "unbalanced_loading_timeout_s": load_model_utils.UNBALANCED_MODEL_LOADING_TIMEOUT_S,
    }


def _closure_cells(fn: Any) -> list[Any]:
    cells = getattr(fn, "__closure__", None) or ()
    return [c.cell_contents for c in cells]


def probe_into_queue(queue: Any) -> None:
    """multiprocessing target: put plugin_status() (or the error text) on ``queue``."""
    try:
        queue.put(plugin_status())
    except BaseException as err:  # report, never hang the parent
        queue.put({"error": f"{type(err).__name__}: {err}"})


def main() -> int:
    status = plugin_status()
    print(json.dumps(status, indent=2))
    ok = status["backend_choice"] and status["runner_core"] and all(status["hooks"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
