"""What :func:`k3nvfp4.sglang_ext.register` does in each SGLang process.

1. ``--moe-runner-backend triton_situ`` (the Triton kernels) and ``torch_reference`` (the same
   MoE in plain torch, reference_runner.py): their argparse choices
   (add_moe_runner_backend_choices) and runner-core factories (register_moe_runner_core).
2. HookRegistry AROUND hooks on ModelOptNvFp4FusedMoEMethod (hooks.py: the cast NVFP4
   checkpoint) and on Mxfp4MoEMethod (hooks_mxfp4.py: the MXFP4 release, read directly), for
   both backends (backends.py: one object per backend name, which prepares a loaded layer and
   runs it: backend_triton.py, backend_reference.py);
   SGLang's ``load_plugins()`` applies them right after the plugins ran.
3. ``K3NVFP4_LOAD_TIMEOUT_S`` -> SGLang's unbalanced-loading timeout (see load_timeout.py).

SGLANG_PLUGINS filtering is SGLang's: ``load_plugins_by_group`` skips entry points whose
name is not listed, so this function never runs for an excluded plugin.
"""

from __future__ import annotations

import logging

from .names import BACKEND_NAME, REFERENCE_BACKEND_NAME

logger = logging.getLogger(__name__)

_registered = False


def all_hooks() -> tuple[tuple[str, object], ...]:
    """(dotted SGLang target, AROUND hook) for every method the plugin hooks."""
    from .hooks import HOOKS as MODELOPT_HOOKS
    from .hooks_mxfp4 import HOOKS as MXFP4_HOOKS

    return MODELOPT_HOOKS + MXFP4_HOOKS


def register() -> None:
    """Register the backend, its hooks and the load timeout; idempotent."""
    global _registered
    if _registered:
        return
    from .load_timeout import LoadTimeoutError, apply_load_timeout

    # A bad timeout must stop the launch: load_plugins() logs and swallows Exceptions.
    try:
        timeout_s = apply_load_timeout()
    except LoadTimeoutError as err:
        raise SystemExit(f"k3nvfp4 SGLang plugin: {err}") from None

    from sglang.srt.layers.moe.moe_runner.runner import (
        _CUSTOM_RUNNER_CORE_FACTORIES,
        register_moe_runner_core,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import MOE_RUNNER_BACKEND_CHOICES, add_moe_runner_backend_choices

    from .reference_runner import make_reference_runner_core
    from .runner import make_runner_core

    for name, factory in ((BACKEND_NAME, make_runner_core), (REFERENCE_BACKEND_NAME, make_reference_runner_core)):
        # add_moe_runner_backend_choices is list.extend: guard it to stay idempotent.
        if name not in MOE_RUNNER_BACKEND_CHOICES:
            add_moe_runner_backend_choices([name])
        if name not in _CUSTOM_RUNNER_CORE_FACTORIES:
            register_moe_runner_core(name, factory)
    for target, hook in all_hooks():
        HookRegistry.register(target, hook, HookType.AROUND)
    _registered = True
    logger.info(
        "k3nvfp4: registered --moe-runner-backend %s and %s%s",
        BACKEND_NAME,
        REFERENCE_BACKEND_NAME,
        "" if timeout_s is None else f"; UNBALANCED_MODEL_LOADING_TIMEOUT_S={timeout_s:g}",
    )
