"""Self-checks of the SGLang integration.

- ``python -P -m k3nvfp4.sglang_ext.selfcheck``: does this process see the plugin? Runs
  SGLang's own ``load_plugins()`` (entry points, SGLANG_PLUGINS filter, hook application),
  exactly as SGLang's launcher and scheduler processes do, and prints what it registered as JSON.
- ``python -P -m k3nvfp4.sglang_ext.selfcheck --model CKPT [...]``: the model-class check of a
  cast checkpoint through SGLang's own Kimi-K3 model class and loader
  (:mod:`k3nvfp4.sglang_ext.model_check`; ``--help`` lists the options).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import warnings
from typing import Any, Sequence

from .names import BACKEND_NAME


# SGLang imports every quantization method when it starts, and two of them warn on a machine
# without CUDA (model_check/noise.py lists them with the other known start-up messages). Kimi-K3
# uses neither, so the plugin check silences exactly these two, by their text.
_NOT_OURS = r"Only CUDA, (HIP and XPU|MUSA and NPU) support (AWQ|GGUF)"


def plugin_status() -> dict[str, Any]:
    """Load SGLang's plugins in this process and report the triton_situ registrations."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NOT_OURS, category=UserWarning)
        from sglang.srt.plugins import load_plugins

        load_plugins()
    from sglang.srt.layers.moe.moe_runner.runner import _CUSTOM_RUNNER_CORE_FACTORIES
    from sglang.srt.model_executor.model_runner_components import load_model_utils
    from sglang.srt.server_args import MOE_RUNNER_BACKEND_CHOICES

    from .plugin import all_hooks

    hooked = {}
    for target, hook in all_hooks():
        module_name, cls_name, attr = target.rsplit(".", 2)
        cls = getattr(importlib.import_module(module_name), cls_name)
        fn = cls.__dict__.get(attr)
        # HookRegistry's AROUND wrapper keeps the original in __wrapped__ and calls our hook.
        hooked[f"{cls_name}.{attr}"] = fn is not None and hasattr(fn, "__wrapped__") and hook in _closure_cells(fn)
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


def _sglang_missing(err: ModuleNotFoundError) -> bool:
    return (err.name or "").split(".")[0] == "sglang"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; 0 when every check holds, 1 when one fails, 2 on bad input or without SGLang."""
    try:
        return _main(argv)
    except ModuleNotFoundError as err:
        if not _sglang_missing(err):
            raise
        from .model_check.cli import PROG

        print(f"{PROG}: error: SGLang is not installed here ({err}); the self-checks run SGLang's own plugin loader "
              "and model class: install the serving extra (pip install \".[sglang]\" in the checkout, README.md)", file=sys.stderr)
        return 2


def _main(argv: Sequence[str] | None) -> int:
    from .model_check import cli as model_cli

    ap = argparse.ArgumentParser(prog=model_cli.PROG, description="Self-checks of the k3nvfp4 SGLang plugin: "
                                 "without --model, the plugin registration; with --model, the model-class check.")
    model_cli.add_arguments(ap)
    args = ap.parse_args(argv)
    with warnings.catch_warnings():  # both checks run SGLang's own code: a core install stops here, in main's one line
        warnings.filterwarnings("ignore", message=_NOT_OURS, category=UserWarning)
        import sglang  # noqa: F401
    if args.model:
        if argv is None:  # without CUDA the fused kernels run in the Triton interpreter
            from ..kernels.interpreter import rerun_with_interpreter

            rerun_with_interpreter("k3nvfp4.sglang_ext.selfcheck")
        return model_cli.main(argv, ap)
    status = plugin_status()
    print(json.dumps(status, indent=2))
    ok = status["backend_choice"] and status["runner_core"] and all(status["hooks"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
