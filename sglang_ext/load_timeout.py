"""SGLang's unbalanced-loading timeout as an environment variable.

SGLang 0.5.23 waits ``UNBALANCED_MODEL_LOADING_TIMEOUT_S`` (480 s, no CLI flag) in a
monitored barrier for every TP rank to finish loading. Loading 1.6 TB from network storage
skews ranks by more than that, so the plugin sets the module global (read at use time) from
``K3NVFP4_LOAD_TIMEOUT_S``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

ENV_VAR = "K3NVFP4_LOAD_TIMEOUT_S"
_TARGET_MODULE = "sglang.srt.model_executor.model_runner_components.load_model_utils"
_TARGET_NAME = "UNBALANCED_MODEL_LOADING_TIMEOUT_S"


class LoadTimeoutError(ValueError):
    """``K3NVFP4_LOAD_TIMEOUT_S`` holds something that is not a positive number of seconds."""


def parse_load_timeout(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds from ``K3NVFP4_LOAD_TIMEOUT_S``; None when unset or empty.

    Raises LoadTimeoutError for anything but a finite number > 0.
    """
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV_VAR)
    if raw is None or not raw.strip():
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise LoadTimeoutError(
            f"{ENV_VAR}={raw!r} is not a number; give the unbalanced model-loading "
            f"timeout in seconds, e.g. {ENV_VAR}=3600"
        ) from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise LoadTimeoutError(
            f"{ENV_VAR}={raw!r} must be a finite number of seconds > 0, e.g. {ENV_VAR}=3600"
        )
    return seconds


def apply_load_timeout(environ: Mapping[str, str] | None = None) -> float | None:
    """Set SGLang's ``UNBALANCED_MODEL_LOADING_TIMEOUT_S`` from the environment.

    Returns the value set, or None (SGLang's default is left alone) when the variable is unset.
    """
    seconds = parse_load_timeout(environ)
    if seconds is None:
        return None
    import importlib

    module = importlib.import_module(_TARGET_MODULE)
    if not hasattr(module, _TARGET_NAME):
        raise RuntimeError(
            f"{_TARGET_MODULE}.{_TARGET_NAME} does not exist in this SGLang version; "
            f"{ENV_VAR} cannot be applied"
        )
    setattr(module, _TARGET_NAME, seconds)
    return seconds
