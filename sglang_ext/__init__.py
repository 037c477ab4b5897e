"""SGLang plugin of kimi-k3-nvfp4 (entry point group ``sglang.srt.plugins``).

SGLang's ``load_plugins()`` calls :func:`register` in every process it starts (launcher,
schedulers/TP workers, detokenizer). This module stays import-light: SGLang and the Triton
kernels are imported only inside :func:`register` and at model-load/forward time.
"""

from .names import BACKEND_NAME, REFERENCE_BACKEND_NAME


def register() -> None:
    """Plugin entry point: register ``--moe-runner-backend triton_situ`` / ``torch_reference``
    and their hooks.

    Idempotent. See :mod:`k3nvfp4.sglang_ext.plugin` for what is registered.
    """
    from .plugin import register as _register

    _register()


__all__ = ["BACKEND_NAME", "REFERENCE_BACKEND_NAME", "register"]
